"""Peak memory of this process, from ``/proc/self/status``: what an operation adds."""

from __future__ import annotations

from typing import Any, Callable


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def peak_extra_mib(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``fn`` and return (its result, peak RSS above the start in MiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    before = status_kib("VmRSS")
    out = fn()
    return out, (status_kib("VmHWM") - before) / 1024
