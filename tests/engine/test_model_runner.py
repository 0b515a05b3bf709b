"""The model runner on the real model, driven by hand-made SchedulerOutputs as a scheduler would send them: a
prompt in two chunks, a decode, drafts verified (two accepted, the third rejected and replaced), a draft
rollback, and the request forgotten when its finish is told; the tokens are the engine's own greedy ones."""

from engine import SamplingParams
from engine.core.step_io import CachedRequestData, NewRequestData, SchedulerOutput


def step(runner, so: SchedulerOutput):
    out = runner.execute_model(so)
    return dict(zip(out.req_ids, out.sampled_token_ids))


def cached(req_id, new_tokens, computed, num_tokens, drafts=()):
    return SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData([req_id], [False], [new_tokens], [([],)], [computed]),
        num_scheduled_tokens={req_id: num_tokens},
        scheduled_spec_decode_tokens={req_id: list(drafts)} if drafts else {},
    )


def test_runner_follows_synthetic_steps(llm, prompts):
    runner = llm.engine.engine_core.executor.runner
    prompt = prompts[3]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    n = len(prompt)
    # the engine is idle: the last blocks of its cache are free to use
    blocks = list(range(runner.num_blocks - (n + 16) // 16 - 1, runner.num_blocks))
    half = n // 2
    new = NewRequestData("x", prompt, greedy, frozenset(), (blocks,), 0)
    assert step(runner, SchedulerOutput([new], num_scheduled_tokens={"x": half})) == {}  # still prefilling
    assert step(runner, cached("x", [], half, n - half)) == {"x": [ref[0]]}
    assert step(runner, cached("x", [ref[0]], n, 1)) == {"x": [ref[1]]}
    # drafts: the next two greedy tokens and a wrong one; the target replaces the wrong one
    wrong = (ref[4] + 1) % runner.shape.vocab_size
    assert step(runner, cached("x", [ref[1]], n + 1, 4, [ref[2], ref[3], wrong])) == {"x": ref[2:5]}
    # the scheduler rolled back the rejected draft: the next step starts after ref[4]'s position
    assert step(runner, cached("x", [ref[2], ref[3], ref[4]], n + 4, 1)) == {"x": [ref[5]]}
    runner.execute_model(SchedulerOutput(finished_req_ids={"x"}))
    assert "x" not in runner.input_batch.requests
