"""The server's options beyond the engine's (`ServerSettings`): each field is declared once, with its help,
and `server.py`'s flags are generated from these fields and EngineConfig's (api/cli.py)."""

import dataclasses

from api.data_parallel import ROUTER_POLICIES
from api.reasoning import REASONING_PARSERS
from api.tool_parsers import TOOL_CALL_PARSERS
from engine.config.parse import byte_size, setting


def read_template(path: str) -> str:
    """The text of a chat-template file (`--chat-template FILE`). Raises ValueError naming the file."""
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise ValueError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What the server does besides running the engine: where it listens, who may call it, what its API
    answers, how it stops, and the data-parallel launcher's settings.

    Raises ValueError for a value out of range or flags that need one another.
    """

    host: str = setting("127.0.0.1", "address to bind (0.0.0.0 for every interface)")
    port: int = setting(8000, "port to bind (0: any free port, the ready line says which)")
    api_key: str | None = setting(None, "require `Authorization: Bearer KEY` on all but /health, /metrics and /version")
    served_model_name: list[str] | None = setting(
        None,
        "model id(s) the API accepts in a request's `model`; the first is the one it reports (default: the --model "
        "value)",
        nargs="+",
        metavar="NAME",
    )
    max_queue_len: int | None = setting(
        None,
        "answer 503 with Retry-After while this many accepted requests have "
        "not produced a token yet (default: no limit)",
    )
    max_request_body_bytes: int = setting(8 << 20, "larger request bodies get 413", parse=byte_size, metavar="BYTES")
    chat_template: str | None = setting(
        None, "Jinja chat template file replacing the tokenizer's", parse=read_template, metavar="FILE"
    )
    enable_auto_tool_choice: bool = setting(
        False,
        'let the model decide on tool calls (tool_choice "auto"); needs --tool-call-parser (both are set by '
        "themselves when the chat template asks for calls in a format a parser reads)",
    )
    tool_call_parser: str | None = setting(
        None,
        "how tool calls are read from the output with --enable-auto-tool-choice (vLLM's parsers, "
        "api/tool_parsers/): hermes = <tool_call>{...}</tool_call> blocks (Hermes, Qwen); llama3_json = "
        '[<|python_tag|>]{"name", "parameters"} objects separated by ; (Llama 3.1/3.2); pythonic = '
        "[f(a=1), g(b='x')] (Llama 3.2 1B/3B, Llama 4); mistral = [TOOL_CALLS] then a JSON array of "
        '{"name", "arguments"}. Default: the one the chat template\'s tool format calls for, if any',
        choices=TOOL_CALL_PARSERS,
    )
    score_method: str = setting(
        "embedding",
        "how /v1/rerank and /score score a pair: embedding = the cosine similarity of pooled embeddings (any "
        'model); judge = p("yes") of a judging prompt through the chat template (reranker checkpoints such as '
        "Qwen3-Reranker)",
        choices=("embedding", "judge"),
    )
    rerank_instruction: str = setting(
        "Given a web search query, retrieve relevant passages that answer the query",
        "the <Instruct> line of the judging prompt of --score-method judge (Qwen3-Reranker's default)",
    )
    reasoning_parser: str | None = setting(
        None,
        "split <think>...</think> out of chat replies into reasoning_content (and reasoning): deepseek_r1 "
        "(the template opens the block) or qwen3 (only when the reply starts with <think>)",
        choices=REASONING_PARSERS,
    )
    enable_dashboard: bool = setting(
        True, "serve the live dashboard page at /dashboard (--no-dashboard: 404)", flags=("--dashboard",)
    )
    shutdown_timeout: float = setting(
        30.0,
        "on SIGTERM/SIGINT, new requests get 503 while those in flight get this "
        "long to finish before they are aborted (a second SIGINT aborts at once)",
        metavar="SECONDS",
    )
    log_level: str = setting(
        "info", "log level of the server and uvicorn", choices=("debug", "info", "warning", "error", "critical")
    )
    headless: bool = setting(False, "run this node's tensor-parallel ranks (--node-rank > 0) without an API server")
    data_parallel_size: int = setting(
        1,
        "serve N engine replicas behind vllm-router on --port (needs the [router] extra; 1: one engine, no router)",
        metavar="N",
    )
    data_parallel_rank: int | None = setting(
        None, "this engine's replica rank (set by the launcher); labels /metrics with engine=RANK", metavar="RANK"
    )
    router_policy: str = setting(
        "cache_aware", "vllm-router policy with --data-parallel-size > 1", choices=ROUTER_POLICIES
    )
    models_dir: str | None = setting(
        None,
        "serve every model in DIR (.gguf files by stem, model directories by name), each loaded on the first request "
        "that names it (llama-server's router mode); --model picks the default among them",
        metavar="DIR",
    )
    models_max: int = setting(
        4,
        "with --models-dir: models loaded at once (the least recently used idle one is unloaded past it)",
        metavar="N",
    )

    def __post_init__(self):
        if isinstance(self.served_model_name, str):  # one name given as a string (the Python API)
            object.__setattr__(self, "served_model_name", [self.served_model_name])
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("--served-model-name needs at least one name")
        if self.data_parallel_size < 1:
            raise ValueError("--data-parallel-size must be >= 1")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError("--max-queue-len must be >= 0")
        if self.shutdown_timeout < 0:
            raise ValueError("--shutdown-timeout must be >= 0")
        if self.models_max < 1:
            raise ValueError("--models-max must be >= 1")
        if self.models_dir is not None and self.data_parallel_size > 1:
            raise ValueError("--models-dir and --data-parallel-size > 1 do not go together")

    @property
    def model_id(self) -> str | None:
        """The model id the API reports: the first --served-model-name (vLLM's rule)."""
        return self.served_model_name[0] if self.served_model_name else None

    @property
    def model_names(self) -> list[str]:
        """Every name a request's `model` may use."""
        return list(self.served_model_name or [])
