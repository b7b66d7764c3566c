"""Helpers of the command-line tests: run the CLI in this process or as a real command."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from checkpointer.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``checkpointer ARGV`` in this process: ``(exit status, stdout, stderr)``."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as ex:  # argparse usage errors
        code = int(ex.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def cli_process(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python -m checkpointer ARGV`` as a separate process (not on a terminal)."""
    full_env = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "checkpointer", *argv],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def at_once(run: Callable[..., Any], *calls: Sequence[Any]) -> list[Any]:
    """``run(*args)`` for each ``args`` of ``calls``, all at once (each in a thread), in order:
    commands that each spend seconds of one core starting up overlap on several cores."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda args: run(*args), calls))


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same keys, shapes, dtypes and bits."""
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        assert got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key


def without(d: dict, keys: Sequence[str]) -> dict:
    return {k: v for k, v in d.items() if k not in keys}
