"""A small HTTP server that puts any registered reward behind a URL (`flowrl serve-reward`).

  GET  /info   -> {"name", "channels", "protocol"}       (also a health check)
  POST /score  -> safetensors scores for a safetensors batch (see rewards.wire)

Requests are handled on threads, but scoring runs one request at a time: reward models are
not assumed thread-safe and one GPU serves best one batch at a time. It binds 127.0.0.1
unless told otherwise: there is no authentication, so expose it only on a trusted network.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Sequence

import torch

from flowrl.errors import UserError
from rewards import wire

MAX_BODY_BYTES = 2 << 30  # 2 GiB: a batch of 64 images of 2048 x 2048 x 3 is 0.8 GiB
log = logging.getLogger("rewards.server")


class _Handler(BaseHTTPRequestHandler):
    server: "_HTTPServer"
    protocol_version = "HTTP/1.1"

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str) -> None:
        self._reply(status, json.dumps({"error": message}).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") != "/info":
            return self._error(404, f"no such path {self.path}; use GET /info or POST /score")
        reward = self.server.reward
        info = {"name": reward.name, "channels": list(reward.channel_names), "protocol": wire.PROTOCOL}
        self._reply(200, json.dumps(info).encode(), "application/json")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/score":
            return self._error(404, f"no such path {self.path}; use GET /info or POST /score")
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY_BYTES:
            return self._error(413 if length > 0 else 411, f"a request body of 1 to {MAX_BODY_BYTES} bytes is needed; got {length}")
        body = self.rfile.read(length)
        try:
            images, prompts, metadata = wire.decode_request(body)
        except Exception as exc:  # malformed safetensors, JSON or shapes
            return self._error(400, f"bad request: {str(exc).splitlines()[0]}")
        try:
            scores = self.server.reward.score(images, prompts, metadata)
        except UserError as exc:
            return self._error(400, str(exc))
        except Exception as exc:
            log.exception("reward '%s' failed", self.server.reward.name)
            return self._error(500, f"reward '{self.server.reward.name}' failed on the server: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        self._reply(200, wire.encode_scores(scores), "application/octet-stream")

    def log_message(self, format: str, *args) -> None:  # quiet unless the server is verbose
        if self.server.verbose:
            sys.stderr.write(f"{self.address_string()} - {format % args}\n")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    reward: "ServedReward"
    verbose: bool


class ServedReward:
    """One reward, scored one request at a time in chunks of `batch_size` (None: the whole
    request); outputs are returned as the reward gave them (no NaN check: the client decides)."""

    def __init__(self, name: str, fn: Callable, channel_names: Sequence[str], batch_size: int | None = None):
        self.name, self.fn, self.channel_names, self.batch_size = name, fn, tuple(channel_names), batch_size
        self._lock = threading.Lock()

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list | None) -> torch.Tensor:
        n = images.shape[0]
        step = self.batch_size or max(n, 1)
        parts = []
        with self._lock:
            for i in range(0, n, step):
                meta = metadata[i : i + step] if metadata is not None else None
                parts.append(torch.as_tensor(self.fn(images[i : i + step], prompts[i : i + step], meta)).detach().float().cpu())
        return torch.cat(parts) if len(parts) > 1 else parts[0]


class RewardServer:
    """`RewardServer(reward, host, port).start()` serves on a background thread (tests);
    `serve_forever()` blocks (the CLI). Port 0 picks a free port; `url` tells which."""

    def __init__(self, reward: ServedReward, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False):
        try:
            self.httpd = _HTTPServer((host, port), _Handler)
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host") from None
        self.httpd.reward, self.httpd.verbose = reward, verbose
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def start(self) -> "RewardServer":
        # a short poll interval makes close() quick (shutdown waits for the next poll)
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="reward-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()

    def __enter__(self) -> "RewardServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_served_reward(name: str, options: dict[str, Any] | None = None) -> ServedReward:
    """A registered reward, built with its options (checked as config options are)."""
    from rewards.options import check_options, plan_reward
    from rewards.registry import get_reward

    get_reward(name)  # an unknown name: one sentence listing the registered ones
    check_options(name, options, lambda key: f"--option {key}")
    plan = plan_reward(name, options)
    fn, channels = plan.build()
    return ServedReward(name, fn, channels, plan.batch_size)
