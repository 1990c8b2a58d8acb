"""CIDEr-D's n-gram table (:class:`_NgramIndex`), reference captions in compact arrays (CSR) and the idf by count.

The n-gram table is described in :mod:`captioning.metrics.cider`.

:class:`CsrReferences` holds a corpus of integer-token captions as four arrays and nothing per caption or image in
Python: ``tokens`` (all captions' tokens, one flat array), ``token_offsets`` (caption c is
``tokens[token_offsets[c]:token_offsets[c + 1]]``), ``caption_offsets`` (image i has the captions
``caption_offsets[i]..caption_offsets[i + 1] - 1``) and ``image_ids`` (int64, distinct). An ``append`` token (SCST's
``<eos>``) is added to the end of every caption when captions are read, without a copy of the corpus. ``tokens`` and
``token_offsets`` may be arrays read from a file by position (:class:`captioning.data.spill.FileArray`): they are
only ever sliced and gathered, never read whole.
:class:`CountIdf` is the idf over a table's n-gram ids computed from their document counts through a small
per-count table instead of one float per n-gram.

This module imports nothing from :mod:`captioning.metrics.cider`, which builds its scorer on these.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import chain

import numpy as np

__all__ = ["CountIdf", "CsrReferences", "ragged_arange"]

_EMPTY = np.zeros(0, np.int64)
_SHIFT = 32  # key of a k-gram (k >= 2): (prefix id << 32) | word id


def ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + c)`` for every (s, c)."""
    total = int(counts.sum())
    if total == 0:
        return _EMPTY
    first = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(first - starts, counts)


def _array(values):
    """``values`` as a numpy array, or as it is when it is already a one-dimensional typed array (a
    :class:`~captioning.data.spill.FileArray`: not read whole)."""
    if isinstance(values, np.ndarray) or (getattr(values, "ndim", None) == 1 and hasattr(values, "dtype")):
        return values
    return np.asarray(values)


def _rising(a, block: int = 1 << 20) -> bool:
    """Whether ``a`` never falls, read a block at a time."""
    for lo in range(0, max(len(a) - 1, 0), block):
        x = a[lo:lo + block + 1]
        if (x[1:] < x[:-1]).any():
            return False
    return True


def _tokens(caption) -> list:
    """A caption as a list of tokens: a string is split on white space (as pycocoevalcap does); a sequence of
    token ids (list, tuple, numpy array, torch tensor) is taken as it is (numpy / torch ints become Python ints)."""
    if isinstance(caption, str):
        return caption.split()
    if hasattr(caption, "tolist"):
        caption = caption.tolist()
    return list(caption)


def _tokenize_all(captions: Sequence) -> list[list]:
    try:
        return list(map(str.split, captions))  # fast path: all strings
    except TypeError:
        return [_tokens(c) for c in captions]


class _NgramIndex:
    """The n-gram table: word ids from a dict, k-gram ids (k >= 2) from sorted key arrays.

    ``keys[k]`` (k = 2..n; ``keys[0]`` and ``keys[1]`` unused) is sorted; ``ids[k][i]`` is the id of the k-gram
    with key ``keys[k][i]`` (``ids[k]`` None: the id is the position ``i``, in a finished table that is never added
    to). Word (1-gram) ids are the dict's values, 0..len(vocab)-1. Ids of each order are dense, 0..sizes[k]-1, and
    stable: adding n-grams appends ids.
    """

    def __init__(self, n: int):
        self.n = n
        self.vocab: dict[Hashable, int] = {}
        self.keys: list[np.ndarray] = [_EMPTY] * (n + 1)
        self.ids: list[np.ndarray] = [np.zeros(0, np.int32)] * (n + 1)  # int32: ids stay below 2**31
        self.sizes: list[int] = [0] * (n + 1)

    def copy(self) -> _NgramIndex:
        new = _NgramIndex(self.n)
        new.vocab = dict(self.vocab)
        new.keys, new.ids, new.sizes = list(self.keys), list(self.ids), list(self.sizes)
        return new

    def __len__(self) -> int:
        return len(self.vocab) + sum(self.sizes[2:])

    def offsets(self) -> np.ndarray:
        """Start of each order in the combined id space (``cid = offsets[k - 1] + id``), length n + 1."""
        sizes = [len(self.vocab), *self.sizes[2:]]
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def _find(self, k: int, q: np.ndarray) -> np.ndarray:
        """Ids of the k-grams with keys q (-1 where absent)."""
        keys = self.keys[k]
        if len(keys) == 0 or len(q) == 0:
            return np.full(len(q), -1, np.int64)
        srt = np.argsort(q, kind="stable")  # sorted queries: cache-friendly binary searches
        qs = q[srt]
        pos = np.searchsorted(keys, qs)
        np.minimum(pos, len(keys) - 1, out=pos)
        out = np.empty(len(q), np.int64)
        ids = self.ids[k]  # None: a table whose ids are the positions in the sorted keys (never added to)
        out[srt] = np.where(keys[pos] == qs, pos if ids is None else ids[pos], -1)
        return out

    def _add(self, k: int, q: np.ndarray) -> np.ndarray:
        """Append the (distinct, absent) keys q to order k; returns their new ids. The keys are merged into the
        sorted table (linear in its size: a table built block by block is not re-sorted per block)."""
        new_ids = self.sizes[k] + np.arange(len(q), dtype=np.int64)
        srt = np.argsort(q, kind="stable")
        pos = np.searchsorted(self.keys[k], q[srt])
        self.keys[k] = np.insert(self.keys[k], pos, q[srt])
        self.ids[k] = np.insert(self.ids[k], pos, new_ids[srt])
        self.sizes[k] += len(q)
        return new_ids

    def _word_ids(self, captions: Sequence, add: bool) -> tuple[np.ndarray, np.ndarray]:
        """Flat word ids of all captions and their lengths. Unknown tokens get distinct ids >= len(vocab) for
        this call only (they are added to the vocabulary first with ``add=True``)."""
        vocab = self.vocab
        if len(captions) and all(isinstance(c, np.ndarray) and c.ndim == 1 and c.dtype.kind in "iu"
                                 for c in captions):  # integer arrays: one dict look-up per distinct token
            lengths = np.fromiter(map(len, captions), np.int64, len(captions))
            values, inv = np.unique(np.concatenate(captions).astype(np.int64), return_inverse=True)
            tokens = values.tolist()
        else:
            toks = _tokenize_all(captions)
            lengths = np.fromiter(map(len, toks), np.int64, len(toks))
            tokens, inv = list(chain.from_iterable(toks)), None
        if add:
            for t in tokens:
                if t not in vocab:
                    vocab[t] = len(vocab)
        n_words = len(vocab)
        w = np.fromiter(map(vocab.get, tokens, [-1] * len(tokens)), np.int64, len(tokens))
        if not add and (w < 0).any():
            local: dict[Hashable, int] = {}
            for i in np.flatnonzero(w < 0).tolist():
                w[i] = local.setdefault(tokens[i], n_words + len(local))
        return (w if inv is None else w[inv.reshape(-1)]), lengths

    def word_ids_flat(self, tokens: np.ndarray, add: bool) -> np.ndarray:
        """Word ids of a flat integer token array (a CSR corpus), the vocabulary grown in the order in which the
        tokens first occur (as :meth:`_word_ids` grows it from lists of tokens). With ``add=False`` unknown
        tokens get distinct ids >= len(vocab), in the order of their first occurrence (this call only)."""
        vocab = self.vocab
        values, first, inv = np.unique(np.asarray(tokens, np.int64), return_index=True, return_inverse=True)
        by_first = np.argsort(first, kind="stable")
        if add:
            for t in values[by_first].tolist():
                if t not in vocab:
                    vocab[t] = len(vocab)
        n_words = len(vocab)
        w = np.fromiter(map(vocab.get, values.tolist(), [-1] * len(values)), np.int64, len(values))
        unknown = w[by_first] < 0
        if unknown.any():
            w[by_first[unknown]] = n_words + np.arange(int(unknown.sum()), dtype=np.int64)
        return w[inv.reshape(-1)]

    def _orders(self, w: np.ndarray, lengths: np.ndarray, add: bool, n: int):
        """Per order k = 1..n of the flat word ids ``w`` (captions of ``lengths`` words): ``(k, starts, inv,
        gid_u)`` - the positions where a k-gram starts, the local id of each such k-gram (local ids are ranks in
        the lexicographic order of the word ids) and the table id of each local k-gram (-1: not in the table).
        With ``add=True`` the missing k-grams are added, their ids in that lexicographic order."""
        n_words = len(self.vocab)  # ids >= n_words: words not in the table (this call only)
        base = max(n_words, int(w.max()) + 1 if len(w) else 1)
        remaining = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(w), dtype=np.int64)
        lid_pos = None  # compact local id of the (k-1)-gram starting at each position (-1: none)
        gid_u = None  # table id of each local (k-1)-gram
        for k in range(1, n + 1):
            if k == 1:
                starts = np.arange(len(w), dtype=np.int64)
                u, inv = np.unique(w, return_inverse=True)
                gid_k = np.where(u < n_words, u, -1)
            else:
                starts = np.flatnonzero(remaining >= k)
                if len(starts) == 0:
                    break
                words = w[starts + (k - 1)]
                u, inv = np.unique(lid_pos[starts] * base + words, return_inverse=True)
                prefix_gid, word = gid_u[u // base], u % base
                gid_k = np.full(len(u), -1, np.int64)
                ok = (prefix_gid >= 0) & (word < n_words)
                q = (prefix_gid[ok] << _SHIFT) | word[ok]
                found = self._find(k, q)
                if add:
                    miss = found < 0
                    if miss.any():
                        found[miss] = self._add(k, q[miss])
                gid_k[ok] = found
            if len(starts) == 0:
                break
            inv = inv.reshape(-1)
            yield k, starts, inv, gid_k
            lid_pos = np.full(len(w), -1, np.int64)
            lid_pos[starts] = inv
            gid_u = gid_k
        if add:
            self.sizes[1] = len(self.vocab)

    def encode(self, captions: Sequence | None, add: bool = False, n: int | None = None,
               words: tuple[np.ndarray, np.ndarray] | None = None):
        """Term frequencies of the n-grams of every caption.

        Returns ``(cap, order, gid, tf, lengths)``: one entry per distinct (caption, n-gram), ``order`` = k - 1,
        ``gid`` = the n-gram's id within its order (-1 when it is not in the table), ``lengths`` = tokens per
        caption. With ``add=True`` the missing words and n-grams are added first (then no gid is -1); otherwise
        the table is left exactly as it is. ``n``: highest order (default: the table's). ``words``: the captions
        as (flat word ids, lengths) instead of ``captions`` (ids >= len(vocab): words not in the table).
        """
        n = self.n if n is None else min(n, self.n)
        w, lengths = self._word_ids(captions, add) if words is None else words
        n_caps = len(lengths)
        cap = np.repeat(np.arange(n_caps, dtype=np.int64), lengths)
        out_cap, out_order, out_gid, out_tf = [], [], [], []
        for k, starts, inv, gid_k in self._orders(w, lengths, add, n):
            n_u = len(gid_k)
            pair, tf = np.unique(cap[starts] * n_u + inv, return_counts=True)
            local_id = pair % n_u
            out_cap.append(pair // n_u)
            out_order.append(np.full(len(pair), k - 1, np.int8))
            out_gid.append(gid_k[local_id])
            out_tf.append(tf)
        if not out_cap:
            return _EMPTY, np.zeros(0, np.int8), _EMPTY, _EMPTY, lengths
        return (np.concatenate(out_cap), np.concatenate(out_order), np.concatenate(out_gid),
                np.concatenate(out_tf).astype(np.int64), lengths)

    def lookup(self, ngram: Sequence) -> tuple[int, int]:
        """(order - 1, id) of one n-gram, id -1 when absent. Never adds."""
        k = len(ngram)
        if not 1 <= k <= self.n:
            return max(k - 1, 0), -1
        gid = self.vocab.get(ngram[0], -1)
        for j in range(2, k + 1):
            word = self.vocab.get(ngram[j - 1], -1)
            if gid < 0 or word < 0:
                return k - 1, -1
            gid = int(self._find(j, np.array([(gid << _SHIFT) | word], np.int64))[0])
        return k - 1, gid


class CsrReferences:
    """Captions per image as CSR arrays (see the module's doc); the arrays are kept as given (no copy)."""

    def __init__(self, tokens: np.ndarray, token_offsets: np.ndarray, caption_offsets: np.ndarray,
                 image_ids: np.ndarray, append: int | None = None):
        self.tokens = _array(tokens)
        self.token_offsets = _array(token_offsets)
        self.caption_offsets = np.asarray(caption_offsets)
        self.image_ids = np.asarray(image_ids)
        if self.tokens.ndim != 1 or self.tokens.dtype.kind not in "iu":
            raise TypeError("tokens must be a flat integer array")
        if self.image_ids.ndim != 1 or (len(self.image_ids) and self.image_ids.dtype.kind not in "iu"):
            raise TypeError("image_ids must be a flat integer array")
        n_img, n_cap = len(self.image_ids), len(self.token_offsets) - 1
        if len(self.caption_offsets) != n_img + 1 or n_cap < 0:
            raise ValueError("caption_offsets needs one entry per image plus one, token_offsets one per caption "
                             "plus one")
        if n_img and (self.caption_offsets[0] != 0 or self.caption_offsets[-1] != n_cap):
            raise ValueError("caption_offsets must run from 0 to the number of captions")
        if n_cap > 0 and (self.token_offsets[0] != 0 or self.token_offsets[-1] != len(self.tokens)
                          or not _rising(self.token_offsets)):
            raise ValueError("token_offsets must rise from 0 to the number of tokens")
        self.n_refs = np.diff(self.caption_offsets).astype(np.int64)
        if (self.n_refs <= 0).any():
            i = int(np.flatnonzero(self.n_refs <= 0)[0])
            raise ValueError(f"references[{int(self.image_ids[i])!r}] is empty: every image needs at least one "
                             "reference")
        self.append = None if append is None else int(append)
        ids = self.image_ids.astype(np.int64, copy=False)
        if len(ids) < 2 or (ids[1:] > ids[:-1]).all():  # ids in increasing order (shards' keys): no second copy
            self._order, self._sorted = None, ids
        else:
            self._order = np.argsort(ids, kind="stable")
            self._sorted = ids[self._order]
        if len(self._sorted) > 1 and (self._sorted[1:] == self._sorted[:-1]).any():
            raise ValueError("image_ids must be distinct")

    def __len__(self) -> int:
        return len(self.image_ids)

    def index_of(self, ref_ids: Sequence) -> np.ndarray:
        """Positions (images) of the ids ``ref_ids``; KeyError for an id that has no references."""
        n = len(ref_ids)
        try:
            q = np.fromiter(ref_ids, np.int64, n) if not isinstance(ref_ids, np.ndarray) else ref_ids.astype(np.int64)
        except (TypeError, ValueError, OverflowError):
            q = None
        if q is not None and len(self._sorted):
            pos = np.minimum(np.searchsorted(self._sorted, q), len(self._sorted) - 1)
            ok = self._sorted[pos] == q
            if ok.all():
                return pos if self._order is None else self._order[pos]
            bad = list(ref_ids)[int(np.flatnonzero(~ok)[0])]
        else:
            bad = next((r for r in ref_ids if not isinstance(r, (int, np.integer))), next(iter(ref_ids)))
        raise KeyError(f"no references for id {bad!r}")

    def caption_tokens(self, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(flat tokens, lengths) of the captions ``caps`` (indices), each followed by ``append`` when set."""
        starts = self.token_offsets[caps].astype(np.int64)
        lengths = self.token_offsets[caps + 1].astype(np.int64) - starts
        src = self.tokens[ragged_arange(starts, lengths)].astype(np.int64)
        if self.append is None:
            return src, lengths
        out_len = lengths + 1
        out = np.full(int(out_len.sum()), self.append, np.int64)
        out[ragged_arange(np.cumsum(out_len) - out_len, lengths)] = src
        return out, out_len

    def captions_of(self, images: np.ndarray) -> np.ndarray:
        """Indices of the captions of ``images`` (positions), image by image."""
        return ragged_arange(self.caption_offsets[images].astype(np.int64), self.n_refs[images])


class CountIdf:
    """``idf[cid] = log(N) - log(max(1, df[cid]))`` from integer document counts, by a table over the counts (the
    same floats as computing it per n-gram: the same operations on the same values)."""

    def __init__(self, counts: np.ndarray, log_n: float):
        self.counts = counts
        top = int(counts.max()) if len(counts) else 0
        self.table = log_n - np.log(np.maximum(1.0, np.arange(top + 1, dtype=np.float64)))

    def __getitem__(self, cid) -> np.ndarray:
        return self.table[self.counts[cid]]

    def __len__(self) -> int:
        return len(self.counts)


def sorted_join(keys: np.ndarray, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``queries``, its position in the sorted ``keys`` (clipped to the last) and whether it is there."""
    pos = np.searchsorted(keys, queries)
    np.minimum(pos, len(keys) - 1, out=pos)
    return pos, keys[pos] == queries
