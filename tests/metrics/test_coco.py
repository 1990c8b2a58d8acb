"""coco-caption metrics wrapper and diversity statistics.

The full-file tests re-score published outputs (see ``/work/shared/external/README.md``) and must reproduce the
published numbers to 3 decimals; each file is scored once per module (METEOR's JVM alone needs ~13 s to start).
"""

from __future__ import annotations

import json
import re
import warnings
import zipfile
from pathlib import Path

import pytest

from captioning.metrics import coco
from captioning.metrics.coco import (
    CORENLP_JARS,
    METRICS,
    SPICE_ENV,
    EvaluationInputError,
    evaluate_files,
    load_references,
    load_results,
    ptb_tokenize,
    score,
    spice_status,
)
from captioning.metrics.coco import java as coco_java
from captioning.metrics.coco import meteor as coco_meteor
from captioning.metrics.coco import scoring as coco_scoring
from captioning.metrics.coco import spice as coco_spice
from captioning.metrics.diversity import caption_stats


def _scored(fn):
    """Run ``fn`` with no SPICE jar directory in the environment."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(SPICE_ENV, raising=False)
        return fn()


@pytest.fixture(scope="module")
def karpathy_refs_path(external: Path) -> Path:
    return external / "coco_eval" / "karpathy_test_refs.json"


@pytest.fixture(scope="module")
def fakecap(external: Path) -> dict:
    d = external / "coco_eval"
    return _scored(lambda: evaluate_files(d / "fakecap_results.json", d / "fakecap_refs.json"))


@pytest.fixture(scope="module")
def acort(external: Path, karpathy_refs_path: Path) -> dict:
    return _scored(lambda: evaluate_files(external / "model_outputs" / "acort_karpathy_test.json",
                                          karpathy_refs_path))


@pytest.fixture(scope="module")
def magic(external: Path, karpathy_refs_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    # MAGIC's file is [{"image_name": "COCO_val2014_000000391895.jpg", "prediction": str, ...}]: derive a
    # COCO results file from it.
    raw = json.loads((external / "model_outputs" / "magic_karpathy_test.json").read_text())
    results = [{"image_id": int(re.search(r"(\d+)\.jpg$", r["image_name"]).group(1)), "caption": r["prediction"]}
               for r in raw]
    path = tmp_path_factory.mktemp("magic") / "magic_results.json"
    path.write_text(json.dumps(results))
    return _scored(lambda: evaluate_files(path, karpathy_refs_path))


def _assert_published(out: dict, published: dict[str, float]) -> None:
    got = {k: round(out["metrics"][k], 3) for k in published}
    assert got == published


# ------------------------------------------------------------------------------------------ published numbers


@pytest.mark.slow
def test_acort_reproduces_published(acort):
    _assert_published(acort, {"Bleu_1": 0.806, "Bleu_2": 0.655, "Bleu_3": 0.514, "Bleu_4": 0.398,
                               "METEOR": 0.288, "ROUGE_L": 0.584, "CIDEr": 1.311})
    assert acort["images"] == 5000
    assert acort["unscored_references"] == 0


@pytest.mark.slow
def test_magic_reproduces_published(magic):
    _assert_published(magic, {"Bleu_1": 0.568, "Bleu_2": 0.358, "Bleu_3": 0.214, "Bleu_4": 0.129,
                              "METEOR": 0.174, "ROUGE_L": 0.399, "CIDEr": 0.493})
    c = magic["bleu_counts"]
    assert (c["testlen"], c["reflen"], c["correct"]) == (47153, 47168, [26801, 9496, 2857, 902])
    assert c["guess"] == [47153 - k * 4982 for k in range(4)]
    assert magic["tokens"]["ptb_tokenizer"] == {"references": 305984, "results": 57649}
    assert magic["tokens"]["results"] == 47153  # BLEU's testlen is the scored words
    assert (magic["images"], magic["unscored_references"]) == (4982, 18)


@pytest.mark.slow
def test_fakecap_reproduces_official_demo(fakecap, external):
    expected = json.loads((external / "coco_eval" / "fakecap_expected_scores.json").read_text())
    _assert_published(fakecap, {k: expected[k] for k in METRICS if k != "SPICE"})
    _assert_published(fakecap, {"CIDEr": 0.600, "Bleu_4": 0.191})
    c = fakecap["bleu_counts"]
    want = expected["bleu_stats"]
    assert (c["reflen"], c["testlen"], c["guess"], c["correct"]) == (9855, 9893, want["guess"], [5732, 2510, 1043, 423])
    assert (c["reflen"], c["testlen"], c["correct"]) == (want["reflen"], want["testlen"], want["correct"])
    assert c["ratio"] == pytest.approx(want["ratio"], abs=1e-10)
    assert fakecap["images"] == 1000


@pytest.mark.slow
def test_full_file_spice_is_null_not_zero(fakecap):
    assert fakecap["metrics"]["SPICE"] is None
    assert fakecap["spice"].startswith("unavailable: ")
    assert SPICE_ENV in fakecap["spice"]
    assert list(fakecap["metrics"]) == list(METRICS)
    json.dumps(fakecap, allow_nan=False)  # what the CLI prints is valid JSON


# ------------------------------------------------------------------------------------------ SPICE handling


def _jar(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\n")
    return path


def test_spice_unconfigured(monkeypatch):
    monkeypatch.delenv(SPICE_ENV, raising=False)
    jar_dir, status = spice_status(None)
    assert jar_dir is None
    assert status.startswith("unavailable: no Stanford CoreNLP 3.6.0 jar directory configured")


def test_spice_bogus_dirs_name_the_missing_jar(tmp_path):
    jar_dir, status = spice_status(tmp_path / "nope")
    assert jar_dir is None and status.startswith("unavailable: ") and "does not exist" in status

    _jar(tmp_path / "stanford-corenlp-3.6.0.jar")
    jar_dir, status = spice_status(tmp_path)
    assert jar_dir is None
    assert status.startswith("unavailable: ") and "stanford-corenlp-3.6.0-models.jar" in status
    assert "stanford-corenlp-3.6.0.jar " not in status  # only the missing one is named

    (tmp_path / "stanford-corenlp-3.6.0-models.jar").write_text("not a zip")
    jar_dir, status = spice_status(tmp_path)
    assert jar_dir is None and "stanford-corenlp-3.6.0-models.jar is not a valid jar" in status


def test_spice_env_variable_is_a_configured_location(tmp_path, monkeypatch):
    monkeypatch.setenv(SPICE_ENV, str(tmp_path))
    jar_dir, status = spice_status(None)
    assert jar_dir is None and "stanford-corenlp-3.6.0.jar and stanford-corenlp-3.6.0-models.jar" in status
    for name in CORENLP_JARS:
        _jar(tmp_path / name)
    jar_dir, status = spice_status(None)
    assert (jar_dir, status) == (tmp_path.resolve(), "available")


def test_spice_needs_a_jdk_on_java_15_plus(tmp_path, monkeypatch):
    for name in CORENLP_JARS:
        _jar(tmp_path / name)
    monkeypatch.setattr(coco_spice, "java_major", lambda java="java": 17)
    monkeypatch.setattr(coco_spice, "_java_has_compiler", lambda java="java": False)
    jar_dir, status = spice_status(tmp_path)
    assert jar_dir is None and "no JavaScript engine" in status and "jdk.compiler" in status
    monkeypatch.setattr(coco_spice, "java_major", lambda java="java": 11)
    assert spice_status(tmp_path)[1] == "available"


def test_spice_command_keeps_jars_in_place(tmp_path):
    for name in CORENLP_JARS:
        _jar(tmp_path / name)
    cp_of = lambda cmd: cmd[cmd.index("-cp") + 1].split(":")  # noqa: E731
    old = coco_spice._spice_command(tmp_path, 8, tmp_path)
    assert old[-1] == "edu.anu.spice.SpiceScorer" and not any(a.startswith("--add-opens") for a in old)
    cp = cp_of(old)
    assert cp[0].endswith("spice/spice-1.0.jar") and [str(tmp_path / j) for j in CORENLP_JARS] == cp[1:3]
    assert any(p.endswith("lib/SceneGraphParser-1.0.jar") for p in cp)
    new = coco_spice._spice_command(tmp_path, 17, tmp_path)
    assert new[-1] == str(tmp_path / "CapflowSpice.java") and (tmp_path / "CapflowSpice.java").is_file()
    assert "--add-opens=java.base/java.lang=ALL-UNNAMED" in new and cp_of(new) == cp


SMALL_REFS = {
    1: ["A dog runs on the grass.", "A brown dog running across a lawn.", "The dog is running outside."],
    2: ["Two people ride bikes down a street.", "Cyclists on a city road."],
    3: ["A plate of food with broccoli.", "Broccoli and rice on a white plate."],
}
SMALL_RESULTS = {1: "A dog running on the grass.", 2: "two people riding bikes on a street",
                 3: "zebras grazing near trees"}


def test_score_small_without_spice_jars(monkeypatch):
    monkeypatch.delenv(SPICE_ENV, raising=False)
    out = score(SMALL_RESULTS, SMALL_REFS, metrics=("Bleu_1", "Bleu_4", "CIDEr", "ROUGE_L", "SPICE"),
                per_image=True)
    assert list(out["metrics"]) == ["Bleu_1", "Bleu_4", "ROUGE_L", "CIDEr", "SPICE"]
    assert out["metrics"]["SPICE"] is None and out["spice"].startswith("unavailable: ")
    assert out["images"] == 3
    assert out["bleu_counts"]["testlen"] == 6 + 7 + 4  # punctuation removed by the PTB tokenizer
    assert set(out["per_image"]) == {"Bleu_1", "Bleu_4", "ROUGE_L", "CIDEr"}
    cider = out["per_image"]["CIDEr"]
    assert cider[3] == 0.0 and cider[1] > cider[3]
    assert out["metrics"]["CIDEr"] == pytest.approx(sum(cider.values()) / 3)


def test_score_with_spice_jars_runs_spice(tmp_path, monkeypatch):
    for name in CORENLP_JARS:
        _jar(tmp_path / name)
    calls = {}

    def fake_run(gts, res, jar_dir):
        calls["gts"], calls["res"], calls["jar_dir"] = gts, res, jar_dir
        return 0.25, [0.5, 0.25, 0.0]

    monkeypatch.setattr(coco_scoring, "run_spice", fake_run)
    out = score(SMALL_RESULTS, SMALL_REFS, metrics=("CIDEr", "SPICE"), spice_jars=tmp_path, per_image=True)
    assert out["spice"] == "available" and out["metrics"]["SPICE"] == 0.25
    assert out["per_image"]["SPICE"] == {1: 0.5, 2: 0.25, 3: 0.0}
    assert calls["jar_dir"] == tmp_path.resolve()
    assert calls["res"][1] == ["a dog running on the grass"]  # SPICE gets the tokenised text, like the toolkit


def test_spice_run_failure_is_unavailable_not_zero(tmp_path):
    """A real SPICE run with jars that hold no CoreNLP classes: Java fails, SPICE is null with the reason."""
    for name in CORENLP_JARS:
        _jar(tmp_path / name)
    with pytest.warns(UserWarning, match="SPICE run failed"):
        out = score(SMALL_RESULTS, SMALL_REFS, metrics=("SPICE",), spice_jars=tmp_path)
    assert out["metrics"] == {"SPICE": None}
    assert out["spice"].startswith("unavailable: SPICE run failed")
    assert "edu/stanford/nlp" in out["spice"]  # SPICE itself ran and missed the CoreNLP classes


# ------------------------------------------------------------------------------------------ tokenizer


def test_ptb_tokenize_keeps_one_line_per_caption():
    caps = ["A dog\u2028on the grass.", "x\ry", "", "He said \"hi\", then left!", "last one."]
    assert ptb_tokenize(caps) == ["a dog on the grass", "x y", "", "he said hi then left", "last one"]


def test_ptb_tokenize_is_not_shifted_by_jvm_warnings(monkeypatch):
    """Java 9+ prints its own warnings on stdout; one such line used to shift every caption (an evaluation failed
    that way under load). -XX:+UseLargePages makes the JVM warn on a machine without large pages."""
    import subprocess

    probe = subprocess.run(["java", "-XX:+UseLargePages", "-version"], capture_output=True, text=True, check=False)
    if "[warning]" not in probe.stdout:
        pytest.skip("this JVM prints no warning on stdout for -XX:+UseLargePages (large pages configured?)")
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-XX:+UseLargePages")
    caps = ["A dog on the grass.", "two cats", "last one."]
    assert ptb_tokenize(caps) == ["a dog on the grass", "two cats", "last one"]
    monkeypatch.setattr(coco_java, "_jvm_warnings_to_stderr", lambda: ())  # as before: the warning lands in stdout
    with pytest.raises(RuntimeError, match=r"4 lines for 3 captions \(first line '\[.*warning"):
        ptb_tokenize(caps)


# ------------------------------------------------------------------------------------------ bad input


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _refs_file(tmp_path: Path) -> Path:
    return _write(tmp_path / "refs.json", {
        "images": [{"id": 1}, {"id": 2}],
        "annotations": [{"image_id": 1, "caption": "a dog"}, {"image_id": 1, "caption": "a brown dog"},
                        {"image_id": 2, "caption": "a cat"}]})


def test_load_references(tmp_path):
    assert load_references(_refs_file(tmp_path)) == {1: ["a dog", "a brown dog"], 2: ["a cat"]}
    bad = {
        "list.json": ([1, 2], "expected a COCO annotation object"),
        "noann.json": ({"images": []}, "missing key 'annotations'"),
        "empty.json": ({"images": [], "annotations": []}, "'annotations' is empty"),
        "nocap.json": ({"annotations": [{"image_id": 1}]}, r"annotations\[0\] is missing key 'caption'"),
        "strid.json": ({"annotations": [{"image_id": "1", "caption": "x"}]}, "non-integer image_id '1'"),
        "imgid.json": ({"images": [{"id": 1.5}], "annotations": [{"image_id": 1, "caption": "x"}]},
                       "non-integer id 1.5"),
        "orphan.json": ({"images": [{"id": 1}], "annotations": [{"image_id": 7, "caption": "x"}]},
                        "not in 'images': 7"),
    }
    for name, (data, match) in bad.items():
        with pytest.raises(EvaluationInputError, match=match):
            load_references(_write(tmp_path / name, data))


def test_references_images_without_captions_warn(tmp_path):
    path = _write(tmp_path / "r.json", {"images": [{"id": 1}, {"id": 9}],
                                        "annotations": [{"image_id": 1, "caption": "x"}]})
    with pytest.warns(UserWarning, match="have no caption"):
        assert load_references(path) == {1: ["x"]}


def test_malformed_json_names_the_file(tmp_path):
    refs = _refs_file(tmp_path)
    broken = _write(tmp_path / "broken_results.json", '[{"image_id": 1, "caption": "a dog"')
    with pytest.raises(EvaluationInputError, match=r"results file .*broken_results\.json is not valid JSON"):
        load_results(broken)
    with pytest.raises(EvaluationInputError, match=r"broken_results\.json"):
        evaluate_files(broken, refs)
    broken_refs = _write(tmp_path / "broken_refs.json", "{nope")
    with pytest.raises(EvaluationInputError, match=r"references file .*broken_refs\.json is not valid JSON"):
        evaluate_files(_write(tmp_path / "ok.json", [{"image_id": 1, "caption": "x"}]), broken_refs)
    with pytest.raises(FileNotFoundError, match=r"missing\.json"):
        load_results(tmp_path / "missing.json")


def test_result_ids_without_references_are_an_error(tmp_path):
    refs_path = _refs_file(tmp_path)
    res = _write(tmp_path / "res.json", [{"image_id": 1, "caption": "a dog"}, {"image_id": 42, "caption": "x"},
                                         {"image_id": 43, "caption": "y"}])
    with pytest.raises(EvaluationInputError, match=r"2 image id\(s\) have no references: 42, 43"):
        load_results(res, load_references(refs_path))
    with pytest.raises(EvaluationInputError, match="42, 43"):
        evaluate_files(res, refs_path)
    with pytest.raises(EvaluationInputError, match="have no references: 42"):
        score({42: "x"}, {1: ["a dog"]})


def test_duplicate_result_ids(tmp_path):
    res = _write(tmp_path / "dup.json", [{"image_id": 1, "caption": "first"}, {"image_id": 2, "caption": "b"},
                                         {"image_id": 1, "caption": "second"}])
    with pytest.raises(EvaluationInputError, match="duplicate image_id 1"):
        load_results(res)
    with pytest.warns(UserWarning, match="duplicate image_id 1.*kept the first"):
        assert load_results(res, duplicates="first") == {1: "first", 2: "b"}


def test_malformed_results(tmp_path):
    bad = {
        "obj.json": ({"image_id": 1, "caption": "x"}, "expected a list"),
        "empty.json": ([], "no results"),
        "nokey.json": ([{"image_id": 1}], "item 0 is missing key 'caption'"),
        "strid.json": ([{"image_id": "1", "caption": "x"}], "non-integer image_id '1'"),
        "boolid.json": ([{"image_id": True, "caption": "x"}], "non-integer image_id True"),
        "numcap.json": ([{"image_id": 1, "caption": 3}], "non-string caption"),
    }
    for name, (data, match) in bad.items():
        with pytest.raises(EvaluationInputError, match=match):
            load_results(_write(tmp_path / name, data))
    with pytest.raises(ValueError, match="unknown metric"):
        score({1: "x"}, {1: ["x"]}, metrics=("BLEU",))


# ------------------------------------------------------------------------------------------ diversity


def test_caption_stats_exact():
    captions = {
        1: "A dog runs on the grass.",
        2: "a  dog runs on the grass.",   # same caption after normalisation
        3: "Two cats sleep",
        4: "a man's T-shirt is red",
    }
    train = ["a dog runs on the grass.", "TWO cats   sleep", "a cat sleeps"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = caption_stats(captions, train)
    assert stats == {
        "captions": 4,
        "novel_fraction": 0.25,          # only caption 4 is not a training caption
        "unique_fraction": 0.75,         # 3 distinct of 4
        "avg_length": (6 + 6 + 3 + 5) / 4,
        "vocab_used": 13,  # a dog runs on the grass two cats sleep man's t-shirt is red
    }
    with pytest.raises(ValueError):
        caption_stats({}, train)


# ------------------------------------------------------------------------------------------ the METEOR JVM
def test_one_meteor_jvm_serves_every_score_of_a_process_and_a_dead_one_is_replaced():
    refs = {1: ["a red circle on the left", "a small red circle"], 2: ["two blue squares", "blue squares side by side"],
            3: ["a green triangle at the top", "a triangle that is green"]}
    res = {1: "a red circle", 2: "two blue squares", 3: "a green shape at the top"}
    coco.close_meteor()
    first = score(res, refs, metrics=["METEOR"])["metrics"]["METEOR"]
    jvm = coco.meteor_scorer()
    assert jvm.meteor_p.poll() is None
    again = score(res, refs, metrics=["METEOR"])["metrics"]["METEOR"]
    assert coco.meteor_scorer() is jvm and again == first  # reused, and a reused JVM scores the same
    jvm.meteor_p.kill()  # a JVM that died between evaluations (a real fault: the process is gone)
    jvm.meteor_p.wait()
    replaced = score(res, refs, metrics=["METEOR"])["metrics"]["METEOR"]
    assert coco.meteor_scorer() is not jvm and replaced == first
    assert 0 < first < 1
    coco.close_meteor()
    assert coco_meteor._METEOR["scorer"] is None


# ------------------------------------------------------------------------------------------ bounded memory


@pytest.mark.slow
def test_bleu_and_cider_in_chunks_are_pycocoevalcaps_bit_for_bit(external, karpathy_refs_path):
    """BLEU and CIDEr cooked a chunk of images at a time (bounded memory) give pycocoevalcap's own corpus and
    per-image scores exactly (==), on the real Karpathy test references and ACORT's published outputs, with
    chunks that do not divide the 5,000 images; an image's CIDEr needs the document counts of every chunk."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider

    from captioning.metrics.coco.chunked import bleu_in_chunks, cider_in_chunks

    refs = load_references(karpathy_refs_path)
    results = load_results(external / "model_outputs" / "acort_karpathy_test.json", refs)
    ids = list(results)
    flat = ptb_tokenize([r for i in ids for r in refs[i]])
    cand = ptb_tokenize([results[i] for i in ids])
    gts, pos = {}, 0
    for i in ids:
        gts[i] = flat[pos: pos + len(refs[i])]
        pos += len(refs[i])
    res = {i: [c] for i, c in zip(ids, cand, strict=True)}

    want, want_per = Cider().compute_score(gts, res)
    got, got_per = cider_in_chunks(gts, res, chunk_images=777)
    assert got == want and got_per.tolist() == want_per.tolist()
    assert round(got, 3) == 1.311  # ACORT's published CIDEr
    # an image scored with only its own chunk's document counts differs: the counts are the corpus's
    _, alone_per = Cider().compute_score({i: gts[i] for i in ids[:777]}, {i: res[i] for i in ids[:777]})
    assert alone_per.tolist() != got_per[:777].tolist()

    want_b, want_b_per = Bleu(4).compute_score(gts, res, verbose=0)
    got_b, got_b_per, scorer = bleu_in_chunks(gts, res, chunk_images=777)
    assert got_b == want_b and got_b_per == want_b_per
    assert len(scorer.ctest) == 5000 and scorer.crefs == []  # only the per-image statistics were kept
