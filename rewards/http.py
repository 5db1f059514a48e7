"""HTTP with retries for the rewards that call a server (`remote`, `vlm_judge`): connection
failures, timeouts and 5xx replies are retried with exponential backoff, then the run stops with
one sentence naming the server; a 4xx reply (our request is wrong) stops at once."""

from __future__ import annotations

import time

from flowrl.errors import UserError

MAX_BACKOFF_S = 30.0


def check_retry_options(what: str, timeout: float, retries: int, backoff: float) -> None:
    if timeout <= 0 or retries < 0 or backoff < 0:
        raise UserError(f"{what} needs timeout > 0, retries >= 0 and backoff >= 0; got {timeout}, {retries}, {backoff}")


def request_with_retries(method: str, url: str, who: str, hint: str, timeout: float, retries: int, backoff: float, **kwargs):
    """`requests.request(method, url, timeout=timeout, **kwargs)`, retried; `who` names the server
    in the error sentence ("reward server http://..."), `hint` says what to do about it."""
    import requests

    attempts = 1 + retries
    problem = ""
    for attempt in range(attempts):
        if attempt:
            time.sleep(min(backoff * 2 ** (attempt - 1), MAX_BACKOFF_S))
        try:
            reply = requests.request(method, url, timeout=timeout, **kwargs)
        except requests.Timeout:
            problem = f"no answer within the timeout of {timeout:g} s"
            continue
        except requests.ConnectionError:
            problem = "could not connect"
            continue
        if reply.status_code < 400:
            return reply
        message = error_message(reply)
        if reply.status_code < 500:  # our request is wrong: retrying cannot help
            raise UserError(f"{who} rejected the request ({reply.status_code}: {message})")
        problem = f"server error {reply.status_code}: {message}"
    raise UserError(f"{who} failed {attempts} attempt{'s' if attempts > 1 else ''} ({problem}); {hint}")


def error_message(reply) -> str:
    """The reply's own error: a JSON `error` (a string, or OpenAI's {"message": ...}), else its first line."""
    try:
        error = reply.json()["error"]
        return str(error["message"] if isinstance(error, dict) and "message" in error else error)[:200]
    except Exception:
        return reply.text.strip().splitlines()[0][:200] if reply.text.strip() else reply.reason or "no message"
