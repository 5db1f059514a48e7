"""model.text_encoders (flowrl/models/text_cache.py): cpu and cached give the very embeddings of encoding on the fly,
through the real from_pretrained of tiny pipelines saved to disk; a complete cache loads no text encoder."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flowrl.config import load_config
from flowrl.errors import UserError
from flowrl.models import load_policy
from flowrl.schema import ModelConfig

PROMPTS = ["a red circle", "two blue squares", "a green triangle above a cat"]
OUTSIDE = "a prompt the set lacks"
ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def _cfg(kind: str, path: str, mode: str, cache_dir, **kw) -> ModelConfig:
    return ModelConfig(**{"kind": kind, "path": path, "max_sequence_length": 16, "text_encoders": mode,
                          "text_cache_dir": str(cache_dir), **kw})


@pytest.fixture(autouse=True)
def two_prompts_a_file(monkeypatch):
    monkeypatch.setattr("flowrl.models.base.SHARD", 2)  # three prompts: two files, the second of one prompt


def _cache_dirs(root) -> list:
    return sorted(f.parent for f in root.glob("*/prompts.json"))


def _loaded_encoders(policy) -> list[str]:
    return [n for n in ENCODERS if getattr(policy.pipe, n, None) is not None]


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind,fixture", [("sd3", "tiny_sd3_dir"), ("flux", "tiny_flux_dir"), ("z_image", "tiny_z_image_dir")])
def test_cached_embeddings_are_those_of_encoding_on_the_fly(kind, fixture, request, tmp_path):
    path = request.getfixturevalue(fixture)
    reference = load_policy(_cfg(kind, path, "device", tmp_path))
    expected = reference.encode(PROMPTS)
    expected_outside = reference.encode([OUTSIDE])

    # encodes the set with the text encoders alone, writes the files; the policy's pipeline has no encoder
    first = load_policy(_cfg(kind, path, "cached", tmp_path), prompts=PROMPTS)
    (directory,) = _cache_dirs(tmp_path)
    assert sorted(f.name for f in directory.glob("*.safetensors")) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert first.text_device.type == "cpu" and _loaded_encoders(first) == []
    _assert_identical(first.encode(PROMPTS), expected)

    again = load_policy(_cfg(kind, path, "cached", tmp_path), prompts=PROMPTS)  # the complete cache, read back
    assert _loaded_encoders(again) == [] and not again._cache
    _assert_identical(again.encode(PROMPTS), expected)
    _assert_identical(again.encode([PROMPTS[1], PROMPTS[0], PROMPTS[1]]), reference.encode([PROMPTS[1], PROMPTS[0], PROMPTS[1]]))
    # a prompt outside the set: the encoders load onto the CPU on demand, and encode as the pipeline's own would
    _assert_identical(again.encode([OUTSIDE]), expected_outside)
    assert _loaded_encoders(again) == _loaded_encoders(reference)
    assert all(p.device.type == "cpu" for n in _loaded_encoders(again) for p in getattr(again.pipe, n).parameters())


def test_cpu_encoders_encode_as_on_the_device(tiny_sd3_dir, tmp_path):
    on_device = load_policy(_cfg("sd3", tiny_sd3_dir, "device", tmp_path))
    on_cpu = load_policy(_cfg("sd3", tiny_sd3_dir, "cpu", tmp_path))
    assert on_cpu.text_device.type == "cpu"
    _assert_identical(on_cpu.encode(PROMPTS), on_device.encode(PROMPTS))
    assert not list(tmp_path.iterdir())  # cpu caches nothing on disk


def test_the_cache_file_follows_the_prompt_set_and_the_encoder_settings(tiny_sd3_dir, tmp_path):
    def files_after(**kw):
        load_policy(_cfg("sd3", tiny_sd3_dir, "cached", tmp_path, **kw.pop("model", {})), prompts=kw.pop("prompts", PROMPTS))
        return set(_cache_dirs(tmp_path))

    one = files_after()
    assert files_after() == one  # the same set and settings: the same file, read back
    two = files_after(prompts=PROMPTS[:2])
    three = files_after(model={"max_sequence_length": 8})
    four = files_after(model={"dtype": "bf16"})
    assert len(one) == 1 and len(two) == 2 and len(three) == 3 and len(four) == 4


def test_a_damaged_or_unfinished_cache_is_encoded_anew(tiny_flux_dir, tmp_path):
    cfg = _cfg("flux", tiny_flux_dir, "cached", tmp_path)
    expected = load_policy(dataclasses.replace(cfg, text_encoders="device")).encode(PROMPTS)
    load_policy(cfg, prompts=PROMPTS)
    (directory,) = _cache_dirs(tmp_path)
    shard = directory / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    _assert_identical(load_policy(cfg, prompts=PROMPTS).encode(PROMPTS), expected)
    (directory / "prompts.json").unlink()  # a run stopped before its manifest: incomplete
    _assert_identical(load_policy(cfg, prompts=PROMPTS).encode(PROMPTS), expected)
    assert (directory / "prompts.json").is_file()


def test_without_a_prompt_set_cached_encodes_on_the_cpu(tiny_flux_dir, tmp_path):
    # flowrl sample / eval load the policy with no prompt set: nothing to cache, the encoders on the CPU
    policy = load_policy(_cfg("flux", tiny_flux_dir, "cached", tmp_path))
    assert policy.text_device.type == "cpu" and _loaded_encoders(policy)
    assert policy.encode(PROMPTS)["embeds"].shape[0] == 3


@pytest.mark.parametrize("override,says", [
    (["model.text_encoders=gpu"], "model.text_encoders"),
    (["model.text_encoders=cached", "model.quantize_text_encoders=nf4"], "model.quantize_text_encoders"),
    (["model.text_encoders=cached", "rollout.kind=offline", "objective.kind=dgpo", "data.offline=/nowhere"], "set model.text_encoders: cpu"),
])
def test_refusals_are_one_sentence(override, says):
    with pytest.raises(UserError, match=says):
        load_config(None, override, validate_paths=False)


def test_a_training_run_encodes_its_prompt_set_once_and_a_second_run_loads_no_encoder(tiny_sd3_dir, tmp_path, monkeypatch):
    import json

    from flowrl.cli import main
    from flowrl.models.base import FlowPolicy

    def train(name):
        return main(["train", "tiny_jpeg", f"model.path={tiny_sd3_dir}", "model.text_encoders=cached",
                     f"model.text_cache_dir={tmp_path / 'cache'}", "trainer.iterations=1", "run.sample_every=0",
                     "run.tracker=none", "data.eval_prompts=[a cat]", "monitor.enabled=true", "monitor.prompts=[a dog]",
                     "monitor.seeds=2", "monitor.every=100", "--run-dir", str(tmp_path / name)])

    assert train("first") == 0
    (directory,) = _cache_dirs(tmp_path / "cache")
    # the training prompts, the eval prompt and the monitor's, once each
    assert json.loads((directory / "prompts.json").read_text())["prompts"] == [
        "a red circle", "a blue square", "two green triangles", "a yellow star above a cat", "a cat", "a dog"]
    monkeypatch.setattr(FlowPolicy, "_load_missing_text_encoders", lambda self: pytest.fail("a text encoder was loaded"))
    monkeypatch.setattr(FlowPolicy, "_encode_prompt_set", lambda *a: pytest.fail("the prompt set was encoded again"))
    assert train("second") == 0
