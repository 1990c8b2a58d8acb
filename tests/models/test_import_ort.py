"""ORT / ACORT importers (jiahuei/sparse-image-captioning ``RelationTransformerModel``): state dicts built with the
released code's key names and shapes (``linears.j``, one ``WGs.h`` Linear(64, 1) per head, every position of a
shared layer written, 3 linears under Share-kV / Share-QK), converted, and checked against the released forward
written here from the released formulation: box embedding in the released channel order ([sin | cos] outermost),
``log(max(ReLU(WG_h . E), 1e-6)) + masked scores``, the Annotated-Transformer LayerNorm, SentencePiece ids (ORT)
or radix tokens (ACORT)."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F

from captioning.data.text import Vocabulary
from captioning.inference import model_files
from captioning.models.encoder_decoder import ArchConfig
from captioning.models.layers import BoxGeometry, sinusoid_table
from captioning.models.registry import build
from captioning.models.released import (
    ImportCheckpointError,
    box_channel_permutation,
    convert_relation,
    import_checkpoint,
)
from captioning.training import checkpoint
from flows.cli import CLIError
from flows.cli.common import config_args as _config_args
from flows.cli.import_checkpoint import add_import_command

D, D_IN, H, FF = 16, 12, 4, 24
PIECES = ["<pad>", "<unk>", "<bos>", "<eos>", "\u2581a", "\u2581dog", "\u2581runs", "\u2581cat"]
WORDS = ["a", "dog", "runs", "cat"]
BASE = 3  # ACORT radix base in the fixtures: 4 words + <unk> = 5 numbers -> 2 digits (released and capflow)


def released_state_dict(*, n_out: int, share_att: str | None = None, enc_map=(0, 1), dec_map=(0, 1),
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """Keys and shapes as ``RelationTransformerModel.state_dict()`` gives them; shared positions hold the same
    tensors (the released ``layers = [copies[i] for i in share_layer]``)."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    n_lin = 3 if share_att else 4
    sd = {"att_embed.0.weight": t(D, D_IN), "att_embed.0.bias": t(D)}
    for stack, attns, smap in (("encoder", ["self_attn"], enc_map), ("decoder", ["self_attn", "src_attn"], dec_map)):
        unique = []
        for _ in range(len(set(smap))):
            layer = {}
            for a in attns:
                for j in range(n_lin):
                    layer[f"{a}.linears.{j}.weight"], layer[f"{a}.linears.{j}.bias"] = t(D, D), t(D)
            if stack == "encoder":
                for h in range(H):
                    layer[f"self_attn.WGs.{h}.weight"] = t(1, 64, scale=0.2)
                    layer[f"self_attn.WGs.{h}.bias"] = 0.3 + t(1, scale=0.1)
            layer["feed_forward.w_1.weight"], layer["feed_forward.w_1.bias"] = t(FF, D), t(FF)
            layer["feed_forward.w_2.weight"], layer["feed_forward.w_2.bias"] = t(D, FF), t(D)
            for j in range(len(attns) + 1):
                layer[f"sublayer.{j}.norm.a_2"] = 1 + t(D, scale=0.1)
                layer[f"sublayer.{j}.norm.b_2"] = t(D, scale=0.1)
            unique.append(layer)
        for pos, lid in enumerate(smap):
            for k, v in unique[lid].items():
                sd[f"model.{stack}.layers.{pos}.{k}"] = v
        sd[f"model.{stack}.norm.a_2"], sd[f"model.{stack}.norm.b_2"] = 1 + t(D, scale=0.1), t(D, scale=0.1)
    sd["model.tgt_embed.0.lut.weight"] = t(n_out, D, scale=1.0)
    sd["model.tgt_embed.1.pe"] = sinusoid_table(5000, D)[None]
    sd["model.generator.proj.weight"], sd["model.generator.proj.bias"] = t(n_out, D), t(n_out)
    return sd


# ---- the released forward, by hand (eval mode)
def released_box_embedding(boxes: torch.Tensor) -> torch.Tensor:
    """(B, N, 4) x_min, y_min, x_max, y_max -> (B, N, N, 64), channel s*32 + c*8 + f (the released order)."""
    b, n, _ = boxes.shape
    out = boxes.new_empty(b, n, n, 64)
    x0, y0, x1, y1 = boxes[..., 0], boxes[..., 1], boxes[..., 2], boxes[..., 3]
    cx, cy, w, h = (x0 + x1) * 0.5, (y0 + y1) * 0.5, (x1 - x0) + 1.0, (y1 - y0) + 1.0
    for i in range(n):
        for j in range(n):
            deltas = [
                torch.log(torch.clamp(torch.abs((cx[:, i] - cx[:, j]) / w[:, i]), min=1e-3)),
                torch.log(torch.clamp(torch.abs((cy[:, i] - cy[:, j]) / h[:, i]), min=1e-3)),
                torch.log(w[:, i] / w[:, j]),
                torch.log(h[:, i] / h[:, j]),
            ]
            for c, delta in enumerate(deltas):
                for f in range(8):
                    arg = 100.0 * delta / (1000.0 ** (f / 8))
                    out[:, i, j, c * 8 + f] = torch.sin(arg)
                    out[:, i, j, 32 + c * 8 + f] = torch.cos(arg)
    return out


def _ln(sd, p, x):
    mean = x.mean(-1, keepdim=True)
    return sd[p + "a_2"] * (x - mean) / (x.std(-1, keepdim=True) + 1e-6) + sd[p + "b_2"]


def _lin(sd, p, x):
    return x @ sd[p + "weight"].t() + sd[p + "bias"]


def _attn(sd, p, q_in, kv_in, mask, share, geo=None):
    b, tq, _ = q_in.shape
    dk = D // H

    def proj(j, x):
        return _lin(sd, f"{p}linears.{j}.", x).view(b, -1, H, dk).transpose(1, 2)

    q = proj(0, q_in)
    if share == "kv":
        k = v = proj(1, kv_in)
    elif share == "qk":
        k, v = proj(0, kv_in), proj(1, kv_in)
    else:
        k, v = proj(1, kv_in), proj(2, kv_in)
    s = (q @ k.transpose(-1, -2) / math.sqrt(dk)).masked_fill(mask == 0, -1e9)
    if geo is not None:  # per-head WG_h . E, ReLU, log(clamp) added to the masked scores
        w_g = torch.cat([_lin(sd, f"{p}WGs.{h}.", geo).squeeze(-1)[:, None] for h in range(H)], 1)
        s = torch.log(torch.clamp(F.relu(w_g), min=1e-6)) + s
    out = torch.softmax(s, -1) @ v
    return _lin(sd, f"{p}linears.{2 if share else 3}.", out.transpose(1, 2).reshape(b, tq, D))


def released_logprobs(sd, feats, boxes, valid, seq, share=None, n_enc=2, n_dec=2):
    """feats (B, R, D_IN), boxes (B, R, 4), valid (B, R) bool; seq (B, T) released token ids -> (B, T, V)."""
    t = seq.shape[1]
    x = F.relu(_lin(sd, "att_embed.0.", feats)) * valid[..., None]  # pack_wrapper: padded regions stay 0
    src_mask = valid[:, None, None, :].float()
    emb = released_box_embedding(boxes)
    for i in range(n_enc):
        p = f"model.encoder.layers.{i}."
        y = _ln(sd, p + "sublayer.0.norm.", x)
        x = x + _attn(sd, p + "self_attn.", y, y, src_mask, share, emb)
        x = x + _lin(sd, p + "feed_forward.w_2.", F.relu(_lin(sd, p + "feed_forward.w_1.",
                                                               _ln(sd, p + "sublayer.1.norm.", x))))
    mem = _ln(sd, "model.encoder.norm.", x)
    tgt_mask = torch.tril(torch.ones(t, t))[None, None]
    y = sd["model.tgt_embed.0.lut.weight"][seq] * math.sqrt(D) + sinusoid_table(t, D)
    for i in range(n_dec):
        p = f"model.decoder.layers.{i}."
        z = _ln(sd, p + "sublayer.0.norm.", y)
        y = y + _attn(sd, p + "self_attn.", z, z, tgt_mask, share)
        y = y + _attn(sd, p + "src_attn.", _ln(sd, p + "sublayer.1.norm.", y), mem, src_mask, share)
        y = y + _lin(sd, p + "feed_forward.w_2.", F.relu(_lin(sd, p + "feed_forward.w_1.",
                                                               _ln(sd, p + "sublayer.2.norm.", y))))
    return torch.log_softmax(_lin(sd, "model.generator.proj.", _ln(sd, "model.decoder.norm.", y)), -1)


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, 4, D_IN, generator=g)
    lo = torch.rand(2, 4, 2, generator=g) * 0.5
    boxes = torch.cat([lo, lo + 0.1 + torch.rand(2, 4, 2, generator=g) * 0.4], -1)
    valid = torch.tensor([[True] * 4, [True, True, True, False]])
    feats = feats * valid[..., None]
    return feats, boxes, valid


SP_TO_CAPFLOW = torch.tensor([0, 3 + len(WORDS), 1, 2, *range(3, 3 + len(WORDS))])  # SentencePiece id -> capflow


def test_box_channel_permutation_maps_the_released_embedding_to_capflows():
    _, boxes, _ = _inputs()
    boxes = boxes.double()  # float64: sin/cos of arguments up to ~700 keep float32's rounding out of the check
    released = released_box_embedding(boxes)
    mine = BoxGeometry(64)(boxes)
    torch.testing.assert_close(mine, released[..., box_channel_permutation(64)], atol=1e-10, rtol=1e-10)
    assert sorted(box_channel_permutation(64).tolist()) == list(range(64))


def test_ort_gives_the_released_log_probs(tmp_path):
    sd = released_state_dict(n_out=len(PIECES))
    torch.save(sd, tmp_path / "model_best.pth")
    (tmp_path / "word.vocab").write_text("".join(f"{p}\t{-i}.0\n" for i, p in enumerate(PIECES)), encoding="utf-8")
    model, vocab = import_checkpoint("ort", tmp_path / "model_best.pth", tmp_path / "word.vocab", heads=H)
    assert vocab.words == WORDS and model.cfg.geometry and model.cfg.layer_norm == "annotated"
    assert model.cfg.codec == "word" and model.cfg.share is None and model.cfg.enc_share is None
    feats, boxes, valid = _inputs()
    seq = torch.tensor([[2, 4, 5, 6, 1], [2, 7, 6, 4, 5]])  # SentencePiece ids, <bos> = 2 (and an <unk>)
    ref = released_logprobs(sd, feats, boxes, valid, seq)
    with torch.no_grad():
        out = model(feats, boxes, valid, SP_TO_CAPFLOW[seq])
    # every class, released order: a pure permutation of the rows
    torch.testing.assert_close(out[..., SP_TO_CAPFLOW], ref, atol=1e-5, rtol=1e-5)


def released_radix(word_sp_id: int, num: int, base: int) -> list[int]:
    """The released RadixTokenizer's digits for a SentencePiece id (>= 4, or 1 = <unk> -> the last number)."""
    def digits(n):
        if n == 0:
            return [1]
        out = []
        while n:
            out.append(n % base + 1)
            n //= base
        return out[::-1]
    per_word = len(digits(num))
    d = digits(num - 1 if word_sp_id == 1 else word_sp_id - 4)
    return [1] * (per_word - len(d)) + d


@pytest.mark.parametrize("share,enc_map,dec_map", [("kv", (0, 0, 1), (0, 1, 1)), ("qk", (0, 1, 0), (0, 0, 0)),
                                                    (None, (0, 1, 2), (0, 0, 1))])
def test_acort_gives_the_released_log_probs(share, enc_map, dec_map, tmp_path):
    n_out = BASE + 3
    sd = released_state_dict(n_out=n_out, share_att=share, enc_map=enc_map, dec_map=dec_map, seed=2)
    torch.save(sd, tmp_path / "model_best.pth")
    (tmp_path / "config.json").write_text(json.dumps({
        "caption_model": "relation_transformer", "tokenizer": "radix", "radix_base": BASE, "num_heads": H,
        "share_att_encoder": share, "share_att_decoder": share, "share_layer_encoder": list(enc_map),
        "share_layer_decoder": list(dec_map)}))
    (tmp_path / "pieces.json").write_text(json.dumps(PIECES))
    model, vocab = import_checkpoint("acort", tmp_path / "model_best.pth", tmp_path / "pieces.json", heads=H)
    assert vocab.words == WORDS and vocab.radix_base == BASE
    assert model.cfg.codec == "radix" and model.cfg.share == share
    assert (model.cfg.vocab_size, model.cfg.bos, model.cfg.eos) == (BASE + 3, BASE + 1, BASE + 2)
    assert model.cfg.enc_share == (enc_map if len(set(enc_map)) < 3 else None)
    assert model.cfg.dec_share == (dec_map if len(set(dec_map)) < 3 else None)
    assert len(model.encoder.layers) == len(set(enc_map)) and len(model.decoder.layers) == len(set(dec_map))

    # the released radix ids of every word and <unk> are capflow's codec's
    codec = vocab.radix()
    num = len(PIECES) - 3
    for sp_id in [*range(4, len(PIECES)), 1]:
        cap_id = vocab.unk if sp_id == 1 else 3 + sp_id - 4
        assert codec.word_ids_to_digits([[cap_id]])[0].tolist() == released_radix(sp_id, num, BASE)

    feats, boxes, valid = _inputs(seed=4)
    words = [[4, 5, 6], [7, 1, 4]]  # SentencePiece ids ("a dog runs", "cat <unk> a")
    seq = torch.tensor([[BASE + 1, *(d for w in ws for d in released_radix(w, num, BASE))] for ws in words])
    ref = released_logprobs(sd, feats, boxes, valid, seq, share, n_enc=3, n_dec=3)
    with torch.no_grad():
        out = model(feats, boxes, valid, seq)  # radix tokens: the same ids
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_errors_name_keys_and_reasons(tmp_path):
    sd = released_state_dict(n_out=len(PIECES))
    bad = dict(sd, **{"model.encoder.layers.0.self_attn.extra": torch.zeros(2)})
    with pytest.raises(ImportCheckpointError, match=r"unknown keys .*model\.encoder\.layers\.0\.self_attn\.extra"):
        convert_relation(bad, "ort", PIECES)
    bad = dict(sd)
    del bad["model.encoder.layers.1.self_attn.WGs.2.bias"]
    with pytest.raises(ImportCheckpointError, match=r"missing key model\.encoder\.layers\.1\.self_attn\.WGs\.2\.bias"):
        convert_relation(bad, "ort", PIECES)
    bad = dict(sd)
    del bad["model.decoder.layers.0.src_attn.linears.3.weight"], bad["model.decoder.layers.0.src_attn.linears.3.bias"]
    with pytest.raises(ImportCheckpointError, match=r"decoder attentions mix 3 and 4"):
        convert_relation(bad, "ort", PIECES)
    with pytest.raises(ImportCheckpointError, match=r"4 heads .*--heads 4"):
        convert_relation(sd, "ort", PIECES, heads=8)
    with pytest.raises(ImportCheckpointError, match="output classes"):
        convert_relation(sd, "ort", PIECES[:-1])
    with pytest.raises(ImportCheckpointError, match="<pad>, <unk>, <bos>, <eos>"):
        convert_relation(sd, "ort", [*PIECES[1:], "\u2581x"])
    four_d = {k: (v[:, :4] if ".WGs." in k and k.endswith("weight") else v) for k, v in sd.items()}
    with pytest.raises(ImportCheckpointError, match="trigonometric"):
        convert_relation(four_d, "ort", PIECES)

    shared = released_state_dict(n_out=BASE + 3, share_att="kv")
    with pytest.raises(ImportCheckpointError, match=r"config\.json"):  # kv and qk have the same shapes
        convert_relation(shared, "acort", PIECES)
    with pytest.raises(ImportCheckpointError, match="one attention-sharing option"):
        convert_relation(shared, "acort", PIECES, share_att_encoder="kv", share_att_decoder="qk")
    tied = released_state_dict(n_out=BASE + 3, share_att="kv", enc_map=(0, 0))
    with pytest.raises(ImportCheckpointError, match=r"share_layer_encoder=\(0, 1\) but .* as \(0, 0\)"):
        convert_relation(tied, "acort", PIECES, share_att_encoder="kv", share_att_decoder="kv",
                         share_layer_encoder="(0, 1)")
    with pytest.raises(ImportCheckpointError, match=r"share_layer_encoder=None but .* as \(0, 0\)"):
        convert_relation(tied, "acort", PIECES, share_att_encoder="kv", share_att_decoder="kv",
                         share_layer_encoder="None")
    cfg, _, _ = convert_relation(tied, "acort", PIECES, share_att_encoder="kv", share_att_decoder="kv",
                                 share_layer_encoder="(3, 3)", share_layer_decoder=[0, 1])  # the config's spellings
    assert cfg.enc_share == (0, 0) and cfg.dec_share is None
    with pytest.raises(ImportCheckpointError, match="share_att_encoder=kv but the encoder attentions have 4"):
        convert_relation(sd, "ort", PIECES, share_att_encoder="kv", share_att_decoder="None")
    with pytest.raises(ImportCheckpointError, match="radix_base 5"):
        convert_relation(shared, "acort", PIECES, share_att_encoder="kv", share_att_decoder="kv", radix_base=5)
    # 4 words + <unk> = 5 = 5^1: the released tokenizer writes 2 digits, capflow's codec 1
    five = released_state_dict(n_out=5 + 3)
    with pytest.raises(ImportCheckpointError, match="power of the radix base 5"):
        convert_relation(five, "acort", PIECES)

    torch.save(sd, tmp_path / "model_best.pth")
    (tmp_path / "word.vocab").write_text("\n".join(f"{p}\t0" for p in PIECES), encoding="utf-8")
    (tmp_path / "config.json").write_text(json.dumps({"tokenizer": "radix"}))
    with pytest.raises(ImportCheckpointError, match="--from acort"):
        import_checkpoint("ort", tmp_path / "model_best.pth", tmp_path / "word.vocab", heads=H)
    (tmp_path / "word.model").write_bytes(b"\x0a\x07\xff\xfe\x00binary")
    (tmp_path / "config.json").unlink()
    with pytest.raises(ImportCheckpointError, match=r"word\.vocab"):
        import_checkpoint("ort", tmp_path / "model_best.pth", tmp_path / "word.model", heads=H)


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="capflow")
    add_import_command(p.add_subparsers(dest="command", required=True), _config_args)
    args = p.parse_args(argv)
    return args.func(args)


def test_cli_imports_an_acort_run_folder(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    sd = released_state_dict(n_out=BASE + 3, share_att="kv", enc_map=(0, 0), dec_map=(0, 1), seed=5)
    torch.save(sd, run / "model_best.pth")
    (run / "config.json").write_text(json.dumps({"tokenizer": "radix", "radix_base": BASE, "num_heads": H,
                                                 "share_att_encoder": "kv", "share_att_decoder": "kv"}))
    (run / "tokenizer" / "word.vocab").write_text("".join(f"{p}\t0\n" for p in PIECES), encoding="utf-8")
    out = tmp_path / "imported"
    with pytest.raises(CLIError, match="--heads 4"):
        _run(["import-checkpoint", "--from", "acort", str(run / "model_best.pth"), "--vocab",
              str(run / "tokenizer" / "word.vocab"), "--out", str(out), "--set", f"features.feature_dim={D_IN}"])
    assert _run(["import-checkpoint", "--from", "acort", str(run / "model_best.pth"), "--vocab",
                 str(run / "tokenizer" / "word.vocab"), "--out", str(out), "--heads", str(H),
                 "--set", f"features.feature_dim={D_IN}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["words"] == len(WORDS)
    files = model_files(out)
    v = Vocabulary.load(files.vocab)
    assert v.words == WORDS and v.radix_base == BASE
    st = checkpoint.load(files.model)
    arch = ArchConfig.from_dict(st["arch"])
    assert arch.codec == "radix" and arch.share == "kv" and arch.enc_share == (0, 0) and arch.dec_share is None
    model = build(arch)
    model.load_state_dict(st["state_dict"])
    model.eval()
    feats, boxes, valid = _inputs(seed=6)
    seq = torch.tensor([[BASE + 1, 1, 2, 2, 3], [BASE + 1, 2, 1, 1, 1]])
    ref = released_logprobs(sd, feats, boxes, valid, seq, "kv")
    with torch.no_grad():
        got = model(feats, boxes, valid, seq)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
