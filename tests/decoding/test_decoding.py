"""Decoding algorithms (captioning.decoding): greedy, group-aware beam search, sampling, strings."""

from __future__ import annotations

import functools

import pytest
import torch

from captioning.data.text import N_SPECIAL, UNK_WORD, RadixCodec, Vocabulary
from captioning.decoding import Decoded, beam_search, greedy, sample, to_words
from captioning.models.encoder_decoder import PAD, Captioner
from captioning.models.registry import preset, scaled

CODEC = RadixCodec(base=6, num_words=30)  # 29 words + <unk>: 2 digits per word, some digit pairs invalid
VOCAB = Vocabulary(words=[f"w{i}" for i in range(29)], counts=[100 - i for i in range(29)], radix_base=6)
B, R, D_IN = 3, 5, 2048
PRESETS = ["aic", "satic-k2", "satic-k4", "acort-small", "lw-1x", "zodiac-sigmoid"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is faster and immune to other jobs on the shared cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def small_cfg(name: str, **changes):
    cfg = scaled(preset(name), d_model=32, layers=2, heads=4, d_ff=64).replace(vocab_size=40, max_len=40)
    if cfg.codec == "radix":
        cfg = cfg.replace(vocab_size=CODEC.size, bos=CODEC.bos, eos=CODEC.eos)
    return cfg.replace(**changes) if changes else cfg


@functools.cache
def _model(name: str, seed: int = 0) -> Captioner:
    torch.manual_seed(seed)
    return Captioner(small_cfg(name)).eval()


def model_and_inputs(name: str, seed: int = 0):
    model = _model(name, seed)
    g = torch.Generator().manual_seed(100 + seed)
    feats = torch.randn(B, R, D_IN, generator=g)
    xy = torch.rand(B, R, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.1 + torch.rand(B, R, 2, generator=g) * 0.4], -1)
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 4:] = False
    with torch.inference_mode():
        memory = model.encode(feats, boxes, mask)
    return model, (feats, boxes, mask), memory


def teacher_logprob(model: Captioner, memory, tokens: torch.Tensor) -> torch.Tensor:
    """Sum of token log-probs of output tokens (N, L) (N = B*n, image-major) recomputed by teacher forcing."""
    n = tokens.shape[0] // memory.states.shape[0]
    targets = torch.cat([torch.full((tokens.shape[0], 1), model.bos), tokens], 1)
    inputs, y = model.teacher_inputs(targets)
    with torch.inference_mode():
        logp = model.forward(None, None, None, inputs, memory=memory.repeat(n) if n > 1 else memory)
    lp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return torch.where(y != PAD, lp, 0.0).sum(1)


def check_well_formed(model, d: Decoded, max_len: int) -> None:
    b, n, length = d.tokens.shape
    assert d.tokens.dtype == torch.int64
    assert d.logprobs.shape == d.lengths.shape == (b, n)
    assert length <= max_len
    assert int(d.lengths.max()) == length
    flat, lens = d.tokens.reshape(b * n, length), d.lengths.reshape(-1)
    for row, ln in zip(flat.tolist(), lens.tolist(), strict=True):
        body, rest = row[:ln], row[ln:]
        assert all(t == PAD for t in rest)
        assert PAD not in body and model.bos not in body
        assert model.eos not in body[:-1]  # EOS only as the last token
        if body[-1] != model.eos:
            assert ln == max_len  # unfinished only when cut at max_len
    if d.token_logprobs is not None:
        tl = d.token_logprobs.reshape(b * n, length)
        assert torch.all(tl[flat == PAD] == 0)
        torch.testing.assert_close(tl.sum(1), d.logprobs.reshape(-1))


def greedy_reference(model: Captioner, inputs, max_len: int) -> list[list[int]]:
    """Brute force: full forward on the whole relaxed-mask input each step, one image at a time."""
    feats, boxes, mask = inputs
    k = model.group_size
    out = []
    with torch.inference_mode():
        for i in range(feats.shape[0]):
            x = model.start_tokens(1)
            y: list[int] = []
            while len(y) < max_len:
                logp = model.forward(feats[i : i + 1], boxes[i : i + 1], mask[i : i + 1], x)[:, -k:]
                logp[..., PAD] = float("-inf")
                logp[..., model.bos] = float("-inf")
                group = logp.argmax(-1)
                for t in group[0].tolist():
                    if len(y) < max_len and (not y or y[-1] != model.eos):
                        y.append(t)
                if y[-1] == model.eos:
                    break
                x = torch.cat([x, group], 1)
            out.append(y)
    return out


def beam_reference(model: Captioner, memory, beam: int, max_len: int) -> list[list[tuple[float, list[int]]]]:
    """Plain-Python group-aware beam search, one image at a time, each group's distributions from a full
    forward on the hypothesis's whole input; runs to max_len (or all finished). Per image: (score, tokens),
    best first."""
    k, eos = model.group_size, model.eos
    out = []
    for i in range(memory.states.shape[0]):
        mem = memory.select(torch.tensor([i]))
        hyps = [(0.0, [], False)]  # (score, tokens, finished)
        for start in range(0, max_len, k):
            if all(f for _, _, f in hyps):
                break
            dists = []
            for _, toks, _ in hyps:  # input: K start tokens, then every complete group before this one
                x = torch.tensor([[model.bos] * k + toks[:start]])
                with torch.inference_mode():
                    lp = model.forward(None, None, None, x, memory=mem)[0, -k:]
                lp = lp.clone()
                lp[:, PAD] = lp[:, model.bos] = float("-inf")
                dists.append(lp)
            parents = list(range(len(hyps)))
            for j in range(min(k, max_len - start)):
                cands = []
                for (score, toks, fin), par in zip(hyps, parents, strict=True):
                    if fin:
                        cands.append((score, [*toks, PAD], True, par))
                        continue
                    for t, lp in enumerate(dists[par][j].tolist()):
                        if lp > float("-inf"):
                            cands.append((score + lp, [*toks, t], t == eos, par))
                cands.sort(key=lambda c: -c[0])
                hyps = [c[:3] for c in cands[:beam]]
                parents = [c[3] for c in cands[:beam]]
        out.append([(score, [t for t in toks if t != PAD]) for score, toks, _ in hyps])
    return out


def rows(d: Decoded) -> list[list[int]]:
    return [r[:ln] for r, ln in zip(d.flat().tolist(), d.lengths.reshape(-1).tolist(), strict=True)]


# ---------------------------------------------------------------------- equivalences
@pytest.mark.parametrize("name", ["aic", "satic-k2"])
def test_beam_one_is_greedy(name):
    model, _, memory = model_and_inputs(name)
    g = greedy(model, memory, max_len=16)
    bm = beam_search(model, memory, beam=1, max_len=16)
    assert torch.equal(g.tokens, bm.tokens)
    assert torch.equal(g.lengths, bm.lengths)
    torch.testing.assert_close(g.logprobs, bm.logprobs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["aic", "satic-k4", "acort-small", "lw-1x", "zodiac-sigmoid", "expansionnet"])
def test_cached_equals_uncached(name):
    model, _, memory = model_and_inputs(name)
    pairs = [
        (greedy(model, memory, max_len=12), greedy(model, memory, max_len=12, use_cache=False)),
        (beam_search(model, memory, beam=3, max_len=12, n_best=2),
         beam_search(model, memory, beam=3, max_len=12, n_best=2, use_cache=False)),
        (sample(model, memory, n=2, max_len=12, generator=torch.Generator().manual_seed(5)),
         sample(model, memory, n=2, max_len=12, generator=torch.Generator().manual_seed(5), use_cache=False)),
    ]
    for cached, ref in pairs:
        assert torch.equal(cached.tokens, ref.tokens)
        assert torch.equal(cached.lengths, ref.lengths)
        torch.testing.assert_close(cached.logprobs, ref.logprobs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(cached.token_logprobs, ref.token_logprobs, atol=1e-4, rtol=1e-4)


def test_group_size_one_is_autoregressive():
    model, _, memory = model_and_inputs("aic")
    torch.manual_seed(0)
    k1 = Captioner(small_cfg("aic", group_size=1)).eval()
    k1.load_state_dict(model.state_dict())
    for fn in (greedy, functools.partial(beam_search, beam=3)):
        a, b = fn(model, memory, max_len=10), fn(k1, memory, max_len=10)
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("name", ["aic", "satic-k2"])
def test_greedy_matches_bruteforce_forward(name):
    model, inputs, memory = model_and_inputs(name)
    for max_len in (16, 7):
        d = greedy(model, memory, max_len=max_len)
        assert rows(d) == greedy_reference(model, inputs, max_len)


@pytest.mark.parametrize("eos_bias", [0.0, 2.0])  # 2.0: EOS competes with words at these random weights
@pytest.mark.parametrize("name", ["aic", "satic-k2", "satic-k4"])
def test_beam_matches_reference(name, eos_bias):
    model, _, memory = model_and_inputs(name)
    if eos_bias:  # hypotheses finish at different positions, inside groups too, and compete with open ones
        model = _biased(model, model.eos, eos_bias)
    ref = beam_reference(model, memory, beam=3, max_len=10)
    if eos_bias:
        assert len({len(toks) for hyps in ref for _, toks in hyps}) > 2
    for n_best in (1, 3):
        for use_cache in (True, False):
            bm = beam_search(model, memory, beam=3, max_len=10, n_best=n_best, use_cache=use_cache)
            got = rows(bm)
            for i in range(B):
                assert got[i * n_best : (i + 1) * n_best] == [toks for _, toks in ref[i][:n_best]]
                torch.testing.assert_close(bm.logprobs[i].tolist(), [s for s, _ in ref[i][:n_best]], atol=1e-4,
                                           rtol=0)


# ---------------------------------------------------------------------- scores
@pytest.mark.parametrize("name", ["aic", "satic-k2", "satic-k4", "acort-small"])
def test_beam_scores_are_teacher_forced_logprobs(name):
    model, _, memory = model_and_inputs(name)
    bm = beam_search(model, memory, beam=3, max_len=16, n_best=3)
    check_well_formed(model, bm, 16)
    recomputed = teacher_logprob(model, memory, bm.flat()).view(B, 3)
    torch.testing.assert_close(bm.logprobs, recomputed, atol=1e-4, rtol=0)
    assert torch.all(bm.logprobs[:, :-1] >= bm.logprobs[:, 1:])  # best first
    hyps = rows(bm)
    for i in range(B):  # no duplicate hypotheses for an image
        assert len({tuple(r) for r in hyps[3 * i : 3 * i + 3]}) == 3
    g = greedy(model, memory, max_len=16)
    torch.testing.assert_close(g.logprobs.squeeze(1), teacher_logprob(model, memory, g.flat()), atol=1e-4, rtol=0)
    assert torch.all(bm.logprobs[:, 0] >= g.logprobs[:, 0] - 1e-5)


def test_sample_logprobs_are_policy_logprobs():
    model, _, memory = model_and_inputs("satic-k2")
    s = sample(model, memory, n=4, max_len=14, temperature=0.7, generator=torch.Generator().manual_seed(1))
    assert s.tokens.shape[:2] == (B, 4)
    check_well_formed(model, s, 14)
    torch.testing.assert_close(s.logprobs.reshape(-1), teacher_logprob(model, memory, s.flat()), atol=1e-4, rtol=0)
    assert not s.token_logprobs.is_inference()  # usable in autograd expressions (SCST)


def test_length_penalty_reranks_and_keeps_raw_scores():
    model, _, memory = model_and_inputs("aic")
    bm = beam_search(model, memory, beam=4, max_len=16, n_best=4, length_penalty=1.0)
    check_well_formed(model, bm, 16)
    key = bm.logprobs / bm.lengths.float()
    assert torch.all(key[:, :-1] >= key[:, 1:] - 1e-6)
    torch.testing.assert_close(bm.logprobs.reshape(-1), teacher_logprob(model, memory, bm.flat()), atol=1e-4,
                               rtol=0)


# ---------------------------------------------------------------------- EOS, specials, length
def _biased(model: Captioner, token: int, bias: float) -> Captioner:
    """A copy of ``model`` whose output bias for ``token`` is shifted by ``bias``."""
    out = Captioner(model.cfg).eval()
    out.load_state_dict(model.state_dict())
    with torch.no_grad():
        out.generator.bias[token] += bias
    return out


def _force(model: Captioner, token: int) -> Captioner:
    return _biased(model, token, 1e4)


@pytest.mark.parametrize("name", ["aic", "satic-k4"])
def test_eos_first(name):
    model, _, memory = model_and_inputs(name)
    forced = _force(model, model.eos)
    for d in (greedy(forced, memory), beam_search(forced, memory, beam=3),
              sample(forced, memory, n=3, generator=torch.Generator().manual_seed(0))):
        assert torch.all(d.lengths == 1)
        assert d.tokens.shape[-1] == 1
        assert torch.all(d.tokens == model.eos)
        torch.testing.assert_close(d.logprobs, torch.zeros_like(d.logprobs), atol=1e-3, rtol=0)
    # the other beams are forced to spend ~-1e4 on a word, then end too
    bm = beam_search(forced, memory, beam=3, n_best=3)
    assert bm.lengths.tolist() == [[1, 2, 2]] * B
    assert torch.all(bm.tokens[:, 1:, 1] == model.eos) and torch.all(bm.tokens[:, 0, 1] == PAD)


@pytest.mark.parametrize("name", ["aic", "satic-k4"])
def test_pad_and_bos_never_emitted(name):
    model, _, memory = model_and_inputs(name)
    for token in (PAD, model.bos):
        forced = _force(model, token)
        for d in (greedy(forced, memory, max_len=9), beam_search(forced, memory, beam=2, max_len=9, n_best=2),
                  sample(forced, memory, n=2, max_len=9, generator=torch.Generator().manual_seed(0))):
            check_well_formed(model, d, 9)


@pytest.mark.parametrize("name", ["aic", "satic-k2", "satic-k4"])
@pytest.mark.parametrize("max_len", [1, 5, 8])
def test_max_len_respected(name, max_len):
    model, _, memory = model_and_inputs(name)
    never_eos = _biased(model, model.eos, -1e4)
    for d in (greedy(never_eos, memory, max_len=max_len),
              beam_search(never_eos, memory, beam=3, max_len=max_len, n_best=3),
              sample(never_eos, memory, n=2, max_len=max_len, generator=torch.Generator().manual_seed(0)),
              greedy(model, memory, max_len=max_len), beam_search(model, memory, beam=3, max_len=max_len)):
        check_well_formed(model, d, max_len)
    assert torch.all(greedy(never_eos, memory, max_len=max_len).lengths == max_len)


def test_eos_inside_group_discards_the_rest():
    """A SATIC group whose second position is EOS: the caption ends there, the group's tail becomes PAD."""
    model, _, memory = model_and_inputs("satic-k4")
    # wrap the output layer so that position 1 of every group (decoder positions 1, 5, ... in both the cached
    # step, which sees one group, and the uncached one, which sees the whole prefix) prefers EOS
    forced = Captioner(model.cfg).eval()
    forced.load_state_dict(model.state_dict())

    class PositionBias(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def forward(self, h):
            out = self.base(h).clone()
            out[:, 1::4, model.eos] += 1e4
            return out

    forced.generator = PositionBias(forced.generator)
    for d in (greedy(forced, memory), beam_search(forced, memory, beam=2, n_best=2),
              greedy(forced, memory, use_cache=False)):
        assert torch.all(d.lengths == 2)
        assert torch.all(d.tokens[..., 1] == model.eos)
        check_well_formed(model, d, 16)


def test_max_len_capped_by_model_positions():
    model, _, memory = model_and_inputs("satic-k4")  # 40 positions
    d = greedy(model, memory, max_len=1000)
    assert d.tokens.shape[-1] <= 40


# ---------------------------------------------------------------------- sampling
def test_sampling_seeds_and_temperature():
    model, _, memory = model_and_inputs("aic")
    a = sample(model, memory, n=5, generator=torch.Generator().manual_seed(1))
    a2 = sample(model, memory, n=5, generator=torch.Generator().manual_seed(1))
    b = sample(model, memory, n=5, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.tokens, a2.tokens) and torch.equal(a.logprobs, a2.logprobs)
    assert not torch.equal(a.tokens, b.tokens)
    assert len({tuple(r) for r in rows(a)}) > B  # samples of an image differ


def _argmax_rate(model, memory, d: Decoded) -> float:
    """Fraction of sampled tokens that are the model's arg-max (PAD/BOS excluded) given the sampled prefix."""
    toks = d.flat()
    targets = torch.cat([torch.full((toks.shape[0], 1), model.bos), toks], 1)
    inputs, y = model.teacher_inputs(targets)
    with torch.inference_mode():
        logp = model.forward(None, None, None, inputs, memory=memory.repeat(d.tokens.shape[1]))
    logp = logp.clone()
    logp[..., PAD] = logp[..., model.bos] = float("-inf")
    valid = y != PAD
    return float(((logp.argmax(-1) == y) & valid).sum() / valid.sum())


def test_low_temperature_approaches_greedy():
    model, _, memory = model_and_inputs("aic")
    rates = [_argmax_rate(model, memory, sample(model, memory, n=10, temperature=t,
                                                generator=torch.Generator().manual_seed(3)))
             for t in (1.0, 0.1, 0.01)]
    assert rates[0] < rates[1] < rates[2]
    assert rates[2] > 0.95
    g = rows(greedy(model, memory))
    # 1e-6: these random weights have a near-tie (log-prob gap < 1e-4) that T = 1e-3 still samples across
    cold = rows(sample(model, memory, n=4, temperature=1e-6, generator=torch.Generator().manual_seed(3)))
    assert cold == [g[i // 4] for i in range(len(cold))]


# ---------------------------------------------------------------------- sampling on the static engine
# (exponential-race draws, every row running every step: the engine a whole-search CUDA graph replays)
@pytest.mark.parametrize("name", ["aic", "satic-k2", "acort-small"])
def test_static_sampling_is_well_formed_policy_and_seeded(name):
    model, _, memory = model_and_inputs(name)
    kw = {"n": 4, "max_len": 14, "temperature": 0.7, "static_cache": True}
    s = sample(model, memory, generator=torch.Generator().manual_seed(1), **kw)
    assert s.tokens.shape[:2] == (B, 4)
    check_well_formed(model, s, 14)
    torch.testing.assert_close(s.logprobs.reshape(-1), teacher_logprob(model, memory, s.flat()), atol=1e-4, rtol=0)
    assert not s.token_logprobs.is_inference()
    again = sample(model, memory, generator=torch.Generator().manual_seed(1), **kw)
    other = sample(model, memory, generator=torch.Generator().manual_seed(2), **kw)
    assert torch.equal(s.tokens, again.tokens) and torch.equal(s.logprobs, again.logprobs)
    assert not torch.equal(s.tokens, other.tokens)
    assert len({tuple(r) for r in rows(s)}) > B


@pytest.mark.parametrize("name", ["aic", "satic-k4"])
def test_static_sampling_eos_specials_and_length(name):
    model, _, memory = model_and_inputs(name)
    g = torch.Generator().manual_seed(0)
    d = sample(_force(model, model.eos), memory, n=3, generator=g, static_cache=True)
    assert torch.all(d.lengths == 1) and torch.all(d.tokens == model.eos)
    for token in (PAD, model.bos):
        check_well_formed(model, sample(_force(model, token), memory, n=2, max_len=9, generator=g,
                                        static_cache=True), 9)
    never_eos = _biased(model, model.eos, -1e4)
    for max_len in (1, 5, 8):
        d = sample(never_eos, memory, n=2, max_len=max_len, generator=g, static_cache=True)
        check_well_formed(model, d, max_len)
        assert torch.all(d.lengths == max_len)


def test_static_sampling_at_low_temperature_is_greedy():
    model, _, memory = model_and_inputs("satic-k2")
    g = rows(greedy(model, memory))
    cold = rows(sample(model, memory, n=3, temperature=1e-6, generator=torch.Generator().manual_seed(3),
                       static_cache=True))
    assert cold == [g[i // 3] for i in range(len(cold))]


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_exponential_race_draws_from_the_tempered_distribution(temperature):
    from captioning.decoding.steps import race_sampler

    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    n = 40000
    logp = probs.log().expand(n, 1, 6).clone()
    tok = race_sampler(temperature, torch.Generator().manual_seed(7))(logp)
    assert tok.shape == (n, 1)
    freq = torch.bincount(tok.view(-1), minlength=6).double() / n
    want = probs.double() ** (1 / temperature)
    want /= want.sum()
    assert freq[5] == 0  # probability 0 is never drawn
    # within 5 standard errors of a multinomial draw of n
    assert torch.all((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-12), (freq, want)


def test_argument_errors():
    model, _, memory = model_and_inputs("aic")
    with pytest.raises(ValueError):
        beam_search(model, memory, beam=2, n_best=3)
    with pytest.raises(ValueError):
        sample(model, memory, temperature=0.0)
    with pytest.raises(ValueError):
        greedy(model, memory, max_len=0)


# ---------------------------------------------------------------------- strings
def test_to_words_radix():
    model, _, memory = model_and_inputs("acort-small")
    valid = set(VOCAB.words) | {UNK_WORD}
    for d in (greedy(model, memory, max_len=16), beam_search(model, memory, beam=3, n_best=3, max_len=16),
              sample(model, memory, n=4, max_len=16, generator=torch.Generator().manual_seed(0))):
        check_well_formed(model, d, 16)
        for r in rows(d):
            ids = CODEC.decode_caption(r)
            # every complete digit group before EOS decodes to a word id (invalid groups -> <unk>)
            assert len(ids) == (len(r) - (r[-1] == model.eos)) // CODEC.digits
            assert all(N_SPECIAL <= i < N_SPECIAL + CODEC.num_words for i in ids)
        words = to_words(d.flat(), VOCAB, CODEC)
        assert len(words) == d.flat().shape[0]
        for caption, r in zip(words, rows(d), strict=True):
            assert all(w in valid for w in caption.split())
            assert len(caption.split()) == len(CODEC.decode_caption(r))
    # a hand-made row: word 0, an invalid group (digits 6,6 -> rank 35), word 28, EOS mid-way
    w0, w28 = (CODEC.word_ids_to_digits([[i]])[0].tolist() for i in (3, 31))
    row = torch.tensor([[*w0, 6, 6, *w28, CODEC.eos, 3, PAD]])
    assert to_words(row, VOCAB, CODEC) == ["w0 <unk> w28"]


def test_to_words_word_model():
    vocab = Vocabulary(words=[f"w{i}" for i in range(36)], counts=[1] * 36)  # len(vocab) == 40
    assert len(vocab) == 40
    model, _, memory = model_and_inputs("aic")
    d = beam_search(model, memory, beam=2, n_best=2)
    words = to_words(d.flat(), vocab)
    for caption, r in zip(words, rows(d), strict=True):
        body = r[:-1] if r[-1] == model.eos else r
        assert caption.split() == [vocab.word_of(t) for t in body]
    assert to_words(torch.tensor([[5, 1, 6, 2, 7], [0, 0, 0, 0, 0], [99, 3, 0, 0, 0]]), vocab) == [
        "w2 w3", "", "<unk> w0"]
