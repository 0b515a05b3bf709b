"""`python server.py`: command-line flags (generated from EngineConfig's and ServerSettings' fields, vLLM's
names where the concept is the same), logging, and uvicorn running the app with the engine loop on the same
event loop."""

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
import typing

import uvicorn
from sse_starlette.sse import AppStatus

from api import data_parallel, model_router
from api.app import build_app
from api.drain import Drain
from api.memory_report import memory_report
from api.settings import ServerSettings
from engine import AsyncEngine, EngineConfig
from engine.config.parse import byte_size
from models.distributed.group import EngineDeadError

logger = logging.getLogger("api")

__all__ = ["byte_size", "main", "make_parser"]

# the two dataclasses whose fields are the flags, engine first
_SETTINGS = (EngineConfig, ServerSettings)


def _flag_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]


def _add_arguments(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of `cls` declared with engine.config.parse.setting: --field-name (or its `flags`),
    its help and default; booleans get --x / --no-x; fields with a `parse` function are read as text and
    parsed by `_parse_values` (so that a bad JSON object is one line naming the flag)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(f"{cls.__name__} ({cls.__module__})")
    for f in _flag_fields(cls):
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
        help_text = meta["help"] + ("" if default is None or "(default" in meta["help"] else " (default: %(default)s)")
        kwargs = dict(
            dest=f.name, default=default, help=help_text.replace("%", "%%").replace("%%(default)s", "%(default)s")
        )
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif meta.get("nargs"):  # several strings
            kwargs.update(nargs=meta["nargs"], metavar=meta["metavar"])
        else:
            kwargs.update(type=str if meta["parse"] else kind, choices=meta["choices"], metavar=meta["metavar"])
        group.add_argument(*(meta["flags"] or (f"--{f.name.replace('_', '-')}",)), **kwargs)


def _parse_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Parses the text of the flags that have a `parse` function, in place; an error exits with status 2 and
    one line naming the flag."""
    for cls in _SETTINGS:
        for f in _flag_fields(cls):
            value = getattr(args, f.name)
            if f.metadata["parse"] and isinstance(value, str):
                try:
                    setattr(args, f.name, f.metadata["parse"](value))
                except (TypeError, ValueError) as e:
                    flag = f.metadata["flags"][0] if f.metadata["flags"] else f"--{f.name.replace('_', '-')}"
                    parser.exit(2, f"{parser.prog}: error: {flag}: {e}\n")


def _settings(cls, args: argparse.Namespace, **overrides):
    """An instance of `cls` from the parsed flags (and `overrides`)."""
    return cls(**{f.name: getattr(args, f.name) for f in _flag_fields(cls)} | overrides)


def make_parser() -> argparse.ArgumentParser:
    """The server's argument parser: every field of EngineConfig and ServerSettings is a flag."""
    parser = argparse.ArgumentParser(prog="server.py", description="OpenAI-compatible HTTP server for the engine.")
    for cls in _SETTINGS:
        _add_arguments(parser, cls)
    return parser


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat's start time), None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None


def startup_phases(imported: float | None, built: float | None) -> str:
    """ " in Xs: python + imports As, engine Bs, app + uvicorn Cs" for the ready line, from the process ages at
    which the imports and the engine were done (empty where the process's start time is unknown)."""
    now = process_age()
    if now is None or imported is None or built is None:
        return ""
    return (
        f" in {now:.2f}s: python + imports {imported:.2f}s, engine {built - imported:.2f}s, "
        f"app + uvicorn {now - built:.2f}s"
    )


_ABORT_GRACE = 5.0  # seconds for aborted responses to be sent before uvicorn closes the connections


class _Server(uvicorn.Server):
    """uvicorn's server, plus a "ready" line once it listens and a graceful drain on shutdown: new
    requests get 503 while those in flight have `shutdown_timeout` seconds to finish; then the engine
    aborts the rest (their streams end with finish_reason "abort") and uvicorn closes the connections."""

    def __init__(
        self,
        config: uvicorn.Config,
        engine: AsyncEngine,
        drain: Drain,
        shutdown_timeout: float,
        startup_ages: tuple[float | None, float | None],
    ):
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
            logger.info(
                "draining: %d requests in flight get up to %gs to finish; new requests get 503",
                self._drain.in_flight,
                self._shutdown_timeout,
            )
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
    _parse_values(parser, args)
    try:
        settings = _settings(ServerSettings, args)
    except ValueError as e:
        parser.error(str(e))
    rank = "" if settings.data_parallel_rank is None else f"[dp{settings.data_parallel_rank}] "
    logging.basicConfig(
        level=settings.log_level.upper(), format=f"%(asctime)s %(levelname)s {rank}%(name)s: %(message)s"
    )
    if settings.data_parallel_size > 1:
        return data_parallel.serve(args, sys.argv[1:] if argv is None else argv)
    if settings.models_dir is not None:
        try:
            budget = _settings(EngineConfig, args).kv_cache_memory
        except ValueError as e:
            parser.error(str(e))
        return model_router.serve(settings, sys.argv[1:] if argv is None else argv, args.model, budget)
    # a data-parallel replica runs as many threads as the cores it was bound to
    threads = args.num_threads or (
        len(os.sched_getaffinity(0))
        if settings.data_parallel_rank is not None and hasattr(os, "sched_getaffinity")
        else None
    )
    try:
        config = _settings(EngineConfig, args, num_threads=threads)
    except ValueError as e:
        parser.error(str(e))
    if settings.headless != (config.node_rank > 0):
        parser.error(
            "--headless is for nodes other than node 0"
            if settings.headless
            else f"node {config.node_rank} serves no API (rank 0's node does): add --headless"
        )
    if settings.headless:
        from engine.executor.multiproc import run_headless  # here: a server does not import it at start

        return run_headless(config)
    imported = process_age()
    try:
        engine = AsyncEngine(config)
    except (OSError, ValueError, EngineDeadError) as e:
        logger.error("cannot load model %s: %s", args.model or "(default)", e)
        return 1
    except RuntimeError as e:  # e.g. --kv-transfer-config without NIXL installed
        logger.error("cannot start the engine: %s", e)
        return 1
    settings = dataclasses.replace(settings, served_model_name=settings.served_model_name or [engine.model_name])
    logger.info(
        "serving %s as %s: %s on %s, %d KV blocks of %d tokens (%d tokens), max_model_len %d",
        engine.model_name,
        " or ".join(repr(n) for n in settings.model_names),
        str(engine.dtype).removeprefix("torch."),
        engine.device,
        engine.num_kv_blocks,
        engine.block_size,
        engine.num_kv_blocks * engine.block_size,
        engine.max_model_len,
    )
    if settings.chat_template is None and engine.tokenizer.chat_template is None:
        logger.warning("the tokenizer has no chat template: /v1/chat/completions needs --chat-template")
    app = build_app(engine, settings)
    server = _Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            log_level=settings.log_level,
            timeout_graceful_shutdown=10,
        ),
        engine,
        app.state.serving.drain,
        settings.shutdown_timeout,
        (imported, process_age()),
    )
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
