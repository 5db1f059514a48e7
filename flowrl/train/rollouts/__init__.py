"""The registered rollouts: importing this package registers every built-in one."""

from flowrl.train.rollouts import flat, granular, offline, tree, two_stage  # noqa: F401
