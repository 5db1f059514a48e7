"""The reward server (FastAPI on uvicorn) and its client on loopback: round trips, timeouts, server errors, a server
that is not running, and `flowrl serve-reward`'s handling of user mistakes. Offline."""

from __future__ import annotations

import socket
import sys
import threading
import time

import pytest
import requests
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import UserError
from rewards import MultiReward
from rewards.remote import RemoteReward
from rewards.server import RewardServer, ServedReward, build_served_reward
from rewards.simple import brightness

PROMPTS = ["a red cube", "two blue balls", "a cat", "a green tree", "sunset"]
FAST = dict(retries=2, backoff=0.001)  # keep retry backoff tiny in tests


def _images(n: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 16, 24, generator=torch.Generator().manual_seed(seed))


def _quantised(images: torch.Tensor) -> torch.Tensor:
    return (images.clamp(0, 1) * 255).round() / 255  # what travels: 8-bit pixels


@pytest.fixture
def serve():
    servers = []

    def start(fn, channels=("r",), name="r", batch_size=None) -> RewardServer:
        server = RewardServer(ServedReward(name, fn, channels, batch_size), port=0).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_round_trip_matches_the_local_reward(serve):
    server = serve(*_served("brightness"))
    client = RemoteReward(server.url, **FAST)
    images = _images()
    assert client.channel_names == ("brightness",)
    assert torch.allclose(client(images, PROMPTS), brightness(_quantised(images)), atol=1e-6)


def _served(name: str):
    served = build_served_reward(name)
    return served.fn, served.channel_names, served.name


def test_prompts_metadata_and_channels_travel(serve):
    def echo(images, prompts, metadata):
        return torch.tensor([[float(len(p)), float(m["k"])] for p, m in zip(prompts, metadata)])

    server = serve(echo, channels=("length", "k"))
    reward = MultiReward({"far": 2.0}, batch_size=2, options={"far": {"kind": "remote", "url": server.url, **FAST}})
    meta = [{"k": i * 10} for i in range(5)]
    scores = reward(_images(), PROMPTS, meta)
    assert reward.channel_names == ["far/length", "far/k"] and reward.channel_weights.tolist() == [2.0, 2.0]
    assert scores[:, 0].tolist() == [len(p) for p in PROMPTS] and scores[:, 1].tolist() == [0, 10, 20, 30, 40]


def test_edits_travel_with_their_sources_and_references_so_source_rewards_score_remotely(serve):
    from rewards.shapes_edit_world import edit_prompts, edit_set

    prompts = edit_prompts(edit_set(2, seed=3))  # 10 edits at 32 px, with references
    images = torch.stack([p.reference_image() for p in prompts])  # perfect edits
    images[::2] = torch.stack([p.image() for p in prompts[::2]])  # every other one left unedited
    scores = {}
    for name in ("shapes_edit", "pixel_preservation"):
        server = serve(*_served(name))
        scores[name] = MultiReward({name: 1.0})(images, prompts)
        remote = MultiReward({"far": 1.0}, options={"far": {"kind": "remote", "url": server.url, **FAST}})(images, prompts)
        assert torch.equal(remote, scores[name]), name  # 8-bit images, sources and references travel exactly
    strict = scores["shapes_edit"][:, 0]
    assert strict[1::2].tolist() == [1.0] * 5 and strict[::2].tolist() == [0.0] * 5  # the scores say which were edited
    # the server rebuilt the edits: what its reward saw equals what the client sent
    seen = []

    def spy(images, prompts, sources):
        seen.extend((str(p), p.instruction, p.reference_image() is not None) for p in prompts)
        assert torch.equal(sources, torch.stack([p.image() for p in prompts]))
        return torch.zeros(len(prompts))

    RemoteReward(serve(*_registered_spy(spy)).url, **FAST)(images, prompts)
    assert seen == [(str(p), p.instruction, True) for p in prompts]
    with pytest.raises(UserError, match="compares each sample with its source image"):  # a plain prompt beside edits
        RemoteReward(serve(*_served("shapes_edit")).url, **FAST)(images[:2], [prompts[0], "a red circle"])


def _registered_spy(fn):
    from rewards.registry import as_reward

    return as_reward("spy", fn), ("spy",), "spy"


def test_remote_reward_from_the_config(serve):
    server = serve(*_served("brightness"))
    cfg = load_config("tiny_jpeg", ["reward.weights={remote: 1.0, brightness: 1.0}", f"reward.options.remote.url={server.url}"])
    reward = MultiReward.from_config(cfg.reward)
    scores = reward(_images(), PROMPTS)
    assert reward.channel_names == ["remote", "brightness"]
    assert torch.allclose(scores[:, 0], scores[:, 1], atol=2e-3)  # 8-bit pixels remotely, floats locally


def test_server_chunks_a_request_by_its_batch_size(serve):
    sizes = []

    def records(images, prompts, metadata):
        sizes.append(len(images))
        return images.mean((1, 2, 3))

    server = serve(records, batch_size=2)
    assert RemoteReward(server.url, **FAST)(_images(), PROMPTS).shape == (5,)
    assert sizes == [2, 2, 1]


def test_nan_from_the_server_is_dropped_by_the_client(serve):
    def nan_first(images, prompts, metadata):
        out = images.mean((1, 2, 3))
        out[0] = float("nan")
        return out

    server = serve(nan_first)
    options = {"r": {"kind": "remote", "url": server.url, **FAST}}
    scores, valid = MultiReward({"r": 1.0}, options=options, on_invalid="drop").score_with_mask(_images(), PROMPTS)
    assert valid.tolist() == [False, True, True, True, True] and torch.isfinite(scores).all()
    with pytest.raises(UserError, match="NaN or inf"):
        MultiReward({"r": 1.0}, options=options)(_images(), PROMPTS)


def test_a_slow_server_times_out_after_bounded_retries(serve):
    def slow(images, prompts, metadata):
        time.sleep(0.3)
        return images.mean((1, 2, 3))

    server = serve(slow)
    client = RemoteReward(server.url, timeout=0.1, retries=1, backoff=0.001)
    with pytest.raises(UserError) as info:
        client(_images(2), PROMPTS[:2])
    message = str(info.value)
    assert server.url in message and "timeout of 0.1 s" in message and "2 attempts" in message and "\n" not in message


def test_a_server_error_is_retried_then_reported(serve):
    calls = []

    def broken(images, prompts, metadata):
        calls.append(1)
        raise RuntimeError("CUDA out of memory")

    server = serve(broken)
    with pytest.raises(UserError) as info:
        RemoteReward(server.url, **FAST)(_images(2), PROMPTS[:2])
    message = str(info.value)
    assert len(calls) == 3 and "server error 500" in message and "CUDA out of memory" in message and server.url in message


def test_a_user_error_on_the_server_is_not_retried(serve):
    calls = []

    def picky(images, prompts, metadata):
        calls.append(1)
        raise UserError("reward 'r' needs captions in the metadata")

    server = serve(picky)
    with pytest.raises(UserError, match=r"rejected the request \(400: reward 'r' needs captions"):
        RemoteReward(server.url, **FAST)(_images(2), PROMPTS[:2])
    assert len(calls) == 1


def test_a_server_that_is_not_running_fails_clearly():
    url = f"http://127.0.0.1:{_free_port()}"
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        MultiReward({"remote": 1.0}, options={"remote": {"url": url, **FAST}})
    message = str(info.value)
    assert url in message and "3 attempts" in message and "could not connect" in message and "\n" not in message
    assert time.monotonic() - start < 5


def test_malformed_requests_get_400_and_unknown_paths_404(serve):
    server = serve(*_served("brightness"))
    bad = requests.post(server.url + "/score", data=b"not safetensors", timeout=5)
    assert bad.status_code == 400 and "bad request" in bad.json()["error"]
    assert requests.get(server.url + "/nope", timeout=5).status_code == 404
    assert requests.get(server.url + "/info", timeout=5).json()["channels"] == ["brightness"]


def test_requests_run_concurrently_but_scoring_one_at_a_time(serve):
    active, peak = [0], [0]
    lock = threading.Lock()

    def counted(images, prompts, metadata):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return images.mean((1, 2, 3))

    server = serve(counted)
    client = RemoteReward(server.url, **FAST)
    threads = [threading.Thread(target=client, args=(_images(2), PROMPTS[:2])) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert peak[0] == 1


# ---- `flowrl serve-reward` -------------------------------------------------------------------


@pytest.mark.parametrize("argv,words", [
    (["serve-reward", "no_such_reward"], "unknown reward 'no_such_reward'"),
    (["serve-reward", "brightness", "-o", "device=cpu"], "--option device is not an option of reward 'brightness'"),
    (["serve-reward", "pickscore", "-o", "dtype=fp8"], "--option dtype must be one of"),
    (["serve-reward", "brightness", "-o", "batch_size"], "KEY=VALUE"),
])
def test_serve_reward_mistakes_exit_2_with_one_sentence(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowrl: error: ") and words in err and "\n" not in err and "Traceback" not in err


def test_serve_reward_without_the_hps_extra_exits_2_naming_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # as on a machine without the extra
    assert main(["serve-reward", "hpsv2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'flowrl[hps]'" in err and "\n" not in err


def test_serve_reward_on_a_taken_port_exits_2(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve-reward", "brightness", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_serve_reward_serves_until_interrupted(monkeypatch, capsys):
    seen = {}

    def serve_then_interrupt(self):  # what Ctrl-C does to the blocking serve_forever
        loop = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]})
        loop.start()
        while not self.server.started:
            time.sleep(0.01)
        seen["info"] = requests.get(f"{self.url}/info", timeout=5).json()
        self.server.should_exit = True
        loop.join()
        raise KeyboardInterrupt

    monkeypatch.setattr(RewardServer, "serve_forever", serve_then_interrupt)
    assert main(["serve-reward", "jpeg_compressibility", "--port", "0", "-o", "batch_size=4"]) == 0
    assert seen["info"]["name"] == "jpeg_compressibility"
    assert "serving reward 'jpeg_compressibility' on http://127.0.0.1:" in capsys.readouterr().err
