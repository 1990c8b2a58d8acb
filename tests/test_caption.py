"""``capflow caption``: model folders, the MLflow registry, real JPEGs, rejections (no mocks).

The model folders are built like the pipeline's (checkpoint.save_model_dir) around the ``tiny`` preset's
features section (random-weight R50-C4 detector: there are no detector weights offline). The student is a tiny
ACORT (radix tokens, so digits -> words decoding is exercised), fitted for a few steps on the real captions of a
few real images so that it writes words rather than ``<eos>`` straight away.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from captioning.config import load_config
from captioning.data.text import build_vocabulary, tokenize
from captioning.decoding import beam_search, to_words
from captioning.features.extractor import RegionExtractor
from captioning.features.images import load_rgb
from captioning.inference import CaptionerError, ImageCaptioner
from captioning.models.encoder_decoder import ArchConfig
from captioning.models.registry import build
from captioning.training import checkpoint
from captioning.training.recipe import codec_for, max_tokens, student_arch
from flows.cli import main
from tasks.model_refs import ModelResolveError, resolve_model

MAX_WORDS = 16
BEAM = 2
TRAIN_IMAGES = 6  # images whose real captions the tiny model is fitted on
SUBSET = ["COCO_val2014_000000078707.jpg", "COCO_val2014_000000165547.jpg", "COCO_train2014_000000057870.jpg",
          "COCO_val2014_000000060623.jpg"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No telemetry, no writes to the home folder or the working directory."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("CAPFLOW_MODEL_CACHE", str(tmp_path / "model-cache"))
    monkeypatch.setenv("CAPFLOW_WEIGHTS_CACHE", str(tmp_path / "weights-cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def features_cfg():
    return load_config("tiny").features


@pytest.fixture(scope="module")
def images(external) -> list[Path]:
    files = sorted((external / "images").glob("*.jpg"))
    assert len(files) == 27
    return files


@pytest.fixture(scope="module")
def captions(external) -> dict[str, list[str]]:
    index = json.loads((external / "images" / "index_all.json").read_text(encoding="utf-8"))
    return {e["file_name"]: e["captions"] for e in index if e.get("captions")}


@pytest.fixture(scope="module")
def extractor(features_cfg) -> RegionExtractor:
    """The tiny preset's detector, built independently of the Captioner (the hand-made reference)."""
    f = features_cfg
    return RegionExtractor(f.extractor.model_copy(update={"device": "cpu"}), min_boxes=f.min_boxes,
                           max_boxes=f.max_boxes, feature_dim=f.feature_dim)


def _vocab(captions: dict[str, list[str]]):
    toks = [tokenize(c, MAX_WORDS) for caps in captions.values() for c in caps]
    return build_vocabulary(toks, min_count=2, radix_base=16)


def _save(folder: Path, model, arch: ArchConfig, vocab, features: dict, student: str = "acort") -> Path:
    return checkpoint.save_model_dir(folder, model=model, arch=arch.to_dict(), vocab=vocab, features=features,
                                     student=student, preset="acort-base", max_words=MAX_WORDS, beam=BEAM,
                                     test_metrics={"CIDEr": 0.0})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, extractor, features_cfg, images, captions) -> Path:
    """A tiny ACORT fitted briefly on real captions of real images' (random-detector) regions."""
    torch.manual_seed(0)
    vocab = _vocab(captions)
    arch = student_arch("acort", "tiny", vocab, features_cfg.feature_dim, MAX_WORDS)
    model = build(arch)
    codec = codec_for(arch, vocab)
    train = images[:TRAIN_IMAGES]
    regions = extractor([load_rgb(p) for p in train])
    feats = torch.stack([torch.from_numpy(r.features.astype(np.float16)).float() for r in regions])
    boxes = torch.stack([torch.from_numpy(r.boxes) for r in regions])
    mask = torch.ones(feats.shape[:2], dtype=torch.bool)
    seqs = [codec.encode_caption(vocab.encode(tokenize(captions[p.name][0], MAX_WORDS))) for p in train]
    targets = torch.zeros(len(seqs), max(len(s) for s in seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        targets[i, : len(s)] = torch.tensor(s)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(60):
        opt.zero_grad()
        model.xe_loss(feats, boxes, mask, targets).backward()
        opt.step()
    model.eval()
    return _save(tmp_path_factory.mktemp("model") / "model", model, arch, vocab,
                 features_cfg.model_dump(mode="json"))


@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory, features_cfg, captions) -> Path:
    """A model folder that needs no detector to build (for the errors raised before extraction)."""
    torch.manual_seed(0)
    vocab = _vocab(captions)
    arch = student_arch("lw", "tiny", vocab, features_cfg.feature_dim, MAX_WORDS)
    return _save(tmp_path_factory.mktemp("untrained") / "model", build(arch), arch, vocab,
                 features_cfg.model_dump(mode="json"), student="lw")


def by_hand(folder: Path, extractor: RegionExtractor, files: list[Path]) -> dict[str, str]:
    """Each image alone: load_rgb -> regions -> float16 -> encode -> beam search -> words."""
    from captioning.data.text import Vocabulary

    st = checkpoint.load(folder / "model.pt")
    model = build(ArchConfig.from_dict(st["arch"]))
    model.load_state_dict(st["state_dict"])
    model.eval()
    vocab = Vocabulary.load(folder / "vocab.json")
    meta = json.loads((folder / "capflow.json").read_text())
    codec = codec_for(model, vocab)
    out = {}
    for p in files:
        (r,) = extractor([load_rgb(p)])
        f = torch.from_numpy(r.features.astype(np.float16)).float()[None]
        b = torch.from_numpy(r.boxes)[None]
        with torch.inference_mode():
            mem = model.encode(f, b, torch.ones(f.shape[:2], dtype=torch.bool))
            d = beam_search(model, mem, beam=meta["beam"], max_len=max_tokens(model, meta["max_words"],
                                                                               vocab.radix()))
        out[str(p)] = to_words(d.flat(), vocab, codec)[0]
    return out


@pytest.fixture(scope="module")
def subset_captions(model_dir, images) -> dict[str, str]:
    """The Captioner's captions of SUBSET from the model folder (the reference for the registry/JSON tests)."""
    files = [p for p in images if p.name in SUBSET]
    res = ImageCaptioner(model_dir, device="cpu", progress=False).caption(files)
    assert not res.rejected
    return {c["file"]: c["caption"] for c in res.captions}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------- (a) real JPEGs, consistency
@pytest.mark.slow
def test_cli_captions_all_27_real_images_like_extraction_plus_beam_search_by_hand(capsys, caplog, model_dir,
                                                                                   extractor, images, monkeypatch):
    monkeypatch.setenv("CAPFLOW_PROGRESS_EVERY", "0")  # stderr is not a terminal here: progress as lines, each update
    t0 = time.perf_counter()
    rc, out, err = run(capsys, "caption", *map(str, images), "--model", str(model_dir), "--device", "cpu",
                       "--batch-size", "8")
    seconds = time.perf_counter() - t0
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 27
    got = dict(line.split("\t", 1) for line in lines)
    assert list(got) == [str(p) for p in images]  # input order, one line per image
    assert all(c.strip() for c in got.values())  # non-empty captions
    # the random-weight detector is announced (a logged warning, or the CLI's own stderr line)
    assert "RANDOM detector weights" in caplog.text + err
    assert "captioning: 27/27 img (100%)" in err  # the progress, on stderr
    expected = by_hand(model_dir, extractor, images)
    assert got == expected
    assert len(set(got.values())) > 1  # the captions depend on the image
    print(f"27 images captioned in {seconds:.1f} s")


@pytest.mark.slow
def test_captioner_api_matches_by_hand_in_batches_and_greedy(model_dir, extractor, images):
    files = [p for p in images if p.name in SUBSET]
    cap = ImageCaptioner(model_dir, device="cpu", batch_size=3, progress=False)
    assert cap.beam == BEAM and cap.codec is not None  # radix model: digits decoded to words
    res = cap.caption(files)
    assert [c["file"] for c in res.captions] == [str(p) for p in files] and not res.rejected
    assert {c["file"]: c["caption"] for c in res.captions} == by_hand(model_dir, extractor, files)
    assert cap.describe()["random_detector"] is True
    # beam 1 = greedy through the same code
    greedy = ImageCaptioner(model_dir, device="cpu", beam=1, progress=False).caption(files[:1])
    assert greedy.captions[0]["caption"].strip()


# ---------------------------------------------------------------------- (b) bad files
@pytest.mark.slow
def test_corrupt_and_missing_files_are_rejected_with_reasons_others_captioned(capsys, tmp_path, model_dir, images,
                                                                              subset_captions):
    good = [str(p) for p in images if p.name in SUBSET[:2]]
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(images[0].read_bytes()[:3000])
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"this is not a JPEG" * 50)
    missing = tmp_path / "missing.jpg"
    argv = [good[0], str(truncated), str(missing), good[1], str(garbage)]
    rc, out, err = run(capsys, "caption", *argv, "--model", str(model_dir), "--device", "cpu")
    assert rc == 1
    got = dict(line.split("\t", 1) for line in out.splitlines())
    assert got == {f: subset_captions[f] for f in good}
    prefix = "capflow caption: rejected "
    rejected = {line[len(prefix):].split(": ", 1)[0]: line for line in err.splitlines() if line.startswith(prefix)}
    assert set(rejected) == {str(truncated), str(missing), str(garbage)}
    assert "missing file" in rejected[str(missing)]
    assert "truncated" in rejected[str(truncated)] or "corrupt" in rejected[str(truncated)]
    assert "not an image" in rejected[str(garbage)]
    # JSON mode: the same captions, rejections on stderr only
    rc, out, err = run(capsys, "caption", *argv, "--model", str(model_dir), "--device", "cpu", "--json")
    assert rc == 1
    assert json.loads(out) == [{"file": f, "caption": subset_captions[f]} for f in good]
    assert str(missing) in err
    # nothing usable: exit status 2
    rc, out, err = run(capsys, "caption", str(missing), str(garbage), "--model", str(model_dir), "--device", "cpu")
    assert rc == 2 and out == ""
    assert "none of the 2 images" in err


@pytest.mark.slow
def test_captioner_result_records_rejections(model_dir, tmp_path, images, subset_captions):
    """The library result: captions for the usable files, {file, error} for the others, input order."""
    cap = ImageCaptioner(model_dir, device="cpu", progress=False)
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    files = [str(tmp_path / "nope.jpg"), *subset_captions, str(empty)]
    res = cap.caption(files)
    assert res.captions == [{"file": f, "caption": c} for f, c in subset_captions.items()]
    assert [r["file"] for r in res.rejected] == [files[0], files[-1]]
    assert all(set(r) == {"file", "error"} and r["error"] for r in res.rejected)
    assert "zero-byte" in res.rejected[1]["error"]


# ---------------------------------------------------------------------- (c) the MLflow registry
def _register(tmp_path: Path, model_dir: Path, alias: str = "champion") -> tuple[str, str]:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("capflow-test", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run_id = client.create_run(exp, run_name="acort-base").info.run_id
    client.log_artifacts(run_id, str(model_dir), "model")
    client.set_terminated(run_id)
    client.create_registered_model("capflow-captioner")
    mv = client.create_model_version("capflow-captioner", f"runs:/{run_id}/model", run_id=run_id)
    client.set_registered_model_alias("capflow-captioner", alias, mv.version)
    return uri, str(mv.version)


@pytest.mark.slow
def test_registry_champion_resolves_and_captions_like_the_folder(capsys, tmp_path, monkeypatch, model_dir,
                                                                 subset_captions):
    uri, version = _register(tmp_path, model_dir)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    files = list(subset_captions)
    rc, out, err = run(capsys, "caption", *files, "--json", "--device", "cpu")  # default: @champion
    assert rc == 0, err
    assert json.loads(out) == [{"file": f, "caption": c} for f, c in subset_captions.items()]
    # downloaded once into the cache; the version URI gives the same folder
    folder = resolve_model("models:/capflow-captioner@champion", uri)
    assert folder.is_relative_to(tmp_path / "model-cache")
    assert {p.name for p in folder.iterdir()} >= {"model.pt", "vocab.json", "capflow.json"}
    assert (folder / "model.pt").read_bytes() == (model_dir / "model.pt").read_bytes()
    assert resolve_model(f"models:/capflow-captioner/{version}", uri) == folder
    mtime = (folder / "model.pt").stat().st_mtime_ns
    assert resolve_model("models:/capflow-captioner@champion", None) == folder  # MLFLOW_TRACKING_URI
    assert (folder / "model.pt").stat().st_mtime_ns == mtime  # not downloaded again


def test_registry_errors_name_the_model_alias_and_store(capsys, tmp_path, monkeypatch, untrained_dir):
    uri, _ = _register(tmp_path, untrained_dir, alias="staging")
    with pytest.raises(ModelResolveError, match=r"no alias 'champion' \(aliases: staging -> v1\)"):
        resolve_model("models:/capflow-captioner@champion", uri)
    with pytest.raises(ModelResolveError, match=r"no registered model 'other'.*registered: capflow-captioner"):
        resolve_model("models:/other@champion", uri)
    with pytest.raises(ModelResolveError, match="has no version 7"):
        resolve_model("models:/capflow-captioner/7", uri)
    with pytest.raises(ModelResolveError, match="models:/NAME@ALIAS"):
        resolve_model("models:/capflow-captioner", uri)
    assert (resolve_model("models:/capflow-captioner@staging", uri) / "capflow.json").is_file()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    rc, out, err = run(capsys, "caption", "x.jpg")
    assert rc == 2 and out == ""
    assert "no alias 'champion'" in err


def test_unreachable_or_missing_tracking_store_is_a_clear_error(capsys, tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with pytest.raises(ModelResolveError, match="unreachable"):
        resolve_model("models:/capflow-captioner@champion", f"http://127.0.0.1:{port}")
    assert time.perf_counter() - t0 < 30  # no minutes of HTTP retries
    with pytest.raises(ModelResolveError, match="no MLflow tracking store"):
        resolve_model("models:/capflow-captioner@champion", f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}")
    assert not (tmp_path / "none").exists()  # nothing created
    # the CLI default: the default workdir's store (none here), with a hint at --preset / MLFLOW_TRACKING_URI
    rc, out, err = run(capsys, "caption", "x.jpg")
    assert rc == 2 and out == ""
    assert "no MLflow tracking store" in err and "--preset" in err
    with pytest.raises(ModelResolveError, match="not found"):
        resolve_model(str(tmp_path / "no-such-model"))


# ---------------------------------------------------------------------- (d) models that cannot caption images
def test_synthetic_informative_model_is_refused(capsys, tmp_path, untrained_dir):
    folder = tmp_path / "informative"
    shutil.copytree(untrained_dir, folder)
    meta = json.loads((folder / "capflow.json").read_text())
    meta["features"]["source"] = "synthetic-informative"
    (folder / "capflow.json").write_text(json.dumps(meta))
    with pytest.raises(CaptionerError, match=r"synthetic-informative.*cannot caption real images"):
        ImageCaptioner(folder, device="cpu")
    rc, out, err = run(capsys, "caption", "a.jpg", "--model", str(folder))
    assert rc == 2 and out == ""
    assert "cannot caption real images" in err


def test_broken_model_folders_are_clear_errors(capsys, tmp_path, untrained_dir):
    folder = tmp_path / "m"
    shutil.copytree(untrained_dir, folder)
    (folder / "vocab.json").unlink()
    with pytest.raises(CaptionerError, match=r"lacks vocab\.json"):
        ImageCaptioner(folder)
    with pytest.raises(CaptionerError, match=r"lacks vocab\.json"):
        ImageCaptioner(folder / "model.pt")
    shutil.copy(untrained_dir / "vocab.json", folder / "vocab.json")
    meta = json.loads((folder / "capflow.json").read_text())
    meta["features"]["feature_dim"] = 1024  # the model takes 2048-d inputs
    (folder / "capflow.json").write_text(json.dumps(meta))
    with pytest.raises(CaptionerError, match=r"1024-d region features but the model .* takes 2048-d"):
        ImageCaptioner(folder, device="cpu")
    (folder / "model.pt").write_bytes(b"not a checkpoint")
    rc, _, err = run(capsys, "caption", "a.jpg", "--model", str(folder))
    assert rc == 2 and "model.pt" in err
    rc, _, err = run(capsys, "caption", "a.jpg", "--model", str(tmp_path / "nothing"))
    assert rc == 2 and "not found" in err


# ---------------------------------------------------------------------- (e) --json
@pytest.mark.slow
def test_json_output_is_the_list_of_file_and_caption(capsys, model_dir, subset_captions):
    files = list(subset_captions)
    rc, out, err = run(capsys, "caption", *files, "--model", str(model_dir / "model.pt"), "--json", "--device",
                       "cpu", "--batch-size", "1")
    assert rc == 0, err
    got = json.loads(out)
    assert isinstance(got, list) and len(got) == len(files)
    assert all(isinstance(e, dict) and set(e) == {"file", "caption"} for e in got)
    assert [e["file"] for e in got] == files
    assert {e["file"]: e["caption"] for e in got} == subset_captions  # batch size 1 = batch size 16
    assert all(subset_captions.values()) and "empty" not in err  # the fitted model writes words


def test_empty_captions_are_counted_on_stderr(capsys, tmp_path, untrained_dir, subset_captions):
    """A model that ends every caption at once: empty strings in the output, a count on stderr, exit 0."""
    folder = tmp_path / "eos-first"
    shutil.copytree(untrained_dir, folder)
    st = checkpoint.load(folder / "model.pt")
    st["state_dict"]["generator.bias"][int(st["arch"]["eos"])] += 1e4
    torch.save(st, folder / "model.pt")
    files = list(subset_captions)[:2]
    rc, out, err = run(capsys, "caption", *files, "--model", str(folder), "--json", "--device", "cpu")
    assert rc == 0, err
    assert [e["caption"] for e in json.loads(out)] == ["", ""]
    assert "2 of 2 captions are empty" in err


@pytest.mark.slow
def test_draw_writes_each_image_with_its_regions_and_caption(capsys, tmp_path, model_dir, subset_captions):
    """`capflow caption IMAGE --draw OUT`: the image, its selected regions drawn over it (in place: pixels inside
    the image change, its size is kept) and the caption below it; several images: one file each in OUT/."""
    from PIL import Image

    files = list(subset_captions)
    one = tmp_path / "one.png"
    rc, out, err = run(capsys, "caption", files[0], "--model", str(model_dir / "model.pt"), "--device", "cpu",
                       "--draw", str(one))
    assert rc == 0, err
    assert out.strip() == f"{files[0]}\t{subset_captions[files[0]]}"  # the output itself is unchanged
    with Image.open(files[0]) as src, Image.open(one) as drawn:
        w, h = src.size
        assert drawn.size == (w, h + 28)
        a = np.asarray(src.convert("RGB"), dtype=np.int16)
        b = np.asarray(drawn.convert("RGB"), dtype=np.int16)
        assert (np.abs(a - b[:h]).sum(axis=2) > 60).mean() > 0.002  # boxes drawn over the picture
        assert (b[h:] < 128).any()  # the caption's text under it
    folder = tmp_path / "drawn"
    rc, _, err = run(capsys, "caption", *files[:2], "--model", str(model_dir / "model.pt"), "--device", "cpu",
                     "--draw", str(folder))
    assert rc == 0, err
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{Path(f).stem}-captioned.png" for f in files[:2])
