"""Shared by the reliability tests: the template checkpoint, every loader, forked jobs, and the
guard that turns a hang, a huge allocation or a read outside the checkpoint into a failure.

The rule for hostile input (issue 6): every loader either succeeds or raises a
:class:`checkpointer.CheckpointError`; no other exception, no hang, no allocation larger than
the files justify, no read outside the checkpoint directory. :func:`guard` enforces the last
three while a loader runs:

* a hang: ``SIGALRM`` raises :class:`Hang` (a ``BaseException``, so no ``except Exception``
  in the library can swallow it) after ``HANG_S`` seconds (30, or ``CHECKPOINTER_TEST_HANG_S``),
  and again every 2 s after that;
* an allocation: ``RLIMIT_AS`` is lowered to the current address space plus
  ``ALLOC_HEADROOM`` (1 GiB; the checkpoints here are a few KiB), so a hostile size makes the
  allocation fail with ``MemoryError``/``RuntimeError``, which is not a ``CheckpointError``;
* a read outside: an audit hook records every ``open`` of a path that resolves outside the
  checkpoint tree, in the test's temporary directory or under ``/etc``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import resource
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

FUZZ_STATS: dict[str, int] = {}  # fuzz examples run, per target (printed at the end of the session)
FUZZ_KNOWN_HITS: dict[str, int] = {}  # fuzz examples that hit a bug already tracked by an xfail test

HANG_S = float(os.environ.get("CHECKPOINTER_TEST_HANG_S", "30"))
ALLOC_HEADROOM = 1 << 30

# ---------------------------------------------------------------------------------------
# The template checkpoint (saved by 3 ranks of the harness)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Template:
    root: str
    expected: dict[str, dict[str, torch.Tensor]]  # part ("model", "optim", "flat") -> full tensors


@dataclass(frozen=True)
class Copy:
    """A private copy of the template at ``<tmp>/run/step10``."""

    top: str
    expected: dict[str, dict[str, torch.Tensor]]

    @property
    def run_dir(self) -> str:
        return os.path.dirname(self.top)

    def part(self, name: str) -> str:
        return os.path.join(self.top, name)


def flat_full() -> dict[str, torch.Tensor]:
    """Full tensors of the flat checkpoint: flat-sharded, DTensor-sharded, replicated, odd dtypes."""
    g = torch.Generator().manual_seed(7)
    return {
        "flat.w": torch.randn(7, 9, generator=g),  # FlatShardedTensor, interleaved ranges per rank
        "flat.bf16": torch.randn(11, 4, generator=g).to(torch.bfloat16),  # DTensor Shard(0)
        "flat.rep": torch.randn(5, generator=g, dtype=torch.float64),  # replicated
        "flat.i8": torch.randint(-100, 100, (3, 2), generator=g).to(torch.int8),
        "flat.scalar": torch.tensor(3.5),
    }


def flat_ranges(numel: int, world_size: int, rank: int, run: int = 5) -> tuple[tuple[int, int], ...]:
    """Runs of ``run`` elements dealt round-robin to the ranks."""
    return tuple(
        (s, min(s + run, numel)) for i, s in enumerate(range(0, numel, run)) if i % world_size == rank
    )


def flat_local(rank: int, world_size: int) -> dict[str, Any]:
    from checkpointer import FlatShardedTensor

    full = flat_full()
    ranges = flat_ranges(full["flat.w"].numel(), world_size, rank)
    flat_w = full["flat.w"].reshape(-1)
    local = torch.cat([flat_w[s:e] for s, e in ranges]) if ranges else flat_w[:0].clone()
    state: dict[str, Any] = {k: v.clone() for k, v in full.items()}
    state["flat.w"] = FlatShardedTensor(local=local, shape=tuple(full["flat.w"].shape), flattened_offsets=ranges)
    if world_size > 1:
        from dist_helpers import to_layout

        state["flat.bf16"] = to_layout(full["flat.bf16"], f"shard0@{world_size}")
    return state


def zeros_local(rank: int, world_size: int) -> dict[str, Any]:
    """:func:`flat_local`'s layout, zero-filled: what a load into that state dict must fill."""
    from dist_helpers import zeros_like_layout

    from checkpointer import FlatShardedTensor

    state = flat_local(rank, world_size)
    w = state.pop("flat.w")
    out = zeros_like_layout(state)
    out["flat.w"] = FlatShardedTensor(local=torch.zeros_like(w.local), shape=w.shape, flattened_offsets=w.flattened_offsets)
    return out


def save_template(rank: int, world_size: int, root: str, compact: bool = False) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank: save an FSDP2 model + AdamW to ``root`` and a flat state dict to ``root/flat``.

    ``compact=False`` (the hostile tests' template): format 1, every piece listed in
    ``metadata.json`` with its checksums, which those tests edit; ``True``: format 2 (rules)."""
    from dist_helpers import build_model, build_optim, model_full_state, train

    from checkpointer import Checkpointer, save_model_and_optim_state
    from checkpointer.engine import save as engine_save

    engine_save.COMPACT_METADATA = compact

    model = build_model(world_size)
    optim = build_optim(model, "adamw")
    train(model, optim, range(2))
    save_model_and_optim_state(root, model, optim)
    Checkpointer().save(os.path.join(root, "flat"), flat_local(rank, world_size))
    return {
        "model": model_full_state(model),
        "optim": Checkpointer().unshard(os.path.join(root, "optim")),
        "flat": flat_full(),
    }


# ---------------------------------------------------------------------------------------
# The loaders (one process, no process group)
# ---------------------------------------------------------------------------------------


def zeros_of(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in full.items()}


def load_part(path: str, full: dict[str, torch.Tensor], *, verify: bool = False) -> dict[str, torch.Tensor]:
    from checkpointer import Checkpointer

    state = zeros_of(full)
    Checkpointer().load(path, state, verify=verify)
    return state


def load_model_top(top: str) -> Any:
    from dist_helpers import build_model, build_optim, model_full_state

    from checkpointer import load_model_and_optim_state

    model = build_model(1, seed=1)
    optim = build_optim(model, "adamw", fresh=True)
    load_model_and_optim_state(top, model, optim)
    return model_full_state(model)


def lazy_all(path: str) -> dict[str, torch.Tensor]:
    from checkpointer import lazy_load

    return dict(lazy_load(path))


def part_loaders(copy: Copy, part: str) -> dict[str, Callable[[], Any]]:
    """Every loader that reads the checkpoint directory ``part`` (model, optim or flat)."""
    import checkpointer as ck

    path, full = copy.part(part), copy.expected[part]
    calls: dict[str, Callable[[], Any]] = {
        "load": lambda: load_part(path, full),
        "load_verify": lambda: load_part(path, full, verify=True),
        "unshard": lambda: ck.Checkpointer().unshard(path),
        "get_metadata": lambda: ck.Checkpointer().get_metadata(path),
        "lazy_load": lambda: lazy_all(path),
        "latest_checkpoint": lambda: ck.latest_checkpoint(copy.run_dir),
    }
    if part in ("model", "optim"):
        calls["load_model_and_optim_state"] = lambda: load_model_top(copy.top)
    if part == "optim":
        calls["unshard_optim_state"] = lambda: ck.unshard_optim_state(copy.top)
    if part == "model":
        calls["unshard_model_state"] = lambda: ck.unshard_model_state(copy.top)
    return calls


# Loaders that read only metadata.json (a damaged rank file may leave them working).
METADATA_ONLY = {"get_metadata", "latest_checkpoint"}


# ---------------------------------------------------------------------------------------
# The guard
# ---------------------------------------------------------------------------------------


class Hang(BaseException):
    """A loader ran longer than ``HANG_S`` seconds."""


@dataclass
class _Audit:
    active: bool = False
    allowed: str = ""
    watched: tuple[str, ...] = ()
    violations: list[str] = field(default_factory=list)
    busy: bool = False


_AUDIT = _Audit()
_HOOKED: list[bool] = []


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _audit_hook(event: str, args: tuple) -> None:
    if event != "open" or not _AUDIT.active or _AUDIT.busy:
        return
    path = args[0] if args else None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not isinstance(path, str):
        return
    _AUDIT.busy = True
    try:
        real = os.path.realpath(path)
        if not _within(real, _AUDIT.allowed) and any(_within(real, w) for w in _AUDIT.watched):
            _AUDIT.violations.append(f"{path} (resolves to {real})")
    finally:
        _AUDIT.busy = False


def _install_audit_hook() -> None:
    if not _HOOKED:
        sys.addaudithook(_audit_hook)
        _HOOKED.append(True)


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def guard(allowed: str, watched: tuple[str, ...] = (), *, seconds: float = HANG_S, headroom: int = ALLOC_HEADROOM):
    """Run the body with the hang, allocation and outside-read checks described above.

    ``allowed``: the checkpoint tree (reads anywhere under it are fine). ``watched``: roots
    where a read outside ``allowed`` is a violation (the test's temporary directory, ``/etc``).
    Yields the list of violations, filled when the body ends.
    """
    _install_audit_hook()
    violations: list[str] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)

    def on_alarm(signum, frame):
        raise Hang(f"still running after {seconds:g}s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    _AUDIT.active, _AUDIT.allowed = True, os.path.realpath(allowed)
    _AUDIT.watched = tuple(os.path.realpath(w) for w in watched) + ("/etc",)
    _AUDIT.violations = violations
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    signal.setitimer(signal.ITIMER_REAL, seconds, 2.0)
    try:
        yield violations
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        _AUDIT.active = False


@dataclass
class Outcome:
    name: str
    error: BaseException | None
    traceback: str
    seconds: float
    outside_reads: list[str]
    value: Any = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        if self.error is None:
            return f"{self.name}: returned"
        return f"{self.name}: {type(self.error).__name__}: {self.error}\n{self.traceback}"


def run_guarded(
    name: str, call: Callable[[], Any], allowed: str, watched: tuple[str, ...], *, hang_s: float = HANG_S
) -> Outcome:
    t0 = time.monotonic()
    value, error, tb = None, None, ""
    with guard(allowed, watched, seconds=hang_s) as violations:
        try:
            value = call()
        except Hang as ex:
            error, tb = ex, traceback.format_exc()
        except Exception as ex:  # classified by the caller
            error, tb = ex, traceback.format_exc()
    return Outcome(name, error, tb, time.monotonic() - t0, list(violations), value)


def run_loaders(
    calls: dict[str, Callable[[], Any]], allowed: str, watched: tuple[str, ...], *, hang_s: float = HANG_S
) -> dict[str, Outcome]:
    return {name: run_guarded(name, call, allowed, watched, hang_s=hang_s) for name, call in calls.items()}


def rule_violations(
    outcomes: dict[str, Outcome],
    *,
    must_raise: set[str] | None = None,
    needles: tuple[str, ...] = (),
    cls: type = Exception,
) -> list[str]:
    """What breaks the rule for hostile input (empty when nothing does).

    Every outcome: returned, or raised a ``CheckpointError``; no hang; no read outside.
    ``must_raise``: loaders that must raise (a ``cls``), naming at least one of ``needles``.
    """
    from checkpointer import CheckpointError

    problems = []
    for name, out in outcomes.items():
        if out.outside_reads:
            problems.append(f"{name}: read outside the checkpoint: {out.outside_reads}")
        if isinstance(out.error, Hang):
            problems.append(f"{name}: HANG ({out.error})\n{out.traceback}")
        elif out.error is not None and not isinstance(out.error, CheckpointError):
            problems.append(f"{name}: raised {type(out.error).__name__}, not a CheckpointError: {out.error}\n{out.traceback}")
        elif must_raise is not None and name in must_raise:
            if out.error is None:
                problems.append(f"{name}: accepted the hostile input (raised nothing)")
            elif not isinstance(out.error, cls):
                problems.append(f"{name}: raised {type(out.error).__name__}, expected {cls.__name__}: {out.error}")
            elif needles and not any(n in str(out.error) for n in needles):
                problems.append(f"{name}: message names none of {needles}: {out.error}")
    return problems


def assert_rule(outcomes: dict[str, Outcome], **kwargs: Any) -> None:
    __tracebackhide__ = True
    problems = rule_violations(outcomes, **kwargs)
    if problems:
        raise AssertionError("hostile input broke the rule:\n" + "\n\n".join(problems))


# ---------------------------------------------------------------------------------------
# Forked single-process jobs (torch is already imported: no start-up cost)
# ---------------------------------------------------------------------------------------


@dataclass
class ForkResult:
    exitcode: int | None
    value: Any = None
    error: str | None = None  # "Type: message" of what the job raised
    error_type: str | None = None
    traceback: str = ""


def _child(conn, gate, fn, args) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
    if gate is not None:
        gate.wait()
    try:
        value = fn(*args)
        reply = ("ok", value, None, "")
    except BaseException as ex:  # noqa: BLE001 - reported to the parent
        reply = ("error", f"{type(ex).__name__}: {ex}", [c.__name__ for c in type(ex).__mro__], traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(reply))
    finally:
        conn.close()


def start_forked(fn: Callable[..., Any], *args: Any, gate: Any = None):
    """Start ``fn(*args)`` in a forked child; returns ``(process, connection)``."""
    ctx = multiprocessing.get_context("fork")
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child_conn, gate, fn, args), daemon=True)
    proc.start()
    child_conn.close()
    return proc, parent_conn


def finish_forked(proc, conn, timeout: float = 60.0) -> ForkResult:
    deadline = time.monotonic() + timeout
    reply = None
    while time.monotonic() < deadline:
        if conn.poll(0.05):
            try:
                reply = pickle.loads(conn.recv_bytes())
            except EOFError:
                reply = None
            break
        if not proc.is_alive():
            if conn.poll(0.2):
                continue
            break
    proc.join(max(0.1, deadline - time.monotonic()))
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        raise AssertionError(f"forked job {proc.pid} did not finish within {timeout:g}s (a hang)")
    if reply is None:
        return ForkResult(proc.exitcode)
    if reply[0] == "ok":
        return ForkResult(proc.exitcode, value=reply[1])
    return ForkResult(proc.exitcode, error=reply[1], error_type=reply[2][0], traceback=reply[3])


def run_forked(fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> ForkResult:
    proc, conn = start_forked(fn, *args)
    return finish_forked(proc, conn, timeout)


def new_gate():
    return multiprocessing.get_context("fork").Event()


def _in_group(fn: Callable[..., Any], rank: int, world_size: int, init_method: str, timeout_s: float | None, *args: Any) -> Any:
    import datetime

    import torch.distributed as dist

    if timeout_s is not None:
        os.environ["CHECKPOINTER_TIMEOUT_S"] = str(timeout_s)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, init_method=init_method,
        timeout=datetime.timedelta(seconds=120),
    )
    return fn(rank, world_size, *args)


def run_group(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    checkpointer_timeout_s: float | None = None,
    rendezvous: str = "file",
) -> list[ForkResult]:
    """``fn(rank, world_size, *args)`` on each rank of a gloo group of forked processes.

    A process group of its own per call, so a rank may die (``os._exit``, ``SIGKILL``)
    without harming anything else; each rank's :class:`ForkResult` comes back (a dead rank
    has no value and its exit code). The children leave with ``os._exit``, never tearing
    gloo down. ``checkpointer_timeout_s`` sets ``CHECKPOINTER_TIMEOUT_S`` in the children.
    ``rendezvous``: "file" (a file store), or "tcp" (a TCP store hosted by rank 0, on a port
    the OS picks).
    """
    with tempfile.TemporaryDirectory(prefix="ckpt-group-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}" if rendezvous == "file" else f"tcp://127.0.0.1:{_free_port()}"
        started = [start_forked(_in_group, fn, r, world_size, init, checkpointer_timeout_s, *args) for r in range(world_size)]
        deadline = time.monotonic() + timeout
        try:
            return [finish_forked(p, c, max(1.0, deadline - time.monotonic())) for p, c in started]
        finally:
            for proc, _ in started:  # after a hang: take the other ranks down too
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def values(results: list[ForkResult]) -> list[Any]:
    """The ranks' values; a rank that raised or died fails the test with its traceback."""
    __tracebackhide__ = True
    bad = [f"rank {r}: exit code {x.exitcode}, {x.error}\n{x.traceback}" for r, x in enumerate(results) if x.error or x.exitcode != 0]
    if bad:
        raise AssertionError("\n".join(bad))
    return [x.value for x in results]


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------


def snapshot(top: str) -> dict[str, bytes]:
    """Every file under ``top`` with its bytes (checkpoints here are small)."""
    out = {}
    for root, _, names in os.walk(top):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, top)] = f.read()
    return out


def rewrite(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


# Killing a save at a chosen point (tests/reliability/test_crash_safety*.py)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def install_kill(point: str, part: str) -> None:
    """Patch the save path to SIGKILL this process at ``point`` while saving ``part`` (model/optim/train)."""
    from checkpointer.engine import commit as commit_mod
    from checkpointer.engine import save as save_mod
    from checkpointer.format.layout import METADATA_FILENAME, is_rank_filename
    from checkpointer.storage import local

    def ours(path: str) -> bool:
        return f"{os.sep}{part}{os.sep}" in path or path.endswith(f"{os.sep}{part}")

    def rank_file(path: str) -> bool:
        return ours(path) and is_rank_filename(os.path.basename(path))

    def metadata(path: str) -> bool:
        return ours(path) and os.path.basename(path) == METADATA_FILENAME

    real_write, real_commit = local.LocalWriter.write, local.LocalWriter.commit
    real_write_stable = local.LocalWriter.write_stable
    real_commit_md, real_release = save_mod.commit_metadata, commit_mod.release_lock

    def half_then_die(self, buffers, real) -> None:
        # Half of the bytes of the first write (the header and, for small files, every piece).
        if (point == "rank_file_mid_write" and rank_file(self.path)) or (
            point == "metadata_mid_write" and metadata(self.path)
        ):
            views = [memoryview(b).cast("B") for b in buffers]
            budget = max(1, sum(len(v) for v in views) // 2)
            for v in views:
                real(self, [v[:budget]])
                budget -= min(budget, len(v))
                if not budget:
                    break
            _die()
        return real(self, buffers)

    def write(self, buffers):
        return half_then_die(self, buffers, real_write)

    def write_stable(self, buffers):
        return half_then_die(self, buffers, real_write_stable)

    def commit(self):
        if (point == "rank_file_before_rename" and rank_file(self.path)) or (
            point == "metadata_before_rename" and metadata(self.path)
        ):
            os.fsync(self.fd)
            _die()
        return real_commit(self)

    def commit_metadata(storage, meta, lock):
        if point == "after_rank_files_before_metadata" and ours(storage.url):
            _die()
        return real_commit_md(storage, meta, lock)

    def release(storage, lock):
        if point == "after_metadata_before_unlock" and ours(storage.url) and storage.exists(METADATA_FILENAME):
            _die()
        return real_release(storage, lock)

    local.LocalWriter.write, local.LocalWriter.write_stable, local.LocalWriter.commit = write, write_stable, commit
    save_mod.commit_metadata, commit_mod.release_lock = commit_metadata, release
