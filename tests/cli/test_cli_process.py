"""The command as a user runs it: exit statuses, one-line errors, progress only on a terminal, torchrun."""

from __future__ import annotations

import io
import os
import pty
import select
import shutil
import subprocess
import sys

import pytest
from cli_helpers import REPO, assert_same_tensors, at_once, cli, cli_process, without
from safetensors.torch import load_file

from checkpointer.progress import Progress, format_bytes, format_duration


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_on_a_terminal_only():
    tty = _Tty()
    bar = Progress("unshard", total_bytes=2048, total_items=4, stream=tty)
    bar.advance(1024, 2)
    assert tty.getvalue().startswith("\runshard [############------------]  50%  1.0 KiB/2.0 KiB  2/4 tensors  ")
    bar.advance(1024, 2)
    bar.close()
    assert tty.getvalue().endswith("\n") and "100%" in tty.getvalue() and "4/4 tensors" in tty.getvalue()
    bar.close()  # idempotent
    assert tty.getvalue().count("\n") == 1

    log = io.StringIO()
    with Progress("unshard", total_bytes=10, total_items=1, stream=log) as quiet:
        quiet.advance(10, 1)
    assert log.getvalue() == "" and quiet.bytes_done == 10
    assert Progress("x", total_bytes=1, total_items=1, stream=_Tty(), enabled=False).enabled is False


def test_progress_formats():
    assert [format_bytes(n) for n in (0, 1023, 1536, 5 * 2**30)] == ["0 B", "1023 B", "1.5 KiB", "5.0 GiB"]
    assert [format_duration(s) for s in (0, 75, 3725)] == ["0:00", "1:15", "1:02:05"]
    bar = Progress("v", total_bytes=100, total_items=2, unit="chunks", enabled=False)
    bar._start -= 2.0
    bar.advance(50, 1)
    assert bar.line(now=bar._start + 2.0) == "v [############------------]  50%  50 B/100 B  1/2 chunks  25 B/s  0:02 left"


def _run_on_pty(argv: list[str]) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal; returns (status, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=REPO),
    )  # fmt: skip
    os.close(slave)
    shown = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        shown += data
    os.close(master)
    out = proc.stdout.read().decode()
    return proc.wait(timeout=60), out, shown.decode()


def test_progress_bar_on_a_terminal_and_quiet(ckpts):
    script = shutil.which("checkpointer", path=os.path.dirname(sys.executable))
    argv = [script] if script else [sys.executable, "-m", "checkpointer"]
    shown_bar, quiet = at_once(_run_on_pty, ([sys.executable, "-m", "checkpointer", "verify", ckpts.ws3],),
                               (argv + ["verify", ckpts.ws3, "--quiet"],))
    code, out, shown = shown_bar
    assert code == 0 and out.startswith("ok: ")
    assert "\rverify model [" in shown and "\rverify optim [" in shown and "100%" in shown and "chunks" in shown
    assert quiet == (0, "", "")


def test_not_a_terminal_no_bar_and_one_line_errors(ckpts, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(os.path.join(ckpts.ws3, "model"), broken)
    os.remove(broken / "metadata.json")
    done, failed = at_once(cli_process, ("unshard", ckpts.ws3, str(tmp_path / "m.safetensors")),
                           ("unshard", str(broken), str(tmp_path / "x.safetensors")))
    assert (done.returncode, done.stderr) == (0, "")  # no progress bar in a pipe
    assert done.stdout.startswith("wrote 1 file (")
    assert_same_tensors(load_file(str(tmp_path / "m.safetensors")), without(ckpts.ws3_full, ["head.weight"]))

    assert (failed.returncode, failed.stdout) == (1, "")
    assert failed.stderr == (
        f"checkpointer: error: {broken}/metadata.json is missing: {broken} is not a complete checkpoint "
        "(its save never finished)\n"
    )
    assert not (tmp_path / "x.safetensors").exists()


def test_help_lists_every_command(capsys):
    """(``python -m checkpointer`` itself runs in the tests above.)"""
    code, out, err = cli(capsys, "--help")
    assert (code, err) == (0, "")
    for command in ("inspect", "verify", "unshard", "convert", "prune"):
        assert command in out


def test_usage_errors_exit_2(capsys):
    from cli_helpers import cli

    code, out, err = cli(capsys, "frobnicate")
    assert (code, out) == (2, "")
    assert "invalid choice: 'frobnicate'" in err
    code, out, err = cli(capsys, "unshard", "only-one-argument")
    assert (code, out) == (2, "")
    assert "the following arguments are required: OUT" in err


def test_torchrun_unshard_divides_the_shards(ckpts, tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    out = str(tmp_path / "hf")
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "checkpointer", "unshard", ckpts.ws3, out,
         "--max-shard-size", "200B"],
        capture_output=True, text=True, cwd=REPO, timeout=300, stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("rank 0 wrote ")
    names = sorted(os.listdir(out))
    assert len(names) > 4 and names[-1] == "model.safetensors.index.json"
    got = {}
    for name in names[:-1]:
        got.update(load_file(os.path.join(out, name)))
    assert_same_tensors(got, without(ckpts.ws3_full, ["head.weight"]))


def test_output_into_a_closed_pipe_is_not_an_error(tmp_path):
    """``checkpointer inspect DIR | head -2``: head exits early, and the command stops as shell
    tools do (status 141, as if killed by SIGPIPE), with nothing on stderr. It printed
    'checkpointer: error: [Errno 32] Broken pipe' and exited 1."""
    import torch

    from checkpointer import Checkpointer

    dir = str(tmp_path / "many")
    Checkpointer().save(dir, {f"layers.{i}.weight": torch.zeros(2) for i in range(3000)})
    procs = {
        tuple(extra): subprocess.Popen(
            [sys.executable, "-m", "checkpointer", "inspect", dir, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        )  # fmt: skip
        for extra in ([], ["--json"])
    }
    for extra, proc in procs.items():
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert (proc.wait(timeout=120), err) == (141, ""), extra
