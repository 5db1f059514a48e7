"""`flowrl check` (flowrl/train/check.py): the log-prob ratio of training-mode forwards, flowrl's ODE against
the family's own pipeline call, and a one-step LoRA change replayed in plain diffusers pass on every tiny
family, on the default preset and in bf16; a broken adapter fails them with a readable table and exit 1;
bad input is one sentence and exit 2."""

from __future__ import annotations

import pytest
import torch

from flowrl.cli import main
from flowrl.models.base import FlowPolicy
from tiny_families import TINY_FAMILIES, check_schedule, tiny_family_args

SHORT = ["tiny_jpeg", "sampling.num_steps=2", "sampling.eval_num_steps=3", "sampling.batch_size=2"]


def _table(out: str) -> dict[str, list[str]]:
    """The printed table's rows by check: [result, largest difference, tolerance]."""
    rows = [line for line in out.splitlines() if line.startswith("(") and ": " not in line]
    return {row[:3]: row.split()[-3:] for row in rows}


@pytest.mark.parametrize("kind", list(TINY_FAMILIES))
def test_every_family_passes(kind, request, capsys):
    # on the grid the export test does not use (tests/tiny_families.py), so both grids meet each family's pipeline
    assert main(["check", *tiny_family_args(kind, request, check_schedule(kind))]) == 0
    out = capsys.readouterr().out
    table = _table(out)
    assert [row[0] for row in table.values()] == ["pass"] * 3, out
    assert "step 0 (sigma 1.0000 -> " in out and "ratio 1.00000000 .. 1.00000000" in out


def test_the_default_preset_passes_with_the_ratio_skipped(capsys):
    # DGPO samples with the ODE: no log-probs to recompute; fewer sampling steps only for time
    assert main(["check", "sampling.eval_num_steps=4"]) == 0
    out = capsys.readouterr().out
    table = _table(out)
    assert table["(a)"] == ["skipped", "-", "-"] and table["(b)"][0] == table["(c)"][0] == "pass", out
    assert "sampling.sampler ode draws no log-probabilities" in out


def test_the_default_presets_gated_adapter_fails_the_replay_without_the_step_callback(monkeypatch, capsys):
    # lora.sigma_range [0.55, 1]: the 4-step eval grid's last two steps are the base network's; a pipeline that
    # leaves the loaded adapter on at every step draws something else
    import flowrl.models.pipeline_call as pipeline_call

    monkeypatch.setattr(pipeline_call, "gate_adapter", lambda pipe, step, timestep, tensors, low, high: tensors)
    assert main(["check", "sampling.eval_num_steps=4"]) == 1
    out = capsys.readouterr().out
    table = _table(out)
    assert table["(b)"][0] == "pass" and table["(c)"][0] == "FAIL" and float(table["(c)"][1]) > 1e-3, out


def test_bf16_compares_the_pipeline_in_fp32(capsys):
    assert main(["check", *SHORT, "model.dtype=bf16"]) == 0
    out = capsys.readouterr().out
    assert "(b) and (c) on the model loaded again in fp32" in out and list(_table(out)) == ["(a)", "(b)", "(c)"]


def test_full_fine_tuning_has_no_adapter_to_replay(capsys):
    assert main(["check", *SHORT, "lora.enabled=false"]) == 0
    out = capsys.readouterr().out
    assert _table(out)["(c)"][0] == "skipped" and "lora.enabled is false: no adapter to replay" in out


def test_a_broken_adapter_fails_with_a_table(monkeypatch, capsys):
    from peft.tuners.lora import LoraLayer

    add_lora, lora_state_dict = FlowPolicy.add_lora, FlowPolicy.lora_state_dict

    def add_lora_with_dropout(self, lora, seed=0):  # LoRA dropout: training forwards differ from the rollout's
        add_lora(self, lora, seed)
        for module in self.transformer.modules():
            if isinstance(module, LoraLayer):
                module.lora_dropout["default"] = torch.nn.Dropout(0.1)

    def half_the_keys(self, state=None):  # a save that drops keys: diffusers loads half the adapter
        keys = lora_state_dict(self, state)
        return dict(list(keys.items())[: len(keys) // 2])

    monkeypatch.setattr(FlowPolicy, "add_lora", add_lora_with_dropout)
    monkeypatch.setattr(FlowPolicy, "lora_state_dict", half_the_keys)
    assert main(["check", *SHORT]) == 1
    out = capsys.readouterr().out
    table = _table(out)
    assert table["(a)"][0] == "FAIL" and float(table["(a)"][1]) > 1e-5 and table["(a)"][2] == "1e-05", out
    assert table["(b)"][0] == "pass" and table["(c)"][0] == "FAIL" and float(table["(c)"][1]) > 1e-3, out
    assert out.splitlines()[-5].split() == ["check", "result", "largest", "difference", "tolerance"]  # the header, then 3 rows and a note


@pytest.mark.parametrize("args, sentence", [
    (["no_such_preset"], "no_such_preset"),
    (["text_add"], "flowrl check compares flowrl's sampler with a diffusers pipeline; give an image config, not a text one"),
    (["tiny_jpeg", "sampling.sampler=euler"], "sampling.sampler"),
])
def test_bad_input_is_one_sentence(args, sentence, capsys):
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert sentence in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
