"""``expansionnet``: jchenghu/ExpansionNet's ``ExpansionNet`` (``models/Expansion_Net.py``; its attention and
feed-forward modules, ``models/layers/transformer_layers.py``, name their linears ``Wq``/``Wk``/``Wv``/
``out_linear`` and ``linear_1``/``linear_2`` - the same author's ExpansionNet_v2 ``models/layers.py`` shows the
same modules).

Its checkpoint is ``{"model_state_dict": ...}`` (``utils/saving_utils.save_last_checkpoint``); its keys
(:func:`_key_table`)::

    input_linear.*                                         -> input_proj
    encoders.i.stc_exp.{query,bias}_exp_vectors.weight     -> encoder.layers.i.mix.{queries,biases}
    encoders.i.stc_exp.{key_embed,class_a_embed,class_b_embed,selector_embed}.*
                                                           -> ...mix.{key,val_a,val_b,select}
    decoders.i.dyn_exp.{cond_embed,key_linear,...}.*       -> decoder.layers.i.self_mix.{cond,key,...}
    decoders.i.mha.{Wq,Wk,Wv,out_linear}.*                 -> decoder.layers.i.cross.{q,k_proj,v,o}
    {encoders,decoders}.i.ff.linear_{1,2}.*                -> ...ffn.w{1,2}
    {encoders,decoders}.i.norm_j.*                         -> ...sub{j}.norm
    {enc,dec}_reduce_group.*, {enc,dec}_reduce_norm.*      -> {encoder,decoder}.w_r, {encoder,decoder}.norm
    out_embedder.embed.weight, pos_encoder.weight          -> embed (ids remapped), pos (max_len = its rows)
    vocab_linear.*                                         -> generator (ids remapped)

Its vocabulary (``caption_idx2word_list`` of ``data/mscoco2014_dataset_manager.py``: the sorted words with
``PAD``, ``SOS``, ``EOS`` and ``UNK`` among them, ids 0..V-1) holds every special, so the rows are a pure
permutation: ``PAD``/``SOS``/``EOS`` -> ``<pad>``/``<bos>``/``<eos>``, ``UNK`` -> ``<unk>``, the words in id
order between them; every log-prob is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

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

EXPANSIONNET_SPECIALS = ("PAD", "SOS", "EOS", "UNK")  # -> <pad>, <bos>, <eos>, <unk>
# the expansion modules' linears -> capflow's expansion mixers (models/expansion.py)
_EXPANSION = {"key_embed": "key", "key_linear": "key", "cond_embed": "cond", "class_a_embed": "val_a",
              "class_b_embed": "val_b", "selector_embed": "select"}
#: capflow stack -> (released stack, expansion block, capflow mixer, the block's linears, sublayer norms)
_STACKS = {"encoder": ("encoders", "stc_exp", "mix", ("key_embed", "class_a_embed", "class_b_embed", "selector_embed"),
                       2),
           "decoder": ("decoders", "dyn_exp", "self_mix",
                       ("cond_embed", "key_linear", "class_a_embed", "class_b_embed", "selector_embed"), 3)}
_CROSS = {"Wq": "q", "Wk": "k_proj", "Wv": "v", "out_linear": "o"}  # the decoder's cross-attention


def _layer_table(stack: str, i: int) -> list[Entry]:
    src_stack, block, mixer, linears, n_norms = _STACKS[stack]
    src, dst = f"{src_stack}.{i}.", f"{stack}.layers.{i}."
    modules = {f"{block}.{name}": f"{mixer}.{_EXPANSION[name]}" for name in linears}
    if stack == "decoder":
        modules.update({f"mha.{a}": f"cross.{b}" for a, b in _CROSS.items()})
    modules.update({"ff.linear_1": "ffn.w1", "ff.linear_2": "ffn.w2"})
    modules.update({f"norm_{j}": f"sub{j}.norm" for j in range(1, n_norms + 1)})
    return [(f"{src}{block}.query_exp_vectors.weight", f"{dst}{mixer}.queries"),
            (f"{src}{block}.bias_exp_vectors.weight", f"{dst}{mixer}.biases"), *pairs(src, dst, modules)]


def _key_table(n_enc: int, n_dec: int, rows: list[int]) -> list[Entry]:
    table = pairs("", "", {"input_linear": "input_proj"})
    for stack, n in (("encoder", n_enc), ("decoder", n_dec)):
        for i in range(n):
            table += _layer_table(stack, i)
        table += pairs("", f"{stack}.", {f"{stack[:3]}_reduce_group": "w_r", f"{stack[:3]}_reduce_norm": "norm"})
    table.append(("pos_encoder.weight", "pos.weight"))
    # ids: capflow id -> released row (a permutation: the released vocabulary holds every special)
    return table + [(src, dst, lambda t: permute_vocab_rows(t, rows)) for src, dst in (
        ("out_embedder.embed.weight", "embed.weight"), ("vocab_linear.weight", "generator.weight"),
        ("vocab_linear.bias", "generator.bias"))]


def convert_expansionnet(sd: dict[str, torch.Tensor], words: list[str], *, heads: int = 8) -> Converted:
    """Released ExpansionNet state dict -> (capflow config, capflow state dict, capflow word list).

    ``words``: the released ``caption_idx2word_list`` (id order 0..V-1, ``PAD``/``SOS``/``EOS``/``UNK`` among
    them). The sizes (d, layers, expansion counts, max_len) come from the shapes; ``heads`` is not stored."""
    sd = dict(sd)
    require(sd, ["input_linear.weight", "out_embedder.embed.weight", "vocab_linear.weight", "pos_encoder.weight",
                 "encoders.0.stc_exp.query_exp_vectors.weight", "decoders.0.dyn_exp.query_exp_vectors.weight",
                 "encoders.0.ff.linear_1.weight"], "expansionnet")
    rows, kept = specials_last(words, EXPANSIONNET_SPECIALS)
    n_out = sd["vocab_linear.weight"].shape[0]
    if n_out != len(words) or sd["out_embedder.embed.weight"].shape[0] != len(words):
        raise ImportCheckpointError(f"the checkpoint has {n_out} output classes, the vocabulary {len(words)} words "
                                    "(specials included)")
    d, d_in = sd["input_linear.weight"].shape
    if d % heads:
        raise ImportCheckpointError(f"d_model {d} is not a multiple of --heads {heads}")
    n_enc, n_dec = count_layers(sd, "encoders."), count_layers(sd, "decoders.")
    cfg = released(preset("expansionnet")).replace(
        d_model=d, d_in=d_in, heads=heads, d_ff=sd["encoders.0.ff.linear_1.weight"].shape[0], enc_layers=n_enc,
        dec_layers=n_dec, vocab_size=len(words), bos=1, eos=2, max_len=sd["pos_encoder.weight"].shape[0],
        expansion_enc=sd["encoders.0.stc_exp.query_exp_vectors.weight"].shape[0],
        expansion_dec=sd["decoders.0.dyn_exp.query_exp_vectors.weight"].shape[0])
    keys = KeyMap(sd, "expansionnet")
    keys.apply(_key_table(n_enc, n_dec, rows))
    return Converted(cfg, keys.report(), kept)


def load_expansionnet(codebase: str, ckpt: str | Path, vocab: str | Path, options: ImportOptions) -> Converted:
    """``import_checkpoint`` for expansionnet: the id-ordered vocabulary, then the weights."""
    words = read_id_words(vocab)
    return convert_expansionnet(load_state_dict(ckpt), words, heads=options.heads)
