"""LW-Transformer (luogen1996/LWTransformer) import and the ``m2`` skeleton: state dicts built here with the
released code's key names and shapes (``Transformer(bos, LTransformerEncoder, LTransformerDecoderLayer)``, M2's
containers), converted, and checked against the released forward written here from the released arithmetic
(grouped linears, the attention module's own residual + LayerNorm inside the layer's, post-LN, the region
LayerNorm, 1-based positions, a bias-free output layer)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from captioning.decoding.search import beam_search, greedy
from captioning.models.encoder_decoder import Captioner
from captioning.models.params import count
from captioning.models.registry import PAPER_PARAMS, preset, scaled
from captioning.models.released import ImportCheckpointError, convert_lw, import_checkpoint

D, D_IN, H, G, FF, N_ENC, N_DEC, MAX_LEN = 64, 20, 8, 2, 96, 3, 2, 20
ITOS = ["<unk>", "<pad>", "<bos>", "<eos>", "a", "dog", "runs", "on", "grass", "cat"]  # the M2 TextField order
R_PAD, R_BOS, R_EOS = 1, 2, 3


def released_state_dict(qk_expand: int = 1, lffn: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """What ``Transformer.state_dict()`` holds for ``--model lwtransformer [--LFFN] --d_k 8*qk_expand``."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    d_v, d_k = D // H, D // H * qk_expand
    sd: dict[str, torch.Tensor] = {}

    def linear(p, n_in, n_out, bias=True):
        sd[p + "weight"] = t(n_out, n_in, scale=1 / math.sqrt(n_in))
        if bias:
            sd[p + "bias"] = t(n_out, scale=0.1)

    def norm(p):
        sd[p + "weight"], sd[p + "bias"] = 1 + t(D, scale=0.1), t(D, scale=0.1)

    def attention(p):  # LMultiHeadAttention(..., groups=G): LScaledDotProductAttention + layer_norm
        linear(p + "attention.fc_q.", D // G, H * d_k // G)
        linear(p + "attention.fc_k.", D // G, H * d_k // G)
        linear(p + "attention.fc_v.", D // G, H * d_v // G)
        linear(p + "attention.fc_o.", H * d_v // G, D // G)
        norm(p + "layer_norm.")

    def pwff(p):  # LPositionWiseFeedForward (--LFFN) or PositionWiseFeedForward
        linear(p + "fc1.", D, FF)
        linear(p + "fc2.", FF // G, D // G) if lffn else linear(p + "fc2.", FF, D)
        norm(p + "layer_norm.")

    for i in range(N_ENC):
        p = f"encoder.layers.{i}."
        attention(p + "mhatt.")
        norm(p + "lnorm.")
        pwff(p + "pwff.")
    linear("encoder.fc.", D_IN, D)
    norm("encoder.layer_norm.")
    sd["decoder.word_emb.weight"] = t(len(ITOS), D, scale=0.5)
    # frozen table, overwritten by the model-wide xavier_uniform_ of Transformer.init_weights: random rows
    sd["decoder.pos_emb.weight"] = t(MAX_LEN + 1, D, scale=0.5)
    for i in range(N_DEC):
        p = f"decoder.layers.{i}."
        attention(p + "self_att.")
        sd[p + "self_att.running_keys"] = torch.zeros(0, D)  # register_state buffers (can_be_stateful=True)
        sd[p + "self_att.running_values"] = torch.zeros(0, D)
        attention(p + "enc_att.")
        norm(p + "lnorm1.")
        norm(p + "lnorm2.")
        pwff(p + "pwff.")
    linear("decoder.fc.", D, len(ITOS), bias=False)
    sd["decoder.running_mask_self_attention"] = torch.zeros((1, 1, 0), dtype=torch.uint8)
    sd["decoder.running_seq"] = torch.zeros((1,), dtype=torch.long)
    return sd


# ---- the released forward (eval mode), by hand from the released state dict
def _lin(sd, p, x):
    out = x @ sd[p + "weight"].t()
    return out + sd[p + "bias"] if p + "bias" in sd else out


def _glin(sd, p, x):
    """A released group-wise linear: one Linear applied to each of the G channel groups."""
    b, t, _ = x.shape
    return _lin(sd, p, x.view(b, t, G, -1)).reshape(b, t, -1)


def _ln(sd, p, x):
    return F.layer_norm(x, (D,), sd[p + "weight"], sd[p + "bias"], eps=1e-5)


def _mha(sd, p, queries, keys, mask):
    """LMultiHeadAttention: LN(queries + fc_o(attention)); ``mask`` True = masked (the released convention)."""
    b, nq, _ = queries.shape
    nk = keys.shape[1]
    d_k = sd[p + "attention.fc_q.weight"].shape[0] * G // H
    d_v = D // H
    q = _glin(sd, p + "attention.fc_q.", queries).view(b, nq, H, d_k).permute(0, 2, 1, 3)
    k = _glin(sd, p + "attention.fc_k.", keys).view(b, nk, H, d_k).permute(0, 2, 3, 1)
    v = _glin(sd, p + "attention.fc_v.", keys).view(b, nk, H, d_v).permute(0, 2, 1, 3)
    att = torch.softmax((q @ k / math.sqrt(d_k)).masked_fill(mask, float("-inf")), -1)
    out = (att @ v).permute(0, 2, 1, 3).reshape(b, nq, H * d_v)
    return _ln(sd, p + "layer_norm.", queries + _glin(sd, p + "attention.fc_o.", out))


def _pwff(sd, p, x):
    h = F.relu(_lin(sd, p + "fc1.", x))
    grouped = sd[p + "fc2.weight"].shape[0] != D
    out = _glin(sd, p + "fc2.", h) if grouped else _lin(sd, p + "fc2.", h)
    return _ln(sd, p + "layer_norm.", x + out)


def released_encode(sd, feats):
    x = _ln(sd, "encoder.layer_norm.", F.relu(_lin(sd, "encoder.fc.", feats)))
    mask = (x.sum(-1) == 0)[:, None, None, :]  # MultiLevelEncoder's mask, computed after the LayerNorm
    for i in range(N_ENC):
        p = f"encoder.layers.{i}."
        x = _ln(sd, p + "lnorm.", x + _mha(sd, p + "mhatt.", x, x, mask))
        x = _pwff(sd, p + "pwff.", x)
    return x, mask


def released_logprobs(sd, feats, seq):
    """feats (B, R, D_IN); seq (B, T) released ids -> the released log-probs (B, T, V), released id order."""
    enc, enc_mask = released_encode(sd, feats)
    b, t = seq.shape
    keep = (seq != R_PAD)[..., None].float()
    self_mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)[None, None] | (seq == R_PAD)[:, None, None, :]
    pos = torch.arange(1, t + 1).expand(b, t).masked_fill(seq == R_PAD, 0)
    y = sd["decoder.word_emb.weight"][seq] + sd["decoder.pos_emb.weight"][pos]
    for i in range(N_DEC):
        p = f"decoder.layers.{i}."
        s = _ln(sd, p + "lnorm1.", y + _mha(sd, p + "self_att.", y, y, self_mask)) * keep
        c = _ln(sd, p + "lnorm2.", s + _mha(sd, p + "enc_att.", s, enc, enc_mask)) * keep
        y = _pwff(sd, p + "pwff.", c) * keep
    return torch.log_softmax(_lin(sd, "decoder.fc.", y), -1)


# capflow ids: <pad> <bos> <eos> words <unk>; PERM[c] = the released id of capflow id c
PERM = torch.tensor([R_PAD, R_BOS, R_EOS, *range(4, len(ITOS)), 0])
TO_CAPFLOW = torch.argsort(PERM)  # released id -> capflow id


def _import(tmp_path, sd, vocab=None) -> tuple[Captioner, object]:
    torch.save(sd, tmp_path / "lw_state_dict.pth")
    (tmp_path / "vocab.json").write_text(json.dumps(ITOS if vocab is None else vocab))
    return import_checkpoint("lw", tmp_path / "lw_state_dict.pth", tmp_path / "vocab.json", heads=H)


def _inputs(b=3, r=7, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, r, D_IN, generator=g), torch.zeros(b, r, 4), torch.ones(b, r, dtype=torch.bool)


@pytest.mark.parametrize("qk_expand,lffn", [(1, True), (3, True), (2, False)])
def test_imported_model_gives_the_released_log_probs(qk_expand, lffn, tmp_path):
    sd = released_state_dict(qk_expand, lffn)
    model, vocab = _import(tmp_path, sd)
    cfg = model.cfg
    assert vocab.words == ITOS[4:] and len(vocab) == len(ITOS)
    assert (cfg.skeleton, cfg.norm, cfg.groups, cfg.qk_expand, cfg.grouped_merge, cfg.layer_norm) == (
        "m2", "post", G, qk_expand, True, "torch")
    assert cfg.ffn == ("grouped" if lffn else "dense") and cfg.max_len == MAX_LEN
    assert (cfg.enc_layers, cfg.dec_layers, cfg.d_ff, cfg.bos, cfg.eos) == (N_ENC, N_DEC, FF, 1, 2)
    feats, boxes, mask = _inputs()
    seq = torch.tensor([[R_BOS, 4, 5, 6, 7, 4, 8, 9],  # released ids; the last caption padded
                        [R_BOS, 9, 9, 0, 5, 3, 4, 6],
                        [R_BOS, 7, 5, R_EOS, R_PAD, R_PAD, R_PAD, R_PAD]])
    with torch.no_grad():
        ref = released_logprobs(sd, feats, seq)
        out = model(feats, boxes, mask, TO_CAPFLOW[seq])
    real = seq != R_PAD  # positions the released model reads (its outputs at padding are zeroed, unused)
    diff = (out[..., :] - ref[..., PERM]).abs()[real]
    assert float(diff.max()) <= 1e-5, float(diff.max())


def test_greedy_with_caches_is_the_released_step_by_step_arg_max(tmp_path):
    sd = released_state_dict(2, True, seed=5)  # captions of 4..8 tokens, several words
    model, _ = _import(tmp_path, sd)
    feats, boxes, mask = _inputs(b=4, seed=5)
    steps = 8
    seq = torch.full((4, 1), R_BOS)
    ref_lp = []
    with torch.no_grad():
        for _ in range(steps):  # the released model re-run on the whole prefix, capflow's PAD/BOS ban
            lp = released_logprobs(sd, feats, seq)[:, -1]
            lp[:, [R_PAD, R_BOS]] = float("-inf")
            tok = lp.argmax(-1)
            ref_lp.append(lp.gather(1, tok[:, None]))
            seq = torch.cat([seq, tok[:, None]], 1)
    ref_toks, ref_lp = TO_CAPFLOW[seq[:, 1:]], torch.cat(ref_lp, 1)
    memory = model.encode(feats, boxes, mask)
    for static in (False, True):
        dec = greedy(model, memory, max_len=steps, use_cache=True, static_cache=static, graphs=False)
        for b in range(4):
            n = int(dec.lengths[b, 0])
            eos = (ref_toks[b] == 2).nonzero()
            assert n == (int(eos[0]) + 1 if len(eos) else steps)
            assert torch.equal(dec.tokens[b, 0, :n], ref_toks[b, :n])
            torch.testing.assert_close(dec.token_logprobs[b, 0, :n], ref_lp[b, :n], atol=1e-5, rtol=0)
    assert int(dec.lengths.min()) >= 4  # the comparison covers several cached steps and EOS
    uncached = beam_search(model, memory, beam=3, max_len=steps, use_cache=False)
    for static in (False, True):
        cached = beam_search(model, memory, beam=3, max_len=steps, use_cache=True, static_cache=static, graphs=False)
        assert torch.equal(cached.tokens, uncached.tokens)
        torch.testing.assert_close(cached.logprobs, uncached.logprobs, atol=1e-5, rtol=0)


def test_unknown_missing_and_misshapen_keys_are_named(tmp_path):
    sd = released_state_dict()
    sd["decoder.fc.bias"] = torch.zeros(len(ITOS))  # the released output layer has no bias
    with pytest.raises(ImportCheckpointError, match=r"unknown keys .*decoder\.fc\.bias"):
        convert_lw(sd, ITOS, heads=H)
    sd = released_state_dict()
    del sd["decoder.layers.1.enc_att.layer_norm.bias"]
    with pytest.raises(ImportCheckpointError, match=r"missing key decoder\.layers\.1\.enc_att\.layer_norm\.bias"):
        convert_lw(sd, ITOS, heads=H)
    sd = released_state_dict()
    del sd["decoder.pos_emb.weight"]
    with pytest.raises(ImportCheckpointError, match=r"not a released lw state dict: missing decoder\.pos_emb"):
        convert_lw(sd, ITOS, heads=H)
    sd = released_state_dict()
    sd["encoder.layers.2.pwff.fc1.bias"] = torch.zeros(FF + 1)
    with pytest.raises(ImportCheckpointError, match=r"shapes disagree: encoder\.layers\.2\.ffn\.w1\.bias"):
        _import(tmp_path, sd)
    sd = released_state_dict()  # released d_v = 16 with 8 heads at d=64: not capflow's d_v = d/heads
    sd["encoder.layers.0.mhatt.attention.fc_v.weight"] = torch.zeros(H * 16 // G, D // G)
    with pytest.raises(ImportCheckpointError, match="d_v = d_model/heads = 8"):
        convert_lw(sd, ITOS, heads=H)


def test_vocabulary_checks(tmp_path):
    sd = released_state_dict()
    with pytest.raises(ImportCheckpointError, match="lacks the released special words <bos>"):
        convert_lw(sd, [w if w != "<bos>" else "bos" for w in ITOS], heads=H)
    with pytest.raises(ImportCheckpointError, match="has 10 rows, the vocabulary 11 words"):
        convert_lw(sd, [*ITOS, "extra"], heads=H)
    (tmp_path / "vocab_lw.pkl").write_bytes(b"\x80\x04N.")
    torch.save(sd, tmp_path / "m.pth")
    with pytest.raises(ImportCheckpointError, match="capflow does not unpickle"):
        import_checkpoint("lw", tmp_path / "m.pth", tmp_path / "vocab_lw.pkl", heads=H)
    # the same vocabulary as stoi (word -> id) or as {"itos": [...]}
    for obj in ({w: i for i, w in enumerate(ITOS)}, {"itos": ITOS}):
        _, vocab = _import(tmp_path, sd, vocab=obj)
        assert vocab.words == ITOS[4:]


# ---- the m2 skeleton and the released flavour
def test_released_flavour_is_the_m2_skeleton_and_the_default_is_unchanged():
    cfg = scaled(preset("lw-1x@released"), d_model=32, layers=2, heads=4, d_ff=64).replace(vocab_size=12, max_len=10)
    rel = Captioner(cfg)
    keys = set(rel.state_dict())
    assert {"input_norm.weight", "encoder.layers.0.sub1.inner_norm.weight", "decoder.layers.1.sub2.inner_norm.bias",
            "pe"} <= keys
    assert not any(k.startswith(("encoder.norm", "decoder.norm", "generator.bias")) for k in keys)
    assert "decoder.layers.0.sub3.inner_norm.weight" not in keys  # the FFN sublayer: one LayerNorm
    assert rel.decoder.layers[0].self_mix.o.weight.shape == (16, 16)  # per-group merge Linear(d/k, d/k)
    # init="released": the position table is Glorot-uniform like the released one (xavier over every parameter)
    assert rel.pe.shape == (11, 32) and float(rel.pe.abs().max()) <= math.sqrt(6 / (11 + 32))
    assert cfg.input_dropout == cfg.dropout == 0.1
    default = Captioner(scaled(preset("lw-1x"), d_model=32, layers=2, heads=4, d_ff=64).replace(vocab_size=12))
    dkeys = set(default.state_dict())
    assert default.cfg.skeleton == "capflow" and "pe" not in dkeys and "generator.bias" in dkeys
    assert not any("inner_norm" in k or k.startswith("input_norm") for k in dkeys)
    with pytest.raises(ValueError, match="post-LN"):
        Captioner(cfg.replace(norm="pre"))
    with pytest.raises(ValueError, match="unknown skeleton"):
        Captioner(cfg.replace(skeleton="m3"))


def _released_stacks_count(d: int, d_k: int, d_ff: int, h: int = 8, g: int = 2, layers: int = 6) -> int:
    """The released modules' attention and FFN parameters (LScaledDotProductAttention, LPositionWiseFeedForward)."""
    def lin(n_in, n_out):
        return n_in * n_out + n_out

    d_v = d // h
    att = 2 * lin(d // g, h * d_k // g) + lin(d // g, h * d_v // g) + lin(h * d_v // g, d // g)
    ffn = lin(d, d_ff) + lin(d_ff // g, d // g)
    return layers * (att + ffn) + layers * (2 * att + ffn)


@pytest.mark.parametrize("name,d_k", [("lw-1x", 64), ("lw-2x", 128), ("lw-3x", 192)])
def test_params_of_both_flavours(name, d_k):
    with torch.device("meta"):
        default, rel = Captioner(preset(name)), Captioner(preset(name + "@released"))
    assert count(default, "stacks") == PAPER_PARAMS[name][0]  # the paper's figure (dense W_O)
    assert count(rel, "stacks") == PAPER_PARAMS[name + "@released"][0] == _released_stacks_count(512, d_k, 2048)
    assert PAPER_PARAMS[name][0] - PAPER_PARAMS[name + "@released"][0] == 18 * (512 * 512 + 512 - 256 * 256 - 256)


def test_imported_stacks_count_is_the_released_modules(tmp_path):
    sd = released_state_dict(3, True)
    model, _ = _import(tmp_path, sd)
    counted = sum(v.numel() for k, v in sd.items() if ".attention.fc_" in k or ".pwff.fc" in k)
    assert count(model, "stacks") == counted


def test_m2_skeleton_trains_with_a_frozen_position_table():
    cfg = scaled(preset("lw-2x@released"), d_model=32, layers=2, heads=4, d_ff=64).replace(vocab_size=12, max_len=10)
    torch.manual_seed(0)
    model = Captioner(cfg).train()
    pe = model.pe.clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    feats, mask = torch.randn(2, 5, 2048), torch.ones(2, 5, dtype=torch.bool)
    targets = torch.tensor([[1, 4, 5, 6, 2, 0], [1, 7, 8, 2, 0, 0]])
    loss = model.xe_loss(feats, torch.zeros(2, 5, 4), mask, targets)
    loss.backward()
    assert torch.isfinite(loss) and model.input_norm.weight.grad is not None
    assert model.decoder.layers[0].sub1.inner_norm.weight.grad.abs().sum() > 0
    opt.step()
    assert torch.equal(model.pe, pe)  # a buffer, as the released table is frozen
