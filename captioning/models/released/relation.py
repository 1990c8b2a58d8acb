"""``ort`` / ``acort``: jiahuei/sparse-image-captioning's ``RelationTransformerModel``
(``sparse_caption/models/relation_transformer.py``, built from ``sparse_caption/models/transformer.py``'s
Annotated-Transformer parts: :mod:`.annotated`).

Its checkpoint (``model_best.pth``) is the bare ``state_dict()`` (``utils/training.py`` loads it with
``model.load_state_dict(torch.load(...))``), next to the run's ``config.json`` (:func:`released_run_config`). Its
keys (:func:`_key_table`)::

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
JSON list of the pieces is the ``--vocab`` (:func:`read_pieces`). Words are the pieces from id 4 on, ``▁`` prefix
removed. ``ort`` (word tokenizer) outputs the SentencePiece ids: a pure row permutation (``<pad>`` 0, ``<unk>`` 1,
``<bos>`` 2, ``<eos>`` 3 -> capflow's ``<pad>``, ``<unk>``, ``<bos>``, ``<eos>``, the words in id order), every
log-prob unchanged. ``acort`` (``RadixTokenizer``) outputs radix tokens ``0`` = pad, ``1..v`` = digit+1,
``v+1`` = BOS, ``v+2`` = EOS, exactly capflow's :class:`~captioning.data.text.RadixCodec` layout (no
permutation); word ``k`` (SentencePiece id ``k+4``) is the number ``k`` and ``<unk>`` the number after the last
word, as capflow's frequency rank. The released digit count is that of the number of words + 1; capflow's that of
the largest number: they differ only when the words + 1 are an exact power of ``v`` (refused).

Not supported: checkpoints without the trigonometric box embedding (``--no_box_trigonometric_embedding``, 4-d
geometry) and the pruning variants (``relation_transformer_prune.py``, whose masks are unknown keys).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from captioning.data.text import RadixCodec
from captioning.jsonio import read_json
from captioning.models.encoder_decoder import ArchConfig
from captioning.models.registry import preset, released
from captioning.models.released.annotated import (
    AB,
    attention_entries,
    check_position_table,
    ffn_and_norms,
    stack_attentions,
)
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
    require,
    specials_last,
)

RELATION = ("ort", "acort")
SP_SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")  # the released SentencePiece ids 0..3
ENC, DEC = "model.encoder.layers.", "model.decoder.layers."
_VOCAB = {"model.tgt_embed.0.lut.weight": "embed.weight", "model.generator.proj.weight": "generator.weight",
          "model.generator.proj.bias": "generator.bias"}


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
    n = count_layers(sd, prefix)
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


def _geometry_heads(sd: dict[str, torch.Tensor], heads: int | None, d: int) -> int:
    """The heads, one geometry linear ``WGs.h`` (a ``Linear(64, 1)``: the trigonometric box embedding) each."""
    n_heads = count_layers(sd, f"{ENC}0.self_attn.WGs.")
    if heads is not None and heads != n_heads:
        raise ImportCheckpointError(f"the checkpoint has {n_heads} heads (geometry linears WGs.0..{n_heads - 1}), "
                                    f"not {heads}: give --heads {n_heads}")
    g_dim = sd[f"{ENC}0.self_attn.WGs.0.weight"].shape[-1]
    if g_dim != 64:
        raise ImportCheckpointError(f"the geometry linears take {g_dim}-d box embeddings: only the trigonometric "
                                    "64-d embedding is supported (not --no_box_trigonometric_embedding)")
    if d % n_heads:
        raise ImportCheckpointError(f"d_model {d} is not a multiple of the {n_heads} heads")
    return n_heads


def _attention_sharing(sd: dict[str, torch.Tensor], n_enc: int, n_dec: int, encoder: Any, decoder: Any) -> Any:
    """capflow's one attention-sharing option (None, ``kv`` or ``qk``) from the linears' count and the released
    config's ``share_att_encoder``/``share_att_decoder`` (3 linears: kv and qk have the same shapes)."""
    shares = []
    for where, given, prefixes in (
            ("encoder", encoder, [f"{ENC}{i}.self_attn.linears." for i in range(n_enc)]),
            ("decoder", decoder, [f"{DEC}{i}.{a}.linears." for i in range(n_dec) for a in ("self_attn", "src_attn")])):
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
    return shares[0]


def _layer_sharing(sd: dict[str, torch.Tensor], n_enc: int, n_dec: int, encoder: Any, decoder: Any
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The encoder's and decoder's cross-layer sharing maps read from the weights, checked against the released
    config's ``share_layer_encoder``/``share_layer_decoder`` when given."""
    enc_map, dec_map = _sharing_map(sd, ENC, n_enc), _sharing_map(sd, DEC, n_dec)
    for where, given, found in (("encoder", encoder, enc_map), ("decoder", decoder, dec_map)):
        if given is None:  # not said: the weights decide
            continue
        said = _canonical_map(given) or tuple(range(len(found)))
        if said != found:
            raise ImportCheckpointError(f"share_layer_{where}={given} but the weights share the {where} layers as "
                                        f"{found} (positions with equal tensors)")
    return enc_map, dec_map


def _output_classes(sd: dict[str, torch.Tensor], codebase: str, pieces: list[str], words: list[str],
                    radix_base: int | None) -> dict[str, Any]:
    """The output layout (vocab_size, bos, eos, codec): SentencePiece ids (``ort``) or radix tokens (``acort``)."""
    n_out = sd["model.generator.proj.weight"].shape[0]
    if sd["model.tgt_embed.0.lut.weight"].shape[0] != n_out:
        raise ImportCheckpointError(f"model.tgt_embed.0.lut.weight has {sd['model.tgt_embed.0.lut.weight'].shape[0]} "
                                    f"rows, model.generator.proj.weight {n_out}")
    if codebase == "ort":
        if n_out != len(pieces):
            raise ImportCheckpointError(f"the checkpoint has {n_out} output classes, the vocabulary {len(pieces)} "
                                        "pieces (specials included)")
        return {"vocab_size": n_out, "bos": 1, "eos": 2, "codec": "word"}
    base = n_out - 3
    if radix_base is not None and radix_base != base:
        raise ImportCheckpointError(f"the checkpoint has {n_out} output classes = radix base {base} + 3, the "
                                    f"released config says radix_base {radix_base}")
    num = len(pieces) - 3  # the released RadixTokenizer's count: words + <unk>
    released_digits, x = 0, num
    while x:
        released_digits, x = released_digits + 1, x // base
    if RadixCodec(base=base, num_words=num).digits != max(released_digits, 1):
        raise ImportCheckpointError(
            f"{len(words)} words + <unk> = {num} is a power of the radix base {base}: the released tokenizer "
            f"writes {released_digits} digits per word, capflow's codec one fewer")
    return {"vocab_size": n_out, "bos": base + 1, "eos": base + 2, "codec": "radix"}


def _key_table(cfg: ArchConfig, enc_map: tuple[int, ...], dec_map: tuple[int, ...]) -> list[Entry]:
    """The released keys of the first position of every capflow layer (the shared positions hold equal tensors),
    the geometry linears merged per layer, the embedding and generator as stored (``ort`` permutes their rows
    after the pass: :func:`convert_relation`)."""
    linears = {None: ("q", "k_proj", "v", "o"), "kv": ("q", "k_proj", "o"), "qk": ("q", "v", "o")}[cfg.share]
    perm = box_channel_permutation(64)
    table: list[Entry] = [("att_embed.0.weight", "input_proj.weight"), ("att_embed.0.bias", "input_proj.bias")]
    for stack, smap in (("encoder", enc_map), ("decoder", dec_map)):
        attns = stack_attentions(stack)
        for lid, i in sorted(_first_positions(smap).items()):
            src, dst = f"model.{stack}.layers.{i}.", f"{stack}.layers.{lid}."
            table += attention_entries(src, dst, attns, linears)
            if stack == "encoder":  # one Linear(64, 1) per head -> the rows of one (h, 64) linear
                wgs = f"{src}self_attn.WGs."
                table += [(tuple(f"{wgs}{h}.weight" for h in range(cfg.heads)), f"{dst}geo.w.weight",
                           lambda *w: torch.cat(w)[:, perm]),
                          (tuple(f"{wgs}{h}.bias" for h in range(cfg.heads)), f"{dst}geo.w.bias",
                           lambda *b: torch.cat(b))]
            table += ffn_and_norms(src, dst, len(attns) + 1)
        table += pairs(f"model.{stack}.", f"{stack}.", {"norm": "norm"}, AB)
    return [*table, *_VOCAB.items()]


def _first_positions(smap: tuple[int, ...]) -> dict[int, int]:
    """capflow layer id -> its first released position."""
    return {lid: pos for pos, lid in reversed(list(enumerate(smap)))}


def convert_relation(sd: dict[str, torch.Tensor], codebase: str, pieces: list[str], *, heads: int | None = None,
                     share_att_encoder: str | None = None, share_att_decoder: str | None = None,
                     radix_base: int | None = None, share_layer_encoder: Any = None, share_layer_decoder: Any = None
                     ) -> Converted:
    """Released ORT/ACORT state dict (``RelationTransformerModel``) -> (capflow config, state dict, words).

    ``pieces``: the released SentencePiece pieces in id order (``<pad> <unk> <bos> <eos>`` then the words).
    ``heads`` is checked against the per-head geometry linears (``WGs.h``); ``share_att_*`` (the released
    config's ``kv``/``qk``) is needed when the attentions have 3 linears; ``radix_base`` (``acort``) is checked
    against the output classes (``v + 3``), ``share_layer_*`` (the released config's maps) against the sharing
    read from the weights."""
    share_att_encoder, share_att_decoder = _share_att(share_att_encoder), _share_att(share_att_decoder)
    if codebase not in RELATION:
        raise ImportCheckpointError(f"unknown family {codebase!r}: one of {', '.join(RELATION)}")
    sd = dict(sd)
    require(sd, ["att_embed.0.weight", "model.tgt_embed.0.lut.weight", "model.generator.proj.weight",
                 f"{ENC}0.self_attn.WGs.0.weight", f"{DEC}0.self_attn.linears.0.weight"],
            f"{codebase} (RelationTransformerModel)")
    if tuple(pieces[:4]) != SP_SPECIALS:
        raise ImportCheckpointError(f"the vocabulary's first pieces are {pieces[:4]}, not the released tokenizer's "
                                    f"{', '.join(SP_SPECIALS)} (ids 0..3)")
    d, d_in = sd["att_embed.0.weight"].shape
    n_heads = _geometry_heads(sd, heads, d)
    n_enc, n_dec = count_layers(sd, ENC), count_layers(sd, DEC)
    share = _attention_sharing(sd, n_enc, n_dec, share_att_encoder, share_att_decoder)
    enc_map, dec_map = _layer_sharing(sd, n_enc, n_dec, share_layer_encoder, share_layer_decoder)
    words = [p[1:] if p.startswith("\u2581") else p for p in pieces[4:]]
    outputs = _output_classes(sd, codebase, pieces, words, radix_base)
    cfg = released(preset("ort-base" if codebase == "ort" else "acort-base")).replace(
        d_model=d, d_in=d_in, heads=n_heads, d_ff=sd[f"{ENC}0.feed_forward.w_1.weight"].shape[0],
        enc_layers=n_enc, dec_layers=n_dec, **outputs, geometry=True, share=share,
        enc_share=enc_map if len(set(enc_map)) < n_enc else None,
        dec_share=dec_map if len(set(dec_map)) < n_dec else None)
    keys = KeyMap(sd, codebase)
    keys.apply(_key_table(cfg, enc_map, dec_map))
    if codebase == "ort":  # capflow <pad> <bos> <eos> words <unk> <- SentencePiece 0, 2, 3, 4.., 1 (acort: as is)
        rows, _ = specials_last(pieces, ("<pad>", "<bos>", "<eos>", "<unk>"))
        keys.out.update({dst: permute_vocab_rows(keys.out[dst], rows) for dst in _VOCAB.values()})
    for stack, smap in (("encoder", enc_map), ("decoder", dec_map)):
        firsts = _first_positions(smap)
        for pos, lid in enumerate(smap):  # the shared positions: equal tensors (that is how smap was read)
            if pos != firsts[lid]:
                keys.known(f"model.{stack}.layers.{pos}.{k}" for k in _layer_keys(sd, f"model.{stack}.layers.{pos}."))
    check_position_table(keys, d)
    return Converted(cfg, keys.report(), words)


def read_pieces(path: str | Path) -> list[str]:
    """The released SentencePiece vocabulary in id order: ``word.vocab`` (``piece<TAB>score`` lines, written
    beside ``word.model``) or a JSON list of pieces."""
    path = Path(path)
    if path.suffix == ".json":
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
    path = Path(ckpt).parent / "config.json"
    if not path.is_file():
        return {}
    obj = read_json(path, "released config", ImportCheckpointError)
    if not isinstance(obj, dict):
        raise ImportCheckpointError(f"{path} is not a JSON object")
    return obj


def load_relation(codebase: str, ckpt: str | Path, vocab: str | Path, options: ImportOptions) -> Converted:
    """``import_checkpoint`` for ort/acort: the run's ``config.json`` (heads, tokenizer, sharing, radix base)
    checked, the weights and pieces converted; ``options.released_acort_cache`` sets the decoder's released step
    cache (``ArchConfig.released_acort_cache``)."""
    heads = options.heads
    run = released_run_config(ckpt)
    if run.get("num_heads") is not None and int(run["num_heads"]) != heads:
        raise ImportCheckpointError(f"the released config.json says num_heads={run['num_heads']}, not {heads}: "
                                    f"give --heads {run['num_heads']}")
    tokenizer = run.get("tokenizer")
    if tokenizer is not None and tokenizer != ("word" if codebase == "ort" else "radix"):
        raise ImportCheckpointError(f"the released config.json says tokenizer={tokenizer!r}: import it with "
                                    f"--from {'acort' if tokenizer == 'radix' else 'ort'}")
    cfg, state, words = convert_relation(
        load_state_dict(ckpt), codebase, read_pieces(vocab), heads=heads,
        share_att_encoder=run.get("share_att_encoder"), share_att_decoder=run.get("share_att_decoder"),
        radix_base=run.get("radix_base") if codebase == "acort" else None,
        share_layer_encoder=run.get("share_layer_encoder"), share_layer_decoder=run.get("share_layer_decoder"))
    return Converted(cfg.replace(released_acort_cache=bool(options.released_acort_cache)), state, words)
