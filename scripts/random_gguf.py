"""A GGUF of a real model's shape with random weights, from a small skeleton: for benchmarks on machines the
model file cannot travel to (speed does not depend on the weights' values).

    python scripts/random_gguf.py skeleton MODEL.gguf SKELETON.gguf   # every metadata field, no tensor data
    python scripts/random_gguf.py fill SKELETON.gguf OUT.gguf          # the same model, random blocks

The skeleton keeps the model's metadata (architecture, shapes, tokenizer) and lists its tensors (name, GGML type,
shape) in the field `minivllm.skeleton.tensors` (JSON). `fill` writes each tensor back in its own type: quantized
ones as random blocks with sane float16 scales (tests/gguf_blocks.py), float ones (norms) as ones, so that the file
loads and runs as the original does, with the same bytes per weight.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.gguf_blocks import random_blocks  # noqa: E402

TENSORS_KEY = "minivllm.skeleton.tensors"


def copy_fields(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every metadata field of `reader` but GGUF's own and the skeleton's tensor list into `writer`."""
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", TENSORS_KEY):
            continue
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)


def skeleton(src: Path, dst: Path) -> None:
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    copy_fields(reader, writer)
    tensors = [[t.name, int(t.tensor_type), [int(n) for n in t.data.shape]] for t in reader.tensors]
    writer.add_string(TENSORS_KEY, json.dumps(tensors))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def fill(src: Path, dst: Path) -> None:
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    copy_fields(reader, writer)
    for i, (name, qtype, shape) in enumerate(json.loads(reader.fields[TENSORS_KEY].contents())):
        qtype = GGMLQuantizationType(qtype)
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            data = np.ones(shape, dtype=np.float16 if qtype == GGMLQuantizationType.F16 else np.float32)
            writer.add_tensor(name, data)
            continue
        block, nbytes = GGML_QUANT_SIZES[qtype]
        rows, row_bytes = int(np.prod(shape[:-1])), shape[-1]
        blocks = random_blocks(qtype, rows, row_bytes // nbytes * block, seed=i).numpy().reshape(shape)
        writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["skeleton", "fill"])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    (skeleton if args.mode == "skeleton" else fill)(args.src, args.dst)


if __name__ == "__main__":
    main()
