"""`--kv-transfer-config`: which KV connector an engine runs and in which role, with vLLM's keys."""

import uuid
from dataclasses import dataclass, field

from engine.config.parse import parse

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("NixlConnector",)


@dataclass
class KVTransferConfig:
    """A disaggregated-serving role (vLLM's `KVTransferConfig`, the keys this engine implements).

    kv_connector: "NixlConnector" (NIXL one-sided reads of KV blocks, vLLM's connector of that name).
    kv_role: "kv_producer" (a prefill server: keeps a finished request's blocks for a remote decode),
        "kv_consumer" (a decode server: pulls a remote prefill's blocks) or "kv_both".
    engine_id: this engine's name in kv_transfer_params (`remote_engine_id`); default a fresh uuid,
        so a restarted producer is never mistaken for the old one.
    kv_ip, kv_port: where the producer's handshake side channel listens; port 0 = any free port (it is
        announced in each request's kv_transfer_params, so no fixed port is needed).
    kv_connector_extra_config: "abort_request_timeout" (seconds a producer keeps unread blocks,
        default 120), "handshake_timeout" (seconds a consumer waits for a producer's metadata, default 10).
    """

    kv_connector: str
    kv_role: str
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be a port number (0 = any free port), got {self.kv_port!r}")
        extra = self.kv_connector_extra_config
        unknown = set(extra) - {"abort_request_timeout", "handshake_timeout"}
        if unknown:
            raise ValueError(f"unsupported kv_connector_extra_config key(s): {', '.join(sorted(unknown))}")
        for key in ("abort_request_timeout", "handshake_timeout"):
            value = extra.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_connector_extra_config.{key} must be a positive number of seconds")

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def abort_request_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("abort_request_timeout", 120))

    @property
    def handshake_timeout(self) -> float:
        return float(self.kv_connector_extra_config.get("handshake_timeout", 10))

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        """Parses the JSON of `--kv-transfer-config`. Raises ValueError naming the bad or unknown key."""
        data = parse(cls, text, "--kv-transfer-config")
        missing = {"kv_connector", "kv_role"} - set(data)
        if missing:
            raise ValueError(f"--kv-transfer-config needs {' and '.join(sorted(missing))}")
        return cls(**data)
