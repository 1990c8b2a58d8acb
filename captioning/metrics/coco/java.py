"""The Java side of the toolkit shared by tokenisation and SPICE: pycocoevalcap's folders, the version of the
``java`` on PATH, and the coco-caption PTB tokenizer (one Java run per list of captions, its output checked)."""

from __future__ import annotations

import functools
import importlib.util
import re
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

# Same list as pycocoevalcap.tokenizer.ptbtokenizer.PUNCTUATIONS: tokens dropped after PTB tokenisation.
_PUNCTUATIONS = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                           ".", "?", "!", ",", ":", "-", "--", "...", ";"])
# Everything str.splitlines() splits on; the Java tokenizer (-preserveLines) treats at least \r and \u2028 as
# line ends, which would shift every later caption by one line.
_LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def pkg_dir(sub: str) -> Path:
    """A folder of the installed pycocoevalcap (a namespace package: no ``__file__`` of its own)."""
    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("pycocoevalcap is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve() / sub


def ptb_tokenize(captions: Sequence[str]) -> list[str]:
    """The coco-caption PTB tokenisation of each caption (same Java command and punctuation filter as
    ``pycocoevalcap``'s ``PTBTokenizer``), one Java run for the whole list, output count checked."""
    return ptb_tokenize_counted(captions)[0]


def ptb_tokenize_counted(captions: Sequence[str]) -> tuple[list[str], int | None]:
    """(tokenised captions, the token count the Java tokenizer reports: punctuation and line ends included)."""
    if not captions:
        return [], 0
    tok_dir = pkg_dir("tokenizer")
    jar = tok_dir / "stanford-corenlp-3.4.1.jar"
    sentences = "\n".join(c.translate(_LINE_BREAKS) for c in captions)
    with tempfile.TemporaryDirectory(prefix="capflow-ptb-") as tmp:
        src = Path(tmp) / "captions.txt"
        src.write_bytes(sentences.encode())
        cmd = ["java", *_jvm_warnings_to_stderr(), "-cp", str(jar), "edu.stanford.nlp.process.PTBTokenizer",
               "-preserveLines", "-lowerCase", str(src)]
        proc = subprocess.run(cmd, cwd=tok_dir, capture_output=True, check=False)
    err = proc.stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"PTB tokenizer failed (exit {proc.returncode}): {err[-2000:]}")
    lines = proc.stdout.decode().split("\n")
    if len(lines) < len(captions) or any(line.strip() for line in lines[len(captions):]):
        extra = [ln for ln in lines[len(captions):] if ln.strip()][:2]
        raise RuntimeError(f"PTB tokenizer returned {len(lines)} lines for {len(captions)} captions (first line "
                           f"{lines[0][:120]!r}; extra {[ln[:120] for ln in extra]})")
    m = re.search(r"tokenized (\d+) tokens", err)
    tokens = [" ".join(w for w in line.rstrip().split(" ") if w not in _PUNCTUATIONS)
              for line in lines[: len(captions)]]
    return tokens, (int(m.group(1)) if m else None)


@functools.cache
def _jvm_warnings_to_stderr() -> tuple[str, ...]:
    """JVM options that send the JVM's own warnings to stderr. Java 9+ writes them to *stdout* by default (unified
    logging, ``-Xlog`` ``all=warning:stdout``), where one warning line - e.g. a thread the JVM could not start on a
    loaded machine - shifts every tokenised caption by a line; measured: a pipeline's evaluation failed that way
    once under load."""
    major = java_major()
    return ("-Xlog:disable", "-Xlog:all=warning:stderr") if major is not None and major >= 9 else ()


def java_major(java: str = "java") -> int | None:
    """Major version of ``java`` (8 for 1.8), None when it cannot be run or read."""
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if not m:
        return None
    return int(m.group(2) or 0) if m.group(1) == "1" else int(m.group(1))

