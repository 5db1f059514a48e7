"""The `vlm_judge` reward against a fake OpenAI-compatible server on 127.0.0.1 (rewards/vlm_judge.py):
a good answer, an unparseable one, a timeout and a server error, each with its outcome; P(Yes)
from the top log-probabilities; the API key sent and never logged."""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image

from flowrl.errors import UserError
from rewards import MultiReward
from rewards.vlm_judge import VLMJudge

SECRET = "sk-test-not-a-real-key"


class FakeServer:
    """Answers /v1/chat/completions with what `answer(body)` returns: a chat-completion dict, an
    int (that HTTP status), or "sleep" (no answer for a while)."""

    def __init__(self, answer):
        self.answer, self.bodies, self.headers = answer, [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append(body)
                server.headers.append(dict(self.headers))
                out = server.answer(body)
                if out == "sleep":
                    time.sleep(1.0)
                    return
                if isinstance(out, int):
                    self.send_response(out)
                    self.end_headers()
                    self.wfile.write(json.dumps({"error": {"message": "the model is overloaded"}}).encode())
                    return
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(answer):
        servers.append(FakeServer(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def chat(text: str) -> dict:
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


def images(n: int) -> torch.Tensor:
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_a_score_is_parsed_from_each_answer_and_the_request_is_the_references(serve, monkeypatch, caplog):
    monkeypatch.setenv("JUDGE_KEY", SECRET)
    scores = {"a red circle": "The circle is red and clean.\nFinal Score: 4", "two blue squares": "Final Score: 2.5"}
    server = serve(lambda body: chat(scores[body["messages"][0]["content"][1]["text"].split("[")[-1].rstrip("]")]))
    reward = MultiReward({"vlm_judge": 1.0}, options={"vlm_judge": {"url": server.url, "model": "judge", "api_key_env": "JUDGE_KEY",
                                                                    "image_size": 64, "concurrency": 2}})
    with caplog.at_level(logging.DEBUG):
        got = reward(images(2), ["a red circle", "two blue squares"])
    assert got[:, 0].tolist() == pytest.approx([4 / 5, 2.5 / 5])
    body = server.bodies[0]
    image, text = body["messages"][0]["content"]  # the image first, then the text (UnifiedReward's order)
    assert image["type"] == "image_url" and text["type"] == "text" and body["temperature"] == 0.0 and body["model"] == "judge"
    png = Image.open(io.BytesIO(base64.b64decode(image["image_url"]["url"].removeprefix("data:image/png;base64,"))))
    assert png.size == (64, 64) and png.format == "PNG"
    assert all(h["Authorization"] == f"Bearer {SECRET}" for h in server.headers)
    assert SECRET not in caplog.text


def test_an_unparseable_answer_is_invalid_then_dropped_or_refused_or_zero(serve, caplog):
    server = serve(lambda body: chat("I cannot judge this image."))
    options = {"url": server.url, "model": "judge"}
    dropping = MultiReward({"vlm_judge": 1.0}, options={"vlm_judge": options}, on_invalid="drop")
    with caplog.at_level(logging.WARNING):
        scores, valid = dropping.score_with_mask(images(2), ["a", "b"])
    assert not valid.any() and "I cannot judge this image." in caplog.text
    with pytest.raises(UserError, match="reward 'vlm_judge' returned NaN or inf for 2 of 2 images"):
        MultiReward({"vlm_judge": 1.0}, options={"vlm_judge": options})(images(2), ["a", "b"])
    zero = MultiReward({"vlm_judge": 1.0}, options={"vlm_judge": {**options, "unparseable": "zero"}})
    assert zero(images(2), ["a", "b"]).tolist() == [[0.0], [0.0]]  # the reference code's behaviour


def test_a_timeout_and_a_server_error_are_retried_then_one_sentence(serve):
    slow = serve(lambda body: "sleep")
    judge = VLMJudge(slow.url, "judge", timeout=0.2, retries=1, backoff=0.0)
    with pytest.raises(UserError, match=r"failed 2 attempts \(no answer within the timeout of 0.2 s\)"):
        judge(images(1), ["a"])
    assert len(slow.bodies) == 2
    failing = serve(lambda body: 503)
    with pytest.raises(UserError, match=r"failed 3 attempts \(server error 503: the model is overloaded\)"):
        VLMJudge(failing.url, "judge", retries=2, backoff=0.0)(images(1), ["a"])
    assert len(failing.bodies) == 3
    rejecting = serve(lambda body: 400)
    with pytest.raises(UserError, match=r"rejected the request \(400: the model is overloaded\)"):
        VLMJudge(rejecting.url, "judge", retries=2, backoff=0.0)(images(1), ["a"])
    assert len(rejecting.bodies) == 1  # a bad request is not retried


def test_yes_probability_reads_the_first_tokens_top_logprobs(serve):
    top = [{"token": "Yes", "logprob": math.log(0.6)}, {"token": " yes", "logprob": math.log(0.1)},
           {"token": "No", "logprob": math.log(0.3)}]
    server = serve(lambda body: {"choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [
        {"token": "Yes", "logprob": math.log(0.6), "top_logprobs": top}]}}]})
    exact = VLMJudge(server.url, "judge", mode="yes_probability")
    assert exact(images(1), ["a red circle"]).item() == pytest.approx(0.6)  # VQAScore's: the token "Yes" exactly
    assert VLMJudge(server.url, "judge", mode="yes_probability", yes_match="loose")(images(1), ["x"]).item() == pytest.approx(0.7)
    body = server.bodies[0]
    assert body["max_tokens"] == 1 and body["logprobs"] is True and body["top_logprobs"] == 20
    assert body["messages"][0]["content"][1]["text"] == 'Does this figure show "a red circle"? Please answer yes or no.'
    bare = serve(lambda body: chat("Yes"))
    with pytest.raises(UserError, match="returned no log-probabilities"):
        VLMJudge(bare.url, "judge", mode="yes_probability")(images(1), ["a"])


def _png(part: dict) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(part["image_url"]["url"].removeprefix("data:image/png;base64,"))))


def test_edit_mode_sends_the_source_then_the_edit_and_the_instruction(serve):
    from flowrl.models.edit_prompt import EditPrompt

    red, green, blue = (torch.zeros(3, 32, 32).index_fill_(0, torch.tensor([c]), 1.0) for c in range(3))
    edits = [EditPrompt("make it blue", red, name="red.png"), EditPrompt("make it green", red, name="red.png")]
    scores = {"make it blue": "The colour changed and nothing else.\nFinal Score: 4", "make it green": "Final Score: 1"}
    server = serve(lambda body: chat(scores[body["messages"][0]["content"][2]["text"].split("[")[-1].rstrip("]")]))
    reward = MultiReward({"vlm_judge": 1.0}, options={"vlm_judge": {"url": server.url, "model": "judge", "mode": "edit",
                                                                    "image_size": 16, "concurrency": 1}})
    assert reward(torch.stack([blue, blue]), edits)[:, 0].tolist() == pytest.approx([4 / 5, 1 / 5])  # parsed as in score mode
    source, edited, text = server.bodies[0]["messages"][0]["content"]
    assert source["type"] == edited["type"] == "image_url" and text["type"] == "text"
    # the source first, then the edit, each as a PNG at image_size
    assert [_png(p).size for p in (source, edited)] == [(16, 16)] * 2
    assert _png(source).getpixel((8, 8)) == (255, 0, 0) and _png(edited).getpixel((8, 8)) == (0, 0, 255)
    assert text["text"].endswith("Editing Instruction: [make it blue]") and "[source:" not in text["text"]
    assert "preserves everything in the source" in text["text"] and "Final Score: <score>" in text["text"]
    # a plain prompt has no source: the registry's sentence, before any request
    asked = len(server.bodies)
    with pytest.raises(UserError, match=r"^reward 'vlm_judge' compares each sample with its source image, but the prompt "
                                        r"'a blue square' edits no source"):
        reward(blue[None], ["a blue square"])
    assert len(server.bodies) == asked
    # mode score is as before on an edit: one image, the prompt's whole text in the score template
    plain = serve(lambda body: chat("Final Score: 3"))
    assert VLMJudge(plain.url, "judge")(blue[None], edits[:1]).tolist() == pytest.approx([3 / 5])
    image, text = plain.bodies[0]["messages"][0]["content"]
    assert image["type"] == "image_url" and text["text"].endswith("Text Caption: [make it blue [source: red.png]]")


@pytest.mark.parametrize("options, words", [
    ({"url": "gpu-box:8000", "model": "m"}, "must start with http://"),
    ({"url": "http://x/v1", "model": "m", "mode": "rank"}, "mode must be one of score, yes_probability, edit"),
    ({"url": "http://x/v1", "model": "m", "template": "no slot"}, "must contain {prompt}"),
    ({"url": "http://x/v1", "model": "m", "api_key_env": "FLOWRL_TEST_UNSET_KEY"}, "$FLOWRL_TEST_UNSET_KEY, which is not set"),
])
def test_bad_options_are_one_sentence(options, words):
    with pytest.raises(UserError, match=None) as err:
        VLMJudge(**options)
    assert words in str(err.value)
