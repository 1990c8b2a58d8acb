"""Import the papers' released checkpoints into capflow (the ``released`` flavours, :func:`registry.released`).

Supported: the Annotated-Transformer-based captioners of ruotianluo's self-critical.pytorch code base -
``aic`` (``TransformerModel``), ``satic`` (YuanEZhou/satic ``SAT``) and ``zodiac`` (zanyarz/zodiac
``ZTransformerModel``). Their state dicts name the parts::

    att_embed.0.{weight,bias}                                   -> input_proj   (Linear(d_in, d), ReLU, Dropout)
    model.{encoder,decoder}.layers.i.self_attn.linears.j.*      -> ...mix / self_mix: q, k_proj, v, o
                                                                   (ZoDIAC: q, q2, k_proj, v, o)
    model.decoder.layers.i.src_attn.linears.j.*                 -> decoder.layers.i.cross
    model.{encoder,decoder}.layers.i.feed_forward.w_{1,2}.*     -> ...ffn.w1 / w2
    model.{encoder,decoder}.layers.i.sublayer.j.norm.{a_2,b_2}  -> ...sub{j+1}.norm.{weight,bias}
    model.{encoder,decoder}.norm.{a_2,b_2}                      -> {encoder,decoder}.norm.{weight,bias}
    model.tgt_embed.0.lut.weight, model.generator.proj.*        -> embed, generator (ids remapped)
    model.tgt_embed.1.pe                                        (the sinusoid table: checked, not copied)

ZoDIAC gate: the released ``ZTransformerModel`` (``--caption_model zodiac-sigmoid``) and ``ZTransformerModel2``
(``zodiac-tanh``) differ only in the gate's function, not in their keys or shapes, and the released run records
its ``caption_model`` only in a pickle (``infos_<id>.pkl``) that capflow does not read: the gate must be given
(``zodiac_gate=`` / ``--gate``), and an import without it is refused with that reason.

Ids: the released code uses 0 as BOS, EOS and padding and 1..V for the words of its ``ix_to_word``; capflow has
``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, the words, then ``<unk>``. The embedding rows are permuted accordingly
(``<bos>`` and ``<pad>`` take row 0), the generator's too (``<eos>`` takes row 0; ``<pad>`` and ``<bos>``, which
the released model cannot emit, get weight 0 and bias -1e9, so every other log-prob is unchanged). A released
word ``UNK`` becomes ``<unk>``.

Files are read with ``torch.load(weights_only=True)`` only: a checkpoint that needs arbitrary unpickling is
refused. Unknown or missing keys, and shapes that disagree, are errors naming them.

``expansionnet``: jchenghu/ExpansionNet's ``ExpansionNet`` (``models/Expansion_Net.py``; its attention and
feed-forward modules, ``models/layers/transformer_layers.py``, name their linears ``Wq``/``Wk``/``Wv``/
``out_linear`` and ``linear_1``/``linear_2`` - the same author's ExpansionNet_v2 ``models/layers.py`` shows the
same modules). Its checkpoint is ``{"model_state_dict": ...}`` (``utils/saving_utils.save_last_checkpoint``)::

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

``ort`` / ``acort``: jiahuei/sparse-image-captioning's ``RelationTransformerModel``
(``sparse_caption/models/relation_transformer.py``, built from ``sparse_caption/models/transformer.py``'s
Annotated-Transformer parts). Its checkpoint (``model_best.pth``) is the bare ``state_dict()`` (``utils/training.py``
loads it with ``model.load_state_dict(torch.load(...))``), next to the run's ``config.json``::

    att_embed.0.*                                        -> input_proj
    model.encoder.layers.i.self_attn.linears.j.*         -> encoder.layers.i.mix: q, k_proj, v, o
                                                            (Share-kV: q, k_proj, o; Share-QK: q, v, o)
    model.encoder.layers.i.self_attn.WGs.h.{weight,bias} -> encoder.layers.i.geo.w row h (one Linear(64, 1) per
                                                            head; columns permuted, see below)
    model.decoder.layers.i.{self_attn,src_attn}.linears.j.*  -> decoder.layers.i.{self_mix,cross} (as above)
    feed_forward / sublayer.j.norm / {encoder,decoder}.norm / tgt_embed / generator   as for aic

Box embedding channels: the released ``BoxRelationalEmbedding`` lays out ``[sin | cos]`` outermost, then the
four deltas (dx, dy, dw, dh), then the 8 frequencies (released channel ``s*32 + c*8 + f``); capflow's
:class:`~captioning.models.layers.BoxGeometry` puts the delta outermost (``c*16 + s*8 + f``). The per-head weight
columns are permuted accordingly (:func:`box_channel_permutation`); the deltas, the frequencies
``1000^(-f/8)``, the scale 100 and the ``+1`` on widths are the same.

Sharing: cross-layer sharing (``share_layer_encoder/decoder``: ``layers = [copies[i] for i in share_layer]``)
writes every position's keys, the shared ones holding equal tensors; the map is read from the weights (positions
whose tensors are all equal share a capflow layer). Attention sharing (``share_att_encoder/decoder``) leaves 3
linears instead of 4: ``kv`` = (W_Q, W_K = W_V, W_O), ``qk`` = (W_Q = W_K, W_V, W_O). The two have the same
shapes, so which one it is comes from the released ``config.json`` beside the checkpoint (or ``share_att=``);
capflow has one sharing option for every attention, so the encoder's and the decoder's must agree.

Vocabulary: the released tokenizer is a SentencePiece word model (``sparse_caption/tokenizer.py``: ``--pad_id=0
--unk_id=1 --bos_id=2 --eos_id=3``); its ``tokenizer/word.vocab`` (``piece<TAB>score`` per line, id order) or a
JSON list of the pieces is the ``--vocab``. Words are the pieces from id 4 on, ``▁`` prefix removed.
``ort`` (word tokenizer) outputs the SentencePiece ids: a pure row permutation (``<pad>`` 0, ``<unk>`` 1,
``<bos>`` 2, ``<eos>`` 3 -> capflow's ``<pad>``, ``<unk>``, ``<bos>``, ``<eos>``, the words in id order), every
log-prob unchanged. ``acort`` (``RadixTokenizer``) outputs radix tokens ``0`` = pad, ``1..v`` = digit+1,
``v+1`` = BOS, ``v+2`` = EOS, exactly capflow's :class:`~captioning.data.text.RadixCodec` layout (no
permutation); word ``k`` (SentencePiece id ``k+4``) is the number ``k`` and ``<unk>`` the number after the last
word, as capflow's frequency rank. The released digit count is that of the number of words + 1; capflow's that of
the largest number: they differ only when the words + 1 are an exact power of ``v`` (refused).

``lw``: luogen1996/LWTransformer's image-captioning model (``ImageCaptioning/train.py --model lwtransformer``:
``Transformer(bos, LTransformerEncoder, LTransformerDecoderLayer)`` of ``models/transformer_lightweight``, on the
M2-Transformer code base), into the ``m2`` skeleton (:mod:`captioning.models.encoder_decoder`)::

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
specials move to capflow's places, a pure row permutation (every log-prob unchanged). The released training
checkpoint (``saved_models/<exp>_best.pth``) also holds numpy RNG state, which ``weights_only`` refuses: save its
``state_dict`` entry alone. Not copied: the M2 encoder's region mask (see the skeleton's docstring).

Words that are not capflow words: a released vocabulary may hold tokens capflow's vocabulary cannot (the M2
``TextField`` vocabulary built with spaCy, LW-Transformer's ``vocab.pkl``, holds 6 whitespace tokens: ``' '``,
``'  '``, ``'\\n'``, ``'   '``, ``'\\n '``, ``'    '``). They are real rows of the embedding and output layers, so
they are kept, each under a name (:func:`capflow_word`): every whitespace character becomes ``<U+XXXX>`` (its code
point), e.g. ``' '`` -> ``<U+0020>``, ``'\\n '`` -> ``<U+000A><U+0020>``; an empty token becomes ``<empty>``. A
caption holding one prints that name (the released evaluation would print the whitespace, which its PTB
tokenizer then drops). A name that collides with another word is refused.

Not supported: ORT/ACORT checkpoints without the trigonometric box embedding (``--no_box_trigonometric_embedding``,
4-d geometry) and the pruning variants (``relation_transformer_prune.py``, whose masks are unknown keys).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from captioning.errors import InputError
from captioning.models.encoder_decoder import ArchConfig, Captioner
from captioning.models.layers import sinusoid_table
from captioning.models.registry import preset, released

ANNOTATED = ("aic", "satic", "zodiac")
RELATION = ("ort", "acort")
FAMILIES = (*ANNOTATED, *RELATION, "expansionnet", "lw")
EXPANSIONNET_SPECIALS = ("PAD", "SOS", "EOS", "UNK")  # -> <pad>, <bos>, <eos>, <unk>
LW_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # the M2 TextField's tokens, same names as capflow's
# the M2 containers' decoding states (register_state buffers, empty outside beam search): known, not weights
_LW_STATES = re.compile(
    r"decoder\.(running_mask_self_attention|running_seq|layers\.\d+\.self_att\.running_(keys|values))")
SP_SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")  # the released SentencePiece ids 0..3
ZODIAC_GATES = ("sigmoid", "tanh")  # the released --caption_model zodiac-sigmoid / zodiac-tanh
_NEVER = -1e9  # generator bias of classes the released model cannot emit


class ImportCheckpointError(InputError, ValueError):
    """A checkpoint that cannot be imported; the message names the keys or the reason."""


def load_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A released checkpoint's state dict, read with ``weights_only=True`` (a bare state dict, or one nested
    under ``model``/``state_dict``/``model_state_dict``)."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ImportCheckpointError(f"no checkpoint at {path}") from None
    except Exception as e:  # pickle errors have many types
        raise ImportCheckpointError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {e}); capflow does not "
            "unpickle arbitrary objects: save the model's state_dict() alone (torch.save(model.state_dict(), ...))"
        ) from None
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ImportCheckpointError(f"{path} does not hold a state dict of tensors")
    return dict(obj)


def _count(sd: dict[str, torch.Tensor], prefix: str) -> int:
    ids = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if ids != set(range(len(ids))):
        raise ImportCheckpointError(f"layers {sorted(ids)} under {prefix} are not 0..n-1")
    return len(ids)


def convert_annotated(sd: dict[str, torch.Tensor], family: str, words: list[str], *, heads: int = 8,
                      group_size: int | None = None, zodiac_gate: str | None = None
                      ) -> tuple[ArchConfig, dict[str, torch.Tensor], list[str]]:
    """Released state dict (AIC/SATIC/ZoDIAC) -> (capflow config, capflow state dict, capflow word list).

    ``words``: the released ``ix_to_word`` in id order (word ids 1..V). Returns the words capflow's
    vocabulary holds (``UNK`` removed: it becomes ``<unk>``). ``zodiac_gate`` (``sigmoid`` | ``tanh``): the
    released ZoDIAC model class, which its weights cannot tell (module docstring); required for ``zodiac``."""
    if family not in ANNOTATED:
        raise ImportCheckpointError(f"unknown family {family!r}: one of {', '.join(ANNOTATED)}")
    if family == "satic" and not group_size:
        raise ImportCheckpointError("a SATIC checkpoint needs its group size K (not stored in the weights)")
    if family == "zodiac" and zodiac_gate not in ZODIAC_GATES:
        raise ImportCheckpointError(
            "a ZoDIAC checkpoint needs its gate: the released zodiac-sigmoid (ZTransformerModel) and zodiac-tanh "
            "(ZTransformerModel2) models have the same keys and shapes, and the released run records which in a "
            "pickle capflow does not read; give the run's --caption_model as --gate sigmoid or --gate tanh"
            + ("" if zodiac_gate is None else f" (not {zodiac_gate!r})"))
    if family != "zodiac" and zodiac_gate is not None:
        raise ImportCheckpointError(f"--gate is for zodiac checkpoints, not {family}")
    sd = dict(sd)
    need = ["att_embed.0.weight", "model.tgt_embed.0.lut.weight", "model.generator.proj.weight"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise ImportCheckpointError(f"not a released {family} state dict: missing {', '.join(missing)}")
    d, d_in = sd["att_embed.0.weight"].shape
    n_enc, n_dec = _count(sd, "model.encoder.layers."), _count(sd, "model.decoder.layers.")
    d_ff = sd["model.encoder.layers.0.feed_forward.w_1.weight"].shape[0]
    n_out = sd["model.generator.proj.weight"].shape[0]
    if n_out != len(words) + 1:
        raise ImportCheckpointError(f"the checkpoint has {n_out} output classes, the vocabulary {len(words)} words "
                                    "+ 1 (id 0 = BOS/EOS)")
    kept = [w for w in words if w != "UNK"]
    vocab_size = 3 + len(kept) + 1  # <pad> <bos> <eos> words <unk>
    base = {"aic": "aic", "satic": "aic", "zodiac": f"zodiac-{zodiac_gate}"}[family]
    cfg = released(preset(base)).replace(
        d_model=d, d_in=d_in, heads=heads, d_ff=d_ff, enc_layers=n_enc, dec_layers=n_dec, vocab_size=vocab_size,
        bos=1, eos=2, group_size=group_size or 1)
    # SATIC and AIC release a standard FFN; ZoDIAC's released classes have none (registry.released)
    linears = ("q", "q2", "k_proj", "v", "o") if family == "zodiac" else ("q", "k_proj", "v", "o")

    keys = _Keys(sd)
    take, out, used = keys.take, keys.out, keys.used
    take("att_embed.0.weight", "input_proj.weight")
    take("att_embed.0.bias", "input_proj.bias")
    for stack, n in (("encoder", n_enc), ("decoder", n_dec)):
        attns = [("self_attn", "mix")] if stack == "encoder" else [("self_attn", "self_mix"), ("src_attn", "cross")]
        for i in range(n):
            src, dst = f"model.{stack}.layers.{i}.", f"{stack}.layers.{i}."
            for a_src, a_dst in attns:
                for j, name in enumerate(linears):
                    for p in ("weight", "bias"):
                        take(f"{src}{a_src}.linears.{j}.{p}", f"{dst}{a_dst}.{name}.{p}")
            keys.take_all(_ffn_and_norms(src, dst, len(attns) + 1))
        take(f"model.{stack}.norm.a_2", f"{stack}.norm.weight")
        take(f"model.{stack}.norm.b_2", f"{stack}.norm.bias")

    # ids: capflow id -> released row
    rows = {0: 0, 1: 0, 2: 0}
    unk_row = None
    for rid, w in enumerate(words, start=1):
        if w == "UNK":
            unk_row = rid
        else:
            rows[3 + kept.index(w)] = rid
    lut, proj_w = sd["model.tgt_embed.0.lut.weight"], sd["model.generator.proj.weight"]
    proj_b = sd.get("model.generator.proj.bias")
    if proj_b is None:
        raise ImportCheckpointError("missing key model.generator.proj.bias")
    used.update({"model.tgt_embed.0.lut.weight", "model.generator.proj.weight", "model.generator.proj.bias"})
    unk = vocab_size - 1
    emb = lut.new_zeros(vocab_size, d)
    gen_w, gen_b = proj_w.new_zeros(vocab_size, d), proj_b.new_full((vocab_size,), _NEVER)
    for c, r in rows.items():
        emb[c] = lut[r]
    for c, r in rows.items():
        if c >= 2:  # <eos> (row 0) and the words
            gen_w[c], gen_b[c] = proj_w[r], proj_b[r]
    if unk_row is not None:
        emb[unk], gen_w[unk], gen_b[unk] = lut[unk_row], proj_w[unk_row], proj_b[unk_row]
    out.update({"embed.weight": emb, "generator.weight": gen_w, "generator.bias": gen_b})

    _check_rest(sd, used, family, d)
    return cfg, out, kept


class _Keys:
    """Released tensors taken into a capflow state dict (``out``); a missing key is an error naming it, and
    ``used`` collects what was read (the rest are unknown keys: :func:`_check_unknown`)."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd = sd
        self.out: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()

    def get(self, src: str) -> torch.Tensor:
        if src not in self.sd:
            raise ImportCheckpointError(f"missing key {src}")
        self.used.add(src)
        return self.sd[src]

    def take(self, src: str, dst: str) -> None:
        self.out[dst] = self.get(src)

    def take_all(self, pairs: list[tuple[str, str]]) -> None:
        for src, dst in pairs:
            self.take(src, dst)


_WB = (("weight", "weight"), ("bias", "bias"))  # nn.Linear / nn.LayerNorm parameters
_AB = (("a_2", "weight"), ("b_2", "bias"))  # the Annotated Transformer's LayerNorm parameters


def _pairs(src: str, dst: str, modules: dict[str, str], params=_WB) -> list[tuple[str, str]]:
    """(released key, capflow key) for every parameter of every module: ``src + module + "." + param``."""
    return [(f"{src}{m}.{p}", f"{dst}{c}.{q}") for m, c in modules.items() for p, q in params]


def _ffn_and_norms(src: str, dst: str, n_sub: int) -> list[tuple[str, str]]:
    """An Annotated-Transformer layer's feed-forward and sublayer norms (AIC/SATIC/ZoDIAC, ORT/ACORT)."""
    ffn = _pairs(src, dst, {"feed_forward.w_1": "ffn.w1", "feed_forward.w_2": "ffn.w2"})
    return ffn + _pairs(src, dst, {f"sublayer.{j}.norm": f"sub{j + 1}.norm" for j in range(n_sub)}, _AB)


def _check_unknown(sd: dict[str, torch.Tensor], used: set[str], family: str) -> None:
    unknown = sorted(set(sd) - used)
    if unknown:
        raise ImportCheckpointError(f"unknown keys in the released {family} state dict: {', '.join(unknown)}")


def _specials_last(words: list[str], specials: tuple[str, str, str, str]) -> tuple[torch.Tensor, list[str]]:
    """A released vocabulary holding every special (id order) -> (``perm``, capflow's words): capflow id ``c`` is
    released id ``perm[c]``, for capflow's order ``<pad>``, ``<bos>``, ``<eos>``, the words in released id
    order, ``<unk>`` (``specials`` names the released pad, bos, eos and unk tokens). A pure permutation of the
    embedding and output rows: every log-prob is unchanged."""
    absent = [w for w in specials if w not in words]
    if absent:
        raise ImportCheckpointError(f"the vocabulary lacks the released special words {', '.join(absent)}")
    if len(set(words)) != len(words):
        raise ImportCheckpointError("the vocabulary has duplicate words")
    index = {w: i for i, w in enumerate(words)}
    kept = [w for w in words if w not in specials]
    pad, bos, eos, unk = specials
    order = [index[pad], index[bos], index[eos], *(index[w] for w in kept), index[unk]]
    return torch.tensor(order), kept


def _check_rest(sd: dict[str, torch.Tensor], used: set[str], family: str, d: int) -> None:
    """The Annotated-Transformer tail: the stored position table must be capflow's sinusoid table (checked, not
    copied), and every other key must have been used."""
    pe = sd.get("model.tgt_embed.1.pe")
    if pe is not None:
        used.add("model.tgt_embed.1.pe")
        table = sinusoid_table(min(pe.shape[-2], 64), d)
        if not torch.allclose(pe.reshape(-1, d)[: table.shape[0]].float(), table, atol=1e-4):
            raise ImportCheckpointError("model.tgt_embed.1.pe is not the sinusoid table capflow uses")
    _check_unknown(sd, used, family)


def convert_expansionnet(sd: dict[str, torch.Tensor], words: list[str], *, heads: int = 8
                         ) -> tuple[ArchConfig, dict[str, torch.Tensor], list[str]]:
    """Released ExpansionNet state dict -> (capflow config, capflow state dict, capflow word list).

    ``words``: the released ``caption_idx2word_list`` (id order 0..V-1, ``PAD``/``SOS``/``EOS``/``UNK`` among
    them). The sizes (d, layers, expansion counts, max_len) come from the shapes; ``heads`` is not stored."""
    sd = dict(sd)
    need = ["input_linear.weight", "out_embedder.embed.weight", "vocab_linear.weight", "pos_encoder.weight",
            "encoders.0.stc_exp.query_exp_vectors.weight", "decoders.0.dyn_exp.query_exp_vectors.weight",
            "encoders.0.ff.linear_1.weight"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise ImportCheckpointError(f"not a released expansionnet state dict: missing {', '.join(missing)}")
    perm, kept = _specials_last(words, EXPANSIONNET_SPECIALS)
    n_out = sd["vocab_linear.weight"].shape[0]
    if n_out != len(words) or sd["out_embedder.embed.weight"].shape[0] != len(words):
        raise ImportCheckpointError(f"the checkpoint has {n_out} output classes, the vocabulary {len(words)} words "
                                    "(specials included)")
    d, d_in = sd["input_linear.weight"].shape
    if d % heads:
        raise ImportCheckpointError(f"d_model {d} is not a multiple of --heads {heads}")
    n_enc, n_dec = _count(sd, "encoders."), _count(sd, "decoders.")
    cfg = released(preset("expansionnet")).replace(
        d_model=d, d_in=d_in, heads=heads, d_ff=sd["encoders.0.ff.linear_1.weight"].shape[0], enc_layers=n_enc,
        dec_layers=n_dec, vocab_size=len(words), bos=1, eos=2, max_len=sd["pos_encoder.weight"].shape[0],
        expansion_enc=sd["encoders.0.stc_exp.query_exp_vectors.weight"].shape[0],
        expansion_dec=sd["decoders.0.dyn_exp.query_exp_vectors.weight"].shape[0])

    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(src: str, dst: str, params=("weight", "bias")) -> None:
        for p in params:
            key = f"{src}.{p}" if p else src
            if key not in sd:
                raise ImportCheckpointError(f"missing key {key}")
            out[f"{dst}.{p}" if p else dst] = sd[key]
            used.add(key)

    take("input_linear", "input_proj")
    expansion = {"key_embed": "key", "key_linear": "key", "cond_embed": "cond", "class_a_embed": "val_a",
                 "class_b_embed": "val_b", "selector_embed": "select"}
    for stack, src_stack, block, dst_block in (("encoder", "encoders", "stc_exp", "mix"),
                                               ("decoder", "decoders", "dyn_exp", "self_mix")):
        for i in range(n_enc if stack == "encoder" else n_dec):
            src, dst = f"{src_stack}.{i}.", f"{stack}.layers.{i}."
            take(f"{src}{block}.query_exp_vectors.weight", f"{dst}{dst_block}.queries", params=("",))
            take(f"{src}{block}.bias_exp_vectors.weight", f"{dst}{dst_block}.biases", params=("",))
            names = ("key_embed", "class_a_embed", "class_b_embed", "selector_embed") if stack == "encoder" else \
                ("cond_embed", "key_linear", "class_a_embed", "class_b_embed", "selector_embed")
            for name in names:
                take(f"{src}{block}.{name}", f"{dst}{dst_block}.{expansion[name]}")
            if stack == "decoder":
                for name, mine in (("Wq", "q"), ("Wk", "k_proj"), ("Wv", "v"), ("out_linear", "o")):
                    take(f"{src}mha.{name}", f"{dst}cross.{mine}")
            take(f"{src}ff.linear_1", f"{dst}ffn.w1")
            take(f"{src}ff.linear_2", f"{dst}ffn.w2")
            for j in range(1, (2 if stack == "encoder" else 3) + 1):
                take(f"{src}norm_{j}", f"{dst}sub{j}.norm")
        take(f"{stack[:3]}_reduce_group", f"{stack}.w_r")
        take(f"{stack[:3]}_reduce_norm", f"{stack}.norm")
    take("pos_encoder", "pos", params=("weight",))

    # ids: capflow id -> released row (a permutation: the released vocabulary holds every special)
    for key in ("out_embedder.embed.weight", "vocab_linear.weight", "vocab_linear.bias"):
        if key not in sd:
            raise ImportCheckpointError(f"missing key {key}")
        used.add(key)
    out["embed.weight"] = sd["out_embedder.embed.weight"][perm]
    out["generator.weight"] = sd["vocab_linear.weight"][perm]
    out["generator.bias"] = sd["vocab_linear.bias"][perm]
    _check_unknown(sd, used, "expansionnet")
    return cfg, out, kept


def convert_lw(sd: dict[str, torch.Tensor], words: list[str], *, heads: int = 8
               ) -> tuple[ArchConfig, dict[str, torch.Tensor], list[str]]:
    """Released LW-Transformer state dict (``Transformer(bos, LTransformerEncoder, LTransformerDecoderLayer)``)
    -> (capflow config, capflow state dict, capflow word list), in the ``m2`` skeleton (``lw-*@released``).

    ``words``: the released vocabulary's ``itos`` (id order, ``<unk> <pad> <bos> <eos>`` among them). The sizes
    come from the shapes: groups k from ``fc_q``'s input width d/k, the per-head query/key width d_k (lw 1x/2x/3x
    = 64/128/192 at d=512) from its output h*d_k/k, the G-FFN (``--LFFN``) or dense FFN from ``fc2``, max_len
    from the position table's rows - 1; ``heads`` is not stored."""
    sd = dict(sd)
    enc, dec = "encoder.layers.", "decoder.layers."
    fc_q = f"{enc}0.mhatt.attention.fc_q.weight"
    need = ["encoder.fc.weight", fc_q, f"{enc}0.pwff.fc2.weight", "decoder.word_emb.weight",
            "decoder.pos_emb.weight", "decoder.fc.weight"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise ImportCheckpointError(f"not a released lw state dict: missing {', '.join(missing)}")
    perm, kept = _specials_last(words, LW_SPECIALS)
    for key in ("decoder.word_emb.weight", "decoder.fc.weight"):
        if sd[key].shape[0] != len(words):
            raise ImportCheckpointError(f"{key} has {sd[key].shape[0]} rows, the vocabulary {len(words)} words "
                                        "(specials included)")
    d, d_in = sd["encoder.fc.weight"].shape
    q_out, q_in = sd[fc_q].shape  # Linear(d/k, h*d_k/k)
    if d % q_in or d % heads:
        raise ImportCheckpointError(f"{fc_q} takes {q_in} inputs: d_model {d} must be a multiple of it and of "
                                    f"--heads {heads}")
    groups = d // q_in
    d_v = d // heads
    v_out = sd.get(f"{enc}0.mhatt.attention.fc_v.weight", torch.empty(0, 0)).shape[0]
    if heads % groups or (q_out * groups) % heads or (v_out and v_out * groups != d):
        raise ImportCheckpointError(f"{groups} groups, {heads} heads, fc_q/fc_v outputs {q_out}/{v_out} per group: "
                                    f"capflow's group-wise attention needs heads divisible by the groups and "
                                    f"d_v = d_model/heads = {d_v} (give the right --heads)")
    d_k = q_out * groups // heads
    if d_k % d_v:
        raise ImportCheckpointError(f"the query/key width per head {d_k} is not a multiple of d_v {d_v}")
    d_ff = sd[f"{enc}0.pwff.fc1.weight"].shape[0] if f"{enc}0.pwff.fc1.weight" in sd else 0
    ffn = "dense" if groups == 1 or sd[f"{enc}0.pwff.fc2.weight"].shape[0] == d else "grouped"
    cfg = released(preset("lw-1x")).replace(
        d_model=d, d_in=d_in, heads=heads, d_ff=d_ff, enc_layers=_count(sd, enc), dec_layers=_count(sd, dec),
        groups=groups, qk_expand=d_k // d_v, ffn=ffn, vocab_size=len(words), bos=1, eos=2,
        max_len=sd["decoder.pos_emb.weight"].shape[0] - 1)

    keys = _Keys(sd)
    keys.take_all(_pairs("encoder.", "", {"fc": "input_proj", "layer_norm": "input_norm"}))
    fcs = {"fc_q": "q", "fc_k": "k_proj", "fc_v": "v", "fc_o": "o"}
    ffn_keys = {"pwff.fc1": "ffn.w1", "pwff.fc2": "ffn.w2"}
    for i in range(cfg.enc_layers):
        keys.take_all(_pairs(f"{enc}{i}.", f"encoder.layers.{i}.", {
            **{f"mhatt.attention.{a}": f"mix.{b}" for a, b in fcs.items()}, "mhatt.layer_norm": "sub1.inner_norm",
            "lnorm": "sub1.norm", **ffn_keys, "pwff.layer_norm": "sub2.norm"}))
    for i in range(cfg.dec_layers):
        keys.take_all(_pairs(f"{dec}{i}.", f"decoder.layers.{i}.", {
            **{f"self_att.attention.{a}": f"self_mix.{b}" for a, b in fcs.items()},
            "self_att.layer_norm": "sub1.inner_norm", "lnorm1": "sub1.norm",
            **{f"enc_att.attention.{a}": f"cross.{b}" for a, b in fcs.items()},
            "enc_att.layer_norm": "sub2.inner_norm", "lnorm2": "sub2.norm", **ffn_keys,
            "pwff.layer_norm": "sub3.norm"}))
    keys.used.update(k for k in sd if _LW_STATES.fullmatch(k))
    keys.out["embed.weight"] = keys.get("decoder.word_emb.weight")[perm]
    keys.out["generator.weight"] = keys.get("decoder.fc.weight")[perm]
    keys.out["pe"] = keys.get("decoder.pos_emb.weight")  # the released table as stored (see encoder_decoder)
    _check_unknown(sd, keys.used, "lw")
    return cfg, keys.out, kept


def box_channel_permutation(dim: int = 64) -> torch.Tensor:
    """``perm`` with capflow box-embedding channel ``j`` = released channel ``perm[j]``: capflow's channel
    ``c*2n + s*n + f`` (delta c, sin/cos s, frequency f; n = dim/8) is the released ``s*4n + c*n + f``."""
    n = dim // 8
    return torch.tensor([s * 4 * n + c * n + f for c in range(4) for s in range(2) for f in range(n)])


def _layer_keys(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}


def _sharing_map(sd: dict[str, torch.Tensor], prefix: str, n: int) -> tuple[int, ...]:
    """The released cross-layer sharing map read from the weights: positions whose tensors are all equal are one
    layer (ids by first position)."""
    layers = [_layer_keys(sd, f"{prefix}{i}.") for i in range(n)]
    ids: list[int] = []
    firsts: list[int] = []
    for i, mine in enumerate(layers):
        for lid, j in enumerate(firsts):
            other = layers[j]
            if mine.keys() == other.keys() and all(
                    mine[k].shape == other[k].shape and torch.equal(mine[k], other[k]) for k in mine):
                ids.append(lid)
                break
        else:
            ids.append(len(firsts))
            firsts.append(i)
    return tuple(ids)


def _n_linears(sd: dict[str, torch.Tensor], prefix: str) -> int:
    n = _count(sd, prefix)
    if n not in (3, 4):
        raise ImportCheckpointError(f"{prefix}: {n} linears (expected 4, or 3 with attention sharing)")
    return n


def _canonical_map(m: Any) -> tuple[int, ...] | None:
    """A released ``share_layer`` value (a list, or the command line's string ``"(0, 0, 1)"``) with ids renumbered
    by first position; None for no sharing."""
    if m is None or (isinstance(m, str) and m.strip().lower() in ("", "none", "null")):
        return None
    ids = [int(x) for x in re.findall(r"-?\d+", m)] if isinstance(m, str) else [int(x) for x in m]
    first = {v: i for i, v in enumerate(dict.fromkeys(ids))}
    return tuple(first[v] for v in ids)


def _share_att(v: Any) -> Any:
    return None if isinstance(v, str) and v.strip().lower() in ("", "none", "null") else v


def convert_relation(sd: dict[str, torch.Tensor], family: str, pieces: list[str], *, heads: int | None = None,
                     share_att_encoder: str | None = None, share_att_decoder: str | None = None,
                     radix_base: int | None = None, share_layer_encoder: Any = None, share_layer_decoder: Any = None
                     ) -> tuple[ArchConfig, dict[str, torch.Tensor], list[str]]:
    """Released ORT/ACORT state dict (``RelationTransformerModel``) -> (capflow config, state dict, words).

    ``pieces``: the released SentencePiece pieces in id order (``<pad> <unk> <bos> <eos>`` then the words).
    ``heads`` is checked against the per-head geometry linears (``WGs.h``); ``share_att_*`` (the released
    config's ``kv``/``qk``) is needed when the attentions have 3 linears; ``radix_base`` (``acort``) is checked
    against the output classes (``v + 3``), ``share_layer_*`` (the released config's maps) against the sharing
    read from the weights."""
    share_att_encoder, share_att_decoder = _share_att(share_att_encoder), _share_att(share_att_decoder)
    if family not in RELATION:
        raise ImportCheckpointError(f"unknown family {family!r}: one of {', '.join(RELATION)}")
    sd = dict(sd)
    enc, dec = "model.encoder.layers.", "model.decoder.layers."
    need = ["att_embed.0.weight", "model.tgt_embed.0.lut.weight", "model.generator.proj.weight",
            f"{enc}0.self_attn.WGs.0.weight", f"{dec}0.self_attn.linears.0.weight"]
    missing = [k for k in need if k not in sd]
    if missing:
        raise ImportCheckpointError(f"not a released {family} (RelationTransformerModel) state dict: missing "
                                    f"{', '.join(missing)}")
    if tuple(pieces[:4]) != SP_SPECIALS:
        raise ImportCheckpointError(f"the vocabulary's first pieces are {pieces[:4]}, not the released tokenizer's "
                                    f"{', '.join(SP_SPECIALS)} (ids 0..3)")
    d, d_in = sd["att_embed.0.weight"].shape
    n_heads = _count(sd, f"{enc}0.self_attn.WGs.")
    if heads is not None and heads != n_heads:
        raise ImportCheckpointError(f"the checkpoint has {n_heads} heads (geometry linears WGs.0..{n_heads - 1}), "
                                    f"not {heads}: give --heads {n_heads}")
    g_dim = sd[f"{enc}0.self_attn.WGs.0.weight"].shape[-1]
    if g_dim != 64:
        raise ImportCheckpointError(f"the geometry linears take {g_dim}-d box embeddings: only the trigonometric "
                                    "64-d embedding is supported (not --no_box_trigonometric_embedding)")
    if d % n_heads:
        raise ImportCheckpointError(f"d_model {d} is not a multiple of the {n_heads} heads")
    n_enc, n_dec = _count(sd, enc), _count(sd, dec)

    # attention sharing: 3 linears = kv or qk (same shapes: the released config says which)
    shares = []
    for where, given, prefixes in (
            ("encoder", share_att_encoder, [f"{enc}{i}.self_attn.linears." for i in range(n_enc)]),
            ("decoder", share_att_decoder, [f"{dec}{i}.{a}.linears." for i in range(n_dec)
                                            for a in ("self_attn", "src_attn")])):
        counts = {_n_linears(sd, p) for p in prefixes}
        if len(counts) != 1:
            raise ImportCheckpointError(f"the {where} attentions mix 3 and 4 linears")
        if given not in (None, "kv", "qk"):
            raise ImportCheckpointError(f"share_att_{where} {given!r}: one of kv, qk or none")
        if counts == {4}:
            if given is not None:
                raise ImportCheckpointError(f"share_att_{where}={given} but the {where} attentions have 4 linears")
            shares.append(None)
        elif given is None:
            raise ImportCheckpointError(
                f"the {where} attentions have 3 linears (attention sharing), and Share-kV and Share-QK have the same "
                f"shapes: put the released config.json (share_att_{where}) beside the checkpoint")
        else:
            shares.append(given)
    if shares[0] != shares[1]:
        raise ImportCheckpointError(f"share_att_encoder={shares[0]} but share_att_decoder={shares[1]}: capflow has one "
                                    "attention-sharing option for every attention")
    share = shares[0]
    enc_map, dec_map = _sharing_map(sd, enc, n_enc), _sharing_map(sd, dec, n_dec)
    for where, given, found in (("encoder", share_layer_encoder, enc_map), ("decoder", share_layer_decoder, dec_map)):
        if given is None:  # not said: the weights decide
            continue
        said = _canonical_map(given) or tuple(range(len(found)))
        if said != found:
            raise ImportCheckpointError(f"share_layer_{where}={given} but the weights share the {where} layers as "
                                        f"{found} (positions with equal tensors)")

    words = [p[1:] if p.startswith("\u2581") else p for p in pieces[4:]]
    n_out = sd["model.generator.proj.weight"].shape[0]
    if sd["model.tgt_embed.0.lut.weight"].shape[0] != n_out:
        raise ImportCheckpointError(f"model.tgt_embed.0.lut.weight has {sd['model.tgt_embed.0.lut.weight'].shape[0]} "
                                    f"rows, model.generator.proj.weight {n_out}")
    base_cfg = released(preset("ort-base" if family == "ort" else "acort-base"))
    if family == "ort":
        if n_out != len(pieces):
            raise ImportCheckpointError(f"the checkpoint has {n_out} output classes, the vocabulary {len(pieces)} "
                                        "pieces (specials included)")
        vocab_size, bos, eos, codec = n_out, 1, 2, "word"
    else:
        base = n_out - 3
        if radix_base is not None and radix_base != base:
            raise ImportCheckpointError(f"the checkpoint has {n_out} output classes = radix base {base} + 3, the "
                                        f"released config says radix_base {radix_base}")
        from captioning.data.text import RadixCodec

        num = len(pieces) - 3  # the released RadixTokenizer's count: words + <unk>
        released_digits, x = 0, num
        while x:
            released_digits, x = released_digits + 1, x // base
        if RadixCodec(base=base, num_words=num).digits != max(released_digits, 1):
            raise ImportCheckpointError(
                f"{len(words)} words + <unk> = {num} is a power of the radix base {base}: the released tokenizer "
                f"writes {released_digits} digits per word, capflow's codec one fewer")
        vocab_size, bos, eos, codec = n_out, base + 1, base + 2, "radix"
    cfg = base_cfg.replace(
        d_model=d, d_in=d_in, heads=n_heads, d_ff=sd[f"{enc}0.feed_forward.w_1.weight"].shape[0],
        enc_layers=n_enc, dec_layers=n_dec, vocab_size=vocab_size, bos=bos, eos=eos, codec=codec, geometry=True,
        share=share, enc_share=enc_map if len(set(enc_map)) < n_enc else None,
        dec_share=dec_map if len(set(dec_map)) < n_dec else None)

    keys = _Keys(sd)
    get, take, out, used = keys.get, keys.take, keys.out, keys.used
    linears = {None: ("q", "k_proj", "v", "o"), "kv": ("q", "k_proj", "o"), "qk": ("q", "v", "o")}[share]
    perm = box_channel_permutation(64)
    take("att_embed.0.weight", "input_proj.weight")
    take("att_embed.0.bias", "input_proj.bias")
    for stack, smap in (("encoder", enc_map), ("decoder", dec_map)):
        attns = [("self_attn", "mix")] if stack == "encoder" else [("self_attn", "self_mix"), ("src_attn", "cross")]
        firsts = {lid: pos for pos, lid in reversed(list(enumerate(smap)))}
        for lid, i in sorted(firsts.items()):
            src, dst = f"model.{stack}.layers.{i}.", f"{stack}.layers.{lid}."
            for a_src, a_dst in attns:
                for j, name in enumerate(linears):
                    for p in ("weight", "bias"):
                        take(f"{src}{a_src}.linears.{j}.{p}", f"{dst}{a_dst}.{name}.{p}")
            if stack == "encoder":
                w = torch.cat([get(f"{src}self_attn.WGs.{h}.weight") for h in range(n_heads)])  # (h, 64)
                out[f"{dst}geo.w.weight"] = w[:, perm]
                out[f"{dst}geo.w.bias"] = torch.cat([get(f"{src}self_attn.WGs.{h}.bias") for h in range(n_heads)])
            keys.take_all(_ffn_and_norms(src, dst, len(attns) + 1))
        for pos, lid in enumerate(smap):  # the shared positions: equal tensors (that is how smap was read)
            if pos != firsts[lid]:
                used.update(f"model.{stack}.layers.{pos}.{k}" for k in _layer_keys(sd, f"model.{stack}.layers.{pos}."))
        take(f"model.{stack}.norm.a_2", f"{stack}.norm.weight")
        take(f"model.{stack}.norm.b_2", f"{stack}.norm.bias")

    lut, proj_w, proj_b = (get("model.tgt_embed.0.lut.weight"), get("model.generator.proj.weight"),
                           get("model.generator.proj.bias"))
    if family == "ort":  # capflow <pad> <bos> <eos> words <unk> <- SentencePiece 0, 2, 3, 4.., 1
        rows, _ = _specials_last(pieces, ("<pad>", "<bos>", "<eos>", "<unk>"))
        lut, proj_w, proj_b = lut[rows], proj_w[rows], proj_b[rows]
    out.update({"embed.weight": lut, "generator.weight": proj_w, "generator.bias": proj_b})

    _check_rest(sd, used, family, d)
    return cfg, out, words


def read_pieces(path: str | Path) -> list[str]:
    """The released SentencePiece vocabulary in id order: ``word.vocab`` (``piece<TAB>score`` lines, written
    beside ``word.model``) or a JSON list of pieces."""
    path = Path(path)
    if path.suffix == ".json":
        from captioning.jsonio import read_json

        obj: Any = read_json(path, "vocabulary", ImportCheckpointError, missing=ImportCheckpointError)
        if not (isinstance(obj, list) and all(isinstance(w, str) for w in obj)):
            raise ImportCheckpointError(f"{path}: expected a JSON list of SentencePiece pieces (id order)")
        return list(obj)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ImportCheckpointError(f"vocabulary file {path} not found") from None
    except UnicodeDecodeError:
        raise ImportCheckpointError(f"{path} is not UTF-8 text: give the tokenizer's word.vocab (beside "
                                    "word.model), not the binary model") from None
    pieces = [line.split("\t")[0] for line in text.splitlines() if line.strip()]
    if not pieces:
        raise ImportCheckpointError(f"{path} holds no pieces")
    return pieces


def released_run_config(ckpt: str | Path) -> dict[str, Any]:
    """The released run's ``config.json`` beside the checkpoint (``utils/config.Config.save_config``), or {}."""
    from captioning.jsonio import read_json

    path = Path(ckpt).parent / "config.json"
    if not path.is_file():
        return {}
    obj = read_json(path, "released config", ImportCheckpointError)
    if not isinstance(obj, dict):
        raise ImportCheckpointError(f"{path} is not a JSON object")
    return obj


def build_imported(cfg: ArchConfig, state: dict[str, torch.Tensor], max_len: int | None = None) -> Captioner:
    """A capflow model holding the converted weights (shapes checked by ``load_state_dict``); ``max_len``
    overrides the config's (learned position tables fix it)."""
    model = Captioner(cfg if max_len is None else cfg.replace(max_len=max_len))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ImportCheckpointError(f"the conversion left capflow keys unset: {', '.join(missing)}")
    bad = [k for k, v in state.items() if tuple(own[k].shape) != tuple(v.shape)]
    if bad:
        raise ImportCheckpointError("shapes disagree: " + ", ".join(
            f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in bad))
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return model.eval()


def read_words(path: str | Path) -> list[str]:
    """The released vocabulary in id order: a JSON list of words (ids 1..V), or a JSON object with
    ``ix_to_word`` (``{"1": "a", ...}``, ruotianluo's ``cocotalk.json``) or that mapping itself."""
    from captioning.jsonio import read_json

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


def read_id_words(path: str | Path) -> list[str]:
    """A vocabulary in id order 0..V-1 (ExpansionNet, LW-Transformer): a JSON list (``caption_idx2word_list``,
    the M2 vocabulary's ``itos``), a word -> id object (``caption_word2idx_dict``, ``stoi``), or an object holding
    either under ``caption_idx2word_list``, ``idx2word_list``, ``itos``, ``caption_word2idx_dict``,
    ``word2idx_dict`` or ``stoi``. Pickles (the M2 code's ``vocab_<exp>.pkl``) are refused: capflow does not
    unpickle."""
    from captioning.jsonio import read_json

    if Path(path).suffix.lower() in (".pkl", ".pickle"):
        raise ImportCheckpointError(
            f"{path} is a pickle; capflow does not unpickle: write the vocabulary's id-ordered words as a JSON list "
            "where the released code runs, e.g. json.dump(pickle.load(open(PKL, 'rb')).itos, open('vocab.json', "
            "'w'))")
    obj: Any = read_json(path, "vocabulary", ImportCheckpointError, missing=ImportCheckpointError)
    if isinstance(obj, dict):
        for key in ("caption_idx2word_list", "idx2word_list", "itos", "caption_word2idx_dict", "word2idx_dict",
                    "stoi"):
            if key in obj:
                obj = obj[key]
                break
    if isinstance(obj, dict):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in obj.values()):
            raise ImportCheckpointError(f"{path}: a word -> id mapping needs integer ids")
        if sorted(obj.values()) != list(range(len(obj))):
            raise ImportCheckpointError(f"{path}: word ids must be 0..V-1")
        return sorted(obj, key=obj.__getitem__)
    if isinstance(obj, list) and all(isinstance(w, str) for w in obj):
        return list(obj)
    raise ImportCheckpointError(f"{path}: expected a JSON list of words (id order) or a word -> id mapping")


def capflow_word(word: str) -> str:
    """A released vocabulary token as a capflow vocabulary word: itself when it is one (no white space), else
    every white-space character written ``<U+XXXX>`` (``' '`` -> ``<U+0020>``), ``<empty>`` for an empty token
    (module docstring)."""
    if word == "":
        return "<empty>"
    return "".join(f"<U+{ord(c):04X}>" if c.isspace() else c for c in word)


def capflow_words(words: list[str]) -> list[str]:
    """:func:`capflow_word` of every word; a name equal to another word is refused."""
    out = [capflow_word(w) for w in words]
    seen: dict[str, str] = {}
    for w, c in zip(words, out, strict=True):
        if c in seen and seen[c] != w:
            raise ImportCheckpointError(f"the released tokens {seen[c]!r} and {w!r} both become the capflow word {c!r}")
        seen[c] = w
    return out


def import_checkpoint(family: str, path: str | Path, vocab_path: str | Path, *, heads: int = 8,
                      group_size: int | None = None, zodiac_gate: str | None = None,
                      released_acort_cache: bool = False):
    """Read a released checkpoint and its vocabulary -> (capflow model, capflow Vocabulary).

    ``zodiac_gate``: ``sigmoid`` or ``tanh``, required for ``zodiac`` (see :func:`convert_annotated`).
    ``released_acort_cache`` (``ort``/``acort``): the model decodes with the released step cache
    (``ArchConfig.released_acort_cache``: the published ACORT captions; off = the function it was trained with).
    Released tokens that are not capflow words are renamed (:func:`capflow_word`)."""
    from captioning.data.text import Vocabulary

    if family not in FAMILIES:
        raise ImportCheckpointError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")
    if released_acort_cache and family not in RELATION:
        raise ImportCheckpointError(f"the released step cache is the ORT/ACORT decoder's, not {family}'s")
    if family != "zodiac" and zodiac_gate is not None:
        raise ImportCheckpointError(f"--gate is for zodiac checkpoints, not {family}")
    if family in RELATION:
        run = released_run_config(path)
        if run.get("num_heads") is not None and int(run["num_heads"]) != heads:
            raise ImportCheckpointError(f"the released config.json says num_heads={run['num_heads']}, not {heads}: "
                                        f"give --heads {run['num_heads']}")
        tokenizer = run.get("tokenizer")
        if tokenizer is not None and tokenizer != ("word" if family == "ort" else "radix"):
            raise ImportCheckpointError(f"the released config.json says tokenizer={tokenizer!r}: import it with "
                                        f"--from {'acort' if tokenizer == 'radix' else 'ort'}")
        cfg, state, kept = convert_relation(
            load_state_dict(path), family, read_pieces(vocab_path), heads=heads,
            share_att_encoder=run.get("share_att_encoder"), share_att_decoder=run.get("share_att_decoder"),
            radix_base=run.get("radix_base") if family == "acort" else None,
            share_layer_encoder=run.get("share_layer_encoder"), share_layer_decoder=run.get("share_layer_decoder"))
        model = build_imported(cfg.replace(released_acort_cache=bool(released_acort_cache)), state)
        kept = capflow_words(kept)
        return model, Vocabulary(words=kept, counts=[0] * len(kept), radix_base=cfg.vocab_size - 3
                                 if family == "acort" else 768)
    if family == "expansionnet":
        words = read_id_words(vocab_path)
        cfg, state, kept = convert_expansionnet(load_state_dict(path), words, heads=heads)
    elif family == "lw":
        cfg, state, kept = convert_lw(load_state_dict(path), read_id_words(vocab_path), heads=heads)
    else:
        words = read_words(vocab_path)
        cfg, state, kept = convert_annotated(load_state_dict(path), family, words, heads=heads,
                                             group_size=group_size, zodiac_gate=zodiac_gate)
    model = build_imported(cfg, state)
    kept = capflow_words(kept)
    return model, Vocabulary(words=kept, counts=[0] * len(kept))
