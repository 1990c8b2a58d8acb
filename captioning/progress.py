"""Progress of long work on stderr, the same for every command (tqdm underneath):

- stderr a terminal: a bar with the rate and the time left;
- otherwise (a pipe, a log file, a CI job, a Prefect worker): a plain line at most every ``CAPFLOW_PROGRESS_EVERY``
  seconds (default 30) - what has been done, the rate and the time left -, nothing for work shorter than that;
- ``capflow --quiet`` (``CAPFLOW_QUIET=1``): nothing.

A caller that shows no progress (``progress=False``: a child process, a nested evaluation) passes ``enabled=False``.
Sinks (:func:`add_sink`) see every bar's state at the same pace as the lines: the Prefect flow turns them into
progress artifacts of its run, so the UI shows them without a log line per update.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

from tqdm.auto import tqdm

QUIET_ENV = "CAPFLOW_QUIET"
EVERY_ENV = "CAPFLOW_PROGRESS_EVERY"
LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%), {rate_fmt}, elapsed {elapsed}, left {remaining}"

Sink = Callable[[str, float, float | None], None]  # (description, done, total)
_sinks: list[Sink] = []
_lock = threading.Lock()


def quiet() -> bool:
    return os.environ.get(QUIET_ENV, "").strip().lower() in ("1", "true", "yes")


def every() -> float:
    try:
        return max(0.0, float(os.environ.get(EVERY_ENV, "30")))
    except ValueError:
        return 30.0


class _Lines:
    """A stream for tqdm that turns its carriage-return refreshes into whole lines."""

    def __init__(self, out: IO[str]):
        self.out = out

    def write(self, s: str) -> None:
        for part in s.split("\r"):
            if part.strip():
                self.out.write(part.rstrip("\n") + "\n")

    def flush(self) -> None:
        self.out.flush()


class _Bar(tqdm):
    """tqdm that also reports to the sinks, at most every :func:`every` seconds (and when it closes)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._reported = 0.0
        super().__init__(*args, **kwargs)

    def _report(self, force: bool = False) -> None:
        if not _sinks or self.disable:
            return
        now = time.monotonic()
        if force or now - self._reported >= every():
            self._reported = now
            with _lock:
                sinks = list(_sinks)
            for sink in sinks:
                with contextlib.suppress(Exception):  # a progress display never stops the work
                    sink(str(self.desc), float(self.n), float(self.total) if self.total else None)

    def update(self, n: float | None = 1) -> bool | None:
        out = super().update(n)
        self._report()
        return out

    def __iter__(self):
        for item in super().__iter__():
            yield item
            self._report()

    def close(self) -> None:
        if not self.disable:
            self._report(force=True)
        super().close()


def bar(iterable: Iterable[Any] | None = None, *, enabled: bool = True, **kwargs: Any) -> tqdm:
    """A progress bar over ``iterable`` (or updated by hand), tqdm's keyword arguments (``total``, ``desc``,
    ``unit``, ``initial``); shown as the module's docstring says."""
    if not enabled or quiet():
        return _Bar(iterable, disable=True, **kwargs)
    if sys.stderr.isatty():
        return _Bar(iterable, file=sys.stderr, **kwargs)
    wait = every()
    return _Bar(iterable, file=_Lines(sys.stderr), mininterval=wait, maxinterval=max(wait, 1.0), delay=wait,
                bar_format=LINE_FORMAT, ascii=True, **kwargs)


def add_sink(sink: Sink) -> None:
    with _lock:
        _sinks.append(sink)


def remove_sink(sink: Sink) -> None:
    with _lock:
        if sink in _sinks:
            _sinks.remove(sink)
