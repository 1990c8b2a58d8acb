"""Parameter counting with each paper's convention.

- ``full`` (ACORT/ORT, AIC, SATIC, ZoDIAC): every parameter of the model, shared modules counted once
  (``model.parameters()`` yields a shared tensor once), including the region projection, untied embedding and
  generator, geometric heads and LayerNorms.
- ``stacks`` (LW-Transformer): the encoder and decoder layer stacks' attention and FFN weights and biases only
  (no embeddings, region projection, output layer, LayerNorms or box geometry).
"""

from __future__ import annotations

from torch import nn

from captioning.models.encoder_decoder import Captioner
from captioning.models.layers import FeedForward, MultiHeadAttention


def count(model: nn.Module, convention: str = "full") -> int:
    if convention == "full":
        return sum(p.numel() for p in model.parameters())
    if convention == "stacks":
        if not isinstance(model, Captioner):
            raise TypeError("the stacks convention needs a Captioner")
        seen: set[int] = set()
        total = 0
        for stack in (model.encoder, model.decoder):
            for layer in stack.layers:
                for m in layer.modules():
                    if isinstance(m, MultiHeadAttention | FeedForward) or type(m).__name__ in (
                        "StaticExpansion", "DynamicExpansion"
                    ):
                        for p in m.parameters():
                            if id(p) not in seen:
                                seen.add(id(p))
                                total += p.numel()
        return total
    raise ValueError(f"unknown counting convention {convention!r}")
