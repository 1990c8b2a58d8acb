"""CiderD (captioning.metrics.cider) against pycocoevalcap 1.2's Cider, per image, to 1e-9."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from pycocoevalcap.cider.cider import Cider

from captioning.metrics.cider import CiderD, DocumentFrequency

TOL = 1e-9


def pyco(gts: dict, res: dict, sigma: float = 6.0) -> tuple[float, dict]:
    mean, scores = Cider(sigma=sigma).compute_score(gts, {k: [res[k]] for k in gts})
    return float(mean), {k: float(s) for k, s in zip(gts.keys(), scores, strict=True)}


def assert_same(per: dict, expect: dict) -> None:
    assert per.keys() == expect.keys()
    worst = max(abs(per[k] - expect[k]) for k in expect)
    assert worst <= TOL, worst


HAND_GTS = {
    1: ["a man riding a horse on a beach", "a person rides a brown horse", "man on a horse near the ocean"],
    2: ["two dogs play in the snow", "dogs in snow", "a dog and another dog playing in the white snow"],
    3: ["a cat", "a cat sitting on a mat on a mat", "the cat is on the mat"],
    4: ["<eos> a b c", "a a a a a a a a a a a a a a a a a"],
    5: ["a plate of food with broccoli and rice"],  # a single reference
    6: ["a red bus parked on the street", "a red bus parked on the street", "a bus"],  # duplicate references
    7: ["kitchen", "a small kitchen with a stove and an oven and a sink and a fridge and a table"],
    8: ["", "a dog"],  # an empty reference
}
HAND_RES = {
    1: "a a a a a",  # repeated words
    2: "",  # empty candidate
    3: "zebra unicorn zebra unicorn zebra a cat",  # unseen words, repeated unseen n-grams
    4: "a b c <eos> a b c d e f g h i j k l m n o p q",  # much longer than the references
    5: "food",  # one word: no bigram, length 0
    6: "a red bus parked on the street",  # equal to two references
    7: "kitchen <eos>",  # short, with an eos-like token no reference has
    8: "a dog",
}


def test_hand_made_cases_match_pycocoevalcap():
    mean, per = CiderD(HAND_GTS).score(HAND_RES)
    expect_mean, expect = pyco(HAND_GTS, HAND_RES)
    assert_same(per, expect)
    assert abs(mean - expect_mean) <= TOL
    assert per[2] == 0.0
    assert per[6] > 1.0


def test_sigma_and_single_image():
    res = {k: v for k, v in HAND_RES.items() if k != 2}
    gts = {k: HAND_GTS[k] for k in res}
    _, per = CiderD(gts, sigma=3.0).score(res)
    assert_same(per, pyco(gts, res, sigma=3.0)[1])
    # one image: log(N) = 0, every weight is 0 and so is every score (no nan)
    _, per = CiderD({1: HAND_GTS[1]}).score({1: HAND_RES[1]})
    assert per == pyco({1: HAND_GTS[1]}, {1: HAND_RES[1]})[1] == {1: 0.0}


def test_batch_without_any_matching_ngram_scores_zero():
    """Known words, but no n-gram of any candidate in its own image's references (an early SCST batch): zeros,
    not a dtype error from an empty match table."""
    scorer = CiderD(HAND_GTS)
    got = scorer.score_batch(["dogs snow", "horse beach ocean"], [1, 2])
    np.testing.assert_array_equal(got, [0.0, 0.0])
    assert got.dtype == np.float64
    _, expect = pyco({1: HAND_GTS[1], 2: HAND_GTS[2]}, {1: "dogs snow", 2: "horse beach ocean"})
    assert expect == {1: 0.0, 2: 0.0}


@pytest.mark.parametrize("seed", range(6))
def test_random_corpora_match_pycocoevalcap(seed):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(int(rng.integers(4, 30)))]

    def caption(lo, hi):
        return " ".join(rng.choice(words, int(rng.integers(lo, hi))))

    gts = {i: [caption(1, 14) for _ in range(int(rng.integers(1, 7)))] for i in range(int(rng.integers(2, 40)))}
    res = {i: caption(0, 20) + (" novel" * int(rng.integers(0, 3))) for i in gts}
    mean, per = CiderD(gts).score(res)
    expect_mean, expect = pyco(gts, res)
    assert_same(per, expect)
    assert abs(mean - expect_mean) <= TOL


# --- the real Karpathy-test material -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(external):
    """300 images: PTB-tokenised references and ACORT captions (one Java run for the module)."""
    from captioning.bench.cider import ptb_tokenize_pairs as tokenize

    refs = json.loads((external / "coco_eval" / "karpathy_test_refs.json").read_text())
    results = json.loads((external / "model_outputs" / "acort_karpathy_test.json").read_text())
    ids = [r["image_id"] for r in results][:300]
    wanted = set(ids)
    gts = defaultdict(list)
    for a in refs["annotations"]:
        if a["image_id"] in wanted:
            gts[a["image_id"]].append(a["caption"])
    res = {r["image_id"]: r["caption"] for r in results if r["image_id"] in wanted}
    return tokenize({i: gts[i] for i in ids}, {i: res[i] for i in ids})


def test_real_images_match_pycocoevalcap(real):
    gts, res = real
    assert len(gts) == 300
    mean, per = CiderD(gts).score(res)
    expect_mean, expect = pyco(gts, res)
    assert_same(per, expect)
    assert abs(mean - expect_mean) <= TOL
    assert 0.9 < mean < 1.8  # ACORT's CIDEr is 1.311 on all 5000 images


def test_token_ids_equal_strings(real):
    gts, res = real
    vocab: dict[str, int] = {}
    for caps in gts.values():
        for c in caps:
            for w in c.split():
                vocab.setdefault(w, len(vocab) + 1)
    eos = 0

    def ids(caption: str) -> list[int]:  # words no reference has get ids beyond the vocabulary
        return [vocab.setdefault(w, len(vocab) + 1) for w in caption.split()]

    refs_int = {i: [np.array(ids(c), np.int64) for c in caps] for i, caps in gts.items()}
    by_str, by_int = CiderD(gts), CiderD.from_token_ids(refs_int)
    keys = list(res)
    cands_str = [res[k] + " <eos>" for k in keys]
    cands_list = [[*ids(res[k]), eos] for k in keys]
    vocab.setdefault("<eos>", eos)
    expect = by_str.score_batch(cands_str, keys)
    for cands in (cands_list, [np.array(c, np.int32) for c in cands_list], [tuple(c) for c in cands_list]):
        np.testing.assert_allclose(by_int.score_batch(cands, keys), expect, rtol=0, atol=1e-12)
    assert by_int.table_size == by_str.table_size
    # and int references from plain lists agree with the array ones
    refs_list = {i: [r.tolist() for r in caps] for i, caps in refs_int.items()}
    np.testing.assert_allclose(CiderD.from_token_ids(refs_list).score_batch(cands_list, keys), expect, atol=1e-12)


def test_score_batch_equals_score(real):
    gts, res = real
    scorer = CiderD(gts)
    keys = list(res)[:50]
    rng = np.random.default_rng(0)
    cands, rids = [], []
    for k in keys:  # 50 images x 5 samples, as in SCST
        words = res[k].split()
        for s in range(5):
            cands.append(" ".join(rng.permutation(words)) if s else res[k])
            rids.append(k)
    order = rng.permutation(len(cands))  # batches need not be grouped by image
    got = scorer.score_batch([cands[i] for i in order], [rids[i] for i in order])
    single = np.array([scorer.score({rids[i]: cands[i]})[1][rids[i]] for i in order])
    np.testing.assert_allclose(got, single, rtol=0, atol=1e-12)
    assert scorer([cands[0]], [rids[0]])[0] == pytest.approx(scorer.score({rids[0]: cands[0]})[0], abs=1e-12)


def test_unseen_ngrams_do_not_grow_the_table(real):
    gts, res = real
    df = DocumentFrequency.from_references(gts)
    scorer = CiderD(gts, df=df)
    assert scorer._index is df._index  # same references: the df's table is shared, not copied

    def sizes():
        index = scorer._index
        return (scorer.table_size, len(df), df.vocabulary_size, len(index.vocab), tuple(index.sizes),
                tuple(len(k) for k in index.keys), len(scorer._idf))

    before = sizes()
    keys = list(res)[:20]
    novel = [f"{res[k]} zzunseen qqnever {res[k]} zzunseen <eos>" for k in keys]
    scores = scorer.score_batch(novel, keys)
    assert np.isfinite(scores).all()
    assert df["zzunseen"] == 0.0 and df[("a", "zzunseen")] == 0.0 and df["qqnever zzunseen"] == 0.0
    scorer.score_batch([[10**9, -5, 10**9]], [keys[0]])  # unseen integer tokens too
    assert sizes() == before
    # and the look-ups that do hit report the right document frequencies
    word = res[keys[0]].split()[0]
    assert df[word] == sum(word in " ".join(c).split() for c in gts.values())
    assert df.n_docs == len(gts)


def _slow_cider(cand: str, refs: list[str], df: Counter, n_docs: int, n: int = 4, sigma: float = 6.0) -> float:
    """A plain restatement of the definition, for the cases pycocoevalcap cannot take (df from elsewhere)."""

    def vec(caption: str):
        words = caption.split()
        tf = Counter(tuple(words[i:i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1))
        v = [{} for _ in range(n)]
        for g, c in tf.items():
            v[len(g) - 1][g] = c * (math.log(n_docs) - math.log(max(1.0, df.get(g, 0.0))))
        norms = [math.sqrt(sum(x * x for x in d.values())) for d in v]
        return v, norms, max(len(words) - 1, 0)

    vh, nh, lh = vec(cand)
    total = 0.0
    for ref in refs:
        vr, nr, lr = vec(ref)
        for k in range(n):
            s = sum(min(x, vr[k].get(g, 0.0)) * vr[k].get(g, 0.0) for g, x in vh[k].items())
            if nh[k] and nr[k]:
                s /= nh[k] * nr[k]
            total += s * math.exp(-((lh - lr) ** 2) / (2 * sigma**2))
    return total / n / len(refs) * 10.0


def test_precomputed_df_from_another_corpus(real):
    """SCST set-up: df from the 'training' references, scoring against references it partly lacks."""
    gts, res = real
    keys = list(gts)
    train = {k: gts[k] for k in keys[:200]}
    df = DocumentFrequency.from_references(train)
    n_before = len(df)
    val = {k: gts[k] for k in keys[150:]}  # overlaps the training corpus in 50 images; new n-grams in the rest
    val[-1] = ["a completely novel xylophone caption", "xylophone"]
    scorer = CiderD(val, df=df)
    assert len(df) == n_before  # the df's own table was copied, not extended
    assert scorer.table_size > n_before
    counts = Counter()
    for caps in train.values():
        counts.update({tuple(w[i:i + k]) for c in caps for w in [c.split()] for k in range(1, 5)
                       for i in range(len(w) - k + 1)})
    cands = {k: res.get(k, "a xylophone on a table") for k in val}
    _, per = scorer.score(cands)
    for k, c in cands.items():
        assert abs(per[k] - _slow_cider(c, val[k], counts, len(train))) <= TOL
    # df from the same references as the candidates' own: identical to building without df
    same = CiderD(train, df=df)
    assert same._index is df._index
    sub = {k: res[k] for k in keys[:40]}
    assert same.score(sub)[1] == pytest.approx(CiderD(train).score(sub)[1], abs=1e-12)


def test_errors():
    scorer = CiderD(HAND_GTS)
    with pytest.raises(KeyError, match="no references"):
        scorer.score_batch(["a cat"], [999])
    with pytest.raises(ValueError):
        scorer.score_batch(["a cat"], [1, 2])
    with pytest.raises(ValueError):
        CiderD({1: []})
    with pytest.raises(ValueError):
        CiderD()
    assert scorer.score_batch([], []).shape == (0,)


def test_bench_small(external):
    from captioning.bench.cider import run

    out = run(external / "coco_eval" / "karpathy_test_refs.json",
              external / "model_outputs" / "acort_karpathy_test.json",
              batch_images=10, samples=5, repeats=1, images=60)
    json.dumps(out)
    assert out["bench"] == "cider"
    assert {"machine", "rows", "ratios", "max_abs_diff"} <= out.keys()
    assert {"python", "cpus"} <= out["machine"].keys()
    assert out["max_abs_diff"] <= TOL
    assert out["max_abs_diff_batch_anchor"] <= TOL
    assert any(r.get("name") == "max_abs_diff" and r["value"] <= TOL for r in out["rows"])
    assert out["ratios"]["speedup_vs_pycocoevalcap"] > 0
    assert out["config"]["images"] == 60
