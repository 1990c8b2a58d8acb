"""The decoding constraint (no word right after itself), written once in captioning.decoding.steps."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from captioning.decoding import beam_search, greedy, sample
from captioning.decoding.steps import repeat_ban
from tests.decoding.test_decoding import CODEC, _biased, check_well_formed, model_and_inputs, teacher_logprob


def _repeating(name: str, first: int, second: int):
    """A model that (nearly) always emits ``first``, ``second`` next; never EOS."""
    model, _, memory = model_and_inputs(name)
    m = _biased(_biased(_biased(model, first, 1e4), second, 5e3), model.eos, -1e4)
    return model, m, memory


def _words(row: list[int], d: int) -> list[tuple[int, ...]]:
    row = [t for t in row if t != 0]
    return [tuple(row[i : i + d]) for i in range(0, len(row) - len(row) % d, d)]


def test_repeat_ban_positions():
    hist = torch.tensor([[5, 5], [5, 6]])
    assert repeat_ban(hist, 1).tolist() == [5, 6]  # words of one token: the last token is banned
    assert repeat_ban(hist[:, :0], 1) is None  # nothing before the first word
    # radix words of 2 digits: the next digit ends word 1; banned only where its first digit repeats word 0's
    digits = torch.tensor([[3, 4, 3], [3, 4, 2], [3, 3, 3]])
    assert repeat_ban(digits, 2).tolist() == [4, -1, 3]
    assert repeat_ban(digits[:, :2], 2) is None  # the next digit starts a word
    assert repeat_ban(digits[:, :1], 2) is None  # ends word 0: no previous word


@pytest.mark.parametrize("name", ["aic", "satic-k4", "satic-k2"])
def test_no_word_twice_in_a_row(name):
    model, rep, memory = _repeating(name, 7, 9)
    plain = greedy(rep, memory, max_len=9)
    assert torch.all(plain.tokens == 7)  # without the constraint: "7 7 7 ..."
    outs = [greedy(rep, memory, max_len=9, decoding_constraint=True),
            greedy(rep, memory, max_len=9, decoding_constraint=True, use_cache=False),
            greedy(rep, memory, max_len=9, decoding_constraint=True, static_cache=True),
            beam_search(rep, memory, beam=3, max_len=9, decoding_constraint=True),
            sample(rep, memory, n=2, max_len=9, decoding_constraint=True, generator=torch.Generator().manual_seed(0))]
    for d in outs:
        check_well_formed(model, d, 9)
        assert d.tokens.reshape(-1, 9).tolist() == [[7, 9, 7, 9, 7, 9, 7, 9, 7]] * d.tokens.reshape(-1, 9).shape[0]
    # the reported log-probs stay the model's own (banned tokens only leave the choice)
    bm = beam_search(rep, memory, beam=3, max_len=9, n_best=3, decoding_constraint=True)
    torch.testing.assert_close(bm.logprobs.reshape(-1), teacher_logprob(rep, memory, bm.flat()), atol=1e-2, rtol=1e-5)
    for row in bm.flat().tolist():
        assert all(a != b for a, b in pairwise(row) if b != 0)


def test_radix_words_are_not_repeated():
    """ACORT-style radix model, 2 digits per word: the constraint bans the digit that completes the previous word."""
    assert CODEC.digits == 2
    _, rep, memory = _repeating("acort-small", 3, 4)
    plain = greedy(rep, memory, max_len=8)
    assert _words(plain.flat()[0].tolist(), 2) == [(3, 3)] * 4
    for row in greedy(rep, memory, max_len=8, decoding_constraint=True, word_tokens=2).flat().tolist():
        assert _words(row, 2) == [(3, 3), (3, 4), (3, 3), (3, 4)]
    for row in beam_search(rep, memory, beam=2, max_len=8, decoding_constraint=True, word_tokens=2).flat().tolist():
        words = _words(row, 2)  # two digits 4 cost the same wherever they go: any alternation of the two words
        assert len(words) == 4 and set(words) == {(3, 3), (3, 4)} and all(a != b for a, b in pairwise(words))
    # one token per word on a radix model is the token-level constraint, not the word-level one
    tok = greedy(rep, memory, max_len=8, decoding_constraint=True)
    assert tok.flat()[0].tolist() == [3, 4] * 4


def test_word_tokens_checked():
    model, _, memory = model_and_inputs("aic")
    with pytest.raises(ValueError, match="word_tokens"):
        greedy(model, memory, decoding_constraint=True, word_tokens=0)


def _source(memory_feats, boxes, mask):
    import numpy as np

    from captioning.data.loader import MemoryFeatures

    n = mask.sum(1).numpy()
    return MemoryFeatures(memory_feats.numpy(), boxes.numpy(), n, np.arange(10, 10 + len(n)))


@pytest.mark.parametrize("name, codec", [("satic-k4", None), ("acort-small", CODEC)])
def test_predict_and_config_wire_the_constraint(name, codec):
    """evaluation.decoding_constraint -> predict(..., decoding_constraint) -> the search (radix: words of digits)."""
    import numpy as np

    from captioning.config import load_config
    from captioning.metrics.evaluation import predict
    from tests.decoding.test_decoding import VOCAB

    assert load_config("demo").evaluation.decoding_constraint is False
    assert load_config("demo", overrides=["evaluation.decoding_constraint=true"]).evaluation.decoding_constraint
    feats_boxes_mask = model_and_inputs(name)[1]
    rep = _repeating(name, 7, 9)[1] if codec is None else _repeating(name, 3, 4)[1]
    src = _source(*feats_boxes_mask)
    kw = {"codec": codec, "max_tokens": 8, "beam": 2, "batch_size": 2}
    plain = predict(rep, src, np.arange(3), VOCAB, **kw)
    fixed = predict(rep, src, np.arange(3), VOCAB, decoding_constraint=True, **kw)
    assert sorted(plain) == sorted(fixed) == [10, 11, 12]
    for cap in plain.values():
        words = cap.split()
        assert len(set(words)) == 1 and len(words) == (8 if codec is None else 4)
    for cap in fixed.values():
        words = cap.split()
        assert len(set(words)) == 2 and all(a != b for a, b in pairwise(words))
