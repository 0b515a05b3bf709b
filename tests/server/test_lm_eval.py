"""lm-evaluation-harness as a client: `lm_eval --model local-completions` against the server scores the
local tasks in tests/data/lm_eval (a multiple_choice task, which needs prompt logprobs through echo, and
a generate_until task) the same as `lm_eval --model hf` on the same model in float32: a server with float32
activations on the GGUF's quantized weights, in the default arithmetic (prompt and decode rows quantized to int16
per 32 on CPUs with AVX512-VNNI, to int8 per 32 as llama.cpp computes on the others with AVX2), within one item of
the 20 multiple-choice ones (0.05: the echoed prompts' logprobs come from int8 products, which can flip one
near-tied choice, as they moved the default model's perplexity by +0.26%: docs/benchmarks.md); a server with
bfloat16 activations (what `--dtype auto` picks on a CPU with AVX512-BF16 or AMX) within 0.03."""

import glob
import json
import os
import subprocess
import sys

import pytest

from models.loader import export_hf_directory, resolve_model

pytest_plugins = ["server_harness"]

from server_harness import ENGINE_ARGS, cli_args  # noqa: E402

TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "lm_eval")
TASKS = "minivllm_mc_facts,minivllm_gen_facts"
ONE_ITEM = 1 / 20  # one of mc_facts' 20 items (gen_facts has 10: a flip there fails)


def lm_eval(tmp_path, name: str, model: str, model_args: str) -> dict:
    """Runs the lm_eval CLI on the local tasks (nothing downloaded); returns {task: {metric: value}}."""
    out = tmp_path / name
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        TASKS,
        "--include_path",
        ".",
        "--batch_size",
        "8",
        "--output_path",
        str(out),
    ]
    run = subprocess.run(cmd, cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    [path] = glob.glob(str(out / "*" / "results_*.json"))
    with open(path) as f:
        results = json.load(f)["results"]
    return {task: {k: v for k, v in r.items() if "," in k and "stderr" not in k} for task, r in results.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """transformers' float32 scores on the GGUF's weights dequantized to a Hugging Face directory."""
    model_dir = export_hf_directory(resolve_model(None))
    scores = lm_eval(tmp_path_factory.mktemp("hf"), "hf", "hf", f"pretrained={model_dir},dtype=float32")
    assert scores.keys() == {"minivllm_mc_facts", "minivllm_gen_facts"}
    # the tasks discriminate: neither a model that scores nothing nor one that scores everything passes
    assert all(0 < value < 1 for metrics in scores.values() for value in metrics.values()), scores
    return scores


def assert_scores_match(server, tmp_path, reference: dict, tolerance: float) -> None:
    model_dir = export_hf_directory(resolve_model(None))  # its tokenizer files, for lm_eval
    ours = lm_eval(
        tmp_path,
        "server",
        "local-completions",
        f"model=SmolLM2-135M-Instruct,base_url={server.url}/v1/completions,tokenizer={model_dir},"
        f"tokenizer_backend=huggingface,num_concurrent=4,max_retries=1",
    )
    assert ours.keys() == reference.keys()
    assert set(ours["minivllm_mc_facts"]) == {"acc,none", "acc_norm,none"}
    assert set(ours["minivllm_gen_facts"]) == {"exact_match,first_word"}
    for task, metrics in reference.items():
        for metric, value in metrics.items():
            assert ours[task][metric] == pytest.approx(value, abs=tolerance), (task, metric, ours, reference)


@pytest.mark.slow
def test_lm_eval_local_completions_matches_hf(server_factory, tmp_path, reference):
    default = os.environ | {"MINIVLLM_GGUF_ACTIVATIONS": "int8"}  # the tests' own default is the exact kernel
    server = server_factory(*cli_args(**ENGINE_ARGS), env=default)
    assert_scores_match(server, tmp_path, reference, ONE_ITEM + 0.001)


@pytest.mark.slow
def test_lm_eval_bfloat16_activations_within_0_03(server_factory, tmp_path, reference):
    server = server_factory(*cli_args(**ENGINE_ARGS | {"dtype": "bfloat16"}))
    assert_scores_match(server, tmp_path, reference, 0.03)
