"""SCST's CIDEr-D n-gram table over compact (CSR) references: only the n-grams of at least two images, built one
order at a time in bounded chunks of images, and the scoring of a batch against it.

Why the n-grams of a single image can be left out, exactly:

* their idf is that of an n-gram no reference has: ``log(N) - log(max(1, 1)) = log(N) - log(max(1, 0))``;
* an n-gram that is in two images has its (k-1)-gram prefix and its (k-1)-gram suffix in those two images too, so
  order k's table is counted over the k-grams whose prefix and suffix are in order k-1's (pruned) table - the
  other k-grams are in one image each (they are counted, per image, for :attr:`PrunedTable.distinct` only);
* a candidate scored against image i can still match an n-gram that only image i has: a batch's references and
  candidates are encoded *together* (one local id per distinct n-gram of the batch, whether or not the table has
  it), and the reference vectors are computed from the batch's reference tokens, so such n-grams weigh
  ``tf * idf(df = 1)`` in the norms and the matches as they do in the full table;
* floating-point sums run in the order of the full table's ids: the norms sum an entry's n-grams in their
  lexicographic order (word ids) as before; the matched n-grams of a candidate are summed in the full table's id
  order, which is (block of first appearance, lexicographic order) - the full table was built a block of images
  at a time (:func:`captioning.metrics.cider._block_edges`), appending each block's new n-grams in lexicographic
  order. The table keeps that block (``first``) per n-gram; an n-gram of one image first appeared in that image's
  block.

Memory: the table is 13 bytes per n-gram of >= 2 images (sorted int64 key, int32 document count, block); the
build's temporaries are those of a chunk (<= :data:`_CHUNK_REFS` references) and of one partition of an order's
count (:class:`_Counter`: the k-grams whose prefix and suffix are both in >= 2 images are counted on disk, in
key-range partitions of ~:data:`_PART_ENTRIES` entries, summed one at a time). Nothing here imports
:mod:`captioning.metrics.cider`.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from captioning.data.spill import SpilledArray
from captioning.metrics.cider_refs import _SHIFT, CountIdf, CsrReferences, _NgramIndex, sorted_join
from captioning.util import release_free_heap

__all__ = ["PrunedTable"]

# references per chunk of the build at most (temporaries: ~100 bytes per token); the blocks' least size
# (cider._BLOCK_REFS), so that a chunk is as large at 100k images as at 1M (65,536 doubled the build's peak there)
_CHUNK_REFS = 32_768
_LUT_MAX = 1 << 24  # tokens below this are mapped to word ids through a dense array
_PART_ENTRIES = 1 << 20  # an order's count entries per partition, about (see _Counter): ~40 MB to sum one


def chunk_edges(blocks: Sequence[tuple[int, int]], n_refs: np.ndarray, per: int) -> list[tuple[int, int, int]]:
    """``(lo, hi, block)``: image ranges of at most ``per`` references (at least one image), each inside one of the
    ``blocks`` (image ranges), in order."""
    ends = np.cumsum(np.asarray(n_refs, np.int64))
    out = []
    for b, (lo, hi) in enumerate(blocks):
        start = lo
        while start < hi:
            base = int(ends[start - 1]) if start else 0
            stop = min(max(int(np.searchsorted(ends, base + per, side="right")), start + 1), hi)
            out.append((start, stop, b))
            start = stop
    return out


def _distinct(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values of ``x`` (``np.unique`` without its hash table, which is slow on these keys)."""
    x = np.sort(x)
    first = np.ones(len(x), bool)
    np.not_equal(x[1:], x[:-1], out=first[1:])
    return x[first]


class _Counter:
    """One order's document counts over its candidate keys, written chunk by chunk into key-range partitions on disk
    (:class:`~captioning.data.spill.SpilledArray`, one (key, count, block) entry per key and chunk) and summed one
    partition at a time by :meth:`kept`: memory holds one partition, not every candidate key (most of which are in
    one image and dropped). The partitions' bounds are quantiles of the first chunk's keys; their number follows
    from ``entries``, a bound on the entries to come (at most one per token of the corpus and order)."""

    def __init__(self, entries: int, block_dtype):
        self.n_parts = max(1, -(-int(entries) // _PART_ENTRIES))
        self.entry = np.dtype([("key", np.int64), ("count", np.int32), ("first", block_dtype)])
        self.bounds: np.ndarray | None = None
        self.parts: list[SpilledArray] = []
        self.distinct = 0  # distinct keys, known after kept()

    def add(self, keys: np.ndarray, count: np.ndarray, block: int) -> None:
        """The counts of one chunk's (sorted, distinct) ``keys``, first seen in ``block`` (blocks come in order)."""
        if not len(keys):
            return
        if self.bounds is None:
            picks = (np.arange(1, self.n_parts) * len(keys)) // self.n_parts
            self.bounds = np.unique(keys[picks])
            self.parts = [SpilledArray(self.entry) for _ in range(len(self.bounds) + 1)]
        rec = np.empty(len(keys), self.entry)
        rec["key"], rec["count"], rec["first"] = keys, count, block
        edges = [0, *np.searchsorted(keys, self.bounds).tolist(), len(keys)]
        for part, (lo, hi) in zip(self.parts, pairwise(edges), strict=True):
            if hi > lo:
                part.append(rec[lo:hi])

    def kept(self, minimum: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(keys, count, first)`` of the keys counted at least ``minimum`` times, sorted by key: a key's counts
        summed over chunks, its first block the earliest; :attr:`distinct` counts every key. The partitions'
        files are dropped as they are read; the kept entries wait on disk too (no list and concatenation of them,
        which held them twice)."""
        out = (SpilledArray(np.int64), SpilledArray(np.int32), SpilledArray(self.entry["first"]))
        for part in self.parts:
            rec = np.asarray(part.array())  # one partition, read whole
            order = np.argsort(rec["key"], kind="stable")  # chunk order kept within a key: its first block first
            keys = rec["key"][order]
            start = np.ones(len(keys), bool)
            np.not_equal(keys[1:], keys[:-1], out=start[1:])
            at = np.flatnonzero(start)
            count = np.add.reduceat(rec["count"][order], at, dtype=np.int32) if len(at) else np.zeros(0, np.int32)
            first = rec["first"][order[at]]
            del rec, order
            part.close()
            self.distinct += len(at)
            keep = count >= minimum
            for got, values in zip(out, (keys[at][keep], count[keep], first[keep]), strict=True):
                got.append(values)
            del keys, count, first, keep
        self.parts = []
        return tuple(np.asarray(a.array()) for a in out)


class PrunedTable:
    """The n-grams (n = 1..``n``) of ``refs`` that occur in at least two images (every word is kept), their document
    counts and first blocks, with the word ids and k-gram keys of :class:`_NgramIndex` (ids: positions in the
    sorted keys). ``blocks``: the image ranges the full table would have been built in (they fix the order in which
    a candidate's matches are summed). ``distinct``: number of distinct n-grams, single-image ones included."""

    def __init__(self, refs: CsrReferences, n: int, blocks: Sequence[tuple[int, int]],
                 chunk_refs: int | None = None):
        self.refs, self.n = refs, n
        self.block_starts = np.array([lo for lo, _ in blocks], np.int64)
        block_dtype = np.uint8 if len(blocks) < 2**8 else np.uint16 if len(blocks) < 2**16 else np.int32
        self._chunks = chunk_edges(blocks, refs.n_refs, chunk_refs or _CHUNK_REFS)
        index = self.index = _NgramIndex(n)
        self._lut = None
        words = np.zeros(0, np.int64)  # images having each word
        for lo, hi, _ in self._chunks:
            toks, _, doc = self._chunk(lo, hi)
            w = index.word_ids_flat(toks, add=True)
            size = len(index.vocab)
            got = np.bincount(_distinct(doc * size + w) % size, minlength=size)
            words = got + np.concatenate([words, np.zeros(size - len(words), np.int64)])
        index.sizes[1] = len(index.vocab)
        self._make_lut()
        release_free_heap()  # each phase's temporaries gone before the next one's (see release_free_heap)
        counts, first = SpilledArray(np.int32), SpilledArray(block_dtype)  # over the orders, read back at the end
        counts.append(words.astype(np.int32))
        first.append(np.zeros(len(words), block_dtype))
        self.distinct = len(index.vocab)
        entries = int(refs.token_offsets[-1]) + len(refs.token_offsets)  # tokens, an appended one per caption
        for k in range(2, n + 1):
            counter, single = _Counter(entries, block_dtype), 0
            for lo, hi, b in self._chunks:
                got, count, alone = self._count_order(k, *self._chunk(lo, hi), words)
                counter.add(got, count, b)
                single += alone
            keys, got, block = counter.kept(2)
            self.distinct += counter.distinct + single
            index.keys[k], index.ids[k], index.sizes[k] = keys, None, len(keys)
            counts.append(got)
            first.append(block)
            del counter, keys, got, block
            release_free_heap()
        self.counts = np.asarray(counts.array())  # over the combined ids (index.offsets())
        self.first = np.asarray(first.array())
        counts.close()
        first.close()
        self.offsets = index.offsets()

    # -- reading the references ---------------------------------------------------------------------------------
    def _make_lut(self) -> None:
        keys = list(self.index.vocab)
        if keys and all(isinstance(t, int) for t in keys) and min(keys) >= 0 and max(keys) < _LUT_MAX:
            self._lut = np.full(max(keys) + 1, -1, np.int64)
            self._lut[np.array(keys, np.int64)] = np.fromiter(self.index.vocab.values(), np.int64, len(keys))

    def _words(self, toks: np.ndarray) -> np.ndarray:
        """Word ids of reference tokens (all in the vocabulary)."""
        if self._lut is not None:
            return self._lut[toks]
        return self.index.word_ids_flat(toks, add=False)

    def _chunk(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens and lengths of the captions of images lo..hi-1, and the image (0-based in the chunk) of each
        token."""
        refs = self.refs
        toks, lengths = refs.caption_tokens(np.arange(refs.caption_offsets[lo], refs.caption_offsets[hi]))
        doc = np.repeat(np.repeat(np.arange(hi - lo, dtype=np.int64), refs.n_refs[lo:hi]), lengths)
        return toks, lengths, doc

    def _count_order(self, k: int, toks: np.ndarray, lengths: np.ndarray, doc: np.ndarray, words: np.ndarray):
        """Order k over one chunk: the sorted keys of the k-grams whose prefix and suffix are in the table (in >= 2
        images), the number of the chunk's images having each, and the number of distinct (image, k-gram) pairs
        of the other k-grams (each in one image only)."""
        w = self._words(toks)
        base = max(len(self.index.vocab), 1)
        remaining = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(w), dtype=np.int64)
        u, lid_pos = np.unique(w, return_inverse=True)
        lid_pos = lid_pos.reshape(-1)
        gid_u = np.where(words[u] >= 2, u, -1)  # table id of each local (j-1)-gram, -1: in one image at most
        for j in range(2, k + 1):
            starts = np.flatnonzero(remaining >= j)
            if len(starts) == 0:
                return np.zeros(0, np.int64), np.zeros(0, np.int64), 0
            u, inv = np.unique(lid_pos[starts] * base + w[starts + (j - 1)], return_inverse=True)
            inv = inv.reshape(-1)
            prefix, word = gid_u[u // base], u % base
            if j == k:
                break
            gid = np.full(len(u), -1, np.int64)
            ok = prefix >= 0
            gid[ok] = self.index._find(j, (prefix[ok] << _SHIFT) | word[ok])
            lid_pos = np.full(len(w), -1, np.int64)
            lid_pos[starts] = inv
            gid_u = gid
        candidate = np.zeros(len(u), bool)
        at = (prefix[inv] >= 0) & (gid_u[lid_pos[starts + 1]] >= 0)  # prefix and suffix in >= 2 images
        candidate[inv[at]] = True
        pair = _distinct(doc[starts] * len(u) + inv) % len(u)  # one entry per distinct (image, k-gram)
        is_c = candidate[pair]
        alone = int(len(pair) - is_c.sum())
        got = np.bincount(pair[is_c], minlength=len(u))
        present = np.flatnonzero(got)
        keys = (prefix[present] << _SHIFT) | word[present]
        srt = np.argsort(keys)
        return keys[srt], got[present][srt], alone

    def document_counts(self, grams: np.ndarray) -> np.ndarray:
        """Document counts of k-grams given as rows of tokens (shape (m, k); a token < 0 is a word no reference
        has): the count for an n-gram of the table, 0 for any other (in one image at most: the same idf)."""
        grams = np.asarray(grams, np.int64)
        m, k = grams.shape
        out = np.zeros(m, np.int64)
        if m == 0 or not 1 <= k <= self.n:
            return out

        def words(tokens: np.ndarray) -> np.ndarray:
            w = np.full(len(tokens), -1, np.int64)
            known = tokens >= 0
            if self._lut is not None:
                known &= tokens < len(self._lut)
                w[known] = self._lut[tokens[known]]
            else:
                w[known] = np.fromiter((self.index.vocab.get(t, -1) for t in tokens[known].tolist()), np.int64)
            return w

        gid = words(grams[:, 0])
        for j in range(2, k + 1):
            word = words(grams[:, j - 1])
            ok = (gid >= 0) & (word >= 0)
            nxt = np.full(m, -1, np.int64)
            nxt[ok] = self.index._find(j, (gid[ok] << _SHIFT) | word[ok])
            gid = nxt
        found = gid >= 0
        out[found] = self.counts[self.offsets[k - 1] + gid[found]]
        return out

    def count_images(self, ngram: tuple) -> int:
        """Images whose references contain ``ngram`` (tokens), by a scan of the references: the document count of an
        n-gram the table leaves out (1 when some image has it)."""
        k = len(ngram)
        vocab = self.index.vocab
        if not 1 <= k <= self.n or any(t not in vocab for t in ngram):
            return 0
        g = np.array([vocab[t] for t in ngram], np.int64)
        total = 0
        for lo, hi, _ in self._chunks:
            toks, lengths, doc = self._chunk(lo, hi)
            w = self._words(toks)
            remaining = np.repeat(np.cumsum(lengths), lengths) - np.arange(len(w), dtype=np.int64)
            s = np.flatnonzero((remaining >= k) & (w == g[0]))
            for j in range(1, k):
                s = s[w[s + j] == g[j]]
            total += len(_distinct(doc[s]))
        return total

    # -- scoring ------------------------------------------------------------------------------------------------
    def dots(self, candidates: Sequence, img: np.ndarray, idf: CountIdf, log_n: float, length):
        """The parts of CIDEr-D of ``candidates[i]`` against the references of image ``img[i]`` (positions):
        ``(dot, norm_h, len_h, ref_count, ref_norm, ref_len, u_inv)`` - clipped dot products per (candidate,
        order, reference slot) flattened, candidate norms and lengths, per distinct image (``u_inv``: the image of
        each candidate) its number of references, and per reference (image by image) its norms and length.
        Computed as :class:`captioning.metrics.cider.CiderD` does from the full table, in the same order."""
        n, refs, index = self.n, self.refs, self.index
        u_img, u_inv = np.unique(img, return_inverse=True)
        u_inv = u_inv.reshape(-1)
        n_u = len(u_img)
        ref_count = refs.n_refs[u_img]
        r_toks, r_len = refs.caption_tokens(refs.captions_of(u_img))
        c_w, c_len = index._word_ids(candidates, add=False)
        n_r, n_c = len(r_len), len(c_len)
        w = np.concatenate([self._words(r_toks), c_w])
        lengths = np.concatenate([r_len, c_len])
        cap = np.repeat(np.arange(n_r + n_c, dtype=np.int64), lengths)
        parts = {key: ([], []) for key in ("cap", "order", "lid", "tf", "gid")}  # (references, candidates)
        fb_local, l_off = [], 0
        for k, starts, inv, gid_k in index._orders(w, lengths, False, n):
            n_l = len(gid_k)
            pair, tf = np.unique(cap[starts] * n_l + inv, return_counts=True)
            lid, cp = pair % n_l, pair // n_l
            cut = int(np.searchsorted(cp, n_r))
            for key, value in (("cap", cp), ("order", np.full(len(pair), k - 1, np.int64)), ("lid", lid + l_off),
                               ("tf", tf.astype(np.int64)), ("gid", gid_k[lid])):
                parts[key][0].append(value[:cut])
                parts[key][1].append(value[cut:] - (n_r if key == "cap" else 0))
            fb = self.first[np.where(gid_k >= 0, self.offsets[k - 1] + gid_k, 0)].astype(np.int64)
            fb_local.append(np.where(gid_k >= 0, fb, -1))
            l_off += n_l
        (r_cap, c_cap), (r_order, c_order), (r_lid, c_lid), (r_tf, c_tf), (r_gid, c_gid) = (
            tuple(np.concatenate(v) if v else np.zeros(0, np.int64) for v in parts[key]) for key in parts)
        fb_local = np.concatenate(fb_local) if fb_local else np.zeros(0, np.int64)

        # references: norms per order, then one row per distinct (image, n-gram), one column per reference
        r_cid = np.where(r_gid >= 0, self.offsets[r_order] + r_gid, 0)
        r_idf = np.where(r_gid >= 0, idf.table[idf.counts[r_cid]], idf.table[1])  # df 1: in this image only
        weight = r_tf * r_idf
        ref_norm = np.sqrt(np.bincount(r_cap * n + r_order, weights=weight * weight,
                                       minlength=n_r * n)).reshape(-1, n)
        del weight
        ref_off = np.cumsum(ref_count) - ref_count
        r_img = np.repeat(np.arange(n_u, dtype=np.int64), ref_count)[r_cap]
        key = r_img * max(l_off, 1) + r_lid
        perm = np.argsort(key, kind="stable")
        key = key[perm]
        new_row = np.ones(len(key), bool)
        np.not_equal(key[1:], key[:-1], out=new_row[1:])
        row_keys = key[new_row]
        r_max = int(ref_count.max())
        weights = np.zeros((len(row_keys), r_max), np.float64)
        weights[np.cumsum(new_row) - 1, r_cap[perm] - ref_off[r_img[perm]]] = r_tf[perm] * r_idf[perm]

        # candidates: vectors and norms (n-grams no other image has: weight tf * log(N), as absent ones)
        seen = c_gid >= 0
        cid = np.where(seen, self.offsets[c_order] + c_gid, 0)
        vh = c_tf * np.where(seen, idf[cid], log_n)
        norm_h = np.sqrt(np.bincount(c_cap * n + c_order, weights=vh * vh, minlength=n_c * n)).reshape(n_c, n)

        # matches, summed in the full table's id order: (block of first appearance, lexicographic)
        q = u_inv[c_cap] * max(l_off, 1) + c_lid
        srt = np.argsort(q, kind="stable")
        qs = q[srt]
        dot = np.zeros(n_c * n * r_max, np.float64)
        if len(row_keys) and len(qs):
            pos, hit = sorted_join(row_keys, qs)
            e, pos = srt[hit], pos[hit]
            fb = fb_local[c_lid[e]]
            alone = fb < 0
            fb[alone] = np.searchsorted(self.block_starts, u_img[u_inv[c_cap[e[alone]]]], side="right") - 1
            by_id = np.lexsort((c_lid[e], fb))
            e, pos = e[by_id], pos[by_id]
            vr = weights[pos]
            contrib = np.minimum(vh[e, None], vr) * vr
            flat = ((c_cap[e] * n + c_order[e])[:, None] * r_max + np.arange(r_max)).reshape(-1)
            dot = np.bincount(flat, weights=contrib.reshape(-1), minlength=n_c * n * r_max)
            dot = dot.astype(np.float64, copy=False)
        return dot, norm_h, length(c_len), ref_count, ref_norm, length(r_len), u_inv
