"""Tokenisation, vocabulary and the ACORT radix codec.

Word ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, then the vocabulary words by descending training-split
frequency (ties alphabetical), then ``<unk>`` last. A word's frequency rank ``i = word_id - 3`` is what the
radix codec writes in base ``v`` (ACORT eq. 1-3): ``d`` digits, most significant first, each shifted by one
so that 0 stays padding: digit tokens ``1..v``, ``<bos>`` = v+1, ``<eos>`` = v+2, output size v+3.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PAD, BOS, EOS = 0, 1, 2
N_SPECIAL = 3  # ids below the first word
PAD_WORD, BOS_WORD, EOS_WORD, UNK_WORD = "<pad>", "<bos>", "<eos>", "<unk>"

_SPACE_LIKE = {"Zs", "Zl", "Zp", "Cc"}
# characters that join word parts and are dropped without splitting (matches Karpathy tokens: "don't" -> "dont")
_JOINERS = {"'", "\u2019", "\u2018", "\u02bc"}


def tokenize(text: str, max_words: int | None = None) -> list[str]:
    """Lower-case, strip punctuation, split on white space; truncate to ``max_words``.

    Unicode is NFKC-normalised first, so full-width letters and ligatures become plain letters; every
    punctuation or symbol character (Unicode categories P* and S*) separates words, except apostrophes,
    which are dropped inside a word. Non-ASCII letters (``cafe`` with an accent) are kept as letters.
    """
    if text.isascii():  # the common case, same result in C: NFKC leaves ASCII alone, separators -> spaces
        out = text.lower().translate(_ASCII_SEPARATORS).split()
        return out[:max_words] if max_words is not None else out
    text = unicodedata.normalize("NFKC", text).lower()
    out = []
    buf: list[str] = []
    for ch in text:
        if ch in _JOINERS:
            continue
        cat = unicodedata.category(ch)
        if cat[0] in "PS" or cat in _SPACE_LIKE or cat == "Cf":
            if buf:
                out.append("".join(buf))
                buf = []
        else:
            buf.append(ch)
    if buf:
        out.append("".join(buf))
    return out[:max_words] if max_words is not None else out


def _ascii_separators() -> dict[int, str | None]:
    """``str.translate`` table of ASCII: joiners deleted, every character :func:`tokenize` splits on -> a space
    (letters and digits stay; every ASCII character that ``str.split`` splits on is a control or a space)."""
    table: dict[int, str | None] = {}
    for code in range(128):
        ch = chr(code)
        cat = unicodedata.category(ch)
        if ch in _JOINERS:
            table[code] = None
        elif cat[0] in "PS" or cat in _SPACE_LIKE or cat == "Cf":
            table[code] = " "
    return table


_ASCII_SEPARATORS = _ascii_separators()
_WORD_RE = re.compile(r"^\S+$")


@dataclass
class Vocabulary:
    """Words in frequency order plus their training-split counts; special ids fixed (module docstring)."""

    words: list[str]
    counts: list[int]
    min_count: int = 1
    radix_base: int = 768
    unk_count: int = 0
    _index: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.words) != len(self.counts):
            raise ValueError("words and counts differ in length")
        if len(set(self.words)) != len(self.words):
            raise ValueError("vocabulary has duplicate words")
        for w in self.words:
            if not _WORD_RE.match(w) or w in (PAD_WORD, BOS_WORD, EOS_WORD, UNK_WORD):
                raise ValueError(f"invalid vocabulary word {w!r}")
        self._index = {w: i + N_SPECIAL for i, w in enumerate(self.words)}

    # ------------------------------------------------------------------ ids
    @property
    def unk(self) -> int:
        return N_SPECIAL + len(self.words)

    def __len__(self) -> int:
        """Number of word-level ids (= output classes of a word model): specials + words + <unk>."""
        return self.unk + 1

    def id_of(self, word: str) -> int:
        return self._index.get(word, self.unk)

    def word_of(self, idx: int) -> str:
        if idx == PAD:
            return PAD_WORD
        if idx == BOS:
            return BOS_WORD
        if idx == EOS:
            return EOS_WORD
        if idx == self.unk:
            return UNK_WORD
        if N_SPECIAL <= idx < self.unk:
            return self.words[idx - N_SPECIAL]
        raise IndexError(f"word id {idx} outside vocabulary of {len(self)}")

    def encode(self, tokens: Sequence[str]) -> list[int]:
        return [self.id_of(t) for t in tokens]

    def encode_flat(self, tokens: Iterable[str], count: int = -1) -> np.ndarray:
        """Word ids (int32) of a stream of ``tokens`` (``count`` of them, when known) in one pass."""
        return np.fromiter(map(self._index.get, tokens, itertools.repeat(self.unk)), np.int32, count)

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Word ids -> words, stopping at <eos>/<pad>, skipping <bos>."""
        out = []
        for i in ids:
            i = int(i)
            if i in (EOS, PAD):
                break
            if i == BOS:
                continue
            out.append(self.word_of(i))
        return out

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict:
        return {
            "format": "capflow-vocab/1",
            "special": {PAD_WORD: PAD, BOS_WORD: BOS, EOS_WORD: EOS, UNK_WORD: self.unk},
            "min_count": self.min_count,
            "unk_count": self.unk_count,
            "words": self.words,
            "counts": self.counts,
            "radix": {"base": self.radix_base, "digits": self.radix().digits, "size": self.radix().size},
        }

    def digest(self) -> str:
        blob = json.dumps({"words": self.words, "radix_base": self.radix_base}, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read vocabulary {path}: {e}") from e
        if d.get("format") != "capflow-vocab/1":
            raise ValueError(f"{path}: not a capflow vocabulary (format {d.get('format')!r})")
        return cls(
            words=list(d["words"]),
            counts=[int(c) for c in d["counts"]],
            min_count=int(d["min_count"]),
            radix_base=int(d["radix"]["base"]),
            unk_count=int(d.get("unk_count", 0)),
        )

    def radix(self) -> RadixCodec:
        return RadixCodec(base=self.radix_base, num_words=len(self.words) + 1)


def build_vocabulary(
    captions: Iterable[Sequence[str]], min_count: int = 5, radix_base: int = 768
) -> Vocabulary:
    """Words seen at least ``min_count`` times, by descending count then alphabetically."""
    counter: Counter[str] = Counter()
    for toks in captions:
        counter.update(toks)
    kept = sorted((w for w, c in counter.items() if c >= min_count), key=lambda w: (-counter[w], w))
    unk_count = sum(c for w, c in counter.items() if c < min_count)
    return Vocabulary(
        words=kept, counts=[counter[w] for w in kept], min_count=min_count, radix_base=radix_base,
        unk_count=unk_count,
    )


@dataclass(frozen=True)
class RadixCodec:
    """ACORT radix encoding of word ids.

    ``num_words`` counts the word-like ids (vocabulary words + ``<unk>``), whose frequency ranks are
    ``0..num_words-1``. Every word becomes exactly ``digits`` tokens.
    """

    base: int
    num_words: int

    @property
    def digits(self) -> int:
        largest = max(self.num_words - 1, 0)
        d = 1
        while largest >= self.base**d:
            d += 1
        return d

    @property
    def bos(self) -> int:
        return self.base + 1

    @property
    def eos(self) -> int:
        return self.base + 2

    @property
    def size(self) -> int:
        """Output classes of a radix model: padding + v digits + BOS + EOS."""
        return self.base + 3

    def word_ids_to_digits(self, word_ids: np.ndarray) -> np.ndarray:
        """(..., L) word ids (0 = padding) -> (..., L*d) radix tokens (0 = padding). Specials are rejected."""
        w = np.asarray(word_ids, dtype=np.int64)
        pad = w == PAD
        rank = w - N_SPECIAL
        if np.any(~pad & ((rank < 0) | (rank >= self.num_words))):
            bad = np.unique(w[~pad & ((rank < 0) | (rank >= self.num_words))])
            raise ValueError(f"word ids {bad[:10].tolist()} cannot be radix-encoded (not words)")
        d = self.digits
        powers = self.base ** np.arange(d - 1, -1, -1, dtype=np.int64)  # most significant first
        dig = (rank[..., None] // powers) % self.base + 1
        dig = np.where(pad[..., None], 0, dig)
        return dig.reshape(*w.shape[:-1], w.shape[-1] * d).astype(np.int32)

    def digits_to_word_ids(self, tokens: np.ndarray, strict: bool = True) -> np.ndarray:
        """(..., L*d) digit tokens -> (..., L) word ids. Groups with padding map to padding.

        A group that is not a valid word (a digit out of range, or a rank past the last word) raises in
        strict mode, else becomes ``<unk>``.
        """
        t = np.asarray(tokens, dtype=np.int64)
        d = self.digits
        if t.shape[-1] % d:
            raise ValueError(f"radix sequence length {t.shape[-1]} is not a multiple of {d} digits")
        g = t.reshape(*t.shape[:-1], t.shape[-1] // d, d)
        pad = np.all(g == 0, axis=-1)
        valid_digit = (g >= 1) & (g <= self.base)
        powers = self.base ** np.arange(d - 1, -1, -1, dtype=np.int64)
        rank = ((g - 1) * powers).sum(-1)
        ok = np.all(valid_digit, axis=-1) & (rank < self.num_words)
        bad = ~pad & ~ok
        if strict and np.any(bad):
            raise ValueError(f"{int(bad.sum())} radix groups are not valid words")
        unk = N_SPECIAL + self.num_words - 1
        ids = np.where(pad, PAD, np.where(ok, rank + N_SPECIAL, unk))
        return ids.astype(np.int32)

    def encode_caption(self, word_ids: Sequence[int]) -> list[int]:
        """One caption's word ids (no specials) -> [BOS, digits..., EOS]."""
        body = self.word_ids_to_digits(np.asarray([list(word_ids)], dtype=np.int64))[0].tolist()
        return [self.bos, *body, self.eos]

    def decode_caption(self, tokens: Sequence[int]) -> list[int]:
        """Model output tokens -> word ids: skip BOS, stop at EOS/padding, drop an incomplete last group;
        invalid groups become <unk>."""
        body: list[int] = []
        for t in tokens:
            t = int(t)
            if t == self.bos:
                continue
            if t in (self.eos, PAD):
                break
            body.append(t if 1 <= t <= self.base else self.base + 1)  # stray specials -> invalid digit
        usable = len(body) - len(body) % self.digits
        if usable == 0:
            return []
        ids = self.digits_to_word_ids(np.asarray([body[:usable]]), strict=False)[0]
        return ids.tolist()
