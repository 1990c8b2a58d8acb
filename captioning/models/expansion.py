"""ExpansionNet's static (encoder) and dynamic (decoder) expansion layers, which replace self-attention.

Notation (PAPERS.md, "ExpansionNet"): ``rn(A) = A / (rowsum(A) + eps)``; ``ReLU(+Z)`` and ``ReLU(-Z)`` split the
similarities into two classes ``a`` (+) and ``b`` (-), each with its own value projection ``W_a`` / ``W_b``.

Static expansion over R regions with N_E learned expansion queries ``Q_E`` and biases ``B_E``::

    Z   = Q_E (W_k X)^T / sqrt(d)                             (N_E, R); padded regions' columns get zero weight
    F+- = rn(ReLU(+-Z)) (W_{a|b} X) + B_E                     (N_E, d)  forward: regions -> expansion slots
    Y+- = rn(ReLU(+-Z^T)) F+-                                 (R, d)    backward: slots -> regions
    out = s * Y+ + (1 - s) * Y-,   s = sigmoid(W_s X)

Dynamic expansion over T decoder positions: every position t owns a *group* of N_D expansion queries and biases
``q_{t,n} = Q_D[n] + W_c x_t``, ``b_{t,n} = B_D[n] + W_c x_t``. With a visibility mask M (T x T; the skeleton's
causal / SATIC-relaxed mask, ``M[t, j]`` = position t may see position j):

    Z[t,n,j] = q_{t,n} . (W_k x_j) / sqrt(d)
    forward   F+-[t,n] = sum_{j: M[t,j]}         rn_j(ReLU(+-Z[t,n,j])) (W_{a|b} x_j) + b_{t,n}
    backward  Y+-[i]   = sum_{t',n: M[i,t']}     rn_{(t',n)}(ReLU(+-Z[t',n,i])) F+-[t',n]

(for the causal mask: "query group t sees keys <= t" and "token i reads groups t' <= i").
``Z`` is computed as ``Q_D[n].k_j + (W_c x_t).k_j``, which costs O(T N d + T^2 d) instead of O(T^2 N d).

Incremental decoding (``cache`` dict, batch-first tensors so :meth:`DecoderCache.reorder` works): per past
position the module keeps ``c = W_c x``, ``k = W_k x``, ``va``/``vb = W_{a|b} x``, ``qk = Q_D . k / sqrt(d)``
(B, t, N_D) and the forward results ``fa``/``fb`` of its group (B, t, N_D, d). A step with new positions
computes the new groups' forward over all visible keys and the new tokens' backward over all visible groups
(old groups' F taken from the cache): O(t N_D d) per new position, like attention's O(t d) times N_D.
This is exact as long as an old position's visible key set never grows, i.e. rows of the mask of positions
already fed never see positions fed later - true for the causal mask and for the relaxed mask when every step
feeds whole groups (the skeleton's ``decode_step`` feeds K tokens per step).

With a static cache (:mod:`captioning.models.static_cache`) the same seven states live in buffers of the
cache's preallocated positions, written in place; the mask (over every preallocated position) gives positions
not fed yet zero weight in both the forward and the backward, so the numbers are those of the growing cache.

Deviations from the released code (jchenghu/ExpansionNet), each an :class:`ArchConfig` option whose
``released`` value reproduces the released arithmetic (``expansionnet@released``):

- ``expansion_eps``: capflow 1e-4 (:data:`DEFAULT_EPS`), released 1e-9. With 1e-9 a row whose only visible key
  has similarity 1e-3 still gives that key weight 1.0 (1e-4: 0.909); 1e-4 damps near-empty rows.
- ``expansion_dropout``: capflow drops out the two forward results ``F+-`` (bias included); ``released`` drops
  out ``Z`` (one mask, used by the forward and the backward), ``F+-`` and ``Y+-`` (5 sites), and in the dynamic
  block adds the bias ``b_{t,n}`` after the dropout of ``F+-``.
- ``init="released"``: the expansion slots ``Q``/``B`` are Glorot-uniform (as every ``dim() > 1`` parameter
  there; about 12x smaller than capflow's ``N(0, 1/3)``), and so is the region projection.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioning.models import static_cache

DEFAULT_EPS = 1e-4
RELEASED_EPS = 1e-9
DROPOUT_SITES = ("capflow", "released")


def row_normalize(a: torch.Tensor, mask: torch.Tensor | None = None, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """``rn(A) = A / (rowsum(A) + eps)`` over the last dim; ``mask`` (broadcastable, True = valid) zeroes the
    invalid entries first, so rows sum to ~1 over their valid entries (exactly 0 for a row with no mass)."""
    if mask is not None:
        a = a * mask.to(a.dtype)
    return a / (a.sum(-1, keepdim=True) + eps)


def _init_expansion(p: torch.Tensor) -> None:
    # same scale as a default nn.Linear's output on a LayerNorm'd input, so that Q_D[n] and W_c x_t (and B_D[n]
    # and the forward's weighted mean of values) are of comparable size
    nn.init.normal_(p, std=1.0 / math.sqrt(3.0))


class StaticExpansion(nn.Module):
    """Encoder expansion: regions -> N_E learned slots -> regions (no self-attention)."""

    def __init__(self, d_model: int, n_exp: int, dropout: float = 0.1, eps: float = DEFAULT_EPS,
                 dropout_sites: str = "capflow"):
        super().__init__()
        if dropout_sites not in DROPOUT_SITES:
            raise ValueError(f"unknown expansion dropout sites {dropout_sites!r}: capflow or released")
        self.d, self.n, self.eps, self.released = d_model, n_exp, eps, dropout_sites == "released"
        self.queries = nn.Parameter(torch.empty(n_exp, d_model))  # Q_E
        self.biases = nn.Parameter(torch.empty(n_exp, d_model))  # B_E
        _init_expansion(self.queries)
        _init_expansion(self.biases)
        self.key = nn.Linear(d_model, d_model)  # W_k
        self.val_a = nn.Linear(d_model, d_model)  # W_a
        self.val_b = nn.Linear(d_model, d_model)  # W_b
        self.select = nn.Linear(d_model, d_model)  # W_s
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x (B, R, d), mask (B, R) bool True = real region -> (B, R, d); padded regions' outputs are 0."""
        z = self.queries @ self.key(x).transpose(1, 2) / math.sqrt(self.d)  # (B, N_E, R)
        if self.released:
            z = self.drop(z)
        cols = mask[:, None, :] if mask is not None else None
        fa = self.drop(row_normalize(F.relu(z), cols, self.eps) @ self.val_a(x) + self.biases)  # (B, N_E, d)
        fb = self.drop(row_normalize(F.relu(-z), cols, self.eps) @ self.val_b(x) + self.biases)
        zt = z.transpose(1, 2)  # (B, R, N_E)
        ya = row_normalize(F.relu(zt), eps=self.eps) @ fa  # (B, R, d)
        yb = row_normalize(F.relu(-zt), eps=self.eps) @ fb
        if self.released:
            ya, yb = self.drop(ya), self.drop(yb)
        s = torch.sigmoid(self.select(x))
        out = s * ya + (1 - s) * yb
        if mask is not None:
            out = out * mask[..., None].to(out.dtype)
        return out


_CACHED = ("c", "k", "va", "vb", "qk", "fa", "fb")


class DynamicExpansion(nn.Module):
    """Decoder expansion: every position owns N_D input-conditioned slots; visibility follows ``self_mask``."""

    def __init__(self, d_model: int, n_exp: int, dropout: float = 0.1, eps: float = DEFAULT_EPS,
                 dropout_sites: str = "capflow"):
        super().__init__()
        if dropout_sites not in DROPOUT_SITES:
            raise ValueError(f"unknown expansion dropout sites {dropout_sites!r}: capflow or released")
        self.d, self.n, self.eps, self.released = d_model, n_exp, eps, dropout_sites == "released"
        self.queries = nn.Parameter(torch.empty(n_exp, d_model))  # Q_D
        self.biases = nn.Parameter(torch.empty(n_exp, d_model))  # B_D
        _init_expansion(self.queries)
        _init_expansion(self.biases)
        self.cond = nn.Linear(d_model, d_model)  # W_c
        self.key = nn.Linear(d_model, d_model)  # W_k
        self.val_a = nn.Linear(d_model, d_model)  # W_a
        self.val_b = nn.Linear(d_model, d_model)  # W_b
        self.select = nn.Linear(d_model, d_model)  # W_s
        self.drop = nn.Dropout(dropout)

    @staticmethod
    def _mask(self_mask: torch.Tensor | None, tq: int, tk: int, device) -> torch.Tensor:
        """-> (B or 1, Tq, Tk) bool."""
        if self_mask is None:
            return torch.ones(1, tq, tk, dtype=torch.bool, device=device)
        m = self_mask
        if m.dim() == 4:
            if m.shape[1] != 1:
                raise ValueError(f"expansion mask must have a single head dimension, got {tuple(m.shape)}")
            m = m[:, 0]
        elif m.dim() == 2:
            m = m[None]
        if m.shape[-2:] != (tq, tk):
            raise ValueError(f"mask {tuple(self_mask.shape)} does not match {tq} new and {tk} total positions")
        return m.bool()

    def forward(self, x: torch.Tensor, self_mask: torch.Tensor | None, cache: dict[str, Any] | None = None
                ) -> torch.Tensor:
        """x (B, Tq, d) new positions; self_mask (1, 1, Tq, Tk) True = may see; cache: this module's state."""
        b, tq, d = x.shape
        scale = 1.0 / math.sqrt(d)
        new = {
            "c": self.cond(x),  # (B, Tq, d)
            "k": self.key(x),
            "va": self.val_a(x),
            "vb": self.val_b(x),
        }
        new["qk"] = new["k"] @ self.queries.t() * scale  # (B, Tq, N): Q_D[n] . k_j / sqrt(d)
        static = static_cache.is_static(cache)
        past = cache is not None and "k" in cache
        if static:  # preallocated positions written in place; later positions are masked out
            full = {name: static_cache.write(cache, name, t, 1) for name, t in new.items()}
        else:
            full = {name: torch.cat([cache[name], t], 1) if past else t for name, t in new.items()}
        tk = full["k"].shape[1]
        m = self._mask(self_mask, tq, tk, x.device)  # (Bm, Tq, Tk)

        # forward of the new groups over all visible keys: Z[t, n, j] = c_t . k_j + Q_D[n] . k_j
        z = (new["c"] @ full["k"].transpose(1, 2) * scale)[:, :, None, :] + full["qk"].transpose(1, 2)[:, None]
        zmask = None
        if self.released and self.training and self.drop.p > 0:  # one dropout mask on Z, forward and backward
            if tq != tk:
                raise ValueError("released expansion dropout on Z needs the whole sequence (no cache) in training")
            zmask = self.drop(torch.ones(z.shape, dtype=z.dtype, device=z.device))  # (B, T, N, T): 0 or 1/(1-p)
            z = z * zmask
        kmask = m[:, :, None, :]  # (Bm, Tq, 1, Tk)
        bias = self.biases + new["c"][:, :, None, :]  # b_{t,n}: (B, Tq, N, d)

        def fwd(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:  # (B, Tq, N, Tk) x (B, Tk, d) -> (B, Tq, N, d)
            w = row_normalize(w, kmask, self.eps)
            f = (w.reshape(b, tq * self.n, tk) @ v).view(b, tq, self.n, d)
            return self.drop(f) + bias if self.released else self.drop(f + bias)

        new["fa"] = fwd(F.relu(z), full["va"])
        new["fb"] = fwd(F.relu(-z), full["vb"])
        for name in ("fa", "fb"):
            if static:
                full[name] = static_cache.write(cache, name, new[name], 1)
            else:
                full[name] = torch.cat([cache[name], new[name]], 1) if past else new[name]

        # backward of the new tokens over all visible groups: weight of (t', n) for token i is Z[t', n, i]
        zb = (new["k"] @ full["c"].transpose(1, 2) * scale)[:, :, :, None] + new["qk"][:, :, None, :]  # (B,Tq,Tk,N)
        if zmask is not None:  # zb[i, t', n] = Z[t', n, i]
            zb = zb * zmask.permute(0, 3, 1, 2)
        gmask = m[:, :, :, None].expand(-1, -1, -1, self.n).reshape(m.shape[0], tq, tk * self.n)

        def bwd(w: torch.Tensor, f: torch.Tensor) -> torch.Tensor:  # -> (B, Tq, d)
            w = row_normalize(w.reshape(b, tq, tk * self.n), gmask, self.eps)
            return w @ f.reshape(b, tk * self.n, d)

        ya = bwd(F.relu(zb), full["fa"])
        yb = bwd(F.relu(-zb), full["fb"])
        if self.released:
            ya, yb = self.drop(ya), self.drop(yb)
        s = torch.sigmoid(self.select(x))
        if cache is not None and not static:
            cache.update({name: full[name] for name in _CACHED})
        return s * ya + (1 - s) * yb
