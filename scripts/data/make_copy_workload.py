"""Writes the copy-heavy workload, copy_workload.jsonl, where speculative decoding by prompt lookup
pays: 64 chat requests whose answers copy long spans of their prompt. Half ask to repeat a passage
of documentation word for word, half to rewrite a function's source with a small edit. The texts
are real and ship with Python itself: module docstrings and function sources of the standard
library (no download). Pair it with workload.jsonl (no copying) as the control.

Usage: python scripts/data/make_copy_workload.py [--tokenizer HF_DIR] [--max-tokens 128]
With no --tokenizer, uses the default model's directory (models.loader.resolve_model).
Fields, as in workload.jsonl: id, prompt (templated text), prompt_token_ids, num_prompt_tokens,
max_tokens, plus task ("repeat" or "edit") and source (the module or function quoted).
"""

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Standard-library modules with long docstrings, and modules of pure-Python functions to edit.
DOC_MODULES = [
    "argparse",
    "ast",
    "cmd",
    "codeop",
    "collections",
    "configparser",
    "copy",
    "csv",
    "dbm",
    "difflib",
    "doctest",
    "fileinput",
    "ftplib",
    "getopt",
    "hashlib",
    "heapq",
    "inspect",
    "io",
    "json",
    "mimetypes",
    "optparse",
    "os",
    "pdb",
    "plistlib",
    "pyclbr",
    "pydoc",
    "random",
    "re",
    "rlcompleter",
    "sched",
    "shelve",
    "site",
    "smtplib",
    "socket",
    "socketserver",
    "sqlite3",
    "ssl",
    "statistics",
    "string",
    "struct",
    "subprocess",
    "tempfile",
    "timeit",
    "tokenize",
    "trace",
    "typing",
    "unittest",
    "uuid",
    "wave",
    "wsgiref",
]
CODE_MODULES = [
    "textwrap",
    "heapq",
    "shlex",
    "difflib",
    "fnmatch",
    "posixpath",
    "glob",
    "calendar",
    "colorsys",
    "statistics",
    "string",
    "html",
    "base64",
    "quopri",
    "uu",
    "bisect",
    "keyword",
    "filecmp",
]
REPEAT = "Repeat the following passage exactly, word for word.\n\n{text}"
EDITS = [
    "Rewrite this Python function with type hints added. Keep everything else exactly the same.",
    "Copy this Python function, renaming it to `{name}_v2`. Change nothing else.",
    "Add a one-line comment above the first line of this Python function and repeat the rest unchanged.",
]
MAX_DOC_CHARS = 1500


def passages(count: int) -> list[tuple[str, str]]:
    """(module name, docstring cut at a paragraph break below MAX_DOC_CHARS) for `count` modules."""
    out = []
    for name in DOC_MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except ImportError:
            continue
        if len(doc) < 600:
            continue
        cut = doc[:MAX_DOC_CHARS]
        if len(doc) > MAX_DOC_CHARS:
            cut = cut[: cut.rfind("\n\n")] if "\n\n" in cut[400:] else cut
        out.append((name, cut.strip()))
        if len(out) == count:
            return out
    raise RuntimeError(f"found only {len(out)} standard-library docstrings of 600+ characters")


def functions(count: int) -> list[tuple[str, str, str]]:
    """(qualified name, function name, source) of pure-Python functions of 300..1500 characters."""
    out = []
    for module_name in CODE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, fn in sorted(inspect.getmembers(module, inspect.isfunction)):
            if fn.__module__ != module_name or name.startswith("_"):
                continue
            try:
                source = inspect.getsource(fn)
            except OSError:  # made at run time (e.g. by exec): no source file
                continue
            if 300 <= len(source) <= 1500:
                out.append((f"{module_name}.{name}", name, source))
            if len(out) == count:
                return out
    raise RuntimeError(f"found only {len(out)} standard-library functions of 300..1500 characters")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="HF directory (default: the default model's)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--output", default=str(HERE / "copy_workload.jsonl"))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parents[1]))  # the repository root
    from transformers import AutoTokenizer

    from models.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model(None))
    half = args.num_requests // 2
    tasks = [("repeat", name, REPEAT.format(text=text)) for name, text in passages(args.num_requests - half)]
    for i, (qualname, name, source) in enumerate(functions(half)):
        tasks.append(("edit", qualname, EDITS[i % len(EDITS)].format(name=name) + f"\n\n```python\n{source}```"))
    with open(args.output, "w") as f:
        for i, (task, source, content) in enumerate(tasks):
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            ids = tok.encode(prompt, add_special_tokens=False)
            f.write(
                json.dumps(
                    {
                        "id": i,
                        "task": task,
                        "source": source,
                        "prompt": prompt,
                        "prompt_token_ids": ids,
                        "num_prompt_tokens": len(ids),
                        "max_tokens": args.max_tokens,
                    }
                )
                + "\n"
            )
    print(f"wrote {len(tasks)} requests to {args.output}")


if __name__ == "__main__":
    main()
