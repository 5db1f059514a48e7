"""The registered rollouts: importing this package imports each of its modules, and each module
registers the rollouts it defines, so a new rollout is one new file here."""

import pkgutil
from importlib import import_module

for _module in pkgutil.iter_modules(__path__):
    import_module(f"{__name__}.{_module.name}")
