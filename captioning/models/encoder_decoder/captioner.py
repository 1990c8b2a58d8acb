"""The one skeleton, :class:`Captioner`: region projection, encoder and decoder stacks, word and position
embeddings, the output layer; its initialisation, feature statistics and the decoding interface (teacher
forcing, cached and uncached steps; see :mod:`captioning.models.encoder_decoder`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioning.data.text import PAD
from captioning.models import static_cache
from captioning.models.encoder_decoder.cache import DecoderCache, Memory
from captioning.models.encoder_decoder.config import ArchConfig, check_skeleton
from captioning.models.encoder_decoder.stacks import DecoderLayer, EncoderLayer, Stack
from captioning.models.expansion import DynamicExpansion, StaticExpansion
from captioning.models.layers import BoxGeometry, GeometryBias, MultiHeadAttention, layer_norm, sinusoid_table


class Captioner(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        check_skeleton(cfg)
        m2 = cfg.skeleton == "m2"
        self.cfg = cfg
        d = cfg.d_model
        if cfg.standardize_features:  # identity until set_feature_stats
            self.register_buffer("feature_mean", torch.zeros(cfg.d_in))
            self.register_buffer("feature_scale", torch.ones(cfg.d_in))
        self.input_proj = nn.Linear(cfg.d_in, d)
        self.input_drop = nn.Dropout(cfg.input_dropout)
        self.input_norm = layer_norm(cfg.layer_norm, d) if m2 else None
        self.geometry = BoxGeometry(64) if cfg.geometry else None
        self.encoder = Stack(EncoderLayer, cfg, cfg.enc_layers, cfg.enc_share)
        self.decoder = Stack(DecoderLayer, cfg, cfg.dec_layers, cfg.dec_share)
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.embed_drop = nn.Dropout(cfg.dropout)
        rows = cfg.max_len + 1 if m2 else cfg.max_len  # m2: positions 1..max_len, row 0 = the padding row
        if cfg.pos_enc == "learned":
            self.pos = nn.Embedding(rows, d)
        else:  # m2: a frozen table stored with the weights (the released one is not the sinusoid: init_weights)
            table = sinusoid_table(rows, d)
            if m2:
                table[0] = 0.0
            self.register_buffer("pe", table, persistent=m2)
        self.generator = nn.Linear(d, cfg.vocab_size, bias=not m2)
        self.init_weights()

    def init_weights(self) -> None:
        """Apply ``cfg.init`` (nothing to do for "default").

        "xavier" follows the released code these papers build on (the Annotated Transformer's ``make_model``; the
        ORT/ACORT code, yahoo/object_relation_transformer and jiahuei/sparse-image-captioning
        ``relation_transformer.py``): ``xavier_uniform_`` on every parameter with ``dim() > 1`` of the
        encoder-decoder, i.e. everything but the region projection ``Linear(d_in -> d)``; each head's geometry
        weight ``w_h`` is its own ``Linear(64, 1)`` there, so it gets its own fan-in/fan-out here; ExpansionNet's
        learned expansion slots keep their own initialisation (see ``expansion.py``).

        Why it matters: with PyTorch's ``N(0, 1)`` embedding, ``Emb(w)*sqrt(d)`` is about sqrt(d) times larger
        per channel than the sinusoidal position code and than every pre-LN sublayer's output, so the residual
        stream stays dominated by the current token's embedding and position is drowned out. Models that must
        know *where* they are suffer most: ACORT (the same digit token means a frequency block in slot 0 and a
        word in slot 1) and SATIC (the K positions of a group differ only by position). Measured on the
        ``learning`` preset (demo size, d=128): ACORT with default init emits digit 1 forever ("a a a ...", val
        CIDEr 0.000 every epoch though the loss falls to 1.36), with xavier best val CIDEr 0.99; AIC after 5 XE
        epochs val CIDEr 0.37 (default) -> 0.79 (xavier).
        """
        if self.cfg.init == "default":
            return
        if self.cfg.init not in ("xavier", "released"):
            raise ValueError(f"unknown init {self.cfg.init!r}: default, xavier or released")

        released = self.cfg.init == "released"
        m2 = self.cfg.skeleton == "m2"
        expansion = [m for m in self.modules() if isinstance(m, StaticExpansion | DynamicExpansion)]
        own_init = set() if released else {id(p) for m in expansion for p in (m.queries, m.biases)}
        # ExpansionNet's and the M2-based LW-Transformer's released code initialise every dim > 1 parameter, the
        # region projection included
        skip_input = not (released and (expansion or m2))
        for name, p in self.named_parameters():
            if p.dim() < 2 or (skip_input and name.startswith("input_proj.")) or id(p) in own_init:
                continue
            if name.endswith(".geo.w.weight"):  # (heads, 64): one Linear(64, 1) per head in the released code
                for row in p.data.split(1, 0):
                    nn.init.xavier_uniform_(row)
            else:
                nn.init.xavier_uniform_(p)
        if not released:
            return
        with torch.no_grad():
            if m2 and self.cfg.pos_enc != "learned":
                # the M2 code's Transformer.init_weights runs xavier_uniform_ over model.parameters(), which
                # include the frozen sinusoid table (nn.Embedding.from_pretrained): the released table is random
                nn.init.xavier_uniform_(self.pe)
            for m in self.modules():
                if isinstance(m, GeometryBias):  # the released heads are deep copies of one Linear(64, 1)
                    m.w.bias.copy_(m.w.bias[:1].expand_as(m.w.bias).clone())
                if isinstance(m, MultiHeadAttention) and m.k > 1:  # LW's released attention: biases start at 0
                    for lin in (m.q, getattr(m, "k_proj", None), getattr(m, "v", None), m.o):
                        if lin is not None:
                            nn.init.zeros_(lin.bias)

    # ------------------------------------------------------------------ properties
    @property
    def group_size(self) -> int:
        return self.cfg.group_size

    @property
    def prefix_decoding(self) -> bool:
        """True when a decoding step must re-run the whole prefix (no cache): the released ZoDIAC pooling, whose
        gate changes every earlier position's output as the prefix grows. The decoding functions read it."""
        return self.cfg.zodiac_pool == "released" and "zodiac" in (
            self.cfg.enc_attention, self.cfg.dec_attention, self.cfg.cross_attention)

    @property
    def bos(self) -> int:
        return self.cfg.bos

    @property
    def eos(self) -> int:
        return self.cfg.eos

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def set_feature_stats(self, mean: torch.Tensor, std: torch.Tensor, *, floor: float = 1e-3) -> None:
        """Store the training split's per-dimension region-feature mean and standard deviation (``d_in`` each).
        A dimension whose deviation is below ``floor`` times the median deviation (a dead detector channel) is
        centred but not scaled up."""
        if not self.cfg.standardize_features:
            raise ValueError("this model does not standardise its features (ArchConfig.standardize_features)")
        mean, std = torch.as_tensor(mean, dtype=torch.float64), torch.as_tensor(std, dtype=torch.float64)
        if mean.shape != (self.cfg.d_in,) or std.shape != (self.cfg.d_in,):
            raise ValueError(f"feature statistics must have {self.cfg.d_in} values each, got "
                             f"{tuple(mean.shape)} and {tuple(std.shape)}")
        if not (torch.isfinite(mean).all() and torch.isfinite(std).all()) or (std < 0).any():
            raise ValueError("feature statistics must be finite, with non-negative deviations")
        low = std < floor * std.median().clamp_min(1e-12)
        scale = torch.where(low, torch.ones_like(std), 1.0 / std.clamp_min(1e-12))
        with torch.no_grad():
            self.feature_mean.copy_(mean.to(self.feature_mean.dtype))
            self.feature_scale.copy_(scale.to(self.feature_scale.dtype))

    # ------------------------------------------------------------------ encoder
    def encode(self, features: torch.Tensor, boxes: torch.Tensor, region_mask: torch.Tensor) -> Memory:
        if self.cfg.standardize_features:
            features = (features.to(self.feature_mean.dtype) - self.feature_mean) * self.feature_scale
        x = self.input_proj(features.to(self.input_proj.weight.dtype))
        if self.cfg.input_relu:
            x = F.relu(x)
        x = self.input_drop(x)
        if self.input_norm is not None:
            x = self.input_norm(x)
        x = x * region_mask[..., None]
        geo = self.geometry(boxes) if self.geometry is not None else None
        states = self.encoder.run(x, lambda pos, layer, h: layer(h, region_mask, geo))
        return Memory(states, region_mask)

    # ------------------------------------------------------------------ decoder
    def relaxed_mask(self, t_q: int, t_k: int, offset: int = 0, device=None) -> torch.Tensor:
        """(1, 1, t_q, t_k) bool: query position offset+i may see key j < (floor((offset+i)/K)+1)*K."""
        k = self.group_size
        i = torch.arange(offset, offset + t_q, device=device)[:, None]
        j = torch.arange(t_k, device=device)[None, :]
        return (j < (torch.div(i, k, rounding_mode="floor") + 1) * k)[None, None]

    def _embed(self, tokens: torch.Tensor, offset: int) -> torch.Tensor:
        t = tokens.shape[1]
        if offset + t > self.cfg.max_len:
            raise ValueError(f"decoder position {offset + t} exceeds max_len {self.cfg.max_len}")
        return self._embed_at(tokens, torch.arange(offset, offset + t, device=tokens.device))

    def _embed_at(self, tokens: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Decoder inputs: ``tokens`` (B, t) at the 0-based decoder positions ``idx`` (t,)."""
        learned = self.cfg.pos_enc == "learned"
        if self.cfg.skeleton == "m2":  # no scaling, no dropout; the table's row p+1 holds position p
            pos = self.pos(idx + 1) if learned else self.pe.index_select(0, idx + 1)
            return self.embed(tokens) + pos
        d = self.cfg.d_model
        if learned:
            return self.embed_drop(self.embed(tokens)) * math.sqrt(d) + self.pos(idx)
        return self.embed_drop(self.embed(tokens) * math.sqrt(d) + self.pe.index_select(0, idx))

    def _decode(self, memory: Memory, tokens: torch.Tensor, offset: int, caches: list | None,
                shared: bool = False) -> torch.Tensor:
        x = self._embed(tokens, offset)
        t = tokens.shape[1]
        if caches is None:
            mask = self.relaxed_mask(t, t, 0, tokens.device)
        elif shared:  # the released ACORT step cache: one token per step, every cached key visible (no mask)
            if t != 1:
                raise ValueError("the released ACORT step cache feeds one token per step")
            mask = None
        else:  # new positions see every cached position and, by the relaxed mask, their own group
            mask = self.relaxed_mask(t, offset + t, offset, tokens.device)
        h = self.decoder.run(x, lambda pos, layer, y: layer(y, memory, mask, caches[pos] if caches else None))
        return torch.log_softmax(self.generator(h).float(), dim=-1)

    def forward(self, features, boxes, region_mask, inputs: torch.Tensor, memory: Memory | None = None
                ) -> torch.Tensor:
        """Teacher forcing: ``inputs`` (B, T) decoder inputs (see :meth:`teacher_inputs`) -> (B, T, V)."""
        if memory is None:
            memory = self.encode(features, boxes, region_mask)
        if memory.states.shape[0] != inputs.shape[0]:
            memory = memory.repeat(inputs.shape[0] // memory.states.shape[0])
        return self._decode(memory, inputs, 0, None)

    def new_cache(self, static: bool = False, max_len: int | None = None, device=None,
                  released_acort_cache: bool = False) -> DecoderCache:
        """A growing cache, or with ``static=True`` a static one of ``max_len`` positions (default the model's
        ``cfg.max_len``) whose position counter lives on ``device`` (see :class:`DecoderCache`).

        ``released_acort_cache``: the released ORT/ACORT step cache, where the positions of a shared decoder layer
        share one self-attention state (module docstring); growing only. (The decoding functions ask for it when
        ``cfg.released_acort_cache`` is set or when told to.)"""
        if released_acort_cache:
            if static:
                raise ValueError("the released ACORT step cache grows by a layer's uses per step: no static cache")
            if self.group_size != 1:
                raise ValueError("the released ACORT step cache is for autoregressive models (group size 1)")
            selfs: dict[int, dict[str, Any]] = {lid: {} for lid in set(self.decoder.map)}
            return DecoderCache(layers=[{"self": selfs[lid], "cross": {}} for lid in self.decoder.map], shared=True)
        if not static:
            return DecoderCache(layers=[{} for _ in self.decoder.map])
        size = self.cfg.max_len if max_len is None else int(max_len)
        if not 1 <= size <= self.cfg.max_len:
            raise ValueError(f"a static cache holds 1..{self.cfg.max_len} positions (the model's max_len), "
                             f"not {size}")
        return DecoderCache(layers=[{"self": {static_cache.SIZE: size}} for _ in self.decoder.map], max_len=size,
                            pos=torch.zeros((), dtype=torch.long, device=device))

    def prime_cache(self, memory: Memory, cache: DecoderCache, in_place: bool = False) -> None:
        """Compute the cross-attention keys/values of ``memory`` now (a cache otherwise computes them at its first
        step), into the tensors already there when their shapes match (what a captured step reads; with
        ``in_place=True`` anything else is an error)."""
        for pos, lid in enumerate(self.decoder.map):
            cross = self.decoder.layers[lid].cross
            if not isinstance(cross, MultiHeadAttention):
                continue
            k, v = cross.project_kv(memory.states)
            part = cache.layers[pos].setdefault("cross", {})
            old_k, old_v = part.get("k"), part.get("v")
            if (old_k is not None and old_k.shape == k.shape and old_k.dtype == k.dtype
                    and old_v.shape == v.shape and (old_v is old_k) == (v is k)):
                old_k.copy_(k)
                if v is not k:
                    old_v.copy_(v)
            elif in_place:
                raise ValueError(f"cross states {tuple(k.shape)} {k.dtype} do not fit the cache's tensors")
            else:
                part["k"], part["v"] = k, v

    def decode_step(self, memory: Memory, tokens: torch.Tensor, cache: DecoderCache | None,
                    prefix: torch.Tensor | None = None) -> torch.Tensor:
        """Feed the next ``tokens`` (B, K); returns log-probs (B, K, V) of the next K output positions.

        With ``cache`` the step costs O(t); with ``cache=None`` the whole ``prefix`` (B, t) + tokens is decoded
        again (the reference the cached path must equal)."""
        if cache is None:
            full = tokens if prefix is None else torch.cat([prefix, tokens], 1)
            return self._decode(memory, full, 0, None)[:, -tokens.shape[1] :]
        if cache.length % self.group_size or tokens.shape[1] % self.group_size:
            raise ValueError(f"cached decoding feeds whole groups of {self.group_size} tokens")
        if cache.static:
            if cache.length + tokens.shape[1] > cache.max_len:
                raise ValueError(f"decoder position {cache.length + tokens.shape[1]} exceeds the static cache's "
                                 f"{cache.max_len} positions")
            out = self._decode_static(memory, tokens, cache)
        else:
            out = self._decode(memory, tokens, cache.length, cache.layers, shared=cache.shared)
        cache.length += tokens.shape[1]
        return out

    def _decode_static(self, memory: Memory, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """One step with a static cache: the same numbers as ``_decode`` with a growing cache, but every shape is
        fixed and the positions come from ``cache.pos`` on the device (no host value), so the step can be
        captured in a CUDA graph. Keys beyond the new positions' groups are masked out."""
        t = tokens.shape[1]
        idx = cache.pos + torch.arange(t, device=tokens.device)  # positions written by this step
        x = self._embed_at(tokens, idx)
        k = self.group_size
        j = torch.arange(cache.max_len, device=tokens.device)
        mask = (j[None, :] < (torch.div(idx, k, rounding_mode="floor") + 1)[:, None] * k)[None, None]
        for layer in cache.layers:
            layer["self"][static_cache.INDEX] = idx
        h = self.decoder.run(x, lambda pos, layer, y: layer(y, memory, mask, cache.layers[pos]))
        cache.pos.add_(t)
        return torch.log_softmax(self.generator(h).float(), dim=-1)

    def start_tokens(self, batch: int, device=None) -> torch.Tensor:
        return torch.full((batch, self.group_size), self.bos, dtype=torch.long, device=device)

    # ------------------------------------------------------------------ training helpers
    def teacher_inputs(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Loader targets [BOS, y_1.., EOS, PAD..] (N, T+1) -> (decoder inputs, outputs to predict), both (N, T).

        Inputs are K start symbols then y shifted by K; K = 1 gives the usual [BOS, y_1..] -> [y_1.., EOS]."""
        y = targets[:, 1:]
        k = self.group_size
        start = torch.full((y.shape[0], k), self.bos, dtype=y.dtype, device=y.device)
        inputs = torch.cat([start, y[:, : max(y.shape[1] - k, 0)]], 1)[:, : y.shape[1]]
        return inputs, y

    def xe_loss(self, features, boxes, region_mask, targets: torch.Tensor, label_smoothing: float = 0.0,
                reduction: str = "mean", sync_free: bool = False) -> torch.Tensor:
        """Mean token cross-entropy; ``targets`` (B, C, T+1) or (N, T+1) with the images repeated C times.

        ``reduction="sum"`` gives the sum over the target tokens instead (data-parallel training divides it by
        the global token count). ``sync_free``: label smoothing sums the masked losses instead of selecting the
        target tokens (a selection's size is read on the host, which a CUDA graph cannot do); the same value up
        to float rounding."""
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
        if targets.dim() == 3:
            b, c, t = targets.shape
            targets = targets.reshape(b * c, t)
            memory = self.encode(features, boxes, region_mask).repeat(c)
        else:
            memory = self.encode(features, boxes, region_mask)
        inputs, y = self.teacher_inputs(targets)
        logp = self.forward(None, None, None, inputs, memory=memory)
        if not label_smoothing:
            return F.nll_loss(logp.reshape(-1, logp.shape[-1]), y.reshape(-1), ignore_index=PAD, reduction=reduction)
        return _smoothed_nll(logp, y, label_smoothing, reduction, sync_free)


def _smoothed_nll(logp: torch.Tensor, y: torch.Tensor, eps: float, reduction: str = "mean",
                  sync_free: bool = False) -> torch.Tensor:
    valid = y != PAD
    nll = -logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    smooth = -logp.mean(-1)
    loss = (1 - eps) * nll + eps * smooth
    if sync_free:
        total = torch.where(valid, loss, 0.0).sum()
        return total if reduction == "sum" else total / valid.sum().clamp(min=1)
    return loss[valid].sum() if reduction == "sum" else loss[valid].mean()
