import numpy as np
import pytest
import torch

from captioning.bench.loader import make_data
from captioning.data.loader import (
    CaptionDataset,
    MemoryFeatures,
    NpyFeatures,
    ZarrFeatures,
    caption_matrix,
    make_loader,
)
from captioning.data.prepare import import_npy_features
from captioning.data.stores import OK, REJECTED, FeatureStore, Labels, LabelStore
from captioning.data.text import BOS, EOS, PAD, RadixCodec


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    d = make_data(root, images=40, max_boxes=12, dim=32, chunk_rows=4)
    d["root"] = root
    return d


def _epoch(ds, batch_size=6, workers=0):
    out = []
    for b in make_loader(ds, batch_size, workers=workers):
        out.append(b)
    return out


def test_batches_are_padded_with_masks(data):
    ds = CaptionDataset(ZarrFeatures(str(data["root"] / "features.zarr")), labels=data["labels"],
                        captions_per_image=3, shuffle_buffer=8)
    batches = _epoch(ds)
    assert sum(len(b) for b in batches) == 40
    seen = torch.cat([b.rows for b in batches]).sort().values
    assert seen.tolist() == list(range(40))  # every image exactly once per epoch
    nb = data["num_boxes"]
    for b in batches:
        assert b.features.dtype == torch.float16 and b.boxes.dtype == torch.float32
        assert b.features.shape[1] == int(nb[b.rows.numpy()].max())  # padded to the batch's largest image
        assert b.region_mask.sum(1).tolist() == nb[b.rows.numpy()].tolist()
        assert b.tokens.shape[:2] == (len(b), 3)
        assert torch.all(b.tokens[:, :, 0] == BOS)
        assert torch.all((b.tokens == EOS).sum(-1) == 1)
        assert torch.equal(b.token_mask, b.tokens != PAD)
        for i, r in enumerate(b.rows.tolist()):
            n = int(nb[r])
            assert torch.equal(b.features[i, :n], torch.from_numpy(data["features"][r, :n]))
            assert torch.all(b.features[i, n:] == 0) and not b.region_mask[i, n:].any()
            assert torch.equal(b.boxes[i, :n], torch.from_numpy(data["boxes"][r, :n]))
            # captions belong to this image
            lab = data["labels"]
            mine = {tuple(caption_matrix(lab)[k]) for k in np.flatnonzero(lab.image_row == r)}
            for c in b.tokens[i].tolist():
                assert tuple(c) in mine


def test_shuffle_is_deterministic_and_changes_with_epoch(data):
    def order(epoch, seed=0):
        ds = CaptionDataset(ZarrFeatures(str(data["root"] / "features.zarr")), labels=data["labels"],
                            shuffle_buffer=8, seed=seed)
        ds.set_epoch(epoch)
        return torch.cat([b.rows for b in _epoch(ds)]).tolist()

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0, seed=1) != order(0)
    assert order(0) != sorted(order(0))


def test_three_sources_deliver_identical_batches(data):
    srcs = [
        ZarrFeatures(str(data["root"] / "features.zarr")),
        NpyFeatures(data["att"], data["box"], data["ids"], block_rows=4),
        MemoryFeatures(data["features"], data["boxes"], data["num_boxes"], data["ids"], block_rows=4),
    ]
    runs = []
    for s in srcs:
        ds = CaptionDataset(s, labels=data["labels"], shuffle_buffer=8, seed=5)
        runs.append(_epoch(ds))
    # npy/memory read 4-row blocks, zarr reads 8-chunk blocks: same images and captions, maybe other order
    for other in runs[1:]:
        a = {int(r): (b.features[i], b.tokens[i]) for b in runs[0] for i, r in enumerate(b.rows)}
        o = {int(r): (b.features[i], b.tokens[i]) for b in other for i, r in enumerate(b.rows)}
        assert a.keys() == o.keys()
        for r in a:
            n = int(data["num_boxes"][r])
            assert torch.equal(a[r][0][:n], o[r][0][:n])
    # memory and npy use the same blocks and shuffles: identical batches, byte for byte
    for b1, b2 in zip(runs[1], runs[2], strict=True):
        assert torch.equal(b1.rows, b2.rows) and torch.equal(b1.features, b2.features)
        assert torch.equal(b1.tokens, b2.tokens)


def test_workers_open_stores_lazily_and_cover_everything(data):
    src = ZarrFeatures(str(data["root"] / "features.zarr"), block_chunks=1)
    ds = CaptionDataset(src, labels_uri=str(data["root"] / "labels.zarr"), captions_per_image=2)
    rows = torch.cat([b.rows for b in _epoch(ds, workers=2)]).sort().values
    assert rows.tolist() == list(range(40))
    assert src._store is None  # the parent never opened the store: only the workers did


def test_rejected_rows_and_split_filter(tmp_path):
    ids = np.arange(8)
    s = FeatureStore.create(str(tmp_path / "f.zarr"), ids, max_boxes=3, feature_dim=4, chunk_rows=4)
    st = np.array([OK, REJECTED, OK, OK, OK, OK, OK, OK], np.int8)
    s.write_rows(0, features=np.ones((4, 3, 4)), boxes=np.zeros((4, 3, 4)), num_boxes=np.full(4, 2),
                 image_size=np.zeros((4, 2)), status=st[:4])
    s.write_rows(4, features=np.ones((4, 3, 4)), boxes=np.zeros((4, 3, 4)), num_boxes=np.full(4, 3),
                 image_size=np.zeros((4, 2)), status=st[4:])
    tokens = np.tile(np.array([[4, 5, 0]], np.int32), (8, 1))
    split = np.array([0, 0, 0, 1, 0, 2, 0, 0], np.int8)
    lab = Labels(tokens, np.full(8, 2), ids, ids, split, np.zeros(8, np.int8), {0: "gt"})
    train = CaptionDataset(ZarrFeatures(s.uri), labels=lab, split="train", captions_per_image=1)
    assert train.rows().tolist() == [0, 2, 4, 6, 7]  # row 1 rejected, 3 val, 5 test
    val = CaptionDataset(ZarrFeatures(s.uri), labels=lab, split="val", captions_per_image=1, shuffle=False)
    assert [int(b.rows[0]) for b in make_loader(val, 1)] == [3]


def test_mismatched_label_store_is_an_error(data, tmp_path):
    lab = data["labels"]
    wrong = Labels(lab.tokens, lab.length, lab.image_row, lab.image_id + 1, lab.split, lab.source, lab.sources)
    ds = CaptionDataset(ZarrFeatures(str(data["root"] / "features.zarr")), labels=wrong)
    with pytest.raises(ValueError, match="disagree"):
        ds.rows()


def test_radix_targets():
    lab = Labels(np.array([[3, 4, 0]], np.int32), np.array([2]), np.array([0]), np.array([1]),
                 np.zeros(1, np.int8), np.zeros(1, np.int8), {0: "gt"})
    codec = RadixCodec(base=2, num_words=4)  # 2 digits
    m = caption_matrix(lab, codec)
    assert m.tolist() == [[codec.bos, 1, 1, 1, 2, codec.eos, 0, 0]]
    assert caption_matrix(lab).tolist() == [[BOS, 3, 4, EOS, 0]]


def test_npy_loader_and_import_on_real_bottom_up_features(external, tmp_path):
    bu = external / "bu_features"
    ids = sorted(int(p.stem) for p in (bu / "cocobu_att").glob("*.npy"))
    assert len(ids) == 5
    npy = NpyFeatures(bu / "cocobu_att", bu / "cocobu_box_relative", ids, dtype="float32")
    got = npy.read(np.arange(5))
    store = import_npy_features(bu / "cocobu_att", bu / "cocobu_box_relative", ids, str(tmp_path / "f.zarr"),
                                dtype="float32", chunk_rows=2)
    zsrc = ZarrFeatures(store.uri)
    zgot = zsrc.read(np.arange(5))
    for k, i in enumerate(ids):
        att = np.load(bu / "cocobu_att" / f"{i}.npy")
        box = np.load(bu / "cocobu_box_relative" / f"{i}.npy")
        assert 10 <= att.shape[0] <= 100 and att.shape[1] == 2048
        assert np.array_equal(got.features[k], att) and np.array_equal(zgot.features[k], att)  # bit-exact
        assert np.array_equal(zgot.boxes[k], box.astype(np.float32))  # the schema stores float32 boxes
        assert np.all((box >= 0) & (box <= 1))
    # a training batch over the real features (captions from a tiny hand-made label store)
    m = len(ids)
    LabelStore.create(str(tmp_path / "l.zarr"), np.full((m, 3), 4, np.int32), np.full(m, 3), np.arange(m),
                      np.array(ids), np.zeros(m, np.int8))
    ds = CaptionDataset(zsrc, labels_uri=str(tmp_path / "l.zarr"), captions_per_image=2)
    (b,) = list(make_loader(ds, 5))
    assert b.features.dtype == torch.float32 and b.features.shape[2] == 2048
    assert sorted(b.image_ids.tolist()) == ids


def test_image_batches_stop_at_a_stop_request(data):
    """Evaluation, SeqKD and latency runs decode through image_batches: a stop request (SIGTERM) ends them before
    the next batch, as training stops after its step."""
    from captioning import stopping
    from captioning.data.loader import image_batches

    src = MemoryFeatures(data["features"], data["boxes"], data["num_boxes"], data["ids"])
    rows = np.arange(len(data["ids"]))
    assert sum(len(b.image_ids) for b in image_batches(src, rows, 8)) == len(rows)
    it = image_batches(src, rows, 8)
    next(it)
    stopping.request()
    try:
        with pytest.raises(stopping.Stopped, match="decoding"):
            next(it)
    finally:
        stopping.reset()
