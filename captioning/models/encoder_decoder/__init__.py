"""The one encoder-decoder skeleton. Every paper is a choice of parts (:class:`ArchConfig`), not a copy.

The package: :mod:`.config` (:class:`ArchConfig` and its checks), :mod:`.stacks` (the encoder and decoder layers,
their token mixers looked up by attention kind, the stacks), :mod:`.cache` (:class:`Memory`,
:class:`DecoderCache`) and :mod:`.captioner` (:class:`Captioner`, the skeleton and its decoding interface).

Interface used by training and by every decoding algorithm (written once, in ``captioning.decoding``):
- ``encode(features, boxes, region_mask) -> Memory``
- ``forward(features, boxes, region_mask, inputs) -> log-probs (B, T, V)`` (teacher forcing)
- ``decode_step(memory, tokens (B, K), cache) -> log-probs (B, K, V)``, with ``cache = model.new_cache()``;
  ``cache=None`` recomputes the whole prefix (the uncached reference); ``model.new_cache(static=True,
  max_len=T, device=...)`` is the static-size cache (same numbers, fixed shapes and storage: CUDA graphs).

Semi-autoregressive decoding (SATIC) with group size K: the target sequence y = [w_1..w_T, EOS] is produced
K tokens per step. Decoder input position i holds y_{i-K} (the K start symbols are BOS), and the relaxed mask
lets position i see inputs j < (floor(i/K)+1)*K. K = 1 is exactly the autoregressive captioner.

Fidelity to the papers' released code. With the options below set as in :func:`registry.released` (preset names
``<preset>@released``) the skeleton computes the released modules' arithmetic; the defaults keep capflow's
choices (checkpoints trained before these options existed keep their meaning):

- ``layer_norm``: ``torch`` (``nn.LayerNorm``: biased variance, eps 1e-5 inside the root) or ``annotated``
  (``a * (x - mean) / (std_unbiased + 1e-6) + b``, the Annotated Transformer's, used by the released AIC, SATIC,
  ZoDIAC and ORT/ACORT code; up to 5e-3 apart on a normalised activation at d=512).
- ``ffn_activation``: ``relu`` or ``none`` (ZoDIAC's released model classes have no ReLU in the FFN).
- ``zodiac_pool``: ``sample`` (mean intensity per sample, head and query) or ``released`` (one scalar per sample
  with the released sum and denominator, as the released code computes it for a batch of one image: its own
  batch-level pooling would make a caption depend on the other images of the batch; see
  :meth:`~captioning.models.layers.MultiHeadAttention._released_pool`). Such a model decodes by re-running the
  whole prefix every step (:attr:`Captioner.prefix_decoding`: the decoding functions do it by themselves).
- ``released_acort_cache``: decode with the released ORT/ACORT code's step cache (jiahuei/sparse-image-captioning
  ``CachedMultiHeadedAttention``): a decoder layer shared by several positions keeps ONE self-attention cache, to
  which every position using it appends its keys/values in turn, and a cached step attends to all of it without a
  mask. That is not the function the model was trained with (teacher forcing and whole-prefix decoding see only
  the same position's keys at every earlier step); the published ACORT captions come from it. Off by default;
  without cross-layer sharing it changes nothing. Growing cache only (no static cache / CUDA graphs), K = 1.
- ``attn_dropout``: dropout on the attention weights (None = ``dropout``); ExpansionNet's released
  cross-attention has none.
- ``expansion_eps`` (1e-4; released 1e-9) and ``expansion_dropout`` (``capflow`` | ``released``): see
  :mod:`captioning.models.expansion`.
- ``init="released"``: ``xavier`` plus the released code's details: ExpansionNet's region projection and
  expansion slots Glorot-uniform, LW-Transformer's attention biases 0 (and, in the ``m2`` skeleton, its region
  projection and position table Glorot-uniform), ORT's per-head geometry biases equal across heads.
- ``grouped_merge``: the heads' merge ``W_O`` per group (one ``Linear(d/k, d/k)`` shared by the k groups), as
  LW-Transformer's released attention (``fc_o``) has it; capflow's LW presets keep the dense ``W_O`` the paper's
  parameter counts imply.
- ``skeleton``: ``capflow`` (the layers above: ``norm`` pre/post, embeddings scaled by sqrt(d) with dropout,
  sinusoid positions from 0, a final LN after each stack, an output layer with bias) or ``m2``, the
  M2-Transformer-shaped skeleton of LW-Transformer's released code (luogen1996/LWTransformer,
  ``models/transformer_lightweight``): post-LN (``norm="post"`` required) with every attention sublayer wrapped
  twice, ``LN(x + Drop(LN'(x + Drop(Attn(x)))))`` (``LN'`` is the released attention module's own residual +
  LayerNorm, ``sub<j>.inner_norm`` here); regions ``LN(Drop(ReLU(W x + b)))`` (``input_norm``); word embeddings
  neither scaled nor dropped out, plus a position table indexed from 1 (row 0 is the released padding row) that
  is stored with the weights (``pe``, persistent; frozen as in the released code, whose model-wide Glorot
  initialisation overwrites its sinusoid table: ``init="released"`` does the same); no final LN; an output layer
  without bias. ``FFN`` sublayers are ``LN(x + Drop(FFN(x)))``. The layers, masks and caches are the same code.
- ``standardize_features`` (capflow's pipeline presets turn it on through ``loader.standardize_features``; off
  in every registry preset and ``released`` flavour, as in the papers' code): region features are standardised per
  dimension before the region projection, ``(x - feature_mean) * feature_scale``, with the training split's
  statistics stored in the model as buffers (:meth:`Captioner.set_feature_stats`), so a saved model carries
  them to inference. Detector features share a large common offset (measured on the demo's random-weight
  detector: mean |x| 2.27 against a between-image standard deviation of 0.28 per dimension); without this, small
  models there collapse to one caption for every image.
- Not options (documented in README.md): an image with no valid region gets zero attention here, uniform
  attention in the references (their -1e9 fill); the M2 code's region mask (``sum(LN(x)) == 0`` after the input
  LayerNorm, so padded regions are in effect attended to) is not copied: padded regions are masked out.
"""

from __future__ import annotations

from captioning.data.text import PAD  # the one definition of the padding id (re-exported)
from captioning.models.encoder_decoder.cache import DecoderCache, Memory
from captioning.models.encoder_decoder.captioner import Captioner
from captioning.models.encoder_decoder.config import SKELETONS, ArchConfig
from captioning.models.encoder_decoder.stacks import DecoderLayer, EncoderLayer

__all__ = ["PAD", "SKELETONS", "ArchConfig", "Captioner", "DecoderCache", "DecoderLayer", "EncoderLayer", "Memory"]
