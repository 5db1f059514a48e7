"""The registered objectives: importing this package registers every built-in one."""

from flowrl.train.objectives import dgpo, gdro, grpo, nft  # noqa: F401
