"""flowrl: RL fine-tuning of rectified-flow image models with LoRA against reward models (README.md).

From Python, `from flowrl import api` (flowrl/api.py): the CLI's commands as functions. It is
imported on first use, so `import flowrl` stays light."""


def __getattr__(name: str):
    if name == "api":  # `import flowrl; flowrl.api.train(...)`
        from importlib import import_module

        return import_module("flowrl.api")
    raise AttributeError(f"module 'flowrl' has no attribute '{name}'")
