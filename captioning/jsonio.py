"""Reading JSON input files with errors that name the file, the line and the column."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read_json(path: str | Path, what: str, error: type[Exception],
              missing: type[Exception] = FileNotFoundError) -> Any:
    """Parse ``path``; ``what`` names the file's role in messages ("annotation", "results", ...)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise missing(f"{what} file {path} not found") from None
    except UnicodeDecodeError as e:
        raise error(f"{what} file {path} is not UTF-8 text ({e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{what} file {path} is not valid JSON (malformed JSON at line {e.lineno} column {e.colno}: "
                    f"{e.msg})") from None
    except RecursionError:  # thousands of nested [ or {: not a dataset, and no RecursionError traceback
        raise error(f"{what} file {path} is nested too deeply to be read (thousands of levels of [ or {{): "
                    "refused") from None


class _Reader:
    """A JSON text read in pieces: values are parsed one at a time from a window over the file, so a large array
    never has to be in memory as a whole (``raw_decode`` at the window's position; a value cut by the window's end
    is parsed again with more text). Positions in errors are the file's lines and columns."""

    _WS = " \t\n\r"
    _NUMBER = frozenset("0123456789.eE+-")

    def __init__(self, f, path: Path, what: str, error: type[Exception], block: int = 1 << 20):
        self.f, self.path, self.what, self.error, self.block = f, path, what, error, block
        self.buf, self.pos, self.eof = "", 0, False
        self.line, self.col = 1, 1  # line and column of buf[0] in the file
        self._decoder = json.JSONDecoder()

    def _more(self, want: int) -> bool:
        """Drop the parsed text, read at least ``want`` more characters; False at the end of the file."""
        if self.eof:
            return False
        try:
            data = self.f.read(max(want, self.block))
        except UnicodeDecodeError as e:
            raise self.error(f"{self.what} file {self.path} is not UTF-8 text ({e})") from None
        if not data:  # the window stays as it is: positions in it remain valid
            self.eof = True
            return False
        done = self.buf[: self.pos]
        nl = done.count("\n")
        self.line += nl
        self.col = (len(done) - done.rfind("\n")) if nl else self.col + len(done)
        self.buf, self.pos = self.buf[self.pos:] + data, 0
        return True

    def _where(self, pos: int) -> tuple[int, int]:
        nl = self.buf.count("\n", 0, pos)
        if nl:
            return self.line + nl, pos - self.buf.rfind("\n", 0, pos)
        return self.line, self.col + pos

    def fail(self, msg: str, pos: int | None = None) -> Exception:
        line, col = self._where(self.pos if pos is None else pos)
        return self.error(f"{self.what} file {self.path} is not valid JSON (malformed JSON at line {line} column "
                          f"{col}: {msg})")

    def peek(self) -> str:
        """The next character that is not white space ('' at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in self._WS:
                self.pos += 1
            if self.pos < len(self.buf) or not self._more(self.block):
                return self.buf[self.pos: self.pos + 1]

    def take(self, ch: str, expecting: str) -> None:
        if self.peek() != ch:
            raise self.fail(f"Expecting {expecting}")
        self.pos += 1

    def value(self) -> Any:
        """The next JSON value (after white space)."""
        self.peek()
        want = self.block
        while True:
            try:
                obj, end = self._decoder.raw_decode(self.buf, self.pos)
            except RecursionError:  # thousands of nested [ or {: refused as read_json refuses them
                raise self.error(f"{self.what} file {self.path} is nested too deeply to be read (thousands of levels "
                                 "of [ or {): refused") from None
            except json.JSONDecodeError as e:
                if self._more(want):  # perhaps cut by the window: again with more text
                    want *= 2
                    continue
                raise self.fail(e.msg, e.pos) from None
            cut = end == len(self.buf) or self.buf[end] in self._NUMBER  # a number may go on past the window
            if cut and self._more(want):
                want *= 2
                continue
            self.pos = end
            return obj


def iter_array_field(path: str | Path, key: str, what: str, error: type[Exception],
                     missing: type[Exception] = FileNotFoundError, others: dict[str, Any] | None = None,
                     block: int = 1 << 20) -> Iterator[Any]:
    """The elements of the array under ``key`` of the JSON object in ``path``, parsed one at a time (memory holds
    one element, not the file). The object's other members go into ``others`` as they are read (all of them once
    the iteration ends). Errors (``error``; ``missing`` for no file) name the file, and the line and column of
    malformed JSON, as :func:`read_json`'s do; the structural ones read like a validator's: top level not an
    object, ``key`` missing, not a list, or given twice. ``block``: characters read at a time."""
    path = Path(path)
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed below, the generator may stop early
    except FileNotFoundError:
        raise missing(f"{what} file {path} not found") from None
    with f:
        r = _Reader(f, path, what, error, block)
        if r.peek() != "{":
            if r.peek() == "":
                raise r.fail("Expecting value")
            r.value()  # malformed JSON is reported as such
            raise error(f"{path}: top level must be an object with an '{key}' list")
        r.pos += 1
        seen = False
        first = True
        while r.peek() != "}":
            if not first:
                r.take(",", "',' delimiter")
            first = False
            if r.peek() != '"':
                raise r.fail("Expecting property name enclosed in double quotes")
            name = r.value()
            r.take(":", "':' delimiter")
            if name != key:
                value = r.value()
                if others is not None:
                    others[name] = value
                continue
            if seen:
                raise error(f"{path}: '{key}' is given twice")
            seen = True
            if r.peek() != "[":
                raise error(f"{path}: '{key}' must be a list, got {type(r.value()).__name__}")
            r.pos += 1
            if r.peek() == "]":
                r.pos += 1
                continue
            while True:
                yield r.value()
                nxt = r.peek()
                r.pos += 1
                if nxt == "]":
                    break
                if nxt != ",":
                    raise r.fail("Expecting ',' delimiter", r.pos - 1)
        r.pos += 1
        if r.peek() != "":
            raise r.fail("Extra data")
        if not seen:
            raise error(f"{path}: missing required field '{key}'")
