"""The training loop: rollout -> reward -> advantage -> loss -> step; checkpoints; logging."""
