"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, as in vLLM."""

from tqdm import tqdm

from engine.chat_template import encode_chat
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import FinalOutputs, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """Batch generation with continuous batching; takes EngineConfig fields as keyword arguments.

    Example: `LLM().generate(["Hello"], SamplingParams(max_tokens=32))`.
    Raises ValueError (from EngineConfig, model loading, or a bad prompt/parameter).
    """

    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self.model_dir = self.engine.model_dir

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in input order.

        prompts: a string, a list of token ids, a dict with "prompt" or "prompt_token_ids", or a list
        of these. sampling_params: one for all, or one per prompt (default: SamplingParams()).
        Raises ValueError for a bad prompt or parameter, including a structured-outputs constraint that
        does not compile (in compile_timeout seconds).
        """
        prompts = _as_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        # Grammars compile (in parallel) before any request is queued, so a bad one raises here.
        self.engine.structured.compile_and_wait([p.structured_outputs for p in params if p.structured_outputs])
        return self._run(prompts, params, use_tqdm)

    def embed(self, prompts: Prompt | list[Prompt], use_tqdm: bool = True) -> list[RequestOutput]:
        """The embedding of every prompt (`RequestOutput.embedding`: the final hidden states pooled and
        normalised as `pooler_config` says), in input order. Raises ValueError for a bad prompt."""
        prompts = _as_list(prompts)
        return self._run(prompts, [SamplingParams(max_tokens=0)] * len(prompts), use_tqdm, pooling=True)

    def reset_prefix_cache(self) -> None:
        """Empties the prefix cache, so repeated prompts are computed again."""
        self.engine.reset_prefix_cache()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template (or `chat_template`) to one conversation or a list of
        them, then generates. A conversation is a list of {"role", "content"} dicts."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_ids = [encode_chat(self.tokenizer, c, chat_template, add_generation_prompt) for c in conversations]
        return self.generate(token_ids, sampling_params, use_tqdm)

    def _run(
        self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool, pooling: bool = False
    ) -> list[RequestOutput]:
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                if isinstance(prompt, dict):
                    prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
                ids.append(self.engine.add_request(None, prompt, p, pooling=pooling))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        finals = FinalOutputs()
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if (final := finals.add(out)) is not None:
                        results[out.request_id] = final
                        bar.update(1)
        return [results[rid] for rid in ids]


def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """One prompt (a string, token ids or a dict) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts
