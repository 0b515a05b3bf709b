"""`python server.py --models-dir DIR [--models-max N]`: every model in a directory behind one port, loaded on first
use, as llama-server's router mode and Ollama serve them.

The models are DIR's GGUF files (named by their stem) and its model directories (those holding a config.json, named
by the directory). A request's `model` (its JSON body's; Ollama's `name:latest` is `name`) picks one; a request that
names none, and every request without a JSON body (GET /metrics, /v1/models/...), goes to the default: `--model`
when it names one of them, else the first by name. Each loaded model is its own `python -m api.cli` process on a
free 127.0.0.1 port (its own engine; the KV-cache budget, --kv-cache-memory, shared out evenly over --models-max),
started on the first request that names it; past --models-max loaded models the least recently used one with no
request in flight is stopped, so its memory goes back to the OS. The router answers itself: GET /v1/models and
/models (every model, with llama-server's `status`: loaded or unloaded), Ollama's GET /api/tags, POST /models/load
and /models/unload ({"model": NAME}, llama-server's router endpoints), and GET /health; everything else is passed
through to the model's process, streamed. An unknown model is a 404 in OpenAI's error shape.
"""

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from api.data_parallel import STARTUP_TIMEOUT, child_env, free_port

logger = logging.getLogger("api")

# flags of the router's own that its model processes must not see (each takes one value)
ROUTER_FLAGS = ("--models-dir", "--models-max", "--model", "--served-model-name", "--host", "--port")
# headers not passed on in either direction (hop-by-hop, or recomputed for the new body)
DROPPED_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def discover(models_dir: str) -> dict[str, str]:
    """name -> path of every model in `models_dir`: *.gguf files by stem, directories with a config.json by name,
    sorted by name. Raises ValueError when the directory does not exist or holds no model."""
    root = Path(models_dir)
    if not root.is_dir():
        raise ValueError(f"--models-dir {models_dir}: not a directory")
    found = {}
    for entry in sorted(root.iterdir()):
        if entry.is_file() and entry.suffix == ".gguf":
            found[entry.stem] = str(entry.absolute())
        elif entry.is_dir() and (entry / "config.json").exists():
            found[entry.name] = str(entry.absolute())
    if not found:
        raise ValueError(f"--models-dir {models_dir}: no .gguf file or model directory (with a config.json) in it")
    return found


def strip_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `flags` and their values (`--flag value` and `--flag=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        elif not any(arg.startswith(f + "=") for f in flags):
            out.append(arg)
    return out


@dataclasses.dataclass
class Model:
    """One model of the directory and, while loaded, its process."""

    name: str
    path: str
    proc: subprocess.Popen | None = None
    url: str = ""
    last_used: float = 0.0
    in_flight: int = 0

    @property
    def loaded(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ModelPool:
    """The directory's models, at most `models_max` of them loaded (processes started from `argv`, the router's
    command line less its own flags)."""

    def __init__(self, models: dict[str, str], default: str, argv: list[str], models_max: int, kv_cache_memory: int):
        self.models = {name: Model(name, path) for name, path in models.items()}
        self.default, self.models_max = default, models_max
        self.argv = [*strip_flags(argv, ROUTER_FLAGS), "--kv-cache-memory", str(kv_cache_memory // models_max)]
        self.lock = asyncio.Lock()
        self.changed = asyncio.Condition(self.lock)  # a request finished: an eviction may now go ahead

    def resolve(self, name: str | None) -> Model | None:
        """The model a request names (None: the default; Ollama's `NAME:latest` is NAME), or None if unknown."""
        if not name:
            return self.models[self.default]
        return self.models.get(name) or self.models.get(name.removesuffix(":latest"))

    async def acquire(self, model: Model) -> str:
        """Loads `model` if it is not (first stopping the least recently used idle model past models_max, waiting for
        one to become idle) and counts one request in flight on it; returns its URL. Raises RuntimeError when its
        process fails to start."""
        async with self.lock:
            if not model.loaded:
                while sum(m.loaded for m in self.models.values()) >= self.models_max:
                    idle = [m for m in self.models.values() if m.loaded and m.in_flight == 0]
                    if idle:
                        self._stop(min(idle, key=lambda m: m.last_used))
                    else:
                        await self.changed.wait()
                await self._start(model)
            model.in_flight += 1
            model.last_used = time.monotonic()
            return model.url

    async def release(self, model: Model) -> None:
        async with self.lock:
            model.in_flight -= 1
            model.last_used = time.monotonic()
            self.changed.notify_all()

    async def unload(self, model: Model) -> None:
        """Stops `model`'s process (its in-flight requests are cut)."""
        async with self.lock:
            self._stop(model)
            self.changed.notify_all()

    async def _start(self, model: Model) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "api.cli", *self.argv, "--model", model.path, "--served-model-name", model.name]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        model.proc = subprocess.Popen(cmd, env=child_env(), preexec_fn=_die_with_parent)
        model.url = f"http://127.0.0.1:{port}"
        logger.info("loading %s (%s): pid %d on %s", model.name, model.path, model.proc.pid, model.url)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if model.proc.poll() is not None:
                    code, model.proc = model.proc.returncode, None
                    raise RuntimeError(f"model {model.name} exited with status {code} while loading")
                try:
                    if (await client.get(model.url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self._stop(model)
                    raise RuntimeError(f"model {model.name} not ready after {STARTUP_TIMEOUT:g}s")
                await asyncio.sleep(0.25)
        logger.info("loaded %s", model.name)

    def _stop(self, model: Model) -> None:
        if model.proc is None:
            return
        if model.proc.poll() is None:
            model.proc.send_signal(signal.SIGTERM)
            try:
                model.proc.wait(30)
            except subprocess.TimeoutExpired:
                model.proc.kill()
                model.proc.wait()
        logger.info("unloaded %s (pid %d)", model.name, model.proc.pid)
        model.proc = None

    def stop_all(self) -> None:
        for model in self.models.values():
            self._stop(model)


def _die_with_parent() -> None:
    """In a model's process before it runs: Linux sends it SIGTERM when the router dies, even by SIGKILL (prctl
    PR_SET_PDEATHSIG), so no model outlives its router."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def build_router_app(pool: ModelPool) -> Starlette:
    """The router's Starlette app over `pool`."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))

    async def models(request: Request) -> Response:
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": int(os.path.getmtime(m.path)),
                "owned_by": "minivllm",
                "status": {"value": "loaded" if m.loaded else "unloaded"},
            }
            for m in pool.models.values()
        ]
        return JSONResponse({"object": "list", "data": data})

    async def tags(request: Request) -> Response:
        def size(path: str) -> int:
            p = Path(path)
            return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

        return JSONResponse(
            {
                "models": [
                    {
                        "name": m.name,
                        "model": m.name,
                        "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(os.path.getmtime(m.path))),
                        "size": size(m.path),
                        "digest": "",
                        "details": {"format": "gguf" if m.path.endswith(".gguf") else "safetensors"},
                    }
                    for m in pool.models.values()
                ]
            }
        )

    async def named(request: Request) -> Model | Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        name = body.get("model") if isinstance(body, dict) else None
        model = pool.resolve(name) if isinstance(name, str) and name else None
        return model or _error(404, f"model {name!r} is not in --models-dir", "not_found_error")

    async def load(request: Request) -> Response:
        model = await named(request)
        if isinstance(model, Response):
            return model
        try:
            await pool.acquire(model)
        except RuntimeError as e:
            return _error(500, str(e), "server_error")
        await pool.release(model)
        return JSONResponse({"success": True})

    async def unload(request: Request) -> Response:
        model = await named(request)
        if isinstance(model, Response):
            return model
        await pool.unload(model)
        return JSONResponse({"success": True})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def proxy(request: Request) -> Response:
        body = await request.body()
        name = None
        if body:  # read whatever the content type says (curl -d sends JSON as a form's type)
            try:
                parsed = orjson.loads(body)
                name = parsed.get("model") if isinstance(parsed, dict) else None
            except orjson.JSONDecodeError:
                pass  # the model's own server answers a bad body in its API's shape
        model = pool.resolve(name if isinstance(name, str) else None)
        if model is None:
            return _error(404, f"The model `{name}` does not exist.", "NotFoundError")
        try:
            url = await pool.acquire(model)
        except RuntimeError as e:
            return _error(500, str(e), "server_error")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS]
        upstream = client.build_request(
            request.method, url + request.url.path, params=request.query_params, headers=headers, content=body
        )
        try:
            resp = await client.send(upstream, stream=True)
        except httpx.HTTPError as e:
            await pool.release(model)
            return _error(502, f"model {model.name}: {e}", "server_error")

        async def done():
            await resp.aclose()
            await pool.release(model)

        out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in DROPPED_HEADERS}
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code, headers=out_headers, background=BackgroundTask(done)
        )

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/api/tags", tags, methods=["GET"]),
        Route("/models/load", load, methods=["POST"]),
        Route("/models/unload", unload, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/{path:path}", proxy, methods=["GET", "POST", "PUT", "DELETE"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await client.aclose()

    return Starlette(routes=routes, lifespan=lifespan)


def serve(settings, argv: list[str], default_model: str | None, kv_cache_memory: int) -> int:
    """Runs the router on settings.host:settings.port until SIGINT/SIGTERM, then stops every model's process;
    returns 0, or 1 when the directory holds no model. `argv`: the command line, passed on to the models'
    processes less the router's own flags; `default_model`: --model as given (a name in the directory, or a path
    whose file or directory name is one)."""
    try:
        models = discover(settings.models_dir)
    except ValueError as e:
        logger.error("%s", e)
        return 1
    default = next(iter(models))
    if default_model:
        name = Path(default_model).stem if default_model.endswith(".gguf") else Path(default_model).name
        if name not in models:
            logger.error("--model %s is not one of --models-dir's models: %s", default_model, ", ".join(models))
            return 1
        default = name
    pool = ModelPool(models, default, argv, settings.models_max, kv_cache_memory)
    logger.info(
        "router: %d models in %s (%s), default %s, at most %d loaded",
        len(models),
        settings.models_dir,
        ", ".join(models),
        default,
        settings.models_max,
    )
    config = uvicorn.Config(
        build_router_app(pool), host=settings.host, port=settings.port, log_level=settings.log_level, log_config=None
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll or passed-on request
    # uvicorn re-raises the signal that stopped it once it has shut down, under the handlers it found; these make
    # that a no-op, so a signalled shutdown stops the models and ends with status 0
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        _RouterServer(config).run()
    finally:
        pool.stop_all()
    return 0


class _RouterServer(uvicorn.Server):
    """uvicorn's server plus the "ready" line the engine's server prints once it listens (the port with --port 0)."""

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            logger.info("ready: %s (OpenAI base_url %s/v1), a router of --models-dir's models", url, url)
