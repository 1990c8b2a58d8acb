"""Reading JSON input files with errors that name the file, the line and the column."""

from __future__ import annotations

import json
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
