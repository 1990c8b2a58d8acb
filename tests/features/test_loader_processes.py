"""Decoding in loader processes (``decode_processes``) and channels-last convolutions, on the CPU: the same
regions as in-process decoding, rejected images with their reasons, a dying loader process, an unpicklable
loader."""

from __future__ import annotations

import functools
import multiprocessing
import os

import numpy as np
import pytest

from captioning.features.extractor import RegionExtractor
from captioning.features.images import ImageRejected, load_rgb
from tests.features.test_extractor import REAL, _cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _exit_in_child(path: str) -> np.ndarray:
    """A loader that kills the loader process it runs in (and loads normally in the main process)."""
    if multiprocessing.current_process().name != "MainProcess":
        os._exit(3)
    return load_rgb(path)


def _items(paths):
    return [(i, functools.partial(load_rgb, str(p))) for i, p in enumerate(paths)]


def _collect(model: RegionExtractor, items, **kw) -> dict:
    return dict(model.stream(items, **kw))


def _equal(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, Exception):
            assert type(x) is type(y) and str(x) == str(y), k
            continue
        assert np.array_equal(x.features, y.features) and np.array_equal(x.boxes, y.boxes), k
        assert np.array_equal(x.scores, y.scores) and x.image_size == y.image_size, k


@pytest.fixture(scope="module")
def paths(external, tmp_path_factory):
    bad = tmp_path_factory.mktemp("bad")
    (bad / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return [external / "images" / n for n in REAL] + [bad / "corrupt.jpg", bad / "missing.jpg"]


@pytest.fixture(scope="module")
def inline(paths):
    return _collect(RegionExtractor(_cfg()), _items(paths), threads=0)


def test_loader_processes_give_the_same_regions_and_rejections(paths, inline):
    model = RegionExtractor(_cfg(decode_processes=2, decode_threads=2))
    assert model.decode_processes == 2 and model.describe()["decode_processes"] == 2
    got = _collect(model, _items(paths))
    _equal(got, inline)
    assert isinstance(got[4], ImageRejected) and "unreadable image header" in str(got[4])
    assert isinstance(got[5], ImageRejected) and "missing file" in str(got[5])
    assert model._pool is not None  # the images really went through the processes
    _equal(_collect(model, _items(paths)), inline)  # the pool is reused by the next stream


def test_a_dying_loader_process_falls_back_to_threads(paths, inline, caplog):
    model = RegionExtractor(_cfg(decode_processes=2, decode_threads=2))
    items = [(i, functools.partial(_exit_in_child, str(p))) for i, p in enumerate(paths[:4])]
    got = _collect(model, items)
    _equal(got, {k: v for k, v in inline.items() if k < 4})
    assert model.decode_processes == 0 and model._pool is None
    assert any("loader processes failed" in w for w in model.warnings)


def test_unpicklable_loaders_use_threads(paths, inline):
    model = RegionExtractor(_cfg(decode_processes=2, decode_threads=2))
    items = [(i, (lambda p=p: load_rgb(p))) for i, p in enumerate(paths)]
    _equal(_collect(model, items), inline)
    assert model._pool is None


def test_inline_streams_start_no_processes(paths, inline):
    model = RegionExtractor(_cfg(decode_processes=2))
    _equal(_collect(model, _items(paths), threads=0), inline)
    assert model._pool is None


def test_defaults():
    model = RegionExtractor(_cfg())
    assert model.decode_processes == 0 and not model.channels_last  # CPU: no processes, contiguous layout


def test_channels_last_on_cpu_is_float_rounding_only(paths, inline):
    model = RegionExtractor(_cfg(channels_last=True))
    assert model.describe()["channels_last"] is True
    got = _collect(model, _items(paths[:4]), threads=0)
    for k in range(4):
        a, b = got[k], inline[k]
        assert a.image_size == b.image_size
        # the same boxes where the selection is not a near-tie; features within float rounding on shared boxes
        common = {tuple(x) for x in a.boxes.round(4)} & {tuple(x) for x in b.boxes.round(4)}
        assert len(common) >= 0.9 * len(b.boxes)
        ia = [i for i, x in enumerate(a.boxes.round(4)) if tuple(x) in common]
        ib = [i for i, x in enumerate(b.boxes.round(4)) if tuple(x) in common]
        fa = a.features[ia][np.lexsort(a.boxes[ia].T)]
        fb = b.features[ib][np.lexsort(b.boxes[ib].T)]
        np.testing.assert_allclose(fa, fb, rtol=1e-3, atol=1e-3)
