"""``capflow import-checkpoint`` (flows.cli.import_checkpoint): a released checkpoint -> a model folder that
loads as the captioner loads one and gives the released log-probs; errors are CLIErrors (exit status 2)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from captioning.data.text import Vocabulary
from captioning.inference import model_files, read_meta
from captioning.models.encoder_decoder import ArchConfig
from captioning.models.registry import build
from captioning.training import checkpoint
from flows.cli import CLIError
from flows.cli.common import config_args as _config_args
from flows.cli.import_checkpoint import add_import_command
from tests.models.test_importers import D_IN, WORDS, H, _capflow_ids, released_logprobs, released_state_dict


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="capflow")
    sub = p.add_subparsers(dest="command", required=True)
    add_import_command(sub, _config_args)
    return p


def _files(tmp_path, zodiac=False):
    sd = released_state_dict(zodiac)
    torch.save(sd, tmp_path / "model-best.pth")
    (tmp_path / "cocotalk.json").write_text(json.dumps({"ix_to_word": {str(i + 1): w for i, w in enumerate(WORDS)}}))
    return sd, tmp_path / "model-best.pth", tmp_path / "cocotalk.json"


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize("family,k", [("aic", 1), ("satic", 2), ("zodiac", 1)])
def test_import_writes_a_model_folder_giving_the_released_log_probs(family, k, tmp_path, capsys):
    zodiac = family == "zodiac"
    sd, ckpt, vocab = _files(tmp_path, zodiac)
    out = tmp_path / "imported"
    argv = ["import-checkpoint", "--from", family, str(ckpt), "--vocab", str(vocab), "--out", str(out),
            "--heads", str(H), "--set", f"features.feature_dim={D_IN}", "--set", "dataset.max_words=12", "--json"]
    if family == "satic":
        argv += ["--group-size", str(k)]
    if family == "zodiac":
        argv += ["--gate", "sigmoid"]
    assert _run(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model_dir"] == str(out) and summary["family"] == family and summary["words"] == 4

    # load the folder the way capflow caption does (inference.Captioner._load_model), without the detector
    files = model_files(out)
    meta, features = read_meta(files.meta)
    assert features.feature_dim == D_IN and meta["max_words"] == 12 and meta["student"] == family
    v = Vocabulary.load(files.vocab)
    assert v.words == ["a", "dog", "runs", "cat"]
    st = checkpoint.load(files.model)
    assert st["vocab_digest"] == v.digest()
    arch = ArchConfig.from_dict(st["arch"])
    assert arch.vocab_size == len(v) and arch.layer_norm == "annotated" and arch.group_size == k
    model = build(arch)
    model.load_state_dict(st["state_dict"])
    model.eval()

    torch.manual_seed(3)
    feats = torch.randn(2, 3, D_IN)
    seq = torch.tensor([[0] * k + [1, 2, 3, 5], [0] * k + [5, 4, 1, 2]])
    ref = released_logprobs(sd, feats, seq, zodiac, k)
    with torch.no_grad():
        got = model(feats, torch.zeros(2, 3, 4), torch.ones(2, 3, dtype=torch.bool), _capflow_ids(seq, 0))
    cols = torch.tensor([2, *_capflow_ids(torch.arange(1, len(WORDS) + 1), 0).tolist()])
    torch.testing.assert_close(got[..., cols], ref, atol=1e-5, rtol=1e-5)


def test_import_errors_are_cli_errors(tmp_path):
    sd, ckpt, vocab = _files(tmp_path)
    out = tmp_path / "m"
    base = ["import-checkpoint", "--from", "aic", "--vocab", str(vocab), "--out", str(out), "--heads", str(H)]
    dim = ["--set", f"features.feature_dim={D_IN}"]
    with pytest.raises(CLIError, match=r"missing\.pth does not exist"):
        _run([*base, str(tmp_path / "missing.pth"), *dim])
    with pytest.raises(CLIError, match=r"features\.feature_dim=2048.*--set features\.feature_dim=12"):
        _run([*base, str(ckpt)])  # the default extractor's 2048-d features do not fit a 12-d checkpoint
    assert not out.exists()
    bad = dict(sd, **{"model.extra.weight": torch.zeros(2)})
    torch.save(bad, tmp_path / "bad.pth")
    with pytest.raises(CLIError, match=r"unknown keys .*model\.extra\.weight"):
        _run([*base, str(tmp_path / "bad.pth"), *dim])
    torch.save({"opt": argparse.Namespace(lr=1.0), "model": sd}, tmp_path / "pickled.pth")
    with pytest.raises(CLIError, match="weights_only"):
        _run([*base, str(tmp_path / "pickled.pth"), *dim])
    with pytest.raises(CLIError, match="group size"):
        _run(["import-checkpoint", "--from", "satic", str(ckpt), "--vocab", str(vocab), "--out", str(out),
              "--heads", str(H), *dim])
    assert _run([*base, str(ckpt), *dim]) == 0
    with pytest.raises(CLIError, match="already holds a model"):
        _run([*base, str(ckpt), *dim])
    assert _run([*base, str(ckpt), *dim, "--force"]) == 0


def test_cli_main_reports_cli_errors_with_exit_status_2(tmp_path, monkeypatch, capsys):
    """Through capflow's main (registered here when the parser does not register the command yet)."""
    import flows.cli as cli

    original = cli.build_parser

    def with_import():
        p = original()
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        if "import-checkpoint" not in sub.choices:
            add_import_command(sub, _config_args)
        return p

    monkeypatch.setattr(cli, "build_parser", with_import)
    _, ckpt, _ = _files(tmp_path)
    rc = cli.main(["import-checkpoint", "--from", "aic", str(ckpt), "--vocab", str(tmp_path / "nope.json"),
                   "--out", str(tmp_path / "m")])
    assert rc == 2
    assert "capflow import-checkpoint: error: --vocab" in capsys.readouterr().err


def test_import_lw_writes_a_model_folder_giving_the_released_log_probs(tmp_path, capsys):
    from tests.models import test_import_lw as lw

    sd = lw.released_state_dict(2, True)
    torch.save(sd, tmp_path / "lw_state_dict.pth")
    (tmp_path / "vocab.json").write_text(json.dumps(lw.ITOS))  # the released vocabulary's itos
    out = tmp_path / "imported"
    assert _run(["import-checkpoint", "--from", "lw", str(tmp_path / "lw_state_dict.pth"), "--vocab",
                 str(tmp_path / "vocab.json"), "--out", str(out), "--heads", str(lw.H), "--set",
                 f"features.feature_dim={lw.D_IN}", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["family"] == "lw" and summary["words"] == len(lw.ITOS) - 4
    files = model_files(out)
    v = Vocabulary.load(files.vocab)
    st = checkpoint.load(files.model)
    arch = ArchConfig.from_dict(st["arch"])
    assert arch.skeleton == "m2" and arch.vocab_size == len(v) and st["vocab_digest"] == v.digest()
    model = build(arch)
    model.load_state_dict(st["state_dict"])  # the released position table travels as the "pe" buffer
    model.eval()
    feats, boxes, mask = lw._inputs()
    seq = torch.tensor([[2, 4, 5, 6, 7], [2, 9, 8, 3, 5], [2, 0, 7, 6, 4]])
    with torch.no_grad():
        ref = lw.released_logprobs(sd, feats, seq)
        got = model(feats, boxes, mask, lw.TO_CAPFLOW[seq])
    torch.testing.assert_close(got, ref[..., lw.PERM], atol=1e-5, rtol=0)


def test_import_is_an_mlflow_model_with_a_tracking_uri(tmp_path, capsys, monkeypatch):
    """With MLFLOW_TRACKING_URI set the imported folder is also logged as an MLflow Model (a LoggedModel of a
    FINISHED `import-checkpoint` run, the checkpoint file its input by sha256, pyfunc from code); without one,
    nothing is tracked."""
    from mlflow import MlflowClient

    from captioning.util import sha256_file

    _, ckpt, vocab = _files(tmp_path)
    base = ["import-checkpoint", "--from", "aic", str(ckpt), "--vocab", str(vocab), "--heads", str(H),
            "--set", f"features.feature_dim={D_IN}", "--set", f"run.workdir={tmp_path / 'work'}", "--json"]
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert _run([*base, "--out", str(tmp_path / "plain")]) == 0
    assert "model_id" not in json.loads(capsys.readouterr().out) and not list(tmp_path.rglob("*.db"))
    uri = f"sqlite:///{tmp_path / 'tracking' / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert _run([*base, "--out", str(tmp_path / "tracked")]) == 0
    summary = json.loads(capsys.readouterr().out)
    c = MlflowClient(uri)
    model = c.get_logged_model(summary["model_id"])
    run = c.get_run(model.source_run_id)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.runName"] == "import-checkpoint"
    assert model.tags["capflow.preset"] == "aic@released" and model.tags["capflow.student"] == "aic"
    (inp,) = run.inputs.dataset_inputs
    assert inp.dataset.name == "checkpoint" and inp.dataset.digest == sha256_file(ckpt)[:36]
    files = {a.path for a in c.list_logged_model_artifacts(model.model_id)}
    assert {"MLmodel", "pyfunc_captioner.py"} <= files
