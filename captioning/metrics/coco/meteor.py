"""One METEOR JVM per process (pycocoevalcap's ``Meteor``): started on first use and kept, replaced when it has
died, never shared with a forked child, stopped by :func:`close_meteor` or when the interpreter exits."""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

#: this process's METEOR JVM: (pid, pycocoevalcap Meteor); see :func:`meteor_scorer`
_METEOR: dict[str, Any] = {"pid": None, "scorer": None}
_METEOR_LOCK = threading.Lock()


def meteor_scorer():
    """pycocoevalcap's ``Meteor`` for this process, started on first use and then kept: its JVM loads METEOR's
    paraphrase tables for several seconds (~8 s on a 2-core CPU), once per process instead of once per evaluation
    (a pipeline scores every student). A JVM that has exited is replaced; a forked child starts its own (it never
    writes to its parent's pipes). :func:`close_meteor` stops it; it is also stopped when the interpreter exits."""
    from pycocoevalcap.meteor.meteor import Meteor

    with _METEOR_LOCK:
        m = _METEOR["scorer"]
        if _METEOR["pid"] != os.getpid():
            m = None  # inherited through fork: the parent's
        elif m is not None and m.meteor_p.poll() is not None:
            _close_meteor(m)
            m = None
        if m is None:
            m = Meteor()
            _METEOR.update(pid=os.getpid(), scorer=m)
        return m


def _discard_meteor(meteor) -> None:
    with _METEOR_LOCK:
        if _METEOR["scorer"] is meteor and _METEOR["pid"] == os.getpid():
            _METEOR.update(pid=None, scorer=None)
    _close_meteor(meteor)


def close_meteor() -> None:
    """Stop this process's METEOR JVM, if one runs (the next score starts another)."""
    with _METEOR_LOCK:
        m = _METEOR["scorer"] if _METEOR["pid"] == os.getpid() else None
        _METEOR.update(pid=None, scorer=None)
    if m is not None:
        _close_meteor(m)


atexit.register(close_meteor)


def _close_meteor(meteor) -> None:
    p = meteor.meteor_p
    try:
        if p.stdin:
            p.stdin.close()
    except OSError:
        pass
    if p.poll() is None:
        p.kill()
    p.wait()
    for f in (p.stdout, p.stderr):
        if f:
            f.close()


def compute_meteor(meteor, gts: dict[int, list[str]], res: dict[int, list[str]]) -> tuple[float, list[float]]:
    """``meteor.compute_score(gts, res)``. A JVM that dies on the way is discarded (the next score starts a fresh
    one) and the error says why, with the end of its stderr."""
    try:
        return meteor.compute_score(gts, res)
    except (ValueError, BrokenPipeError, OSError) as e:  # the JVM died: say why
        p = meteor.meteor_p
        err = p.stderr.read().decode(errors="replace")[-2000:] if p.poll() is not None and p.stderr else ""
        _discard_meteor(meteor)  # the next score starts a fresh one
        raise RuntimeError(f"METEOR failed: {e}; {err}") from e
