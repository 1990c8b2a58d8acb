"""Feature and label stores on s3:// against a real S3 HTTP endpoint (moto server on 127.0.0.1), credentials and
endpoint only from the environment: detectron2 extraction into an S3 store (resumable), training that reads it
through DataLoader, and a label store round trip."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from flows.stack import Stack
from tests.flows.test_stack import _free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]
CAPFLOW = [sys.executable, "-m", "flows.cli"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    st = Stack(home=tmp_path_factory.mktemp("s3"), bucket="stores")
    st.ports["s3"] = _free_port()
    st.key_id, st.secret = "test-key", "test-secret-for-moto"
    st._start("s3", 60)
    st.s3_client().create_bucket(Bucket=st.bucket)
    yield st
    st.down(snapshot=False)


@pytest.fixture
def s3_env(s3, monkeypatch):
    for k, v in s3.s3_env().items():
        monkeypatch.setenv(k, v)
    return {**os.environ}


def test_label_store_round_trip_on_s3(s3, s3_env):
    from captioning.data.stores import LabelStore

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=(30, 12)).astype(np.int32)
    length = rng.integers(1, 12, size=30).astype(np.int16)
    rows, ids, split = np.arange(30) // 3, 1000 + np.arange(30) // 3, np.zeros(30, np.int8)
    LabelStore.create("s3://stores/labels/l.zarr", tokens, length, rows, ids, split)
    assert any(k.startswith("labels/l.zarr/tokens/") for k in s3.objects("labels/"))
    got = LabelStore.open("s3://stores/labels/l.zarr").read()
    np.testing.assert_array_equal(got.tokens, tokens)
    np.testing.assert_array_equal(got.length, length)
    np.testing.assert_array_equal(got.image_id, ids)


def test_extract_into_s3_resume_and_train_from_it(s3, s3_env, tmp_path):
    env = {**s3_env, "PREFECT_HOME": str(tmp_path / "prefect")}
    base = ["--preset", "tiny", "--set", f"run.workdir={tmp_path / 'work'}", "--set", "features.store=s3://stores/feat"]

    def capflow(*args):
        p = subprocess.run([*CAPFLOW, *args], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-4000:]
        return json.loads(p.stdout)

    first = capflow("extract", *base, "--json")
    assert first["store"].startswith("s3://stores/feat/") and first["ok"] >= 38 and first["extracted"] == first["ok"]
    key_prefix = first["store"].removeprefix("s3://stores/")
    keys = s3.objects(key_prefix)
    assert any("/features/c/" in k for k in keys) and any(k.endswith("zarr.json") for k in keys)
    again = capflow("extract", *base, "--resume", "--json")
    assert again["extracted"] == 0 and again["skipped_chunks"] >= 5  # nothing redone
    from captioning.data.stores import FeatureStore

    fs = FeatureStore.open(first["store"])
    assert fs.num_rows == first["images"]
    feats, _ = fs.read_features(0, 8)
    assert np.isfinite(feats).all() and np.abs(feats.astype(np.float32)).sum() > 0
    vocab = capflow("vocab", *base, "--features", first["store"], "--json")
    out = tmp_path / "ckpt"
    res = capflow("train", *base, "--model", "lw", "--features", first["store"], "--labels", vocab["labels"],
                  "--vocab", vocab["vocab"], "--out", str(out), "--json")
    assert res["epochs_run"] == 1 and (out / "last.pt").exists()
