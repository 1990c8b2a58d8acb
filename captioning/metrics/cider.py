"""Fast CIDEr-D (coco-caption's ``CIDEr``) for evaluation and SCST rewards.

The definition is exactly that of pycocoevalcap 1.2's ``CiderScorer`` (which is CIDEr-D):

* every caption is split on white space; its n-grams (n = 1..4) are counted (term frequency ``tf``);
* document frequency ``df[g]`` = number of *images* whose set of reference n-grams (the union over that image's
  references) contains ``g``; ``N`` = number of images of the reference corpus;
* ``vec[g] = tf * (log(N) - log(max(1, df[g])))``, one vector per n-gram order. n-grams of a candidate that no
  reference has still get the weight ``tf * log(N)``: they do not match anything, but they count in the
  candidate's norm;
* per order, against each reference: ``sum_g min(v_h[g], v_r[g]) * v_r[g] / (|v_h| |v_r|)`` (not divided when a
  norm is 0), times the Gaussian length penalty ``exp(-(l_h - l_r)^2 / (2 sigma^2))`` with sigma = 6;
  pycocoevalcap's "length" is the number of **bigrams** of a caption (``max(0, words - 1)``, and 0 when n < 2);
* the mean over orders, summed over references and divided by their number, times 10.

Scores equal pycocoevalcap's per image to floating-point rounding (about 1e-15) when the document frequencies
come from the same references: pycocoevalcap's ``Cider`` computes them from the references of the images being
scored, so build ``CiderD(references)`` with exactly those references to reproduce it.

Implementation: a :class:`DocumentFrequency` is built once from a reference corpus (for SCST rewards: the
training references). It owns the n-gram table, built from references only: a dict ``token -> word id`` and,
per order k >= 2, a sorted array of the keys ``(id of the (k-1)-gram prefix << 32) | word id`` with the id of
each k-gram, so that a whole batch of captions is encoded with a handful of vectorised ``np.unique`` /
``np.searchsorted`` calls and no Python-level n-gram tuples. Tokens are any hashable values (space-separated
words, or integer word ids for SCST); an ``<eos>``-like token is just another token. Look-ups never add to the
table: n-grams not in it get df = 0 for that call only. :class:`CiderD` precomputes, once, every reference's
tf-idf entries, per-order norms and length, and per image the sorted distinct n-grams of its references;
:meth:`CiderD.score_batch` then scores a batch (e.g. 50 images x 5 samples) with one vectorised join of the
candidates' n-grams against a dense (image n-gram x reference) weight block of their images.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from itertools import chain, pairwise

import numpy as np

__all__ = ["CiderD", "DocumentFrequency"]

_SHIFT = 32  # key of a k-gram (k >= 2): (prefix id << 32) | word id
_EMPTY = np.zeros(0, np.int64)


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


def _ragged_arange(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + c)`` for every (s, c)."""
    total = int(counts.sum())
    if total == 0:
        return _EMPTY
    first = np.cumsum(counts) - counts
    return np.arange(total, dtype=np.int64) - np.repeat(first - starts, counts)


class _NgramIndex:
    """The n-gram table: word ids from a dict, k-gram ids (k >= 2) from sorted key arrays.

    ``keys[k]`` (k = 2..n; ``keys[0]`` and ``keys[1]`` unused) is sorted; ``ids[k][i]`` is the id of the k-gram
    with key ``keys[k][i]``. Word (1-gram) ids are the dict's values, 0..len(vocab)-1. Ids of each order are
    dense, 0..sizes[k]-1, and stable: adding n-grams appends ids.
    """

    def __init__(self, n: int):
        self.n = n
        self.vocab: dict[Hashable, int] = {}
        self.keys: list[np.ndarray] = [_EMPTY] * (n + 1)
        self.ids: list[np.ndarray] = [_EMPTY] * (n + 1)
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
        out[srt] = np.where(keys[pos] == qs, self.ids[k][pos], -1)
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

    def encode(self, captions: Sequence, add: bool = False, n: int | None = None):
        """Term frequencies of the n-grams of every caption.

        Returns ``(cap, order, gid, tf, lengths)``: one entry per distinct (caption, n-gram), ``order`` = k - 1,
        ``gid`` = the n-gram's id within its order (-1 when it is not in the table), ``lengths`` = tokens per
        caption. With ``add=True`` the missing words and n-grams are added first (then no gid is -1); otherwise
        the table is left exactly as it is. ``n``: highest order (default: the table's).
        """
        n = self.n if n is None else min(n, self.n)
        w, lengths = self._word_ids(captions, add)
        n_words = len(self.vocab)  # ids >= n_words: words not in the table (this call only)
        base = max(n_words, int(w.max()) + 1 if len(w) else 1)
        n_caps = len(lengths)
        cap = np.repeat(np.arange(n_caps, dtype=np.int64), lengths)
        remaining = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(w), dtype=np.int64)

        out_cap, out_order, out_gid, out_tf = [], [], [], []
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
            n_u = len(u)
            pair, tf = np.unique(cap[starts] * n_u + inv, return_counts=True)
            local_id = pair % n_u
            out_cap.append(pair // n_u)
            out_order.append(np.full(len(pair), k - 1, np.int8))
            out_gid.append(gid_k[local_id])
            out_tf.append(tf)
            lid_pos = np.full(len(w), -1, np.int64)
            lid_pos[starts] = inv
            gid_u = gid_k
        if add:
            self.sizes[1] = len(self.vocab)
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


_BLOCK_REFS = 32_768  # references per block at least (temporary arrays: a few KB per reference)
_MAX_BLOCKS = 16  # at most: table merges stay few, the work linear


def _blocks(caps: list[list]) -> list[tuple[int, int]]:
    """Image ranges of the corpus ``caps`` holding ~max(32k, total/16) references each."""
    counts = np.fromiter(map(len, caps), np.int64, len(caps))
    if len(counts) == 0:
        return [(0, 0)]
    per = max(_BLOCK_REFS, -(-int(counts.sum()) // _MAX_BLOCKS))
    ends = np.cumsum(counts)
    cuts = np.searchsorted(ends, np.arange(per, int(ends[-1]), per), side="left") + 1
    edges = [0, *sorted(set(int(c) for c in cuts if 0 < c < len(caps))), len(caps)]
    return list(pairwise(edges))


def _as_references(references: Mapping[Hashable, Sequence] | None) -> tuple[list, list[list]]:
    if references is None:
        return [], []
    ids, caps = [], []
    for key, refs in references.items():
        if isinstance(refs, str):
            raise TypeError(f"references[{key!r}] must be a list of captions, not one string")
        refs = list(refs)
        if not refs:
            raise ValueError(f"references[{key!r}] is empty: every image needs at least one reference")
        ids.append(key)
        caps.append(refs)
    return ids, caps


class _Corpus:
    """Encoded references: term frequencies per (reference, n-gram) and, per image, its distinct n-grams."""

    def __init__(self, index: _NgramIndex, caps: list[list], n: int, add: bool = False):
        flat = list(chain.from_iterable(caps))
        self.n_refs = np.array([len(c) for c in caps], np.int64)
        self.img_of_ref = np.repeat(np.arange(len(caps), dtype=np.int64), self.n_refs)
        ref, order, gid, tf, self.lengths = index.encode(flat, add=add, n=n)
        self.ref, self.order, self.tf = ref, order, tf
        self.cid = index.offsets()[order.astype(np.int64)] + gid
        self.complete = bool((gid >= 0).all())
        self._rows = None

    def image_rows(self, total: int):
        """Entries sorted by (image, n-gram): (permutation, distinct (image, n-gram) keys, row of each sorted
        entry). Doubles as the document-frequency pass (df[g] = number of images having g)."""
        if self._rows is None:
            key = self.img_of_ref[self.ref] * total + self.cid
            perm = np.argsort(key, kind="stable")
            key = key[perm]
            first = np.ones(len(key), bool)
            np.not_equal(key[1:], key[:-1], out=first[1:])
            self._rows = perm, key[first], np.cumsum(first) - 1
        return self._rows


class DocumentFrequency:
    """Document frequencies of the n-grams (n = 1..``n``) of a reference corpus, and the n-gram table.

    ``df[g]`` counts the images (documents) whose references, together, contain g; ``n_docs`` is the number of
    images. Build it once from the training references for SCST rewards and pass it to every :class:`CiderD`.
    Looking up n-grams that are not in the corpus never grows it.
    """

    def __init__(self, index: _NgramIndex, df: np.ndarray, n_docs: int):
        self._index = index
        self._df = df  # float64 over the combined ids (see _NgramIndex.offsets)
        self.n_docs = int(n_docs)
        self.n = index.n

    @classmethod
    def from_references(cls, references: Mapping[Hashable, Sequence], n: int = 4) -> DocumentFrequency:
        """From ``{image id: [reference caption, ...]}``; captions are tokenised strings or token-id sequences."""
        return cls._build(_as_references(references)[1], n)

    @classmethod
    def from_token_ids(cls, references: Mapping[Hashable, Sequence[Sequence[int]]], n: int = 4) -> DocumentFrequency:
        return cls.from_references(references, n)

    @classmethod
    def _build(cls, caps: list[list], n: int) -> DocumentFrequency:
        """The DocumentFrequency of a corpus, built a block of images at a time (:func:`_blocks`): images are
        documents, so the counts of disjoint blocks add up; per order, since a later block's new words move the
        combined ids of the higher orders."""
        if n < 1:
            raise ValueError("n must be >= 1")
        index = _NgramIndex(n)
        counts = [_EMPTY] * (n + 1)  # per order k: images having each k-gram, by id
        for lo, hi in _blocks(caps):
            corpus = _Corpus(index, caps[lo:hi], n, add=True)
            offsets = index.offsets()
            total = max(int(offsets[-1]), 1)
            _, rows, _ = corpus.image_rows(total)
            cid = rows % total
            order = np.searchsorted(offsets, cid, side="right") - 1  # k - 1
            for k in range(1, n + 1):
                size = int(offsets[k] - offsets[k - 1])
                got = np.bincount(cid[order == k - 1] - offsets[k - 1], minlength=size)
                counts[k] = got + np.concatenate([counts[k], np.zeros(size - len(counts[k]), np.int64)])
        df = np.concatenate([counts[k] for k in range(1, n + 1)]).astype(np.float64)
        return cls(index, df, len(caps))

    def __len__(self) -> int:
        """Number of distinct n-grams (all orders) in the table."""
        return len(self._index)

    @property
    def vocabulary_size(self) -> int:
        return len(self._index.vocab)

    def __getitem__(self, ngram: Sequence | str) -> float:
        """df of one n-gram (a tuple of tokens, or a space-separated string); 0.0 when absent (never added)."""
        if isinstance(ngram, str):
            ngram = ngram.split()
        k1, gid = self._index.lookup(tuple(ngram))
        return 0.0 if gid < 0 else float(self._df[self._index.offsets()[k1] + gid])


class CiderD:
    """CIDEr-D with precomputed reference vectors; equal to pycocoevalcap's ``Cider`` given the same df.

    ``references``: ``{image id: [reference caption, ...]}``, each caption tokenised (space-separated string) or
    a sequence of token ids. Document frequencies come from these references, or from ``df`` (e.g. the training
    references, built once with :meth:`DocumentFrequency.from_references`); reference n-grams that ``df`` lacks
    are added, with df = 0, to a private copy of its table. ``n`` other than 4 is supported, but pycocoevalcap
    itself only works with n = 4 (it always counts 1..4-grams).
    """

    def __init__(self, references: Mapping[Hashable, Sequence[str]] | None = None, *, n: int = 4,
                 sigma: float = 6.0, df: DocumentFrequency | None = None):
        ids, caps = _as_references(references)
        if df is None:
            if not ids:
                raise ValueError("CiderD needs references (or a precomputed df)")
            df = DocumentFrequency._build(caps, n)
            index = df._index
        else:
            if df.n < n:
                raise ValueError(f"df was built for n <= {df.n}, asked for n = {n}")
            index = df._index
            for lo, hi in _blocks(caps):  # reference n-grams that df lacks: add them to a private copy of its table
                if index is df._index and not _Corpus(index, caps[lo:hi], n).complete:
                    index = df._index.copy()
                if index is not df._index:
                    _Corpus(index, caps[lo:hi], n, add=True)
        self.n, self.sigma, self.df = n, float(sigma), df
        self.ids = ids
        self.references = dict(zip(ids, caps, strict=True))
        self._index = index
        self._img_index = {key: i for i, key in enumerate(ids)}

        # idf over this table's combined ids (orders 1..n); df = 0 for n-grams only this table has
        self._log_n = np.log(float(df.n_docs)) if df.n_docs > 0 else 0.0
        self._offsets = index.offsets()
        df_offsets = df._index.offsets()
        df_all = np.zeros(int(self._offsets[n]), np.float64)
        for k in range(1, n + 1):
            size = int(df_offsets[k] - df_offsets[k - 1])
            df_all[self._offsets[k - 1]:self._offsets[k - 1] + size] = df._df[df_offsets[k - 1]:df_offsets[k]]
        self._idf = self._log_n - np.log(np.maximum(1.0, df_all))
        big = self._big = max(int(self._offsets[n]), 1)  # combined ids are below this

        # per reference: norms per order and length; per image: distinct n-grams ("rows") and its entries. Built a
        # block of images at a time (the table is complete now: ids are final), so that the encoding's temporary
        # arrays stay those of a block; the blocks' parts are in image order, so they concatenate.
        n_refs = np.fromiter(map(len, caps), np.int64, len(caps))
        cid_dtype = np.int32 if big < 2**31 else np.int64
        col_dtype = np.int8 if len(n_refs) == 0 or n_refs.max() < 128 else np.int32
        parts: dict[str, list[np.ndarray]] = {k: [] for k in ("norm", "len", "cid", "rows", "ents", "row", "col",
                                                               "tf")}
        for lo, hi in _blocks(caps):
            corpus = _Corpus(index, caps[lo:hi], n)
            n_img = hi - lo
            ref_off = np.concatenate([[0], np.cumsum(corpus.n_refs)]).astype(np.int64)
            weight = corpus.tf * self._idf[corpus.cid]
            parts["norm"].append(np.sqrt(np.bincount(corpus.ref * n + corpus.order, weights=weight * weight,
                                                     minlength=int(ref_off[-1]) * n)).reshape(-1, n))
            del weight
            parts["len"].append(self._length(corpus.lengths))
            perm, rows, row_of = corpus.image_rows(big)
            row_img = rows // big
            parts["cid"].append((rows - row_img * big).astype(cid_dtype))
            row_off = np.concatenate([[0], np.cumsum(np.bincount(row_img, minlength=n_img))]).astype(np.int64)
            parts["rows"].append(np.diff(row_off))
            ref_sorted = corpus.ref[perm]
            img_sorted = corpus.img_of_ref[ref_sorted]
            parts["ents"].append(np.bincount(img_sorted, minlength=n_img))
            parts["row"].append((row_of - row_off[img_sorted]).astype(np.int32))  # row within its image
            parts["col"].append((ref_sorted - ref_off[img_sorted]).astype(col_dtype))  # reference within image
            parts["tf"].append(corpus.tf[perm])
            del corpus, perm, rows, row_of, ref_sorted, img_sorted

        def cat(name: str, dtype, shape: tuple[int, ...] = (0,)) -> np.ndarray:
            return np.concatenate(parts.pop(name)) if parts[name] else np.zeros(shape, dtype)

        def offsets_of(name: str) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(cat(name, np.int64))]).astype(np.int64)

        self._img_ref_off = np.concatenate([[0], np.cumsum(n_refs)]).astype(np.int64)
        self._ref_norm = cat("norm", np.float64, (0, n))
        self._ref_len = cat("len", np.float64)
        self._row_cid = cat("cid", cid_dtype)
        self._img_row_off = offsets_of("rows")
        self._img_ent_off = offsets_of("ents")
        self._ent_row = cat("row", np.int32)
        self._ent_col = cat("col", col_dtype)
        tf = cat("tf", np.int64)
        self._ent_tf = tf.astype(np.uint16 if len(tf) == 0 or tf.max() < 2**16 else np.int64)

    @classmethod
    def from_token_ids(cls, refs: Mapping[Hashable, Sequence[Sequence[int]]], *, n: int = 4, sigma: float = 6.0,
                       df: DocumentFrequency | None = None) -> CiderD:
        """References as token-id sequences (lists, numpy arrays, tensors): SCST on word ids, no strings."""
        return cls(refs, n=n, sigma=sigma, df=df)

    def _length(self, lengths: np.ndarray) -> np.ndarray:
        # pycocoevalcap's "length" is the summed tf of the bigrams (its n-gram index 1), i.e. words - 1
        if self.n < 2:
            return np.zeros(len(lengths), np.float64)
        return np.maximum(lengths - 1, 0).astype(np.float64)

    @property
    def table_size(self) -> int:
        """Number of n-grams in this scorer's table (look-ups never change it)."""
        return len(self._index)

    def score(self, candidates: Mapping[Hashable, str]) -> tuple[float, dict[Hashable, float]]:
        """``{image id: one tokenised caption}`` against ``self.references[id]``: (mean, per-id scores)."""
        keys = list(candidates.keys())
        scores = self.score_batch([candidates[k] for k in keys], keys)
        per_id = dict(zip(keys, scores.tolist(), strict=True))
        return (float(np.mean(scores)) if len(scores) else 0.0), per_id

    def score_batch(self, candidates: Sequence[Sequence[int] | str], ref_ids: Sequence[Hashable]) -> np.ndarray:
        """CIDEr-D of ``candidates[i]`` (a tokenised string or a token-id sequence, tokens exactly as they are
        to be rewarded, e.g. up to and including EOS, no padding) against the references of ``ref_ids[i]``."""
        n_c = len(candidates)
        if len(ref_ids) != n_c:
            raise ValueError(f"{n_c} candidates but {len(ref_ids)} ref_ids")
        if n_c == 0:
            return np.zeros(0, np.float64)
        try:
            img = np.fromiter(map(self._img_index.__getitem__, ref_ids), np.int64, n_c)
        except KeyError as e:
            raise KeyError(f"no references for id {e.args[0]!r}") from None
        n, big = self.n, self._big

        # candidate vectors (n-grams the table lacks: df 0, weight tf * log(N): they count in the norm only)
        cand, order, gid, tf, lengths = self._index.encode(candidates, n=n)
        order = order.astype(np.int64)
        seen = gid >= 0
        cid = np.where(seen, self._offsets[order] + gid, 0)
        vh = tf * np.where(seen, self._idf[cid], self._log_n)
        norm_h = np.sqrt(np.bincount(cand * n + order, weights=vh * vh, minlength=n_c * n)).reshape(n_c, n)
        len_h = self._length(lengths)

        # the batch's images, each once (u): dense weights, one row per distinct reference n-gram of the image,
        # one column per reference of the image
        u_img, u_inv = np.unique(img, return_inverse=True)
        n_u = len(u_img)
        u_range = np.arange(n_u, dtype=np.int64)
        row_start = self._img_row_off[u_img]
        row_count = self._img_row_off[u_img + 1] - row_start
        row_base = np.cumsum(row_count) - row_count
        row_cid = self._row_cid[_ragged_arange(row_start, row_count)]
        row_keys = np.repeat(u_range, row_count) * big + row_cid  # sorted
        ent_start = self._img_ent_off[u_img]
        ent_count = self._img_ent_off[u_img + 1] - ent_start
        ent = _ragged_arange(ent_start, ent_count)
        row = np.repeat(row_base, ent_count) + self._ent_row[ent]
        ref_count = self._img_ref_off[u_img + 1] - self._img_ref_off[u_img]
        r_max = int(ref_count.max())
        weights = np.zeros((len(row_keys), r_max), np.float64)
        weights[row, self._ent_col[ent]] = self._ent_tf[ent] * self._idf[row_cid[row]]
        g_ref = _ragged_arange(self._img_ref_off[u_img], ref_count)
        j_u = np.repeat(u_range, ref_count)
        j_col = _ragged_arange(np.zeros(n_u, np.int64), ref_count)
        ref_norm = np.zeros((n_u, r_max, n), np.float64)
        ref_norm[j_u, j_col] = self._ref_norm[g_ref]
        ref_len = np.zeros((n_u, r_max), np.float64)
        ref_len[j_u, j_col] = self._ref_len[g_ref]

        # clipped dot products sum_g min(v_h, v_r) v_r, per (candidate, order, reference)
        se = np.flatnonzero(seen)
        q = u_inv[cand[se]] * big + cid[se]
        srt = np.argsort(q, kind="stable")
        qs = q[srt]
        dot = np.zeros(n_c * n * r_max, np.float64)
        if len(row_keys) and len(qs):
            pos = np.searchsorted(row_keys, qs)
            np.minimum(pos, len(row_keys) - 1, out=pos)
            hit = row_keys[pos] == qs
            e = se[srt[hit]]
            vr = weights[pos[hit]]  # (hits, r_max); 0 where that reference lacks the n-gram
            contrib = np.minimum(vh[e, None], vr) * vr
            flat = ((cand[e] * n + order[e])[:, None] * r_max + np.arange(r_max)).reshape(-1)
            # float64 even when nothing hit (bincount of empty weights returns int64)
            dot = np.bincount(flat, weights=contrib.reshape(-1), minlength=n_c * n * r_max)
            dot = dot.astype(np.float64, copy=False)
        dot = dot.reshape(n_c, n, r_max).transpose(0, 2, 1)  # (candidate, reference, order)
        denom = norm_h[:, None, :] * ref_norm[u_inv]
        val = np.divide(dot, denom, out=np.zeros_like(dot), where=denom != 0)
        delta = len_h[:, None] - ref_len[u_inv]
        penalty = np.exp(-(delta * delta) / (2.0 * self.sigma**2))
        n_ref = ref_count[u_inv]
        penalty[np.arange(r_max) >= n_ref[:, None]] = 0.0  # padding columns
        total = (val * penalty[:, :, None]).sum(axis=(1, 2))
        return total / n / n_ref * 10.0

    def __call__(self, candidates: Sequence[Sequence[int] | str], ref_ids: Sequence[Hashable]) -> np.ndarray:
        return self.score_batch(candidates, ref_ids)
