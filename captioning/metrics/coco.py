"""COCO caption metrics (BLEU-1..4, METEOR, ROUGE-L, CIDEr, SPICE) on top of pycocoevalcap 1.2.

The numbers are those of the official coco-caption toolkit (``COCOEvalCap`` with
``params['image_id'] = cocoRes.getImgIds()``, as in its demo notebook): both sides are PTB-tokenised with the
toolkit's Stanford tokenizer (lower-case, punctuation removed), every metric runs on the tokenised text, and
only the images that have a generated caption are scored (CIDEr's document frequencies come from the references
of exactly those images). Re-scoring published model outputs with this module reproduces the published numbers.

What differs from calling ``COCOEvalCap`` directly:

* Inputs are validated first, with errors that name the file and the offending ids (:class:`EvaluationInputError`).
* Line-break characters inside a caption (``\\r``, ``\\u2028``, ...) are replaced by a space before tokenising;
  the Java tokenizer would otherwise split that caption over two lines and silently misalign every caption that
  follows. The tokenizer's output line count is checked too.
* BLEU's internal counts (``testlen``, ``reflen``, ``guess``, ``correct``, ``ratio``) are returned, not printed.
* METEOR's Java process is started before tokenisation and scores in a thread while BLEU, ROUGE-L and CIDEr run,
  and is always shut down afterwards.
* SPICE never downloads anything. It runs only when a directory holding the Stanford CoreNLP 3.6.0 jars
  (``stanford-corenlp-3.6.0.jar``, ``stanford-corenlp-3.6.0-models.jar``) is configured (``spice_jars=`` /
  ``capflow evaluate --spice-jars DIR`` / environment ``CAPFLOW_SPICE_JARS``). Otherwise ``"SPICE"`` is ``None``
  (never 0) and ``"spice"`` says ``"unavailable: <reason>"``; a SPICE run that fails is reported the same way.
  SPICE runs pycocoevalcap's own ``spice-1.0.jar`` with the same input and flags as its ``Spice`` class, but with
  an explicit class path (the jars stay where they are: nothing is linked into site-packages) and two fixes
  without which spice-1.0.jar cannot finish on Java 15+ (see ``_SPICE_OPENS`` below).

Duplicate ``image_id`` in a results file is an error naming the ids (``load_results(..., duplicates="first")``
keeps the first caption of each image instead and warns). Result ids that have no references are an error.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from captioning.errors import InputError
from captioning.jsonio import read_json

log = logging.getLogger(__name__)

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")
BLEU_METRICS = METRICS[:4]

SPICE_ENV = "CAPFLOW_SPICE_JARS"
CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")

# Same list as pycocoevalcap.tokenizer.ptbtokenizer.PUNCTUATIONS: tokens dropped after PTB tokenisation.
_PUNCTUATIONS = frozenset(["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                           ".", "?", "!", ",", ":", "-", "--", "...", ";"])
# Everything str.splitlines() splits on; the Java tokenizer (-preserveLines) treats at least \r and \u2028 as
# line ends, which would shift every later caption by one line.
_LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})
_MAX_NAMED = 10  # ids named in one error message


class EvaluationInputError(InputError, ValueError):
    """A references or results file (or mapping) that cannot be scored; the message says where and why."""


# ----------------------------------------------------------------------------------------------- input files


def _read_json(path: str | Path, what: str) -> Any:
    return read_json(path, what, EvaluationInputError)


def _caption_item(obj: Any, label: str) -> tuple[int, str]:
    """(image_id, caption) of one annotation/result object, or an error naming ``label``."""
    if not isinstance(obj, dict):
        raise EvaluationInputError(f"{label} is not an object")
    for key in ("image_id", "caption"):
        if key not in obj:
            raise EvaluationInputError(f"{label} is missing key '{key}'")
    iid, cap = obj["image_id"], obj["caption"]
    if not _is_int(iid):
        raise EvaluationInputError(f"{label} has a non-integer image_id {iid!r}")
    if not isinstance(cap, str):
        raise EvaluationInputError(f"{label} (image_id {iid}) has a non-string caption")
    return iid, cap


def _name_ids(ids: Iterable[Any]) -> str:
    ids = list(ids)
    shown = ", ".join(repr(i) for i in ids[:_MAX_NAMED])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > _MAX_NAMED else "")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_references(path: str | Path) -> dict[int, list[str]]:
    """Reference captions from a COCO annotation file: ``{image_id: [caption, ...]}`` in file order.

    The file is ``{"images": [{"id": int, ...}], "annotations": [{"image_id": int, "caption": str}, ...]}``
    (``images`` may be left out; when present, every annotation must point at a listed image). Images listed
    without any caption are left out with a warning.
    """
    data = _read_json(path, "references")
    where = f"references file {path}"
    if not isinstance(data, dict):
        raise EvaluationInputError(f"{where}: expected a COCO annotation object with an 'annotations' list, "
                                   f"got {type(data).__name__}")
    if "annotations" not in data:
        raise EvaluationInputError(f"{where}: missing key 'annotations' (keys: {sorted(data)[:10]})")
    anns = data["annotations"]
    if not isinstance(anns, list):
        raise EvaluationInputError(f"{where}: 'annotations' must be a list, got {type(anns).__name__}")
    if not anns:
        raise EvaluationInputError(f"{where}: 'annotations' is empty")

    image_ids: set[int] | None = None
    if "images" in data:
        images = data["images"]
        if not isinstance(images, list):
            raise EvaluationInputError(f"{where}: 'images' must be a list, got {type(images).__name__}")
        image_ids = set()
        for i, img in enumerate(images):
            if not isinstance(img, dict) or "id" not in img:
                raise EvaluationInputError(f"{where}: images[{i}] has no 'id'")
            if not _is_int(img["id"]):
                raise EvaluationInputError(f"{where}: images[{i}] has a non-integer id {img['id']!r}")
            image_ids.add(img["id"])

    refs: dict[int, list[str]] = {}
    for i, ann in enumerate(anns):
        iid, cap = _caption_item(ann, f"{where}: annotations[{i}]")
        refs.setdefault(iid, []).append(cap)

    if image_ids is not None:
        unknown = [i for i in refs if i not in image_ids]
        if unknown:
            raise EvaluationInputError(f"{where}: annotations point at image ids not in 'images': "
                                       f"{_name_ids(unknown)}")
        bare = sorted(image_ids - refs.keys())
        if bare:
            warnings.warn(f"{where}: {len(bare)} image(s) have no caption and are left out: {_name_ids(bare)}",
                          stacklevel=2)
    return refs


def references_document(refs: Mapping[int, Sequence[str]]) -> dict[str, Any]:
    """``{image_id: [captions]}`` -> the COCO-format annotation document that :func:`load_references` reads."""
    ids = sorted(int(i) for i in refs)
    anns = [{"image_id": i, "id": n, "caption": c} for n, (i, c) in enumerate((i, c) for i in ids for c in refs[i])]
    return {"images": [{"id": i} for i in ids], "annotations": anns, "type": "captions", "info": {}, "licenses": []}


def load_results(path: str | Path, references: Mapping[int, Sequence[str]] | None = None, *,
                 duplicates: str = "error") -> dict[int, str]:
    """Generated captions from a COCO results file ``[{"image_id": int, "caption": str}, ...]``.

    ``duplicates="error"`` (default) rejects an image id that occurs twice, naming it: the official toolkit
    cannot score two captions for one image. ``duplicates="first"`` keeps the first caption and warns.
    With ``references`` given, ids that have no references are an error naming them. Extra keys are ignored.
    """
    if duplicates not in ("error", "first"):
        raise ValueError(f"duplicates must be 'error' or 'first', not {duplicates!r}")
    data = _read_json(path, "results")
    where = f"results file {path}"
    if not isinstance(data, list):
        raise EvaluationInputError(f"{where}: expected a list of {{'image_id', 'caption'}} objects, "
                                   f"got {type(data).__name__}")
    if not data:
        raise EvaluationInputError(f"{where}: no results")
    out: dict[int, str] = {}
    dups: list[int] = []
    for i, r in enumerate(data):
        iid, cap = _caption_item(r, f"{where}: item {i}")
        if iid in out:
            dups.append(iid)
            continue
        out[iid] = cap
    if dups:
        uniq = list(dict.fromkeys(dups))
        msg = f"{where}: duplicate image_id {_name_ids(uniq)}"
        if duplicates == "error":
            raise EvaluationInputError(msg + " (one caption per image: fix the file, or keep the first caption "
                                             "of each with `capflow evaluate --duplicates first`)")
        warnings.warn(msg + f"; kept the first caption of each ({len(dups)} later ones dropped)", stacklevel=2)
    if references is not None:
        _check_ids(out, references, where)
    return out


def _check_ids(results: Mapping[int, str], references: Mapping[int, Sequence[str]], where: str) -> None:
    missing = [i for i in results if i not in references]
    if missing:
        raise EvaluationInputError(f"{where}: {len(missing)} image id(s) have no references: {_name_ids(missing)}")


# ----------------------------------------------------------------------------------------------- tokenizer


def _pkg_dir(sub: str) -> Path:
    """A folder of the installed pycocoevalcap (a namespace package: no ``__file__`` of its own)."""
    import importlib.util

    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("pycocoevalcap is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve() / sub


def ptb_tokenize(captions: Sequence[str]) -> list[str]:
    """The coco-caption PTB tokenisation of each caption (same Java command and punctuation filter as
    ``pycocoevalcap``'s ``PTBTokenizer``), one Java run for the whole list, output count checked."""
    return _ptb_tokenize(captions)[0]


def _ptb_tokenize(captions: Sequence[str]) -> tuple[list[str], int | None]:
    """(tokenised captions, the token count the Java tokenizer reports: punctuation and line ends included)."""
    if not captions:
        return [], 0
    tok_dir = _pkg_dir("tokenizer")
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


# ----------------------------------------------------------------------------------------------- SPICE


# SPICE 1.0 on a current Java. Two things in spice-1.0.jar break after Java 14, both worked around here without
# changing what it computes: (1) it pretty-prints its JSON output through the JDK's JavaScript engine (Nashorn),
# which left the JDK in Java 15, so the run would crash after all the parsing; on Java 15+ SPICE runs through the
# small launcher below (Java's single-file source mode, needs a JDK), which calls the same SpiceScorer.scoreBatch
# without "-out" and writes the same score objects as compact JSON; (2) its parse cache serialises with FST,
# which needs these packages opened on Java 16+ (otherwise InaccessibleObjectException).
_SPICE_OPENS = ("java.base/java.lang", "java.base/java.lang.reflect", "java.base/java.util",
                "java.base/java.util.concurrent", "java.base/java.math", "java.base/java.net", "java.base/java.text",
                "java.base/java.io", "java.base/java.nio", "java.base/java.time")
_SPICE_LAUNCHER = "CapflowSpice.java"
_JAVA_EXCEPTION = re.compile(r"\s*(?:Caused by: |Exception in thread \"\w+\" )?[\w.$]+(?:Exception|Error)\b")
_SPICE_LAUNCHER_SRC = """\
import java.lang.reflect.Constructor;
import java.lang.reflect.InvocationTargetException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.List;

/** spice-1.0.jar's SpiceScorer, writing "-out" itself: SPICE formats it with a JavaScript engine Java 15+ lacks. */
public class CapflowSpice {
    public static void main(String[] argv) throws Exception {
        List<String> args = new ArrayList<>();
        String out = null;
        for (int i = 0; i < argv.length; i++) {
            if (argv[i].equals("-out")) { out = argv[++i]; } else { args.add(argv[i]); }
        }
        try {
            Class<?> argClass = Class.forName("edu.anu.spice.SpiceArguments");
            Constructor<?> makeArgs = argClass.getDeclaredConstructor(String[].class);
            makeArgs.setAccessible(true);
            Object spiceArgs = makeArgs.newInstance((Object) args.toArray(new String[0]));
            Class<?> scorerClass = Class.forName("edu.anu.spice.SpiceScorer");
            Constructor<?> makeScorer = scorerClass.getDeclaredConstructor();
            makeScorer.setAccessible(true);
            Object scorer = makeScorer.newInstance();
            scorerClass.getMethod("scoreBatch", argClass).invoke(scorer, spiceArgs);
            Object stats = scorerClass.getField("stats").get(scorer);
            String json = (String) stats.getClass().getMethod("toJSONString").invoke(stats);
            if (out != null) { Files.write(Paths.get(out), json.getBytes(StandardCharsets.UTF_8)); }
        } catch (InvocationTargetException e) {
            System.err.println("Error: Could not score batched file input:");
            e.getCause().printStackTrace();
            System.exit(1);
        }
    }
}
"""


@functools.cache
def _jvm_warnings_to_stderr() -> tuple[str, ...]:
    """JVM options that send the JVM's own warnings to stderr. Java 9+ writes them to *stdout* by default (unified
    logging, ``-Xlog`` ``all=warning:stdout``), where one warning line - e.g. a thread the JVM could not start on a
    loaded machine - shifts every tokenised caption by a line; measured: a pipeline's evaluation failed that way
    once under load."""
    major = _java_major()
    return ("-Xlog:disable", "-Xlog:all=warning:stderr") if major is not None and major >= 9 else ()


def _java_major(java: str = "java") -> int | None:
    """Major version of ``java`` (8 for 1.8), None when it cannot be run or read."""
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', proc.stderr + proc.stdout)
    if not m:
        return None
    return int(m.group(2) or 0) if m.group(1) == "1" else int(m.group(1))


def _java_has_compiler(java: str = "java") -> bool:
    try:
        proc = subprocess.run([java, "--list-modules"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return re.search(r"^jdk\.compiler@", proc.stdout, re.M) is not None


def spice_status(spice_jars: str | Path | None) -> tuple[Path | None, str]:
    """``(jar_dir, "available")`` when ``spice_jars`` (or ``$CAPFLOW_SPICE_JARS`` when it is None) holds both
    Stanford CoreNLP 3.6.0 jars as readable jar files and a Java that can run SPICE is on PATH, else
    ``(None, "unavailable: <reason>")``. Nothing is downloaded."""
    source = "spice_jars"
    if spice_jars is None or str(spice_jars) == "":
        spice_jars = os.environ.get(SPICE_ENV) or None
        source = SPICE_ENV
    if spice_jars is None:
        return None, (f"unavailable: no Stanford CoreNLP 3.6.0 jar directory configured (pass spice_jars / "
                      f"--spice-jars DIR or set {SPICE_ENV}; DIR must hold {' and '.join(CORENLP_JARS)}); "
                      "SPICE is not downloaded")
    d = Path(spice_jars).expanduser()
    if not d.is_dir():
        return None, f"unavailable: {source} directory {d} does not exist"
    missing = [j for j in CORENLP_JARS if not (d / j).is_file()]
    if missing:
        return None, f"unavailable: {' and '.join(missing)} not found in {d}"
    for j in CORENLP_JARS:
        try:
            with zipfile.ZipFile(d / j) as z:
                z.getinfo("META-INF/MANIFEST.MF")
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            return None, f"unavailable: {d / j} is not a valid jar file ({type(e).__name__}: {e})"
    if shutil.which("java") is None:
        return None, "unavailable: java not found on PATH"
    major = _java_major()
    if major is None:
        return None, "unavailable: cannot read the version of java on PATH"
    if major >= 15 and not _java_has_compiler():
        return None, (f"unavailable: Java {major} has no JavaScript engine, which spice-1.0.jar needs to write its "
                      "scores, and no jdk.compiler to run capflow's replacement writer: install a full JDK "
                      "(or put Java 8-14 on PATH)")
    return d.resolve(), "available"


def _spice_command(jar_dir: Path, java_major: int, workdir: Path) -> list[str]:
    """The Java command that runs SPICE 1.0 with the CoreNLP jars from ``jar_dir`` (class path given explicitly:
    nothing is copied into the installed package). ``workdir`` receives the launcher source on Java 15+."""
    spice_dir = _pkg_dir("spice")
    cp = os.pathsep.join([str(spice_dir / "spice-1.0.jar"),
                          *(str(jar_dir / j) for j in CORENLP_JARS),
                          *sorted(str(p) for p in (spice_dir / "lib").glob("*.jar") if p.name not in CORENLP_JARS)])
    cmd = ["java", "-Xmx8G"]
    if java_major >= 9:
        cmd += [f"--add-opens={pkg}=ALL-UNNAMED" for pkg in _SPICE_OPENS]
    cmd += ["-cp", cp]
    if java_major >= 15:
        launcher = workdir / _SPICE_LAUNCHER
        launcher.write_text(_SPICE_LAUNCHER_SRC)
        cmd.append(str(launcher))
    else:
        cmd.append("edu.anu.spice.SpiceScorer")
    return cmd


def _run_spice(gts: dict[int, list[str]], res: dict[int, list[str]], jar_dir: Path,
               cache_dir: Path | None = None) -> tuple[float, list[float]]:
    """SPICE as pycocoevalcap's ``Spice.compute_score`` runs it (same jar, input, ``-cache -subset -silent``
    flags and averaging: mean of the per-image ``All`` F-scores, None counted as NaN), on tokenised captions.
    Returns (mean, per-image F-scores in ``gts`` order). The parse cache defaults to pycocoevalcap's
    ``spice/cache``; a run whose failure comes from the cache is retried once without it."""
    java_major = _java_major()
    if java_major is None:
        raise RuntimeError("cannot read the version of java on PATH")
    spice_dir = _pkg_dir("spice")
    cache_dir = Path(cache_dir) if cache_dir is not None else spice_dir / "cache"
    ids = sorted(gts)
    with tempfile.TemporaryDirectory(prefix="capflow-spice-") as tmp:
        tmp = Path(tmp)
        in_file, out_file = tmp / "input.json", tmp / "output.json"
        in_file.write_text(json.dumps([{"image_id": i, "test": res[i][0], "refs": gts[i]} for i in ids], indent=2))
        base = _spice_command(jar_dir, java_major, tmp)
        for use_cache in (True, False):
            cmd = [*base, str(in_file)]
            if use_cache:
                cache_dir.mkdir(parents=True, exist_ok=True)
                cmd += ["-cache", str(cache_dir)]
            cmd += ["-out", str(out_file), "-subset", "-silent"]
            proc = subprocess.run(cmd, cwd=spice_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  check=False)
            err = proc.stderr.decode(errors="replace")
            if proc.returncode == 0 and out_file.is_file():
                break
            if use_cache and re.search(r"org\.nustaq|lmdbjni|LmdbTupleDB", err):
                log.warning("SPICE failed in its parse cache; running again without it:\n%s", err[-2000:])
                continue
            reason = next((ln.strip() for ln in err.splitlines() if _JAVA_EXCEPTION.match(ln)), "")
            raise RuntimeError(f"SPICE exited with code {proc.returncode}: {reason or err[-500:]}")
        results = json.loads(out_file.read_text())

    def _f(x: Any) -> float:
        try:
            return float(x)
        except (TypeError, ValueError):
            return math.nan

    by_id = {r["image_id"]: _f(r["scores"]["All"]["f"]) for r in results}
    per_sorted = [by_id[i] for i in ids]
    mean = sum(per_sorted) / len(per_sorted) if per_sorted else math.nan
    return mean, [by_id[i] for i in gts]


# ----------------------------------------------------------------------------------------------- scoring


def _finite(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _bleu(gts: dict[int, list[str]], res: dict[int, list[str]]):
    from pycocoevalcap.bleu.bleu_scorer import BleuScorer

    scorer = BleuScorer(n=4)
    for i in gts:
        scorer += (res[i][0], gts[i])
    score, per_image = scorer.compute_score(option="closest", verbose=0)
    # the corpus totals BleuScorer prints with verbose=1, recomputed from its cooked statistics
    testlen = reflen = 0
    guess, correct = [0] * 4, [0] * 4
    for comps in scorer.ctest:
        testlen += comps["testlen"]
        reflen += scorer._single_reflen(comps["reflen"], "closest", comps["testlen"])
        for k in range(4):
            guess[k] += comps["guess"][k]
            correct[k] += comps["correct"][k]
    counts = {"testlen": testlen, "reflen": reflen, "guess": guess, "correct": correct,
              "ratio": (testlen + 1e-15) / (reflen + 1e-9)}
    return [float(s) for s in score], per_image, counts


def score(results: Mapping[int, str], references: Mapping[int, Sequence[str]], *,
          spice_jars: str | Path | None = None, metrics: Sequence[str] = METRICS,
          per_image: bool = False) -> dict:
    """Score generated captions (one per image) against references with the coco-caption metrics.

    Every image in ``results`` is scored; each needs references (extra reference images are ignored, and counted
    in ``"unscored_references"``). Returns::

        {"metrics": {name: float | None, ...},        # the requested ones; SPICE None when unavailable
         "images": n_scored, "unscored_references": n,
         "bleu_counts": {"testlen", "reflen", "guess": [4], "correct": [4], "ratio"},   # when BLEU requested
         "tokens": {"references": n, "results": n,    # words scored (PTB tokens, punctuation removed)
                    "ptb_tokenizer": {"references": n, "results": n}},  # the Java tokenizer's own count
         "spice": "available" | "unavailable: <reason>" | "not requested",
         "per_image": {metric: {image_id: float}}}    # only with per_image=True
    """
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; choose from {METRICS}")
    if not metrics:
        raise ValueError("no metrics requested")
    if not results:
        raise EvaluationInputError("no results to score")
    _check_ids(results, references, "results")
    ids = list(results)
    for i in ids:
        refs = references[i]
        if isinstance(refs, str) or not refs or not all(isinstance(r, str) for r in refs):
            raise EvaluationInputError(f"references of image {i} must be a non-empty list of strings")
        if not isinstance(results[i], str):
            raise EvaluationInputError(f"result caption of image {i} is not a string")

    want = set(metrics)
    timings: dict[str, float] = {}
    spice_jar_dir, spice_state = (None, "not requested")
    if "SPICE" in want:
        spice_jar_dir, spice_state = spice_status(spice_jars)

    meteor = None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capflow-meteor")
    try:
        if "METEOR" in want:
            t0 = time.perf_counter()
            meteor = meteor_scorer()  # a new JVM loads its paraphrase tables while we tokenise
            timings["meteor_spawn"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        flat_refs = [r for i in ids for r in references[i]]
        tok_refs, ptb_refs = _ptb_tokenize(flat_refs)
        tok_res, ptb_res = _ptb_tokenize([results[i] for i in ids])
        gts: dict[int, list[str]] = {}
        pos = 0
        for i in ids:
            n = len(references[i])
            gts[i] = tok_refs[pos: pos + n]
            pos += n
        res = {i: [c] for i, c in zip(ids, tok_res)}
        timings["tokenize"] = time.perf_counter() - t0

        out_metrics: dict[str, float | None] = {}
        per: dict[str, dict[int, float | None]] = {}

        def _meteor():
            t = time.perf_counter()
            try:
                s, scores = meteor.compute_score(gts, res)
            except (ValueError, BrokenPipeError, OSError) as e:  # the JVM died: say why
                p = meteor.meteor_p
                err = p.stderr.read().decode(errors="replace")[-2000:] if p.poll() is not None and p.stderr else ""
                _discard_meteor(meteor)  # the next score starts a fresh one
                raise RuntimeError(f"METEOR failed: {e}; {err}") from e
            timings["METEOR"] = time.perf_counter() - t
            return s, scores

        fut = pool.submit(_meteor) if meteor is not None else None

        bleu_counts = None
        if want & set(BLEU_METRICS):
            t0 = time.perf_counter()
            bleu, bleu_per, bleu_counts = _bleu(gts, res)
            for k, name in enumerate(BLEU_METRICS):
                if name in want:
                    out_metrics[name] = bleu[k]
                    per[name] = dict(zip(ids, (float(x) for x in bleu_per[k])))
            timings["BLEU"] = time.perf_counter() - t0
        if "ROUGE_L" in want:
            from pycocoevalcap.rouge.rouge import Rouge

            t0 = time.perf_counter()
            s, scores = Rouge().compute_score(gts, res)
            out_metrics["ROUGE_L"] = float(s)
            per["ROUGE_L"] = dict(zip(ids, (float(x) for x in scores)))
            timings["ROUGE_L"] = time.perf_counter() - t0
        if "CIDEr" in want:
            from pycocoevalcap.cider.cider import Cider

            t0 = time.perf_counter()
            s, scores = Cider().compute_score(gts, res)
            out_metrics["CIDEr"] = float(s)
            per["CIDEr"] = dict(zip(ids, (float(x) for x in scores)))
            timings["CIDEr"] = time.perf_counter() - t0
        if "SPICE" in want:
            out_metrics["SPICE"] = None
            if spice_jar_dir is not None:
                t0 = time.perf_counter()
                try:
                    s, scores = _run_spice(gts, res, spice_jar_dir)
                except (OSError, RuntimeError, subprocess.SubprocessError, ValueError, KeyError) as e:
                    spice_state = f"unavailable: SPICE run failed ({type(e).__name__}: {e})"
                    warnings.warn(f"SPICE {spice_state}", stacklevel=2)
                else:
                    per["SPICE"] = dict(zip(ids, (_finite(x) for x in scores)))
                    out_metrics["SPICE"] = _finite(s)
                    if out_metrics["SPICE"] is None:  # pycocoevalcap would report NaN here
                        bad = sum(v is None for v in per["SPICE"].values())
                        spice_state = f"unavailable: SPICE gave no F-score for {bad} image(s)"
                timings["SPICE"] = time.perf_counter() - t0
        if fut is not None:
            s, scores = fut.result()
            out_metrics["METEOR"] = float(s)
            per["METEOR"] = dict(zip(ids, (float(x) for x in scores)))
    finally:
        pool.shutdown(wait=True)

    ordered = {m: out_metrics.get(m) for m in METRICS if m in want}
    out: dict[str, Any] = {
        "metrics": ordered,
        "images": len(ids),
        "unscored_references": len(references) - len(ids),
    }
    if bleu_counts is not None:
        out["bleu_counts"] = bleu_counts
    out["tokens"] = {"references": sum(len(c.split()) for c in tok_refs),
                     "results": sum(len(c.split()) for c in tok_res),
                     "ptb_tokenizer": {"references": ptb_refs, "results": ptb_res}}
    out["spice"] = spice_state
    if per_image:
        out["per_image"] = {m: per[m] for m in METRICS if m in per}
    log.debug("coco metrics timings (s): %s", {k: round(v, 2) for k, v in timings.items()})
    return out


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


def evaluate_files(results_path: str | Path, references_path: str | Path,
                   spice_jars: str | Path | None = None, duplicates: str = "error") -> dict:
    """``capflow evaluate``: score a COCO results file against a COCO references file.

    Returns the JSON-ready dict the CLI prints: :func:`score`'s output (without per-image scores) plus the two
    file paths. Non-finite numbers are ``None``. ``duplicates``: see :func:`load_results`.
    """
    refs = load_references(references_path)
    results = load_results(results_path, refs, duplicates=duplicates)
    out = score(results, refs, spice_jars=spice_jars)
    out["metrics"] = {k: (None if v is None else _finite(v)) for k, v in out["metrics"].items()}
    return {"results": str(results_path), "references": str(references_path), **out}
