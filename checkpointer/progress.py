"""A tiny progress bar for long command-line work: bytes and items done, throughput, time left.

It draws only on a terminal (the stream's ``isatty()``), at most ten times a second, on one
line rewritten with ``\\r``; anywhere else (a log file, a pipe, CI) it prints nothing. Safe to
advance from several threads. Standard library only.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress", "format_bytes", "format_duration"]

_REDRAW_S = 0.1
_BAR = 24


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    """``75`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """One progress line: ``desc [#####-----]  52%  1.2/2.3 GiB  12/40 tensors  310 MiB/s  0:04 left``.

    Example::

        with Progress("unshard", total_bytes=n, total_items=k, unit="tensors") as bar:
            for t in tensors:
                ...
                bar.advance(t.nbytes, 1)
    """

    def __init__(
        self,
        desc: str,
        *,
        total_bytes: int,
        total_items: int,
        unit: str = "tensors",
        enabled: bool | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.desc = desc
        self.unit = unit
        self.total_bytes = max(0, total_bytes)
        self.total_items = max(0, total_items)
        self.bytes_done = 0
        self.items_done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0
        self._width = 0
        self._lock = threading.Lock()
        self._closed = False

    def advance(self, nbytes: int = 0, items: int = 0) -> None:
        with self._lock:
            self.bytes_done += nbytes
            self.items_done += items
            if not self.enabled or self._closed:
                return
            now = time.monotonic()
            if now - self._last_draw >= _REDRAW_S:
                self._last_draw = now
                self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The text of the bar as it stands."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._start, 1e-9)
        frac = self.bytes_done / self.total_bytes if self.total_bytes else (
            self.items_done / self.total_items if self.total_items else 1.0
        )
        frac = min(max(frac, 0.0), 1.0)
        filled = int(frac * _BAR)
        rate = self.bytes_done / elapsed
        parts = [
            f"{self.desc} [{'#' * filled}{'-' * (_BAR - filled)}] {frac * 100:3.0f}%",
            f"{format_bytes(self.bytes_done)}/{format_bytes(self.total_bytes)}",
            f"{self.items_done}/{self.total_items} {self.unit}",
            f"{format_bytes(rate)}/s",
        ]
        if 0 < frac < 1 and rate > 0:
            parts.append(f"{format_duration((self.total_bytes - self.bytes_done) / rate)} left")
        else:
            parts.append(f"{format_duration(elapsed)}")
        return "  ".join(parts)

    def _draw(self, now: float) -> None:
        text = self.line(now)
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self.stream.write("\r" + text + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line (nothing when disabled)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.enabled:
                self._draw(time.monotonic())
                self.stream.write("\n")
                self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
