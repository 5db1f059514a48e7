"""Trains briefly and writes this rank's weights and metrics so a test can compare the processes:
run by `accelerate launch --num_processes 2 dist_worker.py OUT MODEL_DIR [OVERRIDE ...]`, or
through `train_and_write` in processes forked from the test's own (`run_cpu_processes`, no
interpreter start-up: about 20 s each on a 2-core box), or alone as one process. Rank 0 also
writes the whole trained weights (full.safetensors, gathered from the shards under fsdp2) and an
ODE sample of them (sample.safetensors)."""

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from flowrl.config import load_config
from flowrl.sampling.rollout import rollout
from flowrl.train.loop import Trainer
from flowrl.train.sharding import local


def train_and_write(out: Path, model_dir: str, extra: list[str]) -> None:
    """Train briefly and write this process's weights and metrics under `out` (see the module's text)."""
    cfg = load_config("tiny_jpeg", [
        f"model.path={model_dir}", "trainer.iterations=2", "data.prompts_per_iteration=2", "data.group_size=4",
        "sampling.batch_size=2", "sampling.num_steps=3", "sampling.eval_num_steps=2", "run.tracker=none",
        "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0", "trainer.kl_beta=0.01", *extra,
    ])
    trainer = Trainer(cfg, run_dir=out / "run")
    end_training, trainer.accelerator.end_training = trainer.accelerator.end_training, lambda: None  # collectives follow
    history = trainer.train()
    rank = trainer.accelerator.process_index
    save_file({n: local(p).detach().contiguous() for n, p in trainer.params.items()}, str(out / f"rank{rank}.safetensors"))
    (out / f"rank{rank}.json").write_text(json.dumps({"world": trainer.accelerator.num_processes, "history": history}))
    full = trainer.layout.full(trainer.params)  # every process takes part; rank 0 gets the weights
    with trainer.layout.gathered():
        if rank == 0:
            save_file({n: t.contiguous() for n, t in full.items()}, str(out / "full.safetensors"))
            traj = rollout(trainer.policy, ["a red circle", "a blue square"], [7, 8], trainer.eval_spec(), 2)
            save_file({"final": traj.final.contiguous()}, str(out / "sample.safetensors"))
    end_training()


if __name__ == "__main__":
    train_and_write(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
