"""Tests for the pipeline configuration (captioning.config)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from captioning.config import (
    ConfigError,
    PipelineConfig,
    describe_keys,
    dump_yaml,
    load_config,
    parse_override,
    preset_dict,
    preset_names,
)

PRESETS = ["coco", "coco-dry", "demo", "learning", "tiny"]


def get(cfg: BaseModel, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)  # a dict-valued setting's entries
    return node


def section_models(model: type[BaseModel] = PipelineConfig, prefix: str = ""):
    """(dotted name, field) of every field, sections included."""
    for name, f in model.model_fields.items():
        yield prefix + name, f
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            yield from section_models(f.annotation, f"{prefix}{name}.")


# ---------------------------------------------------------------------- presets and YAML round trip
def test_preset_names() -> None:
    assert preset_names() == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_and_round_trips(name: str, tmp_path: Path) -> None:
    cfg = load_config(name)
    assert isinstance(cfg, PipelineConfig)
    # every value the preset file sets is what the config holds
    def check(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                check(v, f"{prefix}{k}.")
            else:
                assert get(cfg, prefix + k) == v, prefix + k
    check(preset_dict(name), "")
    text = dump_yaml(cfg)
    assert PipelineConfig.model_validate(yaml.safe_load(text)) == cfg
    p = tmp_path / f"{name}.yaml"
    p.write_text(text)
    again = load_config(path=p)
    assert again == cfg
    assert again.digest() == cfg.digest()
    assert dump_yaml(again) == text


def test_defaults_round_trip(tmp_path: Path) -> None:
    cfg = load_config()
    assert cfg == PipelineConfig()
    p = tmp_path / "c.yaml"
    p.write_text(dump_yaml(cfg))
    assert load_config(path=p) == cfg
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    assert load_config(path=empty) == cfg


def test_preset_specific_values() -> None:
    tiny, coco, demo = load_config("tiny"), load_config("coco"), load_config("demo")
    assert tiny.dataset.synthetic.num_images == 40 and tiny.dataset.max_reject_fraction == 0.05
    assert tiny.dataset.annotations is None and tiny.workdir == Path(".capflow/tiny")
    assert coco.dataset.annotations == "data/coco/dataset_coco.json" and coco.dataset.images == "data/coco/images"
    assert coco.students.scst.lr == 5e-5 and coco.features.max_boxes == 100
    assert demo.vocab.radix_base == 32 and demo.dataset.image_check == "decode"
    # keys a preset does not set keep their defaults
    assert tiny.students.names == PipelineConfig().students.names
    assert tiny.features.dtype == "float16"


# ---------------------------------------------------------------------- keys and descriptions
def test_every_key_has_a_description() -> None:
    rows = describe_keys()
    assert len(rows) > 50
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys))
    for key, _, desc in rows:
        assert desc.strip(), f"{key} has no description"
    for key, f in section_models():
        assert (f.description or "").strip(), f"{key} has no description"
    # defaults listed are the defaults a config gets
    default = PipelineConfig()
    for key, value, _ in rows:
        assert get(default, key) == value, key


def test_required_keys_and_defaults() -> None:
    rows = {k: (v, d) for k, v, d in describe_keys()}
    assert rows["run.workdir"][0] == ".capflow"
    assert rows["dataset.annotations"][0] is None
    assert rows["dataset.images"][0] is None
    assert rows["dataset.max_reject_fraction"][0] == 0.01
    assert "reject" in rows["dataset.max_reject_fraction"][1]
    assert rows["features.dtype"][0] == "float16"
    assert rows["features.extractor.weights"][0] is None
    cfg = PipelineConfig()
    assert cfg.workdir == Path(".capflow")
    assert cfg.feature_store_uri() == str(Path(".capflow") / "features")
    assert load_config(overrides=["features.store=s3://b/f"]).feature_store_uri() == "s3://b/f"


# ---------------------------------------------------------------------- unknown keys, wrong types
@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"run": {"wrokdir": "x"}}, "run.wrokdir"),
        ({"dataset": {"synthetic": {"num_imgs": 3}}}, "dataset.synthetic.num_imgs"),
        ({"features": {"extractor": {"weight": "a.pth"}}}, "features.extractor.weight"),
        ({"students": {"scst": {"lr": 1e-5, "beta": 2}}}, "students.scst.beta"),
    ],
)
def test_unknown_key_in_file(tmp_path: Path, data: dict, key: str) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as ei:
        load_config(path=p)
    assert f"unknown key '{key}'" in str(ei.value)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize(
    "item",
    ["bogus=1", "run.wrokdir=x", "dataset.synthetic.num_imgs=3", "features.extractor.weight=a",
     "dataset.features.dtype=float32"],
)
def test_unknown_key_in_override(item: str) -> None:
    key = item.split("=")[0]
    for preset in (None, "tiny"):
        with pytest.raises(ConfigError) as ei:
            load_config(preset, overrides=[item])
        msg = str(ei.value)
        first_unknown = key if key != "dataset.features.dtype" else "dataset.features"
        assert f"unknown key '{first_unknown}'" in msg
        assert "overrides" in msg


def test_several_errors_are_all_named() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(overrides=["run.nme=a", "vocab.min_count=zero", "loader.dataloader_workers=-1"])
    msg = str(ei.value)
    assert "unknown key 'run.nme'" in msg
    assert "'vocab.min_count'" in msg and "zero" in msg
    assert "'loader.dataloader_workers'" in msg


@pytest.mark.parametrize(
    ("item", "key"),
    [
        ("run.seed=abc", "run.seed"),
        ("dataset.max_reject_fraction=lots", "dataset.max_reject_fraction"),
        ("dataset.max_reject_fraction=1.5", "dataset.max_reject_fraction"),
        ("dataset.image_check=full", "dataset.image_check"),
        ("dataset.restval_split=holdout", "dataset.restval_split"),
        ("features.dtype=float64", "features.dtype"),
        ("features.extractor.amp=maybe", "features.extractor.amp"),
        ("dataset.synthetic.num_images=0", "dataset.synthetic.num_images"),
        ("students.names=acort", "students.names"),
        ("run={a: 1}", "run.a"),
        ("run=3", "run"),
    ],
)
def test_wrong_type_names_the_key(item: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}'") as ei:
        load_config(overrides=[item])
    assert "invalid configuration" in str(ei.value)


def test_wrong_type_in_file(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text("run:\n  seed: [1, 2]\nfeatures:\n  max_boxes: many\n")
    with pytest.raises(ConfigError) as ei:
        load_config(path=p)
    assert "'run.seed'" in str(ei.value) and "'features.max_boxes'" in str(ei.value)


def test_min_boxes_above_max_boxes_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"min_boxes \(20\) > features.max_boxes \(10\)"):
        load_config(overrides=["features.min_boxes=20", "features.max_boxes=10"])
    with pytest.raises(ConfigError, match="min_boxes"):
        load_config("tiny", overrides=["features.min_boxes=13"])  # tiny has max_boxes 12
    assert load_config("tiny", overrides=["features.min_boxes=12"]).features.min_boxes == 12
    cfg = load_config()
    with pytest.raises(ValueError, match="min_boxes"):
        cfg.features = cfg.features.model_copy(update={"min_boxes": 500})
    p = tmp_path / "c.yaml"
    p.write_text("features:\n  min_boxes: 50\n  max_boxes: 20\n")
    with pytest.raises(ConfigError, match="min_boxes"):
        load_config(path=p)


def test_assignment_is_validated() -> None:
    cfg = load_config()
    with pytest.raises(ValueError):
        cfg.run.seed = "abc"
    with pytest.raises(ValueError):
        cfg.dataset.bogus = 1


# ---------------------------------------------------------------------- overrides
@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("3", 3),
        ("-2", -2),
        ("0.25", 0.25),
        ("5.0e-05", 5e-05),
        ("true", True),
        ("false", False),
        ("null", None),
        ("~", None),
        ("hello", "hello"),
        ("/data/coco images/x.json", "/data/coco images/x.json"),
        ("'007'", "007"),
        ("a=b", "a=b"),
        ("[acort, lw]", ["acort", "lw"]),
        ("[unclosed", "[unclosed"),
        ("", ""),
    ],
)
def test_parse_override_yaml_scalars(raw: str, value: Any) -> None:
    keys, got = parse_override(f"a.b={raw}")
    assert keys == ["a", "b"]
    assert got == value and type(got) is type(value)


def test_overrides_apply_typed_values() -> None:
    cfg = load_config(
        "tiny",
        overrides=[
            "run.seed=7",
            "dataset.max_reject_fraction=0.2",
            "features.extractor.amp=true",
            "features.extractor.weights=null",
            "dataset.annotations=/data/x.json",
            "students.names=[acort, lw]",
            "vocab.min_count=3",
            "vocab.min_count=4",  # the last one wins
            "tracking.experiment=exp-1",
        ],
    )
    assert cfg.run.seed == 7
    assert cfg.dataset.max_reject_fraction == 0.2
    assert cfg.features.extractor.amp is True
    assert cfg.features.extractor.weights is None
    assert cfg.dataset.annotations == "/data/x.json"
    assert cfg.students.names == ["acort", "lw"]
    assert cfg.vocab.min_count == 4
    assert cfg.tracking.experiment == "exp-1"
    assert cfg.dataset.synthetic.num_images == 40  # the preset's value survives


@pytest.mark.parametrize("item", ["run.seed", "=3", "run..seed=3", ".seed=1", "run.=1"])
def test_malformed_override(item: str) -> None:
    with pytest.raises(ConfigError, match="override"):
        load_config(overrides=[item])


def test_override_through_a_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"run\.workdir is not a section"):
        load_config("tiny", overrides=["run.workdir.x=1"])
    with pytest.raises(ConfigError, match=r"run\.seed"):
        load_config(overrides=["run.seed=1", "run.seed.x=2"])


def test_loading_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown preset 'huge'; available: coco, coco-dry, demo, learning, tiny"):
        load_config("huge")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(path=tmp_path / "missing.yaml")
    p = tmp_path / "c.yaml"
    p.write_text("run: {seed: 1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path=p)
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(path=p)
    p.write_text("run: {}\n")
    with pytest.raises(ConfigError, match="either a preset or a config file"):
        load_config("tiny", p)


# ---------------------------------------------------------------------- digest
def test_digest_stable_and_value_sensitive(tmp_path: Path) -> None:
    a, b = load_config("tiny"), load_config("tiny")
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64
    # key order in a file does not matter
    d = a.model_dump(mode="json")
    reordered = {k: d[k] for k in reversed(list(d))}
    reordered["dataset"] = {k: d["dataset"][k] for k in reversed(list(d["dataset"]))}
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(reordered, sort_keys=False))
    assert load_config(path=p).digest() == a.digest()
    # any single changed value changes it; an override to the same value does not
    assert load_config("tiny", overrides=["run.seed=0"]).digest() == a.digest()
    seen = {a.digest()}
    for item in ["run.seed=1", "dataset.max_reject_fraction=0.06", "features.extractor.amp=true",
                 "dataset.synthetic.seed=2", "students.names=[acort]", "dataset.annotations=x.json"]:
        dg = load_config("tiny", overrides=[item]).digest()
        assert dg not in seen, item
        seen.add(dg)


def test_section_digest() -> None:
    base = load_config("tiny")
    other_section = load_config("tiny", overrides=["run.seed=5", "vocab.min_count=9"])
    same_section_changed = load_config("tiny", overrides=["dataset.synthetic.num_images=41"])
    assert other_section.digest("dataset.synthetic") == base.digest("dataset.synthetic")
    assert other_section.digest() != base.digest()
    assert same_section_changed.digest("dataset.synthetic") != base.digest("dataset.synthetic")
    assert same_section_changed.digest("dataset") != base.digest("dataset")
    assert base.digest("dataset.synthetic") != base.digest("dataset")


def test_numbers_for_text_settings_are_text() -> None:
    cfg = load_config(overrides=["run.name=2024", "tracking.model_name=7"])
    assert cfg.run.name == "2024" and cfg.tracking.model_name == "7"


def test_scst_batch_size_defaults_to_the_loaders_and_can_be_its_own():
    from captioning.training.recipe import scst_settings, xe_settings

    cfg = load_config("demo", overrides=["loader.batch_size=16"])
    assert scst_settings(cfg.students.scst.model_copy(update={"batch_size": None}), cfg).batch_size == 16
    cfg = load_config("demo", overrides=["loader.batch_size=16", "students.scst.batch_size=40"])
    assert scst_settings(cfg.students.scst, cfg).batch_size == 40
    assert xe_settings(cfg.students.xe, cfg).batch_size == 16


def test_per_student_overrides_merge_over_the_defaults_and_name_known_students():
    from captioning.training.recipe import model_plan

    def scst_epochs(cfg, name):
        return model_plan(cfg, name).scst.settings.epochs

    cfg = load_config("learning")
    sc = cfg.students.scst
    assert cfg.students.per_student["expansionnet"].scst_epochs == 10 and sc.epochs == 5
    assert scst_epochs(cfg, "expansionnet") == 10
    assert [scst_epochs(cfg, s) for s in ("acort", "lw", "satic", "zodiac", "teacher")] == [5] * 5
    # the preset's entry came on top of the default one: SATIC keeps SeqKD and the teacher's weights
    assert (model_plan(cfg, "satic").captions, model_plan(cfg, "satic").init_from_teacher) == ("seqkd", True)
    cfg = load_config("demo", overrides=["students.scst.epochs=3", "students.per_student.lw-2x.scst_epochs=7",
                                         "students.per_student.satic.seqkd=false", "students.per_student.lw.seqkd=1"])
    assert scst_epochs(cfg, "lw-2x") == 7  # a registry preset name
    assert scst_epochs(cfg, "lw") == 3
    satic, lw = model_plan(cfg, "satic"), model_plan(cfg, "lw")
    assert (satic.captions, satic.init_from_teacher) == ("ground_truth", True)  # field by field
    assert (lw.captions, lw.init_from_teacher) == ("seqkd", False)
    with pytest.raises(ConfigError, match=r"per_student.*unknown student 'expnet'"):
        load_config("demo", overrides=["students.per_student.expnet.seqkd=true"])
    with pytest.raises(ConfigError, match=r"per_student.lw.scst_epochs"):
        load_config("demo", overrides=["students.per_student.lw.scst_epochs=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'students.per_student.lw.seqdk'"):
        load_config("demo", overrides=["students.per_student.lw.seqdk=true"])


def test_the_old_per_student_shapes_are_read_with_a_warning():
    """``seqkd_for`` / ``teacher_init_for`` lists (the whole set: a default student left out is off) and
    ``scst.epochs_for`` become ``students.per_student`` entries, with a FutureWarning."""
    from captioning.training.recipe import model_plan

    with pytest.warns(FutureWarning, match=r"students.seqkd_for is now called students.per_student.<name>.seqkd"):
        cfg = load_config("demo", overrides=["students.seqkd_for=[lw]", "students.scst.epochs_for.zodiac=4"])
    assert model_plan(cfg, "lw").captions == "seqkd" and model_plan(cfg, "satic").captions == "ground_truth"
    assert model_plan(cfg, "satic").init_from_teacher  # teacher_init_for not given: the default holds
    assert model_plan(cfg, "zodiac").scst.settings.epochs == 4
    with pytest.warns(FutureWarning, match="teacher_init_for"):
        cfg = load_config("demo", overrides=["students.teacher_init_for=[]"])
    assert not model_plan(cfg, "satic").init_from_teacher and model_plan(cfg, "satic").captions == "seqkd"
    with pytest.raises(ConfigError, match="must be a list of student names"):
        load_config("demo", overrides=["students.seqkd_for=lw"])


def test_renamed_keys_are_read_with_a_warning(tmp_path: Path) -> None:
    """One word, one meaning: the old names (``features.workers``, ``students.threads``, ...) still load - in a
    file and as overrides, an override beating the preset's new name - each with a FutureWarning naming the new
    key; a file giving both names is refused."""
    from captioning.config import RENAMED

    for old, new in RENAMED.items():
        value = 3
        with pytest.warns(FutureWarning, match=rf"{re.escape(old)} is now called {re.escape(new)}"):
            cfg = load_config("tiny", overrides=[f"{old}={value}"])
        assert get(cfg, new) == value
        *path, last = old.split(".")
        doc: dict[str, Any] = {}
        node = doc
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
        p = tmp_path / "old.yaml"
        p.write_text(yaml.safe_dump(doc))
        with pytest.warns(FutureWarning, match=re.escape(old)):
            assert get(load_config(path=p), new) == value
        node[new.rsplit(".", 1)[1]] = value
        p.write_text(yaml.safe_dump(doc))
        with pytest.raises(ConfigError, match=rf"{re.escape(old)} is the old name of {re.escape(new)}"):
            load_config(path=p)
    # the current names load without a warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config("coco", overrides=["features.dask_workers=3", "students.torch_threads=2"])


def test_run_name_is_bounded_input_not_an_mlflow_failure(capsys):
    """A 600-character or control-character ``run.name`` is refused as input (exit 2, the key named), not reported
    as a tracking store that cannot be opened."""
    from flows.cli import main

    with pytest.raises(ConfigError, match=r"run.name.*at most 200 characters"):
        load_config("demo", overrides=["run.name=" + "x" * 600])
    with pytest.raises(ConfigError, match=r"run\.name"):
        load_config("demo", overrides=["run.name=a\tb"])
    assert main(["config", "show", "--preset", "demo", "--set", "run.name=" + "y" * 600]) == 2
    assert "run.name" in capsys.readouterr().err
