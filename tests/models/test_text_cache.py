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

    first = load_policy(_cfg(kind, path, "cached", tmp_path), prompts=PROMPTS)  # encodes the set, writes the file
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    assert first.text_device.type == "cpu" and _loaded_encoders(first) == _loaded_encoders(reference)
    _assert_identical(first.encode(PROMPTS), expected)

    again = load_policy(_cfg(kind, path, "cached", tmp_path), prompts=PROMPTS)  # the complete file: no encoder loaded
    assert _loaded_encoders(again) == []
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
        return {f.name for f in tmp_path.glob("*.safetensors")}

    one = files_after()
    assert files_after() == one  # the same set and settings: the same file, read back
    two = files_after(prompts=PROMPTS[:2])
    three = files_after(model={"max_sequence_length": 8})
    four = files_after(model={"dtype": "bf16"})
    assert len(one) == 1 and len(two) == 2 and len(three) == 3 and len(four) == 4


def test_a_damaged_cache_file_is_encoded_anew(tiny_flux_dir, tmp_path):
    cfg = _cfg("flux", tiny_flux_dir, "cached", tmp_path)
    expected = load_policy(dataclasses.replace(cfg, text_encoders="device")).encode(PROMPTS)
    load_policy(cfg, prompts=PROMPTS)
    (file,) = tmp_path.glob("*.safetensors")
    file.write_bytes(file.read_bytes()[:100])
    policy = load_policy(cfg, prompts=PROMPTS)
    assert _loaded_encoders(policy)  # loaded, since the file was unreadable
    _assert_identical(policy.encode(PROMPTS), expected)


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

    from safetensors import safe_open

    from flowrl.cli import main
    from flowrl.models.base import FlowPolicy

    def train(name):
        return main(["train", "tiny_jpeg", f"model.path={tiny_sd3_dir}", "model.text_encoders=cached",
                     f"model.text_cache_dir={tmp_path / 'cache'}", "trainer.iterations=1", "run.sample_every=0",
                     "run.tracker=none", "data.eval_prompts=[a cat]", "monitor.enabled=true", "monitor.prompts=[a dog]",
                     "monitor.seeds=2", "monitor.every=100", "--run-dir", str(tmp_path / name)])

    assert train("first") == 0
    (file,) = (tmp_path / "cache").glob("*.safetensors")
    with safe_open(str(file), framework="pt") as f:  # the training prompts, the eval prompt and the monitor's, once each
        assert json.loads(f.metadata()["prompts"]) == ["a red circle", "a blue square", "two green triangles",
                                                       "a yellow star above a cat", "a cat", "a dog"]
    monkeypatch.setattr(FlowPolicy, "_load_missing_text_encoders", lambda self: pytest.fail("a text encoder was loaded"))
    fill, seen = FlowPolicy._fill_text_cache, []

    def fill_and_look(self, prompts, cached):
        seen.append((cached is not None, _loaded_encoders(self)))
        fill(self, prompts, cached)

    monkeypatch.setattr(FlowPolicy, "_fill_text_cache", fill_and_look)
    assert train("second") == 0
    assert seen == [(True, [])]  # read from the file; the pipeline loaded without its three encoders
