"""The handshake side channel: a producer serves its NIXL metadata (agent blob + cache layout) as JSON
on `GET http://kv_ip:kv_port/metadata`; a consumer fetches it once per producer engine, the first time
a request names that engine in its kv_transfer_params (vLLM's NixlConnector does the same over ZMQ).
The K/V bytes themselves never pass through here: NIXL reads them."""

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

logger = logging.getLogger(__name__)


class HandshakeServer:
    """Serves `metadata` (a JSON-able dict) on a daemon thread bound to (host, port); port 0 picks a
    free port, readable as `.port`. Raises OSError if the address cannot be bound."""

    def __init__(self, host: str, port: int, metadata: dict):
        body = json.dumps(metadata).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/metadata":
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):  # one line per handshake at debug level, not stderr
                logger.debug("handshake from %s: " + fmt, self.client_address[0], *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="kv-handshake-server", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def fetch_metadata(host: str, port: int, timeout: float) -> dict:
    """A producer's metadata. Raises ConnectionError (with the address) if it cannot be had."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metadata"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors; bad JSON is a ValueError
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise ConnectionError(f"cannot reach the KV producer at {host}:{port}: {reason}") from None
