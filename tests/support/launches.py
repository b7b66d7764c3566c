"""Commands a test module starts together, before its first test needs one, each then awaited by
its own test: every command spends seconds of one core importing torch, and started at once they
overlap on the machine's cores instead of queueing behind each other."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["Launches"]


class Launches:
    """Commands started at once, their output going to files in ``directory`` (a pipe nobody reads
    yet could fill and stall them)."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with open(self._directory / f"{name}.out", "wb") as out, open(self._directory / f"{name}.err", "wb") as err:
            self._procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    def result(self, name: str, timeout: float = 240) -> subprocess.CompletedProcess:
        """The finished command ``name``: its status, stdout and stderr (text)."""
        proc = self._procs[name]
        code = proc.wait(timeout=timeout)
        out, err = ((self._directory / f"{name}.{kind}").read_text() for kind in ("out", "err"))
        return subprocess.CompletedProcess(proc.args, code, out, err)

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
