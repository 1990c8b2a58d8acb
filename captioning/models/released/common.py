"""What every converter of a released checkpoint shares (:mod:`captioning.models.released`).

Reading: files are read with ``torch.load(weights_only=True)`` only: a checkpoint that needs arbitrary unpickling is
refused (:func:`load_state_dict`); so are pickled vocabularies (:func:`read_id_words`).

Renaming, in the manner of detectron2's ``c2_model_loading``: each released code base's module writes an ordered
key table (released key -> capflow key, or released keys -> capflow key through a rule beside the table, e.g. a
vocabulary-row permutation), :class:`KeyMap` makes one pass over it, and :func:`check_complete` then reports what is
left: released tensors no entry used (unknown keys), capflow parameters no entry filled. A table entry whose released
key is absent is an error naming it; shapes that disagree are errors naming them (:func:`build_imported`).

Ids: capflow's vocabulary is ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, the words, then ``<unk>``; every released code
numbers its specials its own way (its module says how), so the embedding and output rows are moved to capflow's
order by :func:`permute_vocab_rows`, the one row permutation every converter uses. A released vocabulary holding
every special gives a pure permutation (:func:`specials_last`: every log-prob unchanged).

Words that are not capflow words: a released vocabulary may hold tokens capflow's vocabulary cannot (the M2
``TextField`` vocabulary built with spaCy, LW-Transformer's ``vocab.pkl``, holds 6 whitespace tokens: ``' '``,
``'  '``, ``'\\n'``, ``'   '``, ``'\\n '``, ``'    '``). They are real rows of the embedding and output layers, so
they are kept, each under a name (:func:`capflow_word`): every whitespace character becomes ``<U+XXXX>`` (its code
point), e.g. ``' '`` -> ``<U+0020>``, ``'\\n '`` -> ``<U+000A><U+0020>``; an empty token becomes ``<empty>``. A
caption holding one prints that name (the released evaluation would print the whitespace, which its PTB
tokenizer then drops). A name that collides with another word is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from captioning.data.text import Vocabulary
from captioning.errors import InputError
from captioning.jsonio import read_json
from captioning.models.encoder_decoder import ArchConfig, Captioner

NEVER = -1e9  # generator bias of classes the released model cannot emit
WB = (("weight", "weight"), ("bias", "bias"))  # nn.Linear / nn.LayerNorm parameters

#: one key-table entry: (released key, capflow key), or (released key or keys, capflow key, rule) where the rule
#: makes the capflow tensor from the released ones (in the order given)
Entry = tuple[str, str] | tuple[str | tuple[str, ...], str, Callable[..., torch.Tensor]]


class ImportCheckpointError(InputError, ValueError):
    """A checkpoint that cannot be imported; the message names the keys or the reason."""


class Converted(NamedTuple):
    """A converted released checkpoint: capflow config, capflow state dict, capflow's words (specials removed)."""

    cfg: ArchConfig
    state: dict[str, torch.Tensor]
    words: list[str]


@dataclass(frozen=True)
class ImportOptions:
    """What ``import_checkpoint`` is told beside the files (the weights do not hold it); each code base's loader
    reads the options it has."""

    heads: int = 8
    group_size: int | None = None
    zodiac_gate: str | None = None
    released_acort_cache: bool = False


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


def require(sd: dict[str, torch.Tensor], keys: Iterable[str], what: str) -> None:
    """The keys that say which code wrote ``sd``: absent ones make it ``not a released {what} state dict``."""
    missing = [k for k in keys if k not in sd]
    if missing:
        raise ImportCheckpointError(f"not a released {what} state dict: missing {', '.join(missing)}")


def count_layers(sd: dict[str, torch.Tensor], prefix: str) -> int:
    """How many numbered modules ``prefix + i + '.'`` the state dict has (they must be 0..n-1)."""
    ids = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    if ids != set(range(len(ids))):
        raise ImportCheckpointError(f"layers {sorted(ids)} under {prefix} are not 0..n-1")
    return len(ids)


def pairs(src: str, dst: str, modules: dict[str, str], params=WB) -> list[tuple[str, str]]:
    """Key-table entries (released key, capflow key) for every parameter of every module, modules first:
    ``src + module + "." + param`` -> ``dst + capflow module + "." + capflow param``."""
    return [(f"{src}{m}.{p}", f"{dst}{c}.{q}") for m, c in modules.items() for p, q in params]


class KeyMap:
    """One pass of a key table over a released state dict: ``apply`` fills the capflow state dict (``out``) in the
    table's order, an absent released key being an error naming it; ``known`` marks tensors read but not copied;
    ``report`` refuses the released tensors nothing used and returns ``out``."""

    def __init__(self, sd: dict[str, torch.Tensor], codebase: str):
        self.sd, self.codebase = sd, codebase
        self.out: dict[str, torch.Tensor] = {}
        self.used: set[str] = set()

    def get(self, src: str) -> torch.Tensor:
        if src not in self.sd:
            raise ImportCheckpointError(f"missing key {src}")
        self.used.add(src)
        return self.sd[src]

    def apply(self, table: Iterable[Entry]) -> None:
        for src, dst, *rule in table:
            tensors = [self.get(k) for k in ((src,) if isinstance(src, str) else src)]
            self.out[dst] = rule[0](*tensors) if rule else tensors[0]

    def known(self, keys: Iterable[str]) -> None:
        self.used.update(keys)

    def report(self) -> dict[str, torch.Tensor]:
        check_complete(unused=set(self.sd) - self.used, codebase=self.codebase)
        return self.out


def check_complete(unused: Iterable[str] = (), unset: Iterable[str] = (), codebase: str = "") -> None:
    """The one coverage check: every released tensor used (``unused``: the released keys no table entry read, the
    unknown keys) and every capflow parameter filled (``unset``: the capflow keys no entry wrote)."""
    unknown = sorted(unused)
    if unknown:
        raise ImportCheckpointError(f"unknown keys in the released {codebase} state dict: {', '.join(unknown)}")
    missing = sorted(unset)
    if missing:
        raise ImportCheckpointError(f"the conversion left capflow keys unset: {', '.join(missing)}")


def specials_last(words: list[str], specials: tuple[str, str, str, str]) -> tuple[list[int], list[str]]:
    """A released vocabulary holding every special (id order) -> (``rows``, capflow's words): capflow id ``c`` is
    released id ``rows[c]``, for capflow's order ``<pad>``, ``<bos>``, ``<eos>``, the words in released id
    order, ``<unk>`` (``specials`` names the released pad, bos, eos and unk tokens). A pure permutation of the
    embedding and output rows (:func:`permute_vocab_rows`): every log-prob is unchanged."""
    absent = [w for w in specials if w not in words]
    if absent:
        raise ImportCheckpointError(f"the vocabulary lacks the released special words {', '.join(absent)}")
    if len(set(words)) != len(words):
        raise ImportCheckpointError("the vocabulary has duplicate words")
    index = {w: i for i, w in enumerate(words)}
    kept = [w for w in words if w not in specials]
    pad, bos, eos, unk = specials
    return [index[pad], index[bos], index[eos], *(index[w] for w in kept), index[unk]], kept


def permute_vocab_rows(t: torch.Tensor, rows: Sequence[int | None], fill: float = 0.0) -> torch.Tensor:
    """The rows of a released embedding, output weight or output bias in capflow's vocabulary order: capflow row
    ``c`` is released row ``rows[c]``, or ``fill`` where ``rows[c]`` is None (a class the released model has no
    row for)."""
    out = t[torch.tensor([0 if r is None else r for r in rows], dtype=torch.long)]
    absent = [c for c, r in enumerate(rows) if r is None]
    if absent:
        out[absent] = fill
    return out


def read_id_words(path: str | Path) -> list[str]:
    """A vocabulary in id order 0..V-1 (ExpansionNet, LW-Transformer): a JSON list (``caption_idx2word_list``,
    the M2 vocabulary's ``itos``), a word -> id object (``caption_word2idx_dict``, ``stoi``), or an object holding
    either under ``caption_idx2word_list``, ``idx2word_list``, ``itos``, ``caption_word2idx_dict``,
    ``word2idx_dict`` or ``stoi``. Pickles (the M2 code's ``vocab_<exp>.pkl``) are refused: capflow does not
    unpickle."""
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


def build_imported(cfg: ArchConfig, state: dict[str, torch.Tensor], max_len: int | None = None) -> Captioner:
    """A capflow model holding the converted weights (every parameter filled: :func:`check_complete`; shapes
    checked); ``max_len`` overrides the config's (learned position tables fix it)."""
    model = Captioner(cfg if max_len is None else cfg.replace(max_len=max_len))
    own = model.state_dict()
    check_complete(unset=set(own) - set(state))
    bad = [k for k, v in state.items() if tuple(own[k].shape) != tuple(v.shape)]
    if bad:
        raise ImportCheckpointError("shapes disagree: " + ", ".join(
            f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in bad))
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})
    return model.eval()


def imported_vocabulary(cfg: ArchConfig, words: list[str]) -> Vocabulary:
    """The capflow vocabulary of an imported model: the released words under their capflow names
    (:func:`capflow_words`), counts 0; a radix-coded model (ACORT) keeps its radix base, its output classes - 3
    (:class:`~captioning.data.text.RadixCodec`: pad, the ``v`` digits, BOS, EOS)."""
    kept = capflow_words(words)
    if cfg.codec == "radix":
        return Vocabulary(words=kept, counts=[0] * len(kept), radix_base=cfg.vocab_size - 3)
    return Vocabulary(words=kept, counts=[0] * len(kept))
