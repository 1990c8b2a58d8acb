"""Importers of released checkpoints: state dicts built with the released code's names and shapes (ruotianluo's
TransformerModel, SATIC's SAT, ZoDIAC's ZTransformerModel), converted, and checked against the released forward
computed here by hand from the released state dict."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F

from captioning.models.layers import sinusoid_table
from captioning.models.released import ImportCheckpointError, convert_annotated, import_checkpoint, load_state_dict

D, D_IN, H, FF, N, WORDS = 16, 12, 4, 24, 2, ["a", "dog", "runs", "UNK", "cat"]


def released_state_dict(zodiac: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {"att_embed.0.weight": t(D, D_IN), "att_embed.0.bias": t(D)}
    n_lin = 5 if zodiac else 4
    for stack, attns in (("encoder", ["self_attn"]), ("decoder", ["self_attn", "src_attn"])):
        for i in range(N):
            p = f"model.{stack}.layers.{i}."
            for a in attns:
                for j in range(n_lin):
                    sd[f"{p}{a}.linears.{j}.weight"], sd[f"{p}{a}.linears.{j}.bias"] = t(D, D), t(D)
            sd[f"{p}feed_forward.w_1.weight"], sd[f"{p}feed_forward.w_1.bias"] = t(FF, D), t(FF)
            sd[f"{p}feed_forward.w_2.weight"], sd[f"{p}feed_forward.w_2.bias"] = t(D, FF), t(D)
            for j in range(len(attns) + 1):
                sd[f"{p}sublayer.{j}.norm.a_2"] = 1 + t(D, scale=0.1)
                sd[f"{p}sublayer.{j}.norm.b_2"] = t(D, scale=0.1)
        sd[f"model.{stack}.norm.a_2"], sd[f"model.{stack}.norm.b_2"] = 1 + t(D, scale=0.1), t(D, scale=0.1)
    v = len(WORDS) + 1
    sd["model.tgt_embed.0.lut.weight"] = t(v, D, scale=1.0)
    sd["model.tgt_embed.1.pe"] = sinusoid_table(5000, D)[None]
    sd["model.generator.proj.weight"], sd["model.generator.proj.bias"] = t(v, D), t(v)
    return sd


# ---- the released forward, by hand from the released state dict (eval mode)
def _ln(sd, p, x):
    mean = x.mean(-1, keepdim=True)
    return sd[p + "a_2"] * (x - mean) / (x.std(-1, keepdim=True) + 1e-6) + sd[p + "b_2"]


def _lin(sd, p, x):
    return x @ sd[p + "weight"].t() + sd[p + "bias"]


def _attn(sd, p, q_in, kv_in, mask, zodiac):
    b, tq, _ = q_in.shape
    dk = D // H
    g = F.gelu if zodiac else (lambda t: t)
    q_in, kv_in = g(q_in), g(kv_in)
    ins = (q_in, q_in, kv_in, kv_in) if zodiac else (q_in, kv_in, kv_in)
    proj = [g(_lin(sd, f"{p}linears.{j}.", x).view(b, -1, H, dk).transpose(1, 2)) for j, x in enumerate(ins)]
    if zodiac:
        q, q2, k, v = proj
    else:
        q, k, v = proj
    s = g(q @ k.transpose(-1, -2) / math.sqrt(dk)).masked_fill(mask == 0, -1e9)
    out = torch.softmax(s, -1) @ v
    if zodiac:
        inten = g(q2 @ v.transpose(-1, -2) / math.sqrt(dk))
        m = mask.float()
        # the released pooling as it runs on one sample alone (capflow's zodiac_pool="released")
        pooled = (inten * m).sum(dim=(1, 2, 3), keepdim=True) / m.sum(dim=(1, 2, 3), keepdim=True)
        out = out * (1 + torch.sigmoid(pooled))
    return _lin(sd, f"{p}linears.{len(ins)}.", out.transpose(1, 2).reshape(b, tq, D))


def released_logprobs(sd, feats, seq, zodiac, k=1):
    """feats (B, R, D_IN) all valid; seq (B, T) released ids (0 = BOS) -> log-probs (B, T, V+1)."""
    b, t = seq.shape
    x = F.relu(_lin(sd, "att_embed.0.", feats))
    src_mask = torch.ones(b, 1, 1, feats.shape[1])
    for i in range(N):
        p = f"model.encoder.layers.{i}."
        x = x + _attn(sd, p + "self_attn.", _ln(sd, p + "sublayer.0.norm.", x), _ln(sd, p + "sublayer.0.norm.", x),
                      src_mask, zodiac)
        y = _ln(sd, p + "sublayer.1.norm.", x)
        hdn = _lin(sd, p + "feed_forward.w_1.", y)
        x = x + _lin(sd, p + "feed_forward.w_2.", hdn if zodiac else F.relu(hdn))
    mem = _ln(sd, "model.encoder.norm.", x)
    i_idx, j_idx = torch.arange(t)[:, None], torch.arange(t)[None]
    tgt_mask = (j_idx < (i_idx // k + 1) * k)[None, None].float()
    y = sd["model.tgt_embed.0.lut.weight"][seq] * math.sqrt(D) + sinusoid_table(t, D)
    for i in range(N):
        p = f"model.decoder.layers.{i}."
        z = _ln(sd, p + "sublayer.0.norm.", y)
        y = y + _attn(sd, p + "self_attn.", z, z, tgt_mask, zodiac)
        y = y + _attn(sd, p + "src_attn.", _ln(sd, p + "sublayer.1.norm.", y), mem, src_mask, zodiac)
        hdn = _lin(sd, p + "feed_forward.w_1.", _ln(sd, p + "sublayer.2.norm.", y))
        y = y + _lin(sd, p + "feed_forward.w_2.", hdn if zodiac else F.relu(hdn))
    return torch.log_softmax(_lin(sd, "model.generator.proj.", _ln(sd, "model.decoder.norm.", y)), -1)


def _capflow_ids(seq_released: torch.Tensor, bos_pos: int) -> torch.Tensor:
    kept = [w for w in WORDS if w != "UNK"]
    unk = 3 + len(kept)
    table = [1] + [unk if w == "UNK" else 3 + kept.index(w) for w in WORDS]
    return torch.tensor(table)[seq_released]


@pytest.mark.parametrize("family,k", [("aic", 1), ("satic", 2), ("zodiac", 1)])
def test_converted_model_gives_the_released_log_probs(family, k, tmp_path):
    zodiac = family == "zodiac"
    sd = released_state_dict(zodiac)
    torch.save(sd, tmp_path / "model.pth")
    (tmp_path / "cocotalk.json").write_text(json.dumps({"ix_to_word": {str(i + 1): w for i, w in enumerate(WORDS)}}))
    model, vocab = import_checkpoint(family, tmp_path / "model.pth", tmp_path / "cocotalk.json", heads=H,
                                     group_size=k if family == "satic" else None,
                                     zodiac_gate="sigmoid" if zodiac else None)
    assert vocab.words == ["a", "dog", "runs", "cat"] and model.cfg.layer_norm == "annotated"
    torch.manual_seed(1)
    feats = torch.randn(2, 3, D_IN)
    seq = torch.tensor([[0] * k + [1, 2, 3, 5], [0] * k + [5, 4, 1, 2]])  # released ids, K start symbols 0
    ref = released_logprobs(sd, feats, seq, zodiac, k)
    with torch.no_grad():
        out = model(feats, torch.zeros(2, 3, 4), torch.ones(2, 3, dtype=torch.bool), _capflow_ids(seq, 0))
    # compare the classes the released model has: <eos> (released 0) and every word, in capflow's order
    cols = torch.tensor([2, *_capflow_ids(torch.arange(1, len(WORDS) + 1), 0).tolist()])
    torch.testing.assert_close(out[..., cols], ref, atol=1e-5, rtol=1e-5)
    assert (out[..., [0, 1]] < -1e6).all()  # <pad>, <bos>: never emitted


def test_unknown_and_missing_keys_are_named(tmp_path):
    sd = released_state_dict(False)
    sd["model.extra.weight"] = torch.zeros(2)
    with pytest.raises(ImportCheckpointError, match=r"model\.extra\.weight"):
        convert_annotated(sd, "aic", WORDS, heads=H)
    sd = released_state_dict(False)
    del sd["model.decoder.layers.1.src_attn.linears.2.bias"]
    with pytest.raises(ImportCheckpointError, match=r"model\.decoder\.layers\.1\.src_attn\.linears\.2\.bias"):
        convert_annotated(sd, "aic", WORDS, heads=H)
    with pytest.raises(ImportCheckpointError, match="group size"):
        convert_annotated(released_state_dict(False), "satic", WORDS, heads=H)
    with pytest.raises(ImportCheckpointError, match="output classes"):
        convert_annotated(released_state_dict(False), "aic", WORDS[:-1], heads=H)


def test_checkpoints_needing_unpickling_are_refused(tmp_path):
    path = tmp_path / "bad.pth"  # ruotianluo-style infos: an argparse.Namespace next to the weights
    torch.save({"opt": argparse.Namespace(lr=1e-4), "model": released_state_dict(False)}, path)
    with pytest.raises(ImportCheckpointError, match="weights_only"):
        load_state_dict(path)
