"""Import a file of scripts/ as a module (scripts/ is no package), for the tests of its functions; and a
stand-in for the `subprocess` of a script that starts `flowrl` in a fresh interpreter."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def forked_flowrl(train_code: str = "") -> SimpleNamespace:
    """A script's `subprocess`, for `monkeypatch.setattr(script, "subprocess", forked_flowrl())`: its `run` of
    `python -m flowrl.cli ARGV` (or `python -c TRAIN_CODE ARGV`, which calls the same main) runs main(ARGV) in a
    process forked from the test's: a process of its own, as the script wants, without a fresh interpreter's
    start-up (about 7 s of CPU on the 2-core box). What it prints goes to the test's output; the returned
    CompletedProcess has its exit code and empty stdout and stderr."""
    from flowrl.cli import main
    from flowrl.runtime.processes import ForkedProcess

    def run(cmd, cwd=None, check=False, **_):
        assert cmd[0] == sys.executable and cmd[1:3] in (["-m", "flowrl.cli"], ["-c", train_code]), cmd

        def child() -> int:
            os.chdir(cwd or os.getcwd())
            return main(cmd[3:])

        code = ForkedProcess(child, {}).wait()
        if check and code:
            raise subprocess.CalledProcessError(code, cmd)
        return subprocess.CompletedProcess(cmd, code, "", "")

    return SimpleNamespace(run=run, CalledProcessError=subprocess.CalledProcessError)
