"""User-facing errors: one sentence naming the field and what is allowed. The CLI prints
them without a traceback and exits 2."""


class UserError(Exception):
    """A mistake in what the user gave us (config, prompt file, checkpoint, reward output)."""


class ConfigError(UserError):
    """A config key with an unknown name, a wrong type or an impossible value."""
