"""``checkpointer prune RUN_DIR --keep-last N [--keep-every K] [--dry-run]``: what it prints, and
that ``--dry-run`` deletes nothing; also as a real command."""

from __future__ import annotations

import os

from cli_helpers import cli, cli_process
from prune_helpers import DELETED, KEPT, make_run


def test_prune_dry_run_then_prune(tmp_path, capsys):
    run = str(tmp_path / "run")
    make_run(run)
    before = sorted(os.listdir(run))
    code, out, err = cli(capsys, "prune", run, "--keep-last", "2", "--keep-every", "200", "--dry-run")
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"would delete {run}/{name}" for name in DELETED]
    assert sorted(os.listdir(run)) == before

    done = cli_process("prune", run, "--keep-last", "2", "--keep-every", "200")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == [f"deleted {run}/{name}" for name in DELETED]
    assert sorted(os.listdir(run)) == KEPT
    assert cli(capsys, "prune", run, "--keep-last", "2", "--keep-every", "200") == (0, "", "")


def test_prune_usage_errors(tmp_path, capsys):
    code, _, err = cli(capsys, "prune", str(tmp_path))
    assert code == 2 and "--keep-last" in err
    code, _, err = cli(capsys, "prune", str(tmp_path), "--keep-last", "-1")
    assert code == 1 and "keep_last must be 0 or more" in err


def test_prune_refuses_a_path_that_is_not_a_run_directory(tmp_path, capsys):
    """A typo, a file, or a checkpoint given for its run directory printed nothing and exited 0
    (found by a review): the run directory's checkpoints were never looked at."""
    run = str(tmp_path / "run")
    make_run(run)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    step = os.path.join(run, "step500")  # complete
    before = sorted(os.listdir(run))
    for path, says in [(str(tmp_path / "rnu"), "no such run directory"), (str(a_file), "is a file"),
                       (step, "is a checkpoint; prune takes the run directory")]:
        for dry in ([], ["--dry-run"]):
            code, out, err = cli(capsys, "prune", path, "--keep-last", "1", *dry)
            assert (code, out) == (1, "") and says in err and path in err, (path, err)
    assert sorted(os.listdir(run)) == before
    os.mkdir(tmp_path / "new_run")
    assert cli(capsys, "prune", str(tmp_path / "new_run"), "--keep-last", "1") == (0, "", "")
