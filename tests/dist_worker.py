"""Run by test_training.py under `accelerate launch --num_processes 2`: trains briefly and
writes this rank's trainable weights and metrics so the test can compare the processes."""

import json
import sys
from pathlib import Path

from safetensors.torch import save_file

from flowrl.config import load_config
from flowrl.train.loop import Trainer

out, model_dir = Path(sys.argv[1]), sys.argv[2]
cfg = load_config("tiny_jpeg", [
    f"model.path={model_dir}", "trainer.iterations=2", "data.prompts_per_iteration=2", "data.group_size=4",
    "sampling.batch_size=2", "sampling.num_steps=3", "sampling.eval_num_steps=2", "run.tracker=none",
    "run.progress=false", "run.sample_every=0", "run.checkpoint_every=0", "trainer.kl_beta=0.01",
])
trainer = Trainer(cfg, run_dir=out / "run")
history = trainer.train()
rank = trainer.accelerator.process_index
save_file({n: p.detach().contiguous() for n, p in trainer.params.items()}, str(out / f"rank{rank}.safetensors"))
(out / f"rank{rank}.json").write_text(json.dumps({"world": trainer.accelerator.num_processes, "history": history}))
