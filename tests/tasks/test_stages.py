"""The pipeline's edges as pure functions: typed stage results through the cache, stage-key invalidation, the
leaderboard ranking and the promotion decision (no servers, seconds)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tasks.cache import StageCache, stage_key
from tasks.refs import (
    Baseline,
    DatasetRef,
    FeaturesRef,
    LabelsRef,
    Leaderboard,
    Promotion,
    RecordMismatch,
    Row,
    SeqKDRef,
    StudentFailure,
    StudentResult,
    TeacherRef,
)
from tasks.report import Rescore, decide_promotion, markdown, rank

REFS = [
    DatasetRef(run_id="r1", path="/w/datasets/dataset-ab.json", digest="ab" * 32, images=40, captions=200,
               rejected_images=2, dropped_captions=1, splits={"train": 30, "val": 4, "test": 4},
               rejects_path="/w/datasets/rejects-ab.json"),
    FeaturesRef(run_id="r2", uri="s3://b/f.zarr", digest="cd" * 32, ok=38, rejected=2,
                report={"extracted": 38, "rejected": [{"image_id": 7, "reason": "corrupt"}]}),
    LabelsRef(run_id="r3", vocab_path="/w/runs/vocab-1/vocab.json", labels_uri="/w/runs/vocab-1/labels.zarr",
              labels_digest="ef" * 32, vocab_digest="01" * 32, features_uri=None, features_digest=None),
    TeacherRef(run_id="r4", checkpoint="/w/runs/teacher-1/best.pt", checkpoint_digest="23" * 32,
               best_val_cider=0.5),
    SeqKDRef(run_id="r5", source="seqkd:232323232323", labels_digest="45" * 32, report={"captions": 30}),
    StudentResult(student="lw", preset="lw-1x", run_id="r6", metrics={"CIDEr": 0.4, "SPICE": None}, params=10,
                  latency_ms=1.5, novel_fraction=0.1, avg_length=8.0, unique_fraction=0.9, model_version="3",
                  test_set="ab" * 32, checkpoint="/w/m/model.pt", predictions="/w/p.json", references="/w/r.json"),
    StudentFailure(student="acort", error="RuntimeError: boom", traceback="..."),
    Promotion(changed=True, reason="no champion yet", champion_version="3", candidate="lw", candidate_version="3",
              candidate_cider=0.4),
]


@pytest.mark.parametrize("ref", REFS, ids=lambda r: type(r).__name__)
def test_typed_results_round_trip_through_the_stage_cache(tmp_path, ref):
    cache = StageCache(tmp_path)
    key = stage_key("some-stage", x=1)
    cache.put("some-stage", key, ref)
    got = cache.get("some-stage", key, type(ref))
    assert got == ref and type(got) is type(ref)
    # the record on disk is plain JSON
    doc = json.loads(cache.path("some-stage", key).read_text())
    assert doc["stage"] == "some-stage" and doc["key"] == key and doc["result"] == ref.to_record()
    assert cache.latest("some-stage", type(ref)) == ref


def test_a_record_of_another_shape_is_a_miss_not_a_keyerror(tmp_path):
    cache = StageCache(tmp_path)
    key = stage_key("vocab", x=1)
    cache.put("vocab", key, REFS[4])  # a SeqKDRef where a LabelsRef is expected
    assert cache.get("vocab", key, LabelsRef) is None
    with pytest.raises(RecordMismatch, match=r"missing .*labels_uri"):
        LabelsRef.from_record(REFS[4].to_record())
    assert cache.get("vocab", stage_key("vocab", x=2), LabelsRef) is None  # another key: a miss


def test_stage_key_changes_with_every_part_and_the_stage_only():
    base = stage_key("teacher", features="f", labels="l", seed=0)
    assert base == stage_key("teacher", seed=0, labels="l", features="f")  # order does not matter
    assert len({base, stage_key("teacher", features="f2", labels="l", seed=0),
                stage_key("teacher", features="f", labels="l", seed=1),
                stage_key("teacher", features="f", labels="l", seed=0, extra=None),
                stage_key("seqkd", features="f", labels="l", seed=0)}) == 5


def test_a_students_key_moves_with_its_own_scst_epochs_only():
    """``students.per_student.<name>.scst_epochs`` for one student re-runs that student's stage, not the
    others'."""
    from types import SimpleNamespace

    from captioning.config import load_config
    from captioning.training.recipe import model_plan
    from tasks.training import student_key

    def key(name, *overrides, scst=True):
        cfg = load_config("demo", overrides=[*overrides, *([] if scst else ["students.scst.enabled=false"])])
        ref = SimpleNamespace(digest="f", labels_digest="l", checkpoint_digest="t")
        return student_key(model_plan(cfg, name), ref, ref, ref, ref)

    longer = "students.per_student.expansionnet.scst_epochs=9"
    assert key("lw") == key("lw", longer) and key("lw", scst=False) == key("lw", longer, scst=False)
    assert key("expansionnet") != key("expansionnet", longer)
    # an entry that says what `epochs` says is the same SCST, the same key
    epochs = load_config("demo").students.scst.epochs
    assert key("expansionnet") == key("expansionnet", f"students.per_student.expansionnet.scst_epochs={epochs}")
    assert key("lw") != key("lw", "students.scst.lr=1e-4")


def test_model_plan_decides_captions_init_and_scst_once():
    from captioning.config import load_config
    from captioning.training.recipe import model_plan

    cfg = load_config("demo", overrides=["students.per_student.lw.seqkd=true", "students.per_student.lw.scst_epochs=7"])
    satic, lw, acort = (model_plan(cfg, n) for n in ("satic", "lw", "acort"))
    assert (satic.preset, satic.captions, satic.init_from_teacher, satic.needs_teacher) == \
        ("satic-k4", "seqkd", True, True)
    assert (lw.preset, lw.captions, lw.init_from_teacher, lw.needs_teacher, lw.scst.settings.epochs) == \
        ("lw-1x", "seqkd", False, True, 7)
    assert lw.scst.section["epochs"] == 7  # what is tracked and keyed is what trains
    assert (acort.captions, acort.init_from_teacher, acort.needs_teacher) == ("ground_truth", False, False)
    assert acort.scst.settings.epochs == cfg.students.scst.epochs
    # JSON-able: what data-parallel ranks, torchrun jobs and Dask workers receive is the same plan
    assert all(type(p).from_json(p.to_json()) == p for p in (satic, lw, acort, model_plan(cfg, "teacher")))
    assert model_plan(load_config("demo", overrides=["students.scst.enabled=false"]), "lw").scst is None
    with pytest.raises(ValueError, match="unknown student 'nope'"):
        model_plan(cfg, "nope")


def test_satic_ablation_and_the_teacher_are_plans_with_their_own_stages_and_keys():
    """SATIC's Table 4 is three plans of one name (own stage, own key), the teacher's plan evaluates the teacher
    stage's weights (keyed by them), and ``evaluation.xe`` is part of every plan and key."""
    from types import SimpleNamespace

    from captioning.config import load_config
    from captioning.training.recipe import model_plan, satic_ablation
    from tasks.training import student_key

    cfg = load_config("demo", overrides=["evaluation.xe=true"])
    abl = satic_ablation(cfg)
    assert {v: (p.stage, p.captions, p.init_from_teacher, p.preset) for v, p in abl.items()} == {
        "base": ("student-satic-base", "ground_truth", False, "satic-k4"),
        "seqkd": ("student-satic-seqkd", "seqkd", False, "satic-k4"),
        "weight_init": ("student-satic-weight_init", "seqkd", True, "satic-k4")}
    assert all(p.evaluate_xe for p in abl.values()) and not model_plan(load_config("demo"), "lw").evaluate_xe
    t = model_plan(cfg, "teacher")
    assert (t.is_teacher, t.needs_teacher, t.preset, t.stage, t.captions) == \
        (True, True, cfg.teacher.model.arch, "student-teacher", "ground_truth")

    def key(plan, digest="t"):
        ref = SimpleNamespace(digest="f", labels_digest="l", checkpoint_digest=digest)
        return stage_key(plan.stage, **student_key(plan, ref, ref, ref, ref))

    assert len({key(p) for p in abl.values()}) == 3
    assert key(t) != key(t, digest="other")  # another teacher checkpoint: another teacher evaluation
    assert key(abl["base"]) == key(abl["base"], digest="other")  # base needs no teacher
    with pytest.raises(ValueError, match="needs the teacher"):
        student_key(t, SimpleNamespace(digest="f", labels_digest="l"), SimpleNamespace(digest="f", labels_digest="l"),
                    None, None)


def _student(name, cider, params=100, version="1"):
    return StudentResult(student=name, preset=name, run_id="", metrics={"CIDEr": cider}, params=params,
                         latency_ms=1.0, novel_fraction=0.0, avg_length=5.0, unique_fraction=0.5,
                         model_version=version, test_set="t", checkpoint="", predictions="", references="")


def test_leaderboard_ranks_by_cider_then_size_then_name_and_lists_failures():
    degenerate = dataclasses.replace(_student("a", 0.3), distinct_captions=7, repeated_token_rate=0.25)
    results = [degenerate, _student("b", 0.5, params=200), _student("c", 0.5, params=100),
               StudentFailure(student="d", error="ValueError: x"), _student("e", None)]
    ranked, failed = rank(results)
    assert [r.student for r in ranked] == ["c", "b", "a", "e"] and [f.student for f in failed] == ["d"]
    table = markdown(Leaderboard(rows=tuple(Row.of(r) for r in ranked), failed=tuple(failed)))
    lines = table.splitlines()
    assert lines[2].startswith("| 1 | c | c |") and lines[-1] == "| - | d | FAILED: ValueError: x |"
    assert "| n/a |" in lines[5]  # e has no CIDEr
    assert lines[4].startswith("| 3 | a |") and lines[4].endswith("| 7 | 0.250 |")  # distinct captions, repeats


def test_leaderboard_shows_the_baseline_row_and_the_best_students_multiple_of_it():
    rows = tuple(Row.of(r) for r in (_student("c", 0.6), _student("b", 0.3)))
    base = Baseline(caption="a red circle", metrics={"Bleu_1": 0.4, "Bleu_4": 0.1, "ROUGE_L": 0.3, "CIDEr": 0.2})
    lines = markdown(Leaderboard(rows, baseline=base)).splitlines()
    assert lines[4] == ("| - | baseline | most frequent training caption | 0.400 | 0.100 | - | 0.300 | 0.200 | - "
                        "| - | - | 1 | - |")
    assert lines[-1] == 'Baseline caption: "a red circle"; best student\'s test CIDEr = 3.0x the baseline\'s.'
    assert markdown(Leaderboard(rows)).splitlines()[-1].startswith("| 2 | b |")  # no baseline, no row


def test_most_frequent_caption_baseline_is_the_commonest_training_caption_scored_on_every_test_image():
    from captioning.metrics.evaluation import most_frequent_caption

    train = ["a red circle", "a blue square", "a red circle", "a blue square", "two shapes"]
    refs = {1: ["a red circle", "a red ring"], 2: ["a blue square"]}
    caption, scored = most_frequent_caption(train, refs)
    assert caption == "a blue square"  # a tie goes to the first in sort order
    assert scored["images"] == 2 and set(scored["metrics"]) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L",
                                                               "CIDEr"}
    assert scored["metrics"]["Bleu_1"] == pytest.approx(4 / 6, abs=1e-6)  # 'a' twice, 'blue square' once
    with pytest.raises(ValueError, match="no training captions"):
        most_frequent_caption([], refs)


def test_promotion_decision():
    best = Row.of(_student("lw", 0.5, version="7"))
    first = decide_promotion(best, None, {}, "t")
    assert first.changed and first.champion_version == "7" and first.reason == "no champion yet"
    same = decide_promotion(best, "7", {"test_set": "t", "test_CIDEr": "0.5"}, "t")
    assert not same.changed and same.reason == "already champion"
    better_champion = decide_promotion(best, "3", {"test_set": "t", "test_CIDEr": "0.6"}, "t")
    assert not better_champion.changed and better_champion.champion_version == "3"
    tie = decide_promotion(best, "3", {"test_set": "t", "test_CIDEr": "0.5"}, "t")
    assert not tie.changed  # a tie keeps the champion
    worse_champion = decide_promotion(best, "3", {"test_set": "t", "test_CIDEr": "0.4"}, "t")
    assert worse_champion.changed and worse_champion.reason == "better than the current champion"
    # a champion scored on another test set is compared by its score on this one (re-scored), never by its tag
    kept = decide_promotion(best, "3", {"test_set": "other", "test_CIDEr": "0.1"}, "t",
                            Rescore({"CIDEr": 0.55}, 5, "decoded from this run's feature store"))
    assert not kept.changed and kept.champion_version == "3" and kept.champion_cider == 0.55
    assert kept.reason.startswith("current champion v3, scored on another test set, re-scored on this one")
    assert kept.rescored == "decoded from this run's feature store"
    tie_rescored = decide_promotion(best, "3", {"test_set": "other"}, "t", Rescore({"CIDEr": 0.5}, 5, "h"))
    assert not tie_rescored.changed
    beaten = decide_promotion(best, "3", {"test_set": "other", "test_CIDEr": "0.9"}, "t",
                              Rescore({"CIDEr": 0.45}, 5, "h"))
    assert beaten.changed and beaten.champion_version == "7" and "re-scored on this test set (h)" in beaten.reason
    unscored = decide_promotion(best, "3", {"test_set": "other", "test_CIDEr": "0.9"}, "t",
                                unscored="no images to extract its own from")
    assert unscored.changed and unscored.champion_cider is None
    assert "could not be scored on this one (no images to extract its own from)" in unscored.reason
    assert "without a comparison" in decide_promotion(best, "3", {"test_set": "other"}, "t").reason
    nobody = decide_promotion(None, "3", {}, "t")
    assert not nobody.changed and nobody.champion_version == "3" and nobody.reason == "no student finished"


def test_every_path_the_stage_keys_digest_exists():
    """A module named in STAGE_CODE that moved would drop out of the stage keys silently: it must exist."""
    from tasks.cache import REPO_ROOT, STAGE_CODE, TRAINING_CODE, code_version

    for paths in (*STAGE_CODE.values(), TRAINING_CODE):
        assert all((REPO_ROOT / p).exists() for p in paths), paths
    with pytest.raises(FileNotFoundError, match="does not exist"):
        code_version("captioning/no_such_module.py")
