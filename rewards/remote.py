"""A reward computed by a server elsewhere (`flowrl serve-reward NAME` on a GPU box).

In the config it is the reward `remote`, with its server's URL as an option:

    reward:
      weights: {remote: 1.0}
      options:
        remote: {url: "http://gpu-box:8000", timeout: 60.0, retries: 3, batch_size: 16}

For several servers, give each its own name and `kind: remote`:
    weights: {pick: 1.0, hps: 0.5}
    options: {pick: {kind: remote, url: ...}, hps: {kind: remote, url: ...}}

Each batch of `batch_size` images is one HTTP request. Connection failures, timeouts and 5xx
replies are retried `retries` times with exponential backoff; then the run stops with one
sentence naming the URL. 4xx replies (a bad request) stop at once.
"""

from __future__ import annotations

from typing import Sequence

import torch

from flowrl.errors import UserError
from rewards import wire
from rewards.http import check_retry_options, request_with_retries
from rewards.registry import register


class RemoteReward:
    """Calls a reward server; asks it for its channel names when built (so a server that is
    down stops the run before any sampling)."""

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise UserError(f"remote reward url '{url}' must start with http:// or https://")
        check_retry_options("remote reward", timeout, retries, backoff)
        self.url, self.timeout, self.retries, self.backoff = url.rstrip("/"), float(timeout), int(retries), float(backoff)
        info = self._request("GET", "/info").json()
        if info.get("protocol") != wire.PROTOCOL:
            raise UserError(f"reward server {self.url} speaks protocol {info.get('protocol')}; this flowrl speaks {wire.PROTOCOL}, so update one side")
        self.name = info["name"]
        self.channel_names = tuple(info["channels"])

    def __call__(self, images: torch.Tensor, prompts: Sequence[str], metadata=None) -> torch.Tensor:
        reply = self._request("POST", "/score", data=wire.encode_request(images, prompts, metadata))
        try:
            return wire.decode_scores(reply.content)
        except Exception:
            raise UserError(f"reward server {self.url} sent a reply that is not a safetensors 'scores' tensor") from None

    def _request(self, method: str, path: str, data: bytes | None = None):
        return request_with_retries(method, self.url + path, f"reward server {self.url}",
                                    "start it with `flowrl serve-reward NAME` or fix its url", self.timeout, self.retries,
                                    self.backoff, data=data,
                                    headers={"Content-Type": "application/octet-stream"} if data is not None else None)


@register("remote", "a reward served by `flowrl serve-reward` elsewhere (options: url, timeout, retries, backoff)", factory=True)
def remote(url: str, timeout: float = 60.0, retries: int = 3, backoff: float = 0.5):
    return RemoteReward(url, timeout, retries, backoff)
