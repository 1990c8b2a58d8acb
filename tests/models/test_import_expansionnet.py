"""ExpansionNet importer: a state dict with jchenghu/ExpansionNet's key names and shapes (``ExpansionNet`` of
``models/Expansion_Net.py``), converted, against the released forward written here from the released
formulation (queries expanded per decoder position into T*N rows, masks of the released shapes)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from captioning.models.released import ImportCheckpointError, convert_expansionnet, import_checkpoint

D, D_IN, H, FF, N_ENC, N_DEC, NE, ND, MAXLEN = 16, 12, 4, 24, 2, 2, 5, 3, 20
EPS = 1e-9
# the released vocabulary: sorted words, the specials among them (ids = positions)
WORDS = sorted(["PAD", "SOS", "EOS", "UNK", "a", "cat", "dog", "runs"])


def released_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    def lin(sd, name, n_out, n_in):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = t(n_out, n_in), t(n_out, scale=0.1)

    def ln(sd, name):
        sd[f"{name}.weight"], sd[f"{name}.bias"] = 1 + t(D, scale=0.1), t(D, scale=0.1)

    sd: dict[str, torch.Tensor] = {}
    lin(sd, "input_linear", D, D_IN)
    for i in range(N_ENC):
        p = f"encoders.{i}."
        ln(sd, p + "norm_1")
        ln(sd, p + "norm_2")
        sd[p + "stc_exp.query_exp_vectors.weight"] = t(NE, D, scale=1.0)
        sd[p + "stc_exp.bias_exp_vectors.weight"] = t(NE, D)
        for name in ("key_embed", "class_a_embed", "class_b_embed", "selector_embed"):
            lin(sd, p + "stc_exp." + name, D, D)
        lin(sd, p + "ff.linear_1", FF, D)
        lin(sd, p + "ff.linear_2", D, FF)
    for i in range(N_DEC):
        p = f"decoders.{i}."
        for j in (1, 2, 3):
            ln(sd, f"{p}norm_{j}")
        sd[p + "dyn_exp.query_exp_vectors.weight"] = t(ND, D, scale=1.0)
        sd[p + "dyn_exp.bias_exp_vectors.weight"] = t(ND, D)
        for name in ("cond_embed", "key_linear", "class_a_embed", "class_b_embed", "selector_embed"):
            lin(sd, p + "dyn_exp." + name, D, D)
        for name in ("Wq", "Wk", "Wv", "out_linear"):
            lin(sd, p + "mha." + name, D, D)
        lin(sd, p + "ff.linear_1", FF, D)
        lin(sd, p + "ff.linear_2", D, FF)
    lin(sd, "enc_reduce_group", D, D * N_ENC)
    ln(sd, "enc_reduce_norm")
    lin(sd, "dec_reduce_group", D, D * N_DEC)
    ln(sd, "dec_reduce_norm")
    sd["out_embedder.embed.weight"] = t(len(WORDS), D)
    sd["pos_encoder.weight"] = t(MAXLEN, D)
    lin(sd, "vocab_linear", len(WORDS), D)
    return sd


# ---- the released forward (eval mode), from the released state dict
def _lin(sd, p, x):
    return x @ sd[p + ".weight"].t() + sd[p + ".bias"]


def _ln(sd, p, x):
    return F.layer_norm(x, (D,), sd[p + ".weight"], sd[p + ".bias"])


def _rn(a):
    return a / (a.sum(-1, keepdim=True) + EPS)


def _static(sd, p, x, mask):  # mask (B, NE, R): 1 = real region
    q, bias = sd[p + "query_exp_vectors.weight"], sd[p + "bias_exp_vectors.weight"]
    z = q @ _lin(sd, p + "key_embed", x).transpose(-1, -2) / math.sqrt(D)
    fa = _rn(F.relu(z).masked_fill(mask == 0, 0.0)) @ _lin(sd, p + "class_a_embed", x) + bias
    fb = _rn(F.relu(-z).masked_fill(mask == 0, 0.0)) @ _lin(sd, p + "class_b_embed", x) + bias
    ya = _rn(F.relu(z.transpose(-1, -2))) @ fa
    yb = _rn(F.relu(-z.transpose(-1, -2))) @ fb
    s = torch.sigmoid(_lin(sd, p + "selector_embed", x))
    return s * ya + (1 - s) * yb


def _dynamic(sd, p, x, mask):  # mask (B, T, T): 1 = may see
    b, t, _ = x.shape
    cond = _lin(sd, p + "cond_embed", x).view(b, t, 1, D)
    q = (sd[p + "query_exp_vectors.weight"][None, None] + cond).reshape(b, t * ND, D)
    bias = (sd[p + "bias_exp_vectors.weight"][None, None] + cond).reshape(b, t * ND, D)
    z = q @ _lin(sd, p + "key_linear", x).transpose(-1, -2) / math.sqrt(D)  # (B, T*ND, T)
    m1 = mask[:, :, None, :].expand(b, t, ND, t).reshape(b, t * ND, t)
    fa = _rn(F.relu(z).masked_fill(m1 == 0, 0.0)) @ _lin(sd, p + "class_a_embed", x)
    fb = _rn(F.relu(-z).masked_fill(m1 == 0, 0.0)) @ _lin(sd, p + "class_b_embed", x)
    m2 = mask[:, :, :, None].expand(b, t, t, ND).reshape(b, t, t * ND)
    ya = _rn(F.relu(z.transpose(-1, -2)).masked_fill(m2 == 0, 0.0)) @ (fa + bias)
    yb = _rn(F.relu(-z.transpose(-1, -2)).masked_fill(m2 == 0, 0.0)) @ (fb + bias)
    s = torch.sigmoid(_lin(sd, p + "selector_embed", x))
    return s * ya + (1 - s) * yb


def _mha(sd, p, q_in, kv, mask):  # mask (B, Tq, R)
    b, tq, _ = q_in.shape
    dk = D // H

    def heads(x):
        return x.view(b, -1, H, dk).transpose(1, 2)

    q, k, v = heads(_lin(sd, p + "Wq", q_in)), heads(_lin(sd, p + "Wk", kv)), heads(_lin(sd, p + "Wv", kv))
    s = (q @ k.transpose(-1, -2) / dk**0.5).masked_fill(mask[:, None] == 0, -1e12)
    return _lin(sd, p + "out_linear", (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, tq, D))


def _ff(sd, p, x):
    return _lin(sd, p + "linear_2", F.relu(_lin(sd, p + "linear_1", x)))


def released_logprobs(sd, feats, num_pads, seq):
    """feats (B, R, D_IN) with num_pads[b] padded regions at the end; seq (B, T) released ids -> (B, T, V)."""
    b, r, _ = feats.shape
    valid = (torch.arange(r)[None] < (r - torch.tensor(num_pads))[:, None]).float()  # (B, R)
    x = _lin(sd, "input_linear", feats)
    outs = []
    for i in range(N_ENC):
        p = f"encoders.{i}."
        x = x + _static(sd, p + "stc_exp.", _ln(sd, p + "norm_1", x), valid[:, None].expand(b, NE, r))
        x = x + _ff(sd, p + "ff.", _ln(sd, p + "norm_2", x))
        outs.append(x)
    mem = _ln(sd, "enc_reduce_norm", x + _lin(sd, "enc_reduce_group", torch.cat(outs, -1)))
    t = seq.shape[1]
    y = sd["out_embedder.embed.weight"][seq] * math.sqrt(D) + sd["pos_encoder.weight"][:t]
    causal = torch.tril(torch.ones(t, t))[None].expand(b, t, t)
    cross = valid[:, None].expand(b, t, r)
    outs = []
    for i in range(N_DEC):
        p = f"decoders.{i}."
        y = y + _dynamic(sd, p + "dyn_exp.", _ln(sd, p + "norm_1", y), causal)
        y = y + _mha(sd, p + "mha.", _ln(sd, p + "norm_2", y), mem, cross)
        y = y + _ff(sd, p + "ff.", _ln(sd, p + "norm_3", y))
        outs.append(y)
    y = _ln(sd, "dec_reduce_norm", y + _lin(sd, "dec_reduce_group", torch.cat(outs, -1)))
    return torch.log_softmax(_lin(sd, "vocab_linear", y), -1)


def _capflow_id(released_id: int) -> int:
    kept = [w for w in WORDS if w not in ("PAD", "SOS", "EOS", "UNK")]
    w = WORDS[released_id]
    special = {"PAD": 0, "SOS": 1, "EOS": 2, "UNK": 3 + len(kept)}
    return special[w] if w in special else 3 + kept.index(w)


@pytest.mark.parametrize("vocab_form", ["list", "word2idx"])
def test_converted_expansionnet_gives_the_released_log_probs(vocab_form, tmp_path):
    sd = released_state_dict()
    # the released checkpoint layout (utils/saving_utils.save_last_checkpoint), optimizer state beside it
    torch.save({"model_state_dict": sd, "optimizer_state_dict": {"state": {}, "param_groups": [{"lr": 1.0}]}},
               tmp_path / "checkpoint.pth")
    vocab = WORDS if vocab_form == "list" else {"caption_word2idx_dict": {w: i for i, w in enumerate(WORDS)}}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    model, v = import_checkpoint("expansionnet", tmp_path / "checkpoint.pth", tmp_path / "vocab.json", heads=H)
    assert v.words == ["a", "cat", "dog", "runs"]
    c = model.cfg
    assert (c.d_model, c.enc_layers, c.dec_layers, c.expansion_enc, c.expansion_dec, c.max_len, c.vocab_size) == \
        (D, N_ENC, N_DEC, NE, ND, MAXLEN, len(WORDS))
    assert c.expansion_eps == EPS and c.expansion_dropout == "released"

    torch.manual_seed(1)
    feats = torch.randn(2, 6, D_IN)
    num_pads = [0, 2]  # the second image has 4 real regions (released: pads at the end)
    w = {x: WORDS.index(x) for x in WORDS}
    seq = torch.tensor([[w["SOS"], w["a"], w["dog"], w["runs"], w["UNK"]],
                        [w["SOS"], w["cat"], w["a"], w["a"], w["EOS"]]])
    ref = released_logprobs(sd, feats, num_pads, seq)
    to_capflow = torch.tensor([_capflow_id(i) for i in range(len(WORDS))])
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    with torch.no_grad():
        out = model(feats, torch.zeros(2, 6, 4), mask, to_capflow[seq])
    # every released class has a capflow column: a pure permutation, all log-probs equal
    torch.testing.assert_close(out[..., to_capflow], ref, atol=1e-5, rtol=1e-5)
    # and the padded regions matter to neither (the released code masks them as keys)
    feats2 = feats.clone()
    feats2[1, 4:] = 100.0
    with torch.no_grad():
        out2 = model(feats2, torch.zeros(2, 6, 4), mask, to_capflow[seq])
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)


def test_expansionnet_errors_name_keys_and_vocabulary(tmp_path):
    sd = released_state_dict()
    with pytest.raises(ImportCheckpointError, match=r"decoders\.0\.extra\.weight"):
        convert_expansionnet({**sd, "decoders.0.extra.weight": torch.zeros(1)}, WORDS, heads=H)
    bad = dict(sd)
    del bad["decoders.1.mha.Wk.bias"]
    with pytest.raises(ImportCheckpointError, match=r"decoders\.1\.mha\.Wk\.bias"):
        convert_expansionnet(bad, WORDS, heads=H)
    with pytest.raises(ImportCheckpointError, match="special words SOS"):
        convert_expansionnet(sd, [w if w != "SOS" else "sos" for w in WORDS], heads=H)
    with pytest.raises(ImportCheckpointError, match="output classes"):
        convert_expansionnet(sd, [*WORDS, "zebra"], heads=H)
    with pytest.raises(ImportCheckpointError, match="multiple of --heads 3"):
        convert_expansionnet(sd, WORDS, heads=3)
    torch.save(sd, tmp_path / "m.pth")
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 2}))
    with pytest.raises(ImportCheckpointError, match=r"0\.\.V-1"):
        import_checkpoint("expansionnet", tmp_path / "m.pth", tmp_path / "v.json", heads=H)


def test_cli_writes_an_expansionnet_model_folder(tmp_path, capsys):
    """capflow import-checkpoint --from expansionnet: the folder keeps the learned position table's max_len and
    gives the imported model's log-probs."""
    import argparse

    from captioning.models.encoder_decoder import ArchConfig
    from captioning.models.registry import build
    from captioning.training import checkpoint
    from flows.cli.common import config_args as _config_args
    from flows.cli.import_checkpoint import add_import_command

    sd = released_state_dict(seed=4)
    torch.save({"model_state_dict": sd}, tmp_path / "ckpt.pth")
    (tmp_path / "vocab.json").write_text(json.dumps(WORDS))
    parser = argparse.ArgumentParser(prog="capflow")
    add_import_command(parser.add_subparsers(dest="command", required=True), _config_args)
    args = parser.parse_args(["import-checkpoint", "--from", "expansionnet", str(tmp_path / "ckpt.pth"), "--vocab",
                              str(tmp_path / "vocab.json"), "--out", str(tmp_path / "m"), "--heads", str(H),
                              "--set", f"features.feature_dim={D_IN}"])
    assert args.func(args) == 0
    assert "imported expansionnet" in capsys.readouterr().out
    st = checkpoint.load(tmp_path / "m" / "model.pt")
    arch = ArchConfig.from_dict(st["arch"])
    assert arch.max_len == MAXLEN and arch.expansion_enc == NE and arch.expansion_dec == ND
    model = build(arch)
    model.load_state_dict(st["state_dict"])
    model.eval()
    torch.manual_seed(2)
    feats = torch.randn(1, 5, D_IN)
    w = {x: WORDS.index(x) for x in WORDS}
    seq = torch.tensor([[w["SOS"], w["dog"], w["a"]]])
    ref = released_logprobs(sd, feats, [0], seq)
    to_capflow = torch.tensor([_capflow_id(i) for i in range(len(WORDS))])
    with torch.no_grad():
        out = model(feats, torch.zeros(1, 5, 4), torch.ones(1, 5, dtype=torch.bool), to_capflow[seq])
    torch.testing.assert_close(out[..., to_capflow], ref, atol=1e-5, rtol=1e-5)
