"""The Annotated-Transformer captioners of ruotianluo's self-critical.pytorch code base: ``aic``
(``TransformerModel``), ``satic`` (YuanEZhou/satic ``SAT``) and ``zodiac`` (zanyarz/zodiac ``ZTransformerModel``).

Their state dicts name the parts (:func:`_key_table`)::

    att_embed.0.{weight,bias}                                   -> input_proj   (Linear(d_in, d), ReLU, Dropout)
    model.{encoder,decoder}.layers.i.self_attn.linears.j.*      -> ...mix / self_mix: q, k_proj, v, o
                                                                   (ZoDIAC: q, q2, k_proj, v, o)
    model.decoder.layers.i.src_attn.linears.j.*                 -> decoder.layers.i.cross
    model.{encoder,decoder}.layers.i.feed_forward.w_{1,2}.*     -> ...ffn.w1 / w2
    model.{encoder,decoder}.layers.i.sublayer.j.norm.{a_2,b_2}  -> ...sub{j+1}.norm.{weight,bias}
    model.{encoder,decoder}.norm.{a_2,b_2}                      -> {encoder,decoder}.norm.{weight,bias}
    model.tgt_embed.0.lut.weight, model.generator.proj.*        -> embed, generator (ids remapped)
    model.tgt_embed.1.pe                                        (the sinusoid table: checked, not copied)

The layers' feed-forward and sublayer norms, the stack norms and the position table are the Annotated
Transformer's, which the relation transformer (ORT/ACORT, :mod:`.relation`) shares: :func:`ffn_and_norms`,
:func:`check_position_table`.

ZoDIAC gate: the released ``ZTransformerModel`` (``--caption_model zodiac-sigmoid``) and ``ZTransformerModel2``
(``zodiac-tanh``) differ only in the gate's function, not in their keys or shapes, and the released run records
its ``caption_model`` only in a pickle (``infos_<id>.pkl``) that capflow does not read: the gate must be given
(``zodiac_gate=`` / ``--gate``), and an import without it is refused with that reason (:func:`check_zodiac_gate`).

Ids: the released code uses 0 as BOS, EOS and padding and 1..V for the words of its ``ix_to_word``; capflow has
``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, the words, then ``<unk>``. The embedding rows are permuted accordingly
(``<bos>`` and ``<pad>`` take row 0), the generator's too (``<eos>`` takes row 0; ``<pad>`` and ``<bos>``, which
the released model cannot emit, get weight 0 and bias -1e9, so every other log-prob is unchanged). A released
word ``UNK`` becomes ``<unk>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from captioning.jsonio import read_json
from captioning.models.layers import sinusoid_table
from captioning.models.registry import preset, released
from captioning.models.released.common import (
    NEVER,
    Converted,
    Entry,
    ImportCheckpointError,
    ImportOptions,
    KeyMap,
    count_layers,
    load_state_dict,
    pairs,
    permute_vocab_rows,
    require,
)

ANNOTATED = ("aic", "satic", "zodiac")
ZODIAC_GATES = ("sigmoid", "tanh")  # the released --caption_model zodiac-sigmoid / zodiac-tanh
AB = (("a_2", "weight"), ("b_2", "bias"))  # the Annotated Transformer's LayerNorm parameters
POSITION_TABLE = "model.tgt_embed.1.pe"


def attention_entries(src: str, dst: str, attns: list[tuple[str, str]], linears: tuple[str, ...]) -> list[Entry]:
    """An Annotated-Transformer layer's attentions: released ``{attn}.linears.j`` -> capflow ``{mixer}.{linears[j]}``
    for every (released attention, capflow mixer) of ``attns`` (AIC/SATIC/ZoDIAC, ORT/ACORT)."""
    return [e for a_src, a_dst in attns
            for e in pairs(src, dst, {f"{a_src}.linears.{j}": f"{a_dst}.{name}" for j, name in enumerate(linears)})]


def ffn_and_norms(src: str, dst: str, n_sub: int) -> list[Entry]:
    """An Annotated-Transformer layer's feed-forward and sublayer norms (AIC/SATIC/ZoDIAC, ORT/ACORT)."""
    ffn = pairs(src, dst, {"feed_forward.w_1": "ffn.w1", "feed_forward.w_2": "ffn.w2"})
    return ffn + pairs(src, dst, {f"sublayer.{j}.norm": f"sub{j + 1}.norm" for j in range(n_sub)}, AB)


def stack_attentions(stack: str) -> list[tuple[str, str]]:
    """(released attention, capflow mixer) of an encoder or decoder layer."""
    return [("self_attn", "mix")] if stack == "encoder" else [("self_attn", "self_mix"), ("src_attn", "cross")]


def check_position_table(keys: KeyMap, d: int) -> None:
    """The stored position table must be capflow's sinusoid table (checked, not copied)."""
    pe = keys.sd.get(POSITION_TABLE)
    if pe is not None:
        keys.known([POSITION_TABLE])
        table = sinusoid_table(min(pe.shape[-2], 64), d)
        if not torch.allclose(pe.reshape(-1, d)[: table.shape[0]].float(), table, atol=1e-4):
            raise ImportCheckpointError(f"{POSITION_TABLE} is not the sinusoid table capflow uses")


def check_zodiac_gate(codebase: str, gate: str | None) -> None:
    """The gate is given for a ZoDIAC checkpoint (its weights cannot tell it: module docstring), and only for one."""
    if codebase == "zodiac" and gate not in ZODIAC_GATES:
        raise ImportCheckpointError(
            "a ZoDIAC checkpoint needs its gate: the released zodiac-sigmoid (ZTransformerModel) and zodiac-tanh "
            "(ZTransformerModel2) models have the same keys and shapes, and the released run records which in a "
            "pickle capflow does not read; give the run's --caption_model as --gate sigmoid or --gate tanh"
            + ("" if gate is None else f" (not {gate!r})"))
    if codebase != "zodiac" and gate is not None:
        raise ImportCheckpointError(f"--gate is for zodiac checkpoints, not {codebase}")


def _vocab_rows(words: list[str], kept: list[str]) -> tuple[list[int | None], list[int | None]]:
    """(embedding rows, generator rows): capflow id -> released row (module docstring). The released row 0 is
    <bos>, <eos> and <pad> for the embedding, <eos> only for the generator; <unk> is the word ``UNK``'s row, none
    when the vocabulary has no ``UNK``."""
    slot: dict[str, int] = {}
    for c, w in enumerate(kept):
        slot.setdefault(w, c)
    word_rows: list[int | None] = [None] * len(kept)
    unk_row = None
    for rid, w in enumerate(words, start=1):
        if w == "UNK":
            unk_row = rid
        else:
            word_rows[slot[w]] = rid
    return [0, 0, 0, *word_rows, unk_row], [None, None, 0, *word_rows, unk_row]


def _key_table(codebase: str, n_enc: int, n_dec: int, words: list[str], kept: list[str]) -> list[Entry]:
    # SATIC and AIC release a standard FFN; ZoDIAC's released classes have none (registry.released)
    linears = ("q", "q2", "k_proj", "v", "o") if codebase == "zodiac" else ("q", "k_proj", "v", "o")
    table: list[Entry] = [("att_embed.0.weight", "input_proj.weight"), ("att_embed.0.bias", "input_proj.bias")]
    for stack, n in (("encoder", n_enc), ("decoder", n_dec)):
        attns = stack_attentions(stack)
        for i in range(n):
            src, dst = f"model.{stack}.layers.{i}.", f"{stack}.layers.{i}."
            table += attention_entries(src, dst, attns, linears) + ffn_and_norms(src, dst, len(attns) + 1)
        table += pairs(f"model.{stack}.", f"{stack}.", {"norm": "norm"}, AB)
    emb_rows, gen_rows = _vocab_rows(words, kept)
    return [*table, ("model.tgt_embed.0.lut.weight", "embed.weight", lambda t: permute_vocab_rows(t, emb_rows)),
            ("model.generator.proj.weight", "generator.weight", lambda t: permute_vocab_rows(t, gen_rows)),
            ("model.generator.proj.bias", "generator.bias", lambda t: permute_vocab_rows(t, gen_rows, NEVER))]


def convert_annotated(sd: dict[str, torch.Tensor], codebase: str, words: list[str], *, heads: int = 8,
                      group_size: int | None = None, zodiac_gate: str | None = None) -> Converted:
    """Released state dict (AIC/SATIC/ZoDIAC) -> (capflow config, capflow state dict, capflow word list).

    ``words``: the released ``ix_to_word`` in id order (word ids 1..V). Returns the words capflow's
    vocabulary holds (``UNK`` removed: it becomes ``<unk>``). ``zodiac_gate`` (``sigmoid`` | ``tanh``): the
    released ZoDIAC model class, which its weights cannot tell (module docstring); required for ``zodiac``."""
    if codebase not in ANNOTATED:
        raise ImportCheckpointError(f"unknown family {codebase!r}: one of {', '.join(ANNOTATED)}")
    if codebase == "satic" and not group_size:
        raise ImportCheckpointError("a SATIC checkpoint needs its group size K (not stored in the weights)")
    check_zodiac_gate(codebase, zodiac_gate)
    sd = dict(sd)
    require(sd, ["att_embed.0.weight", "model.tgt_embed.0.lut.weight", "model.generator.proj.weight"], codebase)
    d, d_in = sd["att_embed.0.weight"].shape
    n_enc, n_dec = count_layers(sd, "model.encoder.layers."), count_layers(sd, "model.decoder.layers.")
    d_ff = sd["model.encoder.layers.0.feed_forward.w_1.weight"].shape[0]
    n_out = sd["model.generator.proj.weight"].shape[0]
    if n_out != len(words) + 1:
        raise ImportCheckpointError(f"the checkpoint has {n_out} output classes, the vocabulary {len(words)} words "
                                    "+ 1 (id 0 = BOS/EOS)")
    kept = [w for w in words if w != "UNK"]
    base = {"aic": "aic", "satic": "aic", "zodiac": f"zodiac-{zodiac_gate}"}[codebase]
    cfg = released(preset(base)).replace(
        d_model=d, d_in=d_in, heads=heads, d_ff=d_ff, enc_layers=n_enc, dec_layers=n_dec,
        vocab_size=3 + len(kept) + 1, bos=1, eos=2, group_size=group_size or 1)  # <pad> <bos> <eos> words <unk>
    keys = KeyMap(sd, codebase)
    keys.apply(_key_table(codebase, n_enc, n_dec, words, kept))
    check_position_table(keys, d)
    return Converted(cfg, keys.report(), kept)


def read_words(path: str | Path) -> list[str]:
    """The released vocabulary in id order: a JSON list of words (ids 1..V), or a JSON object with
    ``ix_to_word`` (``{"1": "a", ...}``, ruotianluo's ``cocotalk.json``) or that mapping itself."""
    obj: Any = read_json(path, "vocabulary", ImportCheckpointError, missing=ImportCheckpointError)
    if isinstance(obj, dict):
        obj = obj.get("ix_to_word", obj)
        try:
            ids = sorted(int(k) for k in obj)
        except ValueError:
            raise ImportCheckpointError(f"{path}: ix_to_word keys must be integers") from None
        if ids != list(range(1, len(ids) + 1)):
            raise ImportCheckpointError(f"{path}: word ids must be 1..V")
        return [obj[str(i)] for i in ids]
    if isinstance(obj, list) and all(isinstance(w, str) for w in obj):
        return list(obj)
    raise ImportCheckpointError(f"{path}: expected a JSON list of words or an ix_to_word mapping")


def load_annotated(codebase: str, ckpt: str | Path, vocab: str | Path, options: ImportOptions) -> Converted:
    """``import_checkpoint`` for aic/satic/zodiac: the ``ix_to_word`` vocabulary, then the weights."""
    words = read_words(vocab)
    return convert_annotated(load_state_dict(ckpt), codebase, words, heads=options.heads,
                             group_size=options.group_size, zodiac_gate=options.zodiac_gate)
