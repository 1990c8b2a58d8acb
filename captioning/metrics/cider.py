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

SCST's scorer (:meth:`CiderD.from_csr`) keeps the training references as compact arrays instead
(:mod:`captioning.metrics.cider_refs`: flat tokens, caption and image offsets; the document counts int32, the idf
by count) and a table of the n-grams of two images or more only (:mod:`captioning.metrics.cider_pruned`: built one
order at a time in chunks of a bounded number of images, without per-(caption, n-gram) entries); a batch's
references and candidates are encoded together when it is scored, so that the n-grams of a single image still
match, and the matches are summed in the full table's id order - the scores are those of the dict-built scorer
bit for bit.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from itertools import chain, pairwise

import numpy as np

from captioning.metrics.cider_pruned import PrunedTable
from captioning.metrics.cider_refs import CountIdf, CsrReferences, _NgramIndex, sorted_join
from captioning.metrics.cider_refs import ragged_arange as _ragged_arange

__all__ = ["CiderD", "DocumentFrequency"]

_EMPTY = np.zeros(0, np.int64)


_PARTS = ("norm", "len", "cid", "rows", "ents", "row", "col", "tf")  # CiderD._reference_parts
_BLOCK_REFS = 32_768  # references per block at least (temporary arrays: a few KB per reference)
_MAX_BLOCKS = 16  # at most: table merges stay few, the work linear


def _blocks(caps: list[list]) -> list[tuple[int, int]]:
    """Image ranges of the corpus ``caps`` holding ~max(32k, total/16) references each."""
    return _block_edges(np.fromiter(map(len, caps), np.int64, len(caps)))


def _block_edges(counts: np.ndarray) -> list[tuple[int, int]]:
    """:func:`_blocks` from the number of references of each image."""
    if len(counts) == 0:
        return [(0, 0)]
    per = max(_BLOCK_REFS, -(-int(counts.sum()) // _MAX_BLOCKS))
    ends = np.cumsum(counts)
    cuts = np.searchsorted(ends, np.arange(per, int(ends[-1]), per), side="left") + 1
    edges = [0, *sorted(set(int(c) for c in cuts if 0 < c < len(counts))), len(counts)]
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
        """``caps``: per image its references."""
        flat = list(chain.from_iterable(caps))
        self.n_refs = np.array([len(c) for c in caps], np.int64)
        enc = index.encode(flat, add=add, n=n)
        self.img_of_ref = np.repeat(np.arange(len(self.n_refs), dtype=np.int64), self.n_refs)
        ref, order, gid, tf, self.lengths = enc
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
        self._absent = None  # df of an n-gram the table lacks (a pruned table: PrunedTable.count_images); else 0

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
        if gid < 0:
            return 0.0 if self._absent is None else float(self._absent(tuple(ngram)))
        return float(self._df[self._index.offsets()[k1] + gid])


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
        self._cid_dtype = np.int32 if big < 2**31 else np.int64
        self._col_dtype = np.int8 if len(n_refs) == 0 or n_refs.max() < 128 else np.int32
        parts: dict[str, list[np.ndarray]] = {k: [] for k in _PARTS}
        for lo, hi in _blocks(caps):
            for key, value in self._reference_parts(_Corpus(index, caps[lo:hi], n), hi - lo).items():
                parts[key].append(value)

        def cat(name: str, dtype, shape: tuple[int, ...] = (0,)) -> np.ndarray:
            return np.concatenate(parts.pop(name)) if parts[name] else np.zeros(shape, dtype)

        def offsets_of(name: str) -> np.ndarray:
            return np.concatenate([[0], np.cumsum(cat(name, np.int64))]).astype(np.int64)

        self._csr = self._pruned = self._distinct = None
        self._img_ref_off = np.concatenate([[0], np.cumsum(n_refs)]).astype(np.int64)
        self._ref_norm = cat("norm", np.float64, (0, n))
        self._ref_len = cat("len", np.float64)
        self._row_cid = cat("cid", self._cid_dtype)
        self._img_row_off = offsets_of("rows")
        self._img_ent_off = offsets_of("ents")
        self._ent_row = cat("row", np.int32)
        self._ent_col = cat("col", self._col_dtype)
        tf = cat("tf", np.int64)
        self._ent_tf = tf.astype(np.uint16 if len(tf) == 0 or tf.max() < 2**16 else np.int64)

    def _reference_parts(self, corpus: _Corpus, n_img: int) -> dict[str, np.ndarray]:
        """The scoring arrays of the images of ``corpus`` (see :data:`_PARTS`): per reference its norms per order
        and its length; per image its distinct n-grams (combined ids, sorted: "rows") and its entries (row within
        the image, reference within the image, tf), sorted by row."""
        n, big = self.n, self._big
        out = {}
        ref_off = np.concatenate([[0], np.cumsum(corpus.n_refs)]).astype(np.int64)
        weight = corpus.tf * self._idf[corpus.cid]
        out["norm"] = np.sqrt(np.bincount(corpus.ref * n + corpus.order, weights=weight * weight,
                                          minlength=int(ref_off[-1]) * n)).reshape(-1, n)
        del weight
        out["len"] = self._length(corpus.lengths)
        perm, rows, row_of = corpus.image_rows(big)
        row_img = rows // big
        out["cid"] = (rows - row_img * big).astype(self._cid_dtype)
        row_off = np.concatenate([[0], np.cumsum(np.bincount(row_img, minlength=n_img))]).astype(np.int64)
        out["rows"] = np.diff(row_off)
        ref_sorted = corpus.ref[perm]
        img_sorted = corpus.img_of_ref[ref_sorted]
        out["ents"] = np.bincount(img_sorted, minlength=n_img)
        out["row"] = (row_of - row_off[img_sorted]).astype(np.int32)  # row within its image
        out["col"] = (ref_sorted - ref_off[img_sorted]).astype(self._col_dtype)  # reference within image
        out["tf"] = corpus.tf[perm]
        return out

    def _image_arrays(self, u_img: np.ndarray):
        """The scoring arrays of the images ``u_img`` (indices, distinct): ``(row_cid, row_count, ent_count,
        ent_row, ent_col, ent_tf, ref_count, ref_norm, ref_len)``, concatenated in the order of ``u_img`` (per
        image ``row_count`` rows, ``ent_count`` entries, ``ref_count`` references): a gather of the precomputed
        arrays (a CSR scorer computes its batches' reference vectors in :meth:`PrunedTable.dots` instead)."""
        row_start = self._img_row_off[u_img]
        row_count = self._img_row_off[u_img + 1] - row_start
        row_cid = self._row_cid[_ragged_arange(row_start, row_count)]
        ent_start = self._img_ent_off[u_img]
        ent_count = self._img_ent_off[u_img + 1] - ent_start
        ent = _ragged_arange(ent_start, ent_count)
        ref_count = self._img_ref_off[u_img + 1] - self._img_ref_off[u_img]
        g_ref = _ragged_arange(self._img_ref_off[u_img], ref_count)
        return (row_cid, row_count, ent_count, self._ent_row[ent], self._ent_col[ent], self._ent_tf[ent], ref_count,
                self._ref_norm[g_ref], self._ref_len[g_ref])

    @classmethod
    def from_token_ids(cls, refs: Mapping[Hashable, Sequence[Sequence[int]]], *, n: int = 4, sigma: float = 6.0,
                       df: DocumentFrequency | None = None) -> CiderD:
        """References as token-id sequences (lists, numpy arrays, tensors): SCST on word ids, no strings."""
        return cls(refs, n=n, sigma=sigma, df=df)

    @classmethod
    def from_csr(cls, tokens: np.ndarray, token_offsets: np.ndarray, caption_offsets: np.ndarray,
                 image_ids: np.ndarray, *, append: int | None = None, n: int = 4, sigma: float = 6.0) -> CiderD:
        """References as CSR arrays (:class:`~captioning.metrics.cider_refs.CsrReferences`: flat integer tokens,
        per-caption token offsets, per-image caption offsets, int64 image ids), each caption followed by the token
        ``append`` when given (SCST's ``<eos>``). Document frequencies come from these references.

        The scores are exactly (bit for bit) those of ``CiderD.from_token_ids({id: [[*tokens, append], ...]})``
        with Python-int token lists, but nothing is kept per caption, image or n-gram in Python, and the n-gram
        table only has the n-grams of at least two images (:class:`~captioning.metrics.cider_pruned.PrunedTable`,
        built one order at a time in bounded chunks of images); each scored batch's reference vectors are computed
        from the (shared, not copied) token arrays - numpy arrays, or arrays read from a file by position - when it
        is scored. ``df`` looks up an n-gram of a single image by
        a scan of the references; ``len(df)`` is the pruned table's size, :attr:`table_size` the full one's.
        """
        refs = CsrReferences(tokens, token_offsets, caption_offsets, image_ids, append)
        if not len(refs):
            raise ValueError("CiderD needs references (or a precomputed df)")
        if n < 1:
            raise ValueError("n must be >= 1")
        table = PrunedTable(refs, n, _block_edges(refs.n_refs))
        df = DocumentFrequency(table.index, table.counts, len(refs))
        df._absent = table.count_images
        self = cls.__new__(cls)
        self.n, self.sigma, self.df = n, float(sigma), df
        self.ids = refs.image_ids
        self.references = None  # the token arrays are in self._csr
        self._index, self._img_index, self._csr, self._pruned = table.index, None, refs, table
        self._distinct = table.distinct
        self._log_n = np.log(float(df.n_docs))
        self._offsets = table.offsets
        self._idf = CountIdf(table.counts, self._log_n)
        return self

    def _lookup(self, ref_ids: Sequence[Hashable]) -> np.ndarray:
        if self._csr is not None:
            return self._csr.index_of(ref_ids)
        try:
            return np.fromiter(map(self._img_index.__getitem__, ref_ids), np.int64, len(ref_ids))
        except KeyError as e:
            raise KeyError(f"no references for id {e.args[0]!r}") from None

    def _length(self, lengths: np.ndarray) -> np.ndarray:
        # pycocoevalcap's "length" is the summed tf of the bigrams (its n-gram index 1), i.e. words - 1
        if self.n < 2:
            return np.zeros(len(lengths), np.float64)
        return np.maximum(lengths - 1, 0).astype(np.float64)

    @property
    def table_size(self) -> int:
        """Number of distinct n-grams of this scorer's references and df (look-ups never change it); a CSR
        scorer's table only keeps those of two images or more."""
        return len(self._index) if self._distinct is None else self._distinct

    def score(self, candidates: Mapping[Hashable, str]) -> tuple[float, dict[Hashable, float]]:
        """``{image id: one tokenised caption}`` against ``self.references[id]``: (mean, per-id scores)."""
        keys = list(candidates.keys())
        scores = self.score_batch([candidates[k] for k in keys], keys)
        per_id = dict(zip(keys, scores.tolist(), strict=True))
        return (float(np.mean(scores)) if len(scores) else 0.0), per_id

    def _dots(self, candidates: Sequence[Sequence[int] | str], img: np.ndarray):
        """:meth:`score_batch`'s parts from the precomputed references (see :meth:`PrunedTable.dots`)."""
        n_c = len(candidates)
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
        (row_cid, row_count, ent_count, ent_row, ent_col, ent_tf, ref_count, ref_norm_g,
         ref_len_g) = self._image_arrays(u_img)
        row_base = np.cumsum(row_count) - row_count
        row_keys = np.repeat(u_range, row_count) * big + row_cid  # sorted
        row = np.repeat(row_base, ent_count) + ent_row
        r_max = int(ref_count.max())
        weights = np.zeros((len(row_keys), r_max), np.float64)
        weights[row, ent_col] = ent_tf * self._idf[row_cid[row]]

        # clipped dot products sum_g min(v_h, v_r) v_r, per (candidate, order, reference)
        se = np.flatnonzero(seen)
        q = u_inv[cand[se]] * big + cid[se]
        srt = np.argsort(q, kind="stable")
        qs = q[srt]
        dot = np.zeros(n_c * n * r_max, np.float64)
        if len(row_keys) and len(qs):
            pos, hit = sorted_join(row_keys, qs)
            e = se[srt[hit]]
            vr = weights[pos[hit]]  # (hits, r_max); 0 where that reference lacks the n-gram
            contrib = np.minimum(vh[e, None], vr) * vr
            flat = ((cand[e] * n + order[e])[:, None] * r_max + np.arange(r_max)).reshape(-1)
            # float64 even when nothing hit (bincount of empty weights returns int64)
            dot = np.bincount(flat, weights=contrib.reshape(-1), minlength=n_c * n * r_max)
            dot = dot.astype(np.float64, copy=False)
        return dot, norm_h, len_h, ref_count, ref_norm_g, ref_len_g, u_inv

    def score_batch(self, candidates: Sequence[Sequence[int] | str], ref_ids: Sequence[Hashable]) -> np.ndarray:
        """CIDEr-D of ``candidates[i]`` (a tokenised string or a token-id sequence, tokens exactly as they are
        to be rewarded, e.g. up to and including EOS, no padding) against the references of ``ref_ids[i]``."""
        n_c = len(candidates)
        if len(ref_ids) != n_c:
            raise ValueError(f"{n_c} candidates but {len(ref_ids)} ref_ids")
        if n_c == 0:
            return np.zeros(0, np.float64)
        img = self._lookup(ref_ids)
        n = self.n
        if self._pruned is not None:
            dot, norm_h, len_h, ref_count, ref_norm_g, ref_len_g, u_inv = self._pruned.dots(
                candidates, img, self._idf, self._log_n, self._length)
        else:
            dot, norm_h, len_h, ref_count, ref_norm_g, ref_len_g, u_inv = self._dots(candidates, img)
        n_u, r_max = len(ref_count), int(ref_count.max())
        j_u = np.repeat(np.arange(n_u, dtype=np.int64), ref_count)
        j_col = _ragged_arange(np.zeros(n_u, np.int64), ref_count)
        ref_norm = np.zeros((n_u, r_max, n), np.float64)
        ref_norm[j_u, j_col] = ref_norm_g
        ref_len = np.zeros((n_u, r_max), np.float64)
        ref_len[j_u, j_col] = ref_len_g
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
