"""Run test functions on every rank of a long-lived ``torch.distributed`` (gloo) process pool.

Starting a process that imports torch costs seconds, so each world size gets one pool of
worker processes per pytest session, and every test sends it tasks. A task names a
module-level function (module, file and qualified name); each worker imports it and calls
``fn(rank, world_size, *args)``. Results, or each failing rank's full traceback, come back
to the parent over a socket pair; nothing is shared through ports (the process group meets
through a ``file://`` rendezvous).

A pool that times out, loses a worker, or is left out of step by a failed task is killed
and started afresh for the next test. On a timeout every worker first dumps its threads'
stacks (faulthandler, ``SIGUSR1``) into its log, and the failure message shows them.

This file is also the workers' entry point: ``python harness.py --rank R ...``. That path
imports only the standard library until the task arrives, and sets the thread counts
before torch is imported. Workers get the repository root and ``tests/support`` (this file's
folder) on ``PYTHONPATH``, so a task's module imports the helpers by bare name
(``from dist_helpers import ...``) as it does under pytest; a test module itself is imported
by its file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

__all__ = ["PoolManager", "WorkerPool", "DistributedTestFailure"]

SUPPORT_DIR = os.path.dirname(os.path.abspath(__file__))  # tests/support: the helper modules
REPO_ROOT = os.path.dirname(os.path.dirname(SUPPORT_DIR))

START_TIMEOUT_S = 180.0
HEALTH_TIMEOUT_S = 20.0
LOG_TAIL_CHARS = 6000


class DistributedTestFailure(Exception):
    """A task failed on some rank, timed out, or lost a worker (carries a readable report)."""


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------


def _describe(fn: Callable[..., Any]) -> tuple[str, str, str]:
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not module or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"{fn!r} must be a module-level function so that workers can import it")
    mod = sys.modules.get(module)
    file = getattr(mod, "__file__", None) or ""
    return module, os.path.abspath(file) if file else "", qualname


@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen
    conn: Connection
    log_path: str
    log_offset: int = 0

    def log_since(self, offset: int | None = None) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset if offset is None else offset)
                text = f.read().decode("utf-8", "replace")
        except OSError as e:
            return f"<log unavailable: {e}>"
        if len(text) > LOG_TAIL_CHARS:
            text = "...\n" + text[-LOG_TAIL_CHARS:]
        return text

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0


@dataclass
class WorkerPool:
    """``world_size`` workers in one process group (gloo unless ``backend`` says otherwise; none
    with ``init_pg=False``). With NCCL, rank ``r`` uses GPU ``r`` modulo the GPUs there are."""

    world_size: int
    init_pg: bool = True
    backend: str = "gloo"
    workers: list[_Worker] = field(default_factory=list)
    tmpdir: str = ""
    tasks_run: int = 0
    ready: bool = False

    def start(self) -> None:
        self.launch()
        self.wait_ready()
        self.ready = True

    def launch(self) -> None:
        """Start the worker processes (they import torch and meet in the background)."""
        self.tmpdir = tempfile.mkdtemp(prefix=f"ckpt-pool-ws{self.world_size}-")
        init_file = os.path.join(self.tmpdir, "rendezvous")
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            OPENBLAS_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONFAULTHANDLER="1",
            PYTHONPATH=os.pathsep.join(
                [REPO_ROOT, SUPPORT_DIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
            ),
        )
        for rank in range(self.world_size):
            parent_sock, child_sock = socket.socketpair()
            child_fd = child_sock.detach()
            log_path = os.path.join(self.tmpdir, f"rank{rank}.log")
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        "--rank",
                        str(rank),
                        "--world-size",
                        str(self.world_size),
                        "--fd",
                        str(child_fd),
                        "--init-file",
                        init_file,
                        "--init-pg",
                        "1" if self.init_pg else "0",
                        "--backend",
                        self.backend,
                    ],
                    env=env,
                    cwd=REPO_ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(child_fd,),
                    start_new_session=True,
                )
            os.close(child_fd)
            self.workers.append(_Worker(rank, proc, Connection(parent_sock.detach()), log_path))

    def wait_ready(self) -> None:
        got = self._recv_all(self.workers, time.monotonic() + START_TIMEOUT_S, "start-up")
        for w in self.workers:
            msg = got[w.rank]
            if msg != ("ready", w.rank):
                self.kill()
                raise DistributedTestFailure(f"rank {w.rank} sent {msg!r} instead of 'ready'")

    def _recv_all(
        self, workers: list[_Worker], deadline: float, what: str, into: dict | None = None, dead_ok: bool = False
    ) -> dict:
        """One message from each worker, whichever answers first; fills and returns ``into``.

        With ``dead_ok`` a worker that exits answers ``("ok", "died")`` instead of failing.
        """
        replies: dict[int, Any] = {} if into is None else into
        waiting = {w.conn: w for w in workers}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"rank(s) {sorted(w.rank for w in waiting.values())} gave no answer ({what})")
            for conn in wait(list(waiting), timeout=min(remaining, 1.0)):
                w = waiting.pop(conn)
                try:
                    replies[w.rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError) as e:
                    if dead_ok:
                        replies[w.rank] = ("ok", "died")
                        continue
                    try:
                        status = w.proc.wait(timeout=3)
                    except subprocess.TimeoutExpired:
                        status = None
                    raise _WorkerDied(w.rank, f"connection lost ({e!r}), exit status {status}") from e
            for w in list(waiting.values()):
                if w.proc.poll() is not None and not w.conn.poll(0):
                    if dead_ok:
                        replies[w.rank] = ("ok", "died")
                        del waiting[w.conn]
                        continue
                    raise _WorkerDied(w.rank, f"exited with status {w.proc.returncode}")
        return replies

    def alive(self) -> bool:
        return bool(self.workers) and all(w.proc.poll() is None for w in self.workers)

    def run(
        self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float, dead_ok: bool = False
    ) -> list[Any]:
        module, file, qualname = _describe(fn)
        payload = pickle.dumps(("run", module, file, qualname, args, kwargs))
        for w in self.workers:
            w.log_offset = w.log_size()
        try:
            for w in self.workers:
                w.conn.send_bytes(payload)
        except OSError as e:
            report = self._report_dead(f"sending the task failed: {e!r}")
            self.kill()
            raise DistributedTestFailure(report) from e
        self.tasks_run += 1
        deadline = time.monotonic() + timeout
        replies: dict[int, Any] = {}
        try:
            self._recv_all(self.workers, deadline, f"task {qualname}", into=replies, dead_ok=dead_ok)
        except TimeoutError:
            pending = [w.rank for w in self.workers if w.rank not in replies]
            report = self._report_timeout(qualname, timeout, pending, replies)
            self.kill()
            raise DistributedTestFailure(report) from None
        except _WorkerDied as e:
            report = self._report_dead(f"rank {e.rank} died during {qualname}: {e.why}", replies)
            self.kill()
            raise DistributedTestFailure(report) from None

        if dead_ok and any(m == ("ok", "died") for m in replies.values()):
            self.kill()  # the group lost a member: the next task gets a fresh pool
        failed = {r: m for r, m in replies.items() if m[0] != "ok"}
        if failed:
            parts = [f"{qualname} failed on rank(s) {sorted(failed)} of {self.world_size}:"]
            shown: dict[str, int] = {}
            for r, m in sorted(failed.items()):
                if m[1] in shown:
                    parts.append(f"\n---------------- rank {r}: the same traceback as rank {shown[m[1]]}")
                    continue
                shown[m[1]] = r
                parts.append(f"\n---------------- rank {r} ----------------\n{m[1]}")
                out = self.workers[r].log_since()
                if out.strip():
                    parts.append(f"[rank {r} output]\n{out}")
            # The task may have left the ranks at different points: make sure the group still works.
            healthy, why = self._healthy() if self.workers else (True, "")
            if not healthy:
                parts.append(f"\n(the process group was left unusable: {why}; the pool is restarted)")
                self.kill()
            raise DistributedTestFailure("\n".join(parts))
        return [replies[r][1] for r in range(self.world_size)]

    def _healthy(self) -> tuple[bool, str]:
        nonce = secrets.randbits(48)
        payload = pickle.dumps(("health", nonce))
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        try:
            for w in self.workers:
                w.conn.send_bytes(payload)
            got = self._recv_all(self.workers, deadline, "health check")
            answers = [got[r] for r in range(self.world_size)]
        except (TimeoutError, _WorkerDied, OSError) as e:
            return False, repr(e)
        expected = ("ok", [nonce] * self.world_size)
        bad = {r: a for r, a in enumerate(answers) if a != expected}
        return not bad, f"health check answers {bad!r}"

    def _dump_stacks(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.kill(w.proc.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(1.5)

    def _report_timeout(self, qualname: str, timeout: float, pending: list[int], replies: dict) -> str:
        self._dump_stacks()
        parts = [
            f"{qualname} timed out after {timeout:.0f}s on world size {self.world_size}: "
            f"rank(s) {pending} never answered (a hang). The pool is killed and will be restarted."
        ]
        for r, m in sorted(replies.items()):
            if m[0] != "ok":
                parts.append(f"\n---------------- rank {r} raised ----------------\n{m[1]}")
        for w in self.workers:
            parts.append(f"\n---------------- rank {w.rank} output and stacks ----------------\n{w.log_since()}")
        return "\n".join(parts)

    def _report_dead(self, why: str, replies: dict | None = None) -> str:
        parts = [f"world size {self.world_size}: {why}. The pool is killed and will be restarted."]
        for r, m in sorted((replies or {}).items()):
            if m[0] != "ok":
                parts.append(f"\n---------------- rank {r} raised ----------------\n{m[1]}")
        for w in self.workers:
            parts.append(f"\n---------------- rank {w.rank} output ----------------\n{w.log_since()}")
        return "\n".join(parts)

    def kill(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                except OSError:
                    pass
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            w.conn.close()
        self.workers = []
        self.ready = False
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = ""

    def shutdown(self) -> None:
        payload = pickle.dumps(("exit",))
        for w in self.workers:
            try:
                w.conn.send_bytes(payload)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class _WorkerDied(Exception):
    def __init__(self, rank: int, why: str):
        super().__init__(rank, why)
        self.rank = rank
        self.why = why


class PoolManager:
    """One lazily started pool per (world size, with/without a process group, backend)."""

    def __init__(self) -> None:
        self._pools: dict[tuple[int, bool, str], WorkerPool] = {}

    def pool(self, world_size: int, init_pg: bool = True, backend: str = "gloo") -> WorkerPool:
        key = (world_size, init_pg, backend)
        pool = self._pools.get(key)
        if pool is not None and not pool.alive():
            pool.kill()
            pool = None
        if pool is None:
            pool = WorkerPool(world_size, init_pg, backend)
            self._pools[key] = pool
            pool.launch()
        if not pool.ready:
            try:
                pool.wait_ready()
            except (TimeoutError, _WorkerDied) as e:
                report = pool._report_dead(f"start-up failed: {e}")
                pool.kill()
                del self._pools[key]
                raise DistributedTestFailure(report) from None
            pool.ready = True
        return pool

    def prestart(self, keys: list[tuple[int, bool]]) -> None:
        """Launch several pools at once, so that their start-up costs overlap."""
        for world_size, init_pg in keys:
            if (world_size, init_pg, "gloo") not in self._pools:
                pool = WorkerPool(world_size, init_pg)
                self._pools[(world_size, init_pg, "gloo")] = pool
                pool.launch()

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *args: Any,
        timeout: float = 120.0,
        init_pg: bool = True,
        dead_ok: bool = False,
        backend: str = "gloo",
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; the per-rank results.

        ``dead_ok``: a rank whose process exits gives ``"died"`` (and the pool is restarted
        afterwards) instead of failing the task.
        """
        return self.pool(world_size, init_pg, backend).run(fn, args, kwargs, timeout, dead_ok)

    def shutdown(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
        self._pools.clear()


# --------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------


def _import_function(module: str, file: str, qualname: str) -> Callable[..., Any]:
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            if not file:
                raise
            spec = importlib.util.spec_from_file_location(module, file)
            if spec is None or spec.loader is None:
                raise
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _send(conn: Connection, msg: Any) -> None:
    try:
        data = pickle.dumps(msg)
    except Exception as e:  # an unpicklable result is the test's bug: say so
        data = pickle.dumps(("error", f"result could not be pickled: {e!r}\nresult: {msg!r:.2000}"))
    conn.send_bytes(data)


def _worker_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--init-file", required=True)
    p.add_argument("--init-pg", type=int, default=1)
    p.add_argument("--backend", default="gloo")
    a = p.parse_args(argv)

    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    conn = Connection(a.fd)  # REPO_ROOT and SUPPORT_DIR come first on PYTHONPATH (see launch)

    import datetime

    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    if "nccl" in a.backend:
        torch.cuda.set_device(a.rank % torch.cuda.device_count())
    if a.init_pg:
        dist.init_process_group(
            a.backend,
            rank=a.rank,
            world_size=a.world_size,
            init_method=f"file://{a.init_file}",
            timeout=datetime.timedelta(seconds=600),
        )
    # Imported by nearly every test; pay for it while the other pools start too.
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    _send(conn, ("ready", a.rank))

    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        kind = msg[0]
        if kind == "exit":
            break
        if kind == "health":
            try:
                if a.init_pg:
                    got: list[Any] = [None] * a.world_size
                    dist.all_gather_object(got, msg[1])
                else:
                    got = [msg[1]]
                _send(conn, ("ok", got))
            except Exception:
                _send(conn, ("error", traceback.format_exc()))
            continue
        _, module, file, qualname, args, kwargs = msg
        try:
            fn = _import_function(module, file, qualname)
            result = fn(a.rank, a.world_size, *args, **kwargs)
        except BaseException:  # report everything, including SystemExit from pytest.fail/skip
            reply = ("error", traceback.format_exc())
        else:
            reply = ("ok", result)
        sys.stdout.flush()
        sys.stderr.flush()
        _send(conn, reply)

    # Tearing down gloo can block on peers that are already gone; nothing is left to clean.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
