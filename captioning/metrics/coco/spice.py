"""SPICE without downloads: whether it can run (:func:`spice_status`: the Stanford CoreNLP 3.6.0 jars configured,
a Java that can run it) and the run itself, as pycocoevalcap's ``Spice`` runs it but with an explicit class path
and the two fixes spice-1.0.jar needs on Java 15+ (see ``_SPICE_OPENS``)."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from captioning.metrics.coco.java import java_major, pkg_dir

log = logging.getLogger(__package__)  # the package's logger (captioning.metrics.coco), as before the split

SPICE_ENV = "CAPFLOW_SPICE_JARS"
CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")


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


def _java_has_compiler(java: str = "java") -> bool:
    """Whether ``java`` has the ``jdk.compiler`` module, which runs the launcher (Java's single-file source mode)."""
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
    major = java_major()
    if major is None:
        return None, "unavailable: cannot read the version of java on PATH"
    if major >= 15 and not _java_has_compiler():
        return None, (f"unavailable: Java {major} has no JavaScript engine, which spice-1.0.jar needs to write its "
                      "scores, and no jdk.compiler to run capflow's replacement writer: install a full JDK "
                      "(or put Java 8-14 on PATH)")
    return d.resolve(), "available"


def _spice_command(jar_dir: Path, major: int, workdir: Path) -> list[str]:
    """The Java command that runs SPICE 1.0 with the CoreNLP jars from ``jar_dir`` (class path given explicitly:
    nothing is copied into the installed package). ``workdir`` receives the launcher source on Java 15+."""
    spice_dir = pkg_dir("spice")
    cp = os.pathsep.join([str(spice_dir / "spice-1.0.jar"),
                          *(str(jar_dir / j) for j in CORENLP_JARS),
                          *sorted(str(p) for p in (spice_dir / "lib").glob("*.jar") if p.name not in CORENLP_JARS)])
    cmd = ["java", "-Xmx8G"]
    if major >= 9:
        cmd += [f"--add-opens={pkg}=ALL-UNNAMED" for pkg in _SPICE_OPENS]
    cmd += ["-cp", cp]
    if major >= 15:
        launcher = workdir / _SPICE_LAUNCHER
        launcher.write_text(_SPICE_LAUNCHER_SRC)
        cmd.append(str(launcher))
    else:
        cmd.append("edu.anu.spice.SpiceScorer")
    return cmd


def run_spice(gts: dict[int, list[str]], res: dict[int, list[str]], jar_dir: Path,
               cache_dir: Path | None = None) -> tuple[float, list[float]]:
    """SPICE as pycocoevalcap's ``Spice.compute_score`` runs it (same jar, input, ``-cache -subset -silent``
    flags and averaging: mean of the per-image ``All`` F-scores, None counted as NaN), on tokenised captions.
    Returns (mean, per-image F-scores in ``gts`` order). The parse cache defaults to pycocoevalcap's
    ``spice/cache``; a run whose failure comes from the cache is retried once without it."""
    major = java_major()
    if major is None:
        raise RuntimeError("cannot read the version of java on PATH")
    spice_dir = pkg_dir("spice")
    cache_dir = Path(cache_dir) if cache_dir is not None else spice_dir / "cache"
    ids = sorted(gts)
    with tempfile.TemporaryDirectory(prefix="capflow-spice-") as tmp:
        tmp = Path(tmp)
        in_file, out_file = tmp / "input.json", tmp / "output.json"
        in_file.write_text(json.dumps([{"image_id": i, "test": res[i][0], "refs": gts[i]} for i in ids], indent=2))
        base = _spice_command(jar_dir, major, tmp)
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

