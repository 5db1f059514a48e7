"""trainer.optimizer (flowrl/runtime/optimizers.py): bitsandbytes' 8-bit AdamW steps as bitsandbytes
builds it, with the trainer's hyper-parameters; its quantised state survives a checkpoint; the
run manager's clipping and non-finite policy hold for it; every refusal is one sentence."""

from __future__ import annotations

import math
import sys
import warnings

import bitsandbytes as bnb  # the test extra holds it (the memory extra's package)
import pytest
import torch

from flowrl.cli import main
from flowrl.config import load_config
from flowrl.errors import ConfigError
from flowrl.runtime.checkpoint import load_checkpoint, save_checkpoint
from flowrl.runtime.optimizers import build_optimizer
from flowrl.runtime.options import TrainerOptions
from flowrl.runtime.run_manager import RunManager

# none of them bitsandbytes' defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2)
OPTIONS = dict(lr=3e-3, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, weight_decay=0.05)
BITSANDBYTES = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit"}


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Two tensors of 8192 and 4100 values (8-bit moments: 32 and 17 blocks of 256) and one of 10 (fp32 moments)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((64, 128), (4100,), (10,))]


def step_with(optimizer, params, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.fixture(autouse=True)
def _quiet_paging():
    with warnings.catch_warnings():  # bitsandbytes pages only CUDA memory; on a CPU it says so once
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        yield


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_an_8bit_optimizer_steps_as_bitsandbytes_own_with_the_trainers_settings(name):
    ours_params, theirs_params = make_params(), make_params()
    ours = build_optimizer(ours_params, TrainerOptions(optimizer=name, **OPTIONS))
    cls = getattr(bnb.optim, BITSANDBYTES[name])
    theirs = cls(theirs_params, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    assert type(ours) is cls
    group = ours.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (3e-3, (0.8, 0.95), 1e-6, 0.05)
    for step in range(3):
        step_with(ours, ours_params, step)
        step_with(theirs, theirs_params, step)
    assert all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params))
    big, odd, small = (ours.state[p] for p in ours_params)
    assert big["state1"].dtype == big["state2"].dtype == torch.uint8 and big["absmax1"].shape == (8192 // 256,)
    assert odd["absmax2"].shape == (17,)  # a last block of 4 values has its own absmax
    assert small["state1"].dtype == torch.float32  # under bitsandbytes' 4096 values: fp32 moments


def test_adamw_is_torchs_with_the_trainers_settings():
    opt = build_optimizer(make_params(), TrainerOptions(**OPTIONS))
    group = opt.param_groups[0]
    assert type(opt) is torch.optim.AdamW
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-3, (0.8, 0.95), 1e-6, 0.05)


def test_the_8bit_state_round_trips_through_a_checkpoint(tmp_path):
    options = TrainerOptions(optimizer="adamw8bit", **OPTIONS)
    straight_params = make_params()
    straight = build_optimizer(straight_params, options)
    for step in range(2):
        step_with(straight, straight_params, step)
    named = {f"w{i}": p for i, p in enumerate(straight_params)}
    ckpt = save_checkpoint(tmp_path, 2, named, straight.state_dict(), None, {})
    data = load_checkpoint(ckpt)
    saved = data["optimizer"]["state"][0]["__bnb_optimizer_quant_state__"]  # bitsandbytes' own wrapping, kept
    assert saved["state1"].dtype == torch.uint8 and {"qmap1", "qmap2", "absmax1", "absmax2", "state2"} <= saved.keys()

    resumed_params = [torch.nn.Parameter(data["params"][f"w{i}"].clone()) for i in range(len(straight_params))]
    resumed = build_optimizer(resumed_params, options)
    resumed.load_state_dict(data["optimizer"])
    for step in range(2, 4):
        step_with(straight, straight_params, step)
        step_with(resumed, resumed_params, step)
    assert all(torch.equal(a, b) for a, b in zip(straight_params, resumed_params))
    for p, q in zip(straight_params, resumed_params):
        a, b = straight.state[p], resumed.state[q]
        assert a.keys() == b.keys() and a["step"] == b["step"] == 4
        assert all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))


class Steps(RunManager):
    """The run manager's optimizer step alone: clip to trainer.max_grad_norm, skip a non-finite step."""

    def __init__(self, params, optimizer, max_grad_norm: float):
        self.params, self.optimizer = params, optimizer
        self.cfg = type("Cfg", (), {"trainer": TrainerOptions(max_grad_norm=max_grad_norm, max_skipped_steps=3)})()
        self.skipped_steps, self.skipped_in_a_row = 0, 0

    def clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.trainer.max_grad_norm))


def test_clipping_and_the_non_finite_policy_hold_for_the_8bit_optimizer():
    options = TrainerOptions(optimizer="adamw8bit", **OPTIONS)
    params, reference_params = make_params(), make_params()
    trainer = Steps(params, build_optimizer(params, options), max_grad_norm=0.5)
    reference = build_optimizer(reference_params, options)
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(p.shape, generator=g) for p in params]

    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    norm = trainer.optimizer_step()
    for p, grad in zip(reference_params, grads):  # the reference steps on the gradients scaled to norm 0.5
        p.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_(reference_params, 0.5)
    reference.step()
    assert norm > 0.5 and all(torch.equal(a, b) for a, b in zip(params, reference_params))

    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in trainer.optimizer.state[params[0]].items() if isinstance(v, torch.Tensor)}
    for p, grad in zip(params, grads):
        p.grad = grad.clone()
    params[0].grad[0, 0] = float("nan")
    assert math.isnan(trainer.optimizer_step())
    assert trainer.skipped_steps == 1 and all(p.grad is None for p in params)
    assert all(torch.equal(a, b) for a, b in zip(params, before))  # the weights and the 8-bit moments as they were
    assert all(torch.equal(v, trainer.optimizer.state[params[0]][k]) for k, v in state.items())
    assert trainer.optimizer.state[params[0]]["step"] == 1


# ---- refusals, one sentence each ----------------------------------------------------------------
def test_an_unknown_optimizer_names_the_field_and_the_choices(tiny_sd3_dir, capsys):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "trainer.optimizer=sgd"])
    assert str(err.value) == "trainer.optimizer must be one of adamw, adamw8bit, paged_adamw8bit; got 'sgd'"
    assert main(["train", "configs/text_add.yaml", "trainer.optimizer=adam8bit"]) == 2  # the text trainer's options too
    assert "trainer.optimizer must be one of adamw, adamw8bit, paged_adamw8bit; got 'adam8bit'" in capsys.readouterr().err


def test_8bit_under_fsdp2_is_refused(tiny_sd3_dir):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_jpeg", [f"model.path={tiny_sd3_dir}", "trainer.optimizer=paged_adamw8bit", "run.distributed=fsdp2"])
    assert str(err.value) == ("trainer.optimizer paged_adamw8bit cannot step run.distributed fsdp2's sharded weights "
                              "(bitsandbytes takes plain tensors); set trainer.optimizer: adamw or run.distributed: ddp")


def test_bitsandbytes_cannot_step_fsdp2s_sharded_weights(tmp_path):
    # why fsdp2 is refused: its weights are DTensors, which bitsandbytes' update kernel does not take
    # (when this fails, bitsandbytes has learnt to: the refusal can go)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        net = torch.nn.Linear(128, 64)
        fully_shard(net)
        opt = bnb.optim.AdamW8bit(net.parameters())
        net(torch.randn(2, 128)).sum().backward()
        with pytest.raises(RuntimeError, match="DTensor"):
            opt.step()
    finally:
        dist.destroy_process_group()


def test_a_missing_bitsandbytes_is_one_sentence_before_the_model_loads(tmp_path, tiny_sd3_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # `import bitsandbytes` now fails as if not installed
    with pytest.raises(ConfigError) as err:
        build_optimizer(make_params(), TrainerOptions(optimizer="adamw8bit"))
    assert str(err.value) == ("trainer.optimizer adamw8bit needs bitsandbytes, which is not installed: "
                              "pip install 'flowrl[memory]', or set trainer.optimizer: adamw")
    monkeypatch.setattr("flowrl.train.loop.load_policy", lambda *a, **k: pytest.fail("the model loaded first"))
    assert main(["train", "tiny_jpeg", f"model.path={tiny_sd3_dir}", "trainer.optimizer=paged_adamw8bit", "run.tracker=none",
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "trainer.optimizer paged_adamw8bit needs bitsandbytes, which is not installed: pip install 'flowrl[memory]'" in err
    assert "Traceback" not in err
