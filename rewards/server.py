"""A registered reward behind a URL (`flowrl serve-reward`): a FastAPI app served by uvicorn.

  GET  /info   -> {"name", "channels", "protocol"}       (also a health check)
  POST /score  -> safetensors scores for a safetensors batch (see rewards.wire)

Requests are taken concurrently (uvicorn's event loop, the scoring on its thread pool), but
scoring runs one request at a time: reward models are not assumed thread-safe and one GPU
serves best one batch at a time. It binds 127.0.0.1 unless told otherwise: there is no
authentication, so expose it only on a trusted network. FastAPI and uvicorn are the `serve`
extra (`pip install 'flowrl[serve]'`), imported when a server starts.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) as objects
import logging
import socket
import threading
from typing import Any, Callable, Sequence

import torch

from flowrl.errors import UserError
from rewards import wire

MAX_BODY_BYTES = 2 << 30  # 2 GiB: a batch of 64 images of 2048 x 2048 x 3 is 0.8 GiB
log = logging.getLogger("rewards.server")


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status)


def reward_app(reward: "ServedReward"):
    """The FastAPI app that serves `reward`."""
    try:
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response
        from starlette.concurrency import run_in_threadpool
        from starlette.exceptions import HTTPException
    except ImportError:
        raise UserError("flowrl serve-reward needs FastAPI and uvicorn: pip install 'flowrl[serve]'") from None

    app = FastAPI(title=f"flowrl reward '{reward.name}'", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def not_found(request: Request, exc: HTTPException):  # every error as {"error": sentence}
        if exc.status_code == 404:
            return _error(404, f"no such path {request.url.path}; use GET /info or POST /score")
        return _error(exc.status_code, str(exc.detail))

    @app.get("/info")
    async def info():
        return JSONResponse({"name": reward.name, "channels": list(reward.channel_names), "protocol": wire.PROTOCOL})

    @app.post("/score")
    async def score(request: Request):
        length = int(request.headers.get("content-length") or 0)
        if length <= 0 or length > MAX_BODY_BYTES:
            return _error(413 if length > 0 else 411, f"a request body of 1 to {MAX_BODY_BYTES} bytes is needed; got {length}")
        body = await request.body()
        try:
            images, prompts, metadata = wire.decode_request(body)
        except Exception as exc:  # malformed safetensors, JSON or shapes
            return _error(400, f"bad request: {str(exc).splitlines()[0]}")
        try:
            scores = await run_in_threadpool(reward.score, images, prompts, metadata)
        except UserError as exc:
            return _error(400, str(exc))
        except Exception as exc:
            log.exception("reward '%s' failed", reward.name)
            return _error(500, f"reward '{reward.name}' failed on the server: {type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}")
        return Response(wire.encode_scores(scores), media_type="application/octet-stream")

    return app


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
    `serve_forever()` blocks (the CLI). Port 0 picks a free port; `url` tells which. The socket
    is bound here, so a taken port is one sentence before anything starts."""

    def __init__(self, reward: ServedReward, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False):
        import uvicorn

        app = reward_app(reward)
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            self.socket.bind((host, port))
        except OSError as exc:
            self.socket.close()
            raise UserError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port or --host") from None
        self.socket.listen(128)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="info" if verbose else "warning", access_log=verbose,
                                                    lifespan="off"))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self.server.run(sockets=[self.socket])

    def start(self) -> "RewardServer":
        self._thread = threading.Thread(target=self.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        while not self.server.started and self._thread.is_alive():
            threading.Event().wait(0.01)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.socket.close()

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
