"""The compile side of structured outputs: the tokenizer's vocabulary for xgrammar, one compile cache, and a
small thread pool that compiles outside the event loop and the engine's step loop."""

import concurrent.futures
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from engine.config.structured_outputs import StructuredOutputsConfig
from engine.core.step_io import GrammarOutput, SchedulerOutput
from engine.sampling_params import StructuredOutputsParams

INSTALL_HINT = "pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi"

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; clients get the message alone.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class StructuredOutputManager:
    """Compiles constraints into xgrammar `CompiledGrammar`s, once per distinct constraint.

    `compile(spec)` returns a `Future` from one LRU cache keyed by `spec.key()` (the constraint's text and
    options), so equal constraints share one compile, also while it is in flight; a failed compile stays
    cached too (the same text fails the same way). The vocabulary given to xgrammar has the tokenizer's
    special tokens blanked, so they cannot appear inside a JSON string or a regex match (as vLLM does);
    the engine's EOS ids are the grammar's stop tokens. The tokenizer info and compiler are built on the
    first constrained request (~0.3 s), on the pool, so engines that never see one never import xgrammar.
    xgrammar's own compiler cache is off: this cache bounds memory by entry count.

    tokenizer: the HF tokenizer; vocab_size: logits width (may exceed len(tokenizer));
    eos_token_ids: the engine's EOS ids.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, config: StructuredOutputsConfig | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.config = config or StructuredOutputsConfig()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredOutputsParams) -> Future:
        """A Future of the spec's CompiledGrammar (done at once on a cache hit); the compile runs on the pool.

        The Future raises ValueError for a constraint xgrammar rejects (the message is xgrammar's).
        Raises ValueError at once when xgrammar is not installed (the message names the install command).
        """
        _import_xgrammar()
        kind, text, any_ws = spec.key()
        key = (kind, text, any_ws and not self.config.disable_any_whitespace)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
            future = self._executor.submit(self._compile, *key)
            self._cache[key] = future
            while len(self._cache) > self.config.max_cached_grammars:
                self._cache.popitem(last=False)
        return future

    def compile_and_wait(self, specs: list[StructuredOutputsParams]) -> list:
        """Compiles `specs` (on the pool, in parallel) and waits for each in turn, `config.compile_timeout`
        seconds at most after the one before (the pool compiles in order, so each grammar gets about that
        long of its own); returns their CompiledGrammars. Raises ValueError for the first invalid spec, or
        one still compiling then."""
        compiled = []
        for future in [self.compile(spec) for spec in specs]:
            try:
                compiled.append(future.result(timeout=self.config.compile_timeout))
            except concurrent.futures.TimeoutError:
                raise self.timeout_error() from None
        return compiled

    def grammar_bitmask(self, requests: dict, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The structured-outputs hook of a step (vLLM's StructuredOutputManager.grammar_bitmask): the next
        tokens each structured-output request that samples in it may take, one bitmask row each; None when
        none does. `requests`: the scheduler's, by id. Costs one attribute check per request without a
        grammar."""
        rows = {}
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = requests[req_id]
            if req.grammar is not None and req.num_computed_tokens + n >= req.num_tokens:
                rows[req_id] = len(rows)
        if not rows:
            return None
        bitmask = np.empty((len(rows), -(-self.vocab_size // 32)), dtype=np.int32)
        for req_id, row in rows.items():
            requests[req_id].grammar.fill_bitmask(bitmask, row)
        return GrammarOutput(rows, bitmask)

    def timeout_error(self) -> ValueError:
        return ValueError(
            f"structured outputs: the grammar did not compile within {self.config.compile_timeout} s "
            f"(compile_timeout of --structured-outputs-config)"
        )

    def shutdown(self) -> None:
        """Stops the compile pool (compiles in flight finish first); a later compile starts a new one."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _compile(self, kind: str, text: str, any_whitespace: bool):
        compiler = self._get_compiler()
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    text, any_whitespace=any_whitespace, max_whitespace_cnt=self.config.max_whitespace_cnt
                )
            if kind == "regex":
                return compiler.compile_regex(text)
            return compiler.compile_grammar(text)
        except RuntimeError as e:
            what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}[kind]
            raise ValueError(f"invalid {what}: {_CPP_PREFIX.sub('', str(e)).strip()}") from None

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                xgr = _import_xgrammar()
                full = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
                )
                # The tokenizer's own (encoded) token strings, special ones blanked: an empty token is
                # never allowed by a grammar, except a stop token where the grammar may end.
                vocab = [""] * self.vocab_size
                for token, token_id in self.tokenizer.get_vocab().items():
                    if token_id < self.vocab_size:
                        vocab[token_id] = token
                for token_id in self.tokenizer.all_special_ids:
                    vocab[token_id] = ""
                info = xgr.TokenizerInfo.from_vocab_and_metadata(vocab, full.dump_metadata())
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
                logger.info(
                    "structured outputs: xgrammar ready (%d tokens, stop tokens %s)",
                    self.vocab_size,
                    self.eos_token_ids,
                )
            return self._compiler


def _import_xgrammar():
    """The xgrammar module. Raises ValueError naming the install command when it is missing."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError(f"structured outputs need xgrammar, which is not installed: {INSTALL_HINT}") from None
    return xgrammar
