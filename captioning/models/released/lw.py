"""``lw``: luogen1996/LWTransformer's image-captioning model (``ImageCaptioning/train.py --model lwtransformer``:
``Transformer(bos, LTransformerEncoder, LTransformerDecoderLayer)`` of ``models/transformer_lightweight``, on the
M2-Transformer code base), into the ``m2`` skeleton (:mod:`captioning.models.encoder_decoder`).

Its keys (:func:`_key_table`)::

    encoder.fc.*, encoder.layer_norm.*                  -> input_proj, input_norm   (LN(Drop(ReLU(W x + b))))
    encoder.layers.i.mhatt.attention.fc_{q,k,v,o}.*     -> encoder.layers.i.mix.{q,k_proj,v,o}   (group-wise;
                                                           fc_o is one Linear(d/k, d/k) per group: grouped_merge)
    encoder.layers.i.mhatt.layer_norm.*, .lnorm.*       -> encoder.layers.i.sub1.inner_norm, sub1.norm
    encoder.layers.i.pwff.{fc1,fc2,layer_norm}.*        -> encoder.layers.i.ffn.{w1,w2}, sub2.norm (G-FFN with
                                                           --LFFN, else dense: read from fc2's shape)
    decoder.layers.i.{self_att,enc_att}.attention.*     -> decoder.layers.i.{self_mix,cross}.*
    decoder.layers.i.{self_att,enc_att}.layer_norm.*    -> decoder.layers.i.sub{1,2}.inner_norm
    decoder.layers.i.{lnorm1,lnorm2}.*, pwff.*          -> decoder.layers.i.sub{1,2}.norm, ffn, sub3.norm
    decoder.word_emb.weight, decoder.fc.weight          -> embed, generator (no bias; ids permuted)
    decoder.pos_emb.weight                              -> pe (copied: the M2 init overwrites the sinusoid table)
    decoder.running_*, decoder.layers.i.self_att.running_*   (decoding-state buffers: known, not copied)

Its vocabulary is the M2 ``TextField``'s (``data/field.py``, torchtext-like): ``itos`` = ``<unk>``, ``<pad>``,
``<bos>``, ``<eos>``, then the words by frequency, pickled as ``vocab_<exp>.pkl``. capflow does not unpickle:
``--vocab`` is that ``itos`` as a JSON list (or ``stoi`` as a word -> id object, or ``{"itos": [...]}``); the
specials move to capflow's places, a pure row permutation (every log-prob unchanged). It may hold whitespace
tokens, kept under capflow names (:func:`~captioning.models.released.common.capflow_word`). The released training
checkpoint (``saved_models/<exp>_best.pth``) also holds numpy RNG state, which ``weights_only`` refuses: save its
``state_dict`` entry alone. Not copied: the M2 encoder's region mask (see the skeleton's docstring).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from captioning.models.encoder_decoder import ArchConfig
from captioning.models.registry import preset, released
from captioning.models.released.common import (
    Converted,
    Entry,
    ImportCheckpointError,
    ImportOptions,
    KeyMap,
    count_layers,
    load_state_dict,
    pairs,
    permute_vocab_rows,
    read_id_words,
    require,
    specials_last,
)

LW_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # the M2 TextField's tokens, same names as capflow's
# the M2 containers' decoding states (register_state buffers, empty outside beam search): known, not weights
_LW_STATES = re.compile(
    r"decoder\.(running_mask_self_attention|running_seq|layers\.\d+\.self_att\.running_(keys|values))")
ENC, DEC = "encoder.layers.", "decoder.layers."
_FCS = {"fc_q": "q", "fc_k": "k_proj", "fc_v": "v", "fc_o": "o"}  # LScaledDotProductAttention's linears
_FFN = {"pwff.fc1": "ffn.w1", "pwff.fc2": "ffn.w2"}


def _attention(src: str, dst: str) -> dict[str, str]:
    return {f"{src}.attention.{a}": f"{dst}.{b}" for a, b in _FCS.items()}


#: released module -> capflow module, per encoder and decoder layer (in the released order)
_ENCODER_LAYER = {**_attention("mhatt", "mix"), "mhatt.layer_norm": "sub1.inner_norm", "lnorm": "sub1.norm", **_FFN,
                  "pwff.layer_norm": "sub2.norm"}
_DECODER_LAYER = {**_attention("self_att", "self_mix"), "self_att.layer_norm": "sub1.inner_norm", "lnorm1": "sub1.norm",
                  **_attention("enc_att", "cross"), "enc_att.layer_norm": "sub2.inner_norm", "lnorm2": "sub2.norm",
                  **_FFN, "pwff.layer_norm": "sub3.norm"}


def _key_table(n_enc: int, n_dec: int, rows: list[int]) -> list[Entry]:
    table = pairs("encoder.", "", {"fc": "input_proj", "layer_norm": "input_norm"})
    table += [e for i in range(n_enc) for e in pairs(f"{ENC}{i}.", f"encoder.layers.{i}.", _ENCODER_LAYER)]
    table += [e for i in range(n_dec) for e in pairs(f"{DEC}{i}.", f"decoder.layers.{i}.", _DECODER_LAYER)]
    return [*table, ("decoder.word_emb.weight", "embed.weight", lambda t: permute_vocab_rows(t, rows)),
            ("decoder.fc.weight", "generator.weight", lambda t: permute_vocab_rows(t, rows)),
            ("decoder.pos_emb.weight", "pe")]  # the released table as stored (see encoder_decoder)


def _lw_config(sd: dict[str, torch.Tensor], words: list[str], heads: int) -> ArchConfig:
    """The sizes from the shapes: groups k from ``fc_q``'s input width d/k, the per-head query/key width d_k from
    its output h*d_k/k, the G-FFN or dense FFN from ``fc2``, max_len from the position table's rows - 1."""
    fc_q = f"{ENC}0.mhatt.attention.fc_q.weight"
    d, d_in = sd["encoder.fc.weight"].shape
    q_out, q_in = sd[fc_q].shape  # Linear(d/k, h*d_k/k)
    if d % q_in or d % heads:
        raise ImportCheckpointError(f"{fc_q} takes {q_in} inputs: d_model {d} must be a multiple of it and of "
                                    f"--heads {heads}")
    groups = d // q_in
    d_v = d // heads
    v_out = sd.get(f"{ENC}0.mhatt.attention.fc_v.weight", torch.empty(0, 0)).shape[0]
    if heads % groups or (q_out * groups) % heads or (v_out and v_out * groups != d):
        raise ImportCheckpointError(f"{groups} groups, {heads} heads, fc_q/fc_v outputs {q_out}/{v_out} per group: "
                                    f"capflow's group-wise attention needs heads divisible by the groups and "
                                    f"d_v = d_model/heads = {d_v} (give the right --heads)")
    d_k = q_out * groups // heads
    if d_k % d_v:
        raise ImportCheckpointError(f"the query/key width per head {d_k} is not a multiple of d_v {d_v}")
    d_ff = sd[f"{ENC}0.pwff.fc1.weight"].shape[0] if f"{ENC}0.pwff.fc1.weight" in sd else 0
    ffn = "dense" if groups == 1 or sd[f"{ENC}0.pwff.fc2.weight"].shape[0] == d else "grouped"
    return released(preset("lw-1x")).replace(
        d_model=d, d_in=d_in, heads=heads, d_ff=d_ff, enc_layers=count_layers(sd, ENC),
        dec_layers=count_layers(sd, DEC), groups=groups, qk_expand=d_k // d_v, ffn=ffn, vocab_size=len(words),
        bos=1, eos=2, max_len=sd["decoder.pos_emb.weight"].shape[0] - 1)


def convert_lw(sd: dict[str, torch.Tensor], words: list[str], *, heads: int = 8) -> Converted:
    """Released LW-Transformer state dict (``Transformer(bos, LTransformerEncoder, LTransformerDecoderLayer)``)
    -> (capflow config, capflow state dict, capflow word list), in the ``m2`` skeleton (``lw-*@released``).

    ``words``: the released vocabulary's ``itos`` (id order, ``<unk> <pad> <bos> <eos>`` among them). The sizes
    come from the shapes: groups k from ``fc_q``'s input width d/k, the per-head query/key width d_k (lw 1x/2x/3x
    = 64/128/192 at d=512) from its output h*d_k/k, the G-FFN (``--LFFN``) or dense FFN from ``fc2``, max_len
    from the position table's rows - 1; ``heads`` is not stored."""
    sd = dict(sd)
    require(sd, ["encoder.fc.weight", f"{ENC}0.mhatt.attention.fc_q.weight", f"{ENC}0.pwff.fc2.weight",
                 "decoder.word_emb.weight", "decoder.pos_emb.weight", "decoder.fc.weight"], "lw")
    rows, kept = specials_last(words, LW_SPECIALS)
    for key in ("decoder.word_emb.weight", "decoder.fc.weight"):
        if sd[key].shape[0] != len(words):
            raise ImportCheckpointError(f"{key} has {sd[key].shape[0]} rows, the vocabulary {len(words)} words "
                                        "(specials included)")
    cfg = _lw_config(sd, words, heads)
    keys = KeyMap(sd, "lw")
    keys.apply(_key_table(cfg.enc_layers, cfg.dec_layers, rows))
    keys.known(k for k in sd if _LW_STATES.fullmatch(k))
    return Converted(cfg, keys.report(), kept)


def load_lw(codebase: str, ckpt: str | Path, vocab: str | Path, options: ImportOptions) -> Converted:
    """``import_checkpoint`` for lw: the weights, then the id-ordered vocabulary."""
    return convert_lw(load_state_dict(ckpt), read_id_words(vocab), heads=options.heads)
