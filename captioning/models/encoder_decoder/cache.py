"""What decoding keeps between steps: the encoder's :class:`Memory` of a batch of images and the decoder's
:class:`DecoderCache` (growing, or static for CUDA graphs: :mod:`captioning.models.static_cache`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from captioning.models import static_cache


@dataclass
class Memory:
    """Encoder output for a batch of images."""

    states: torch.Tensor  # (B, R, d)
    mask: torch.Tensor  # (B, R) bool, True = a real region

    def select(self, idx: torch.Tensor) -> Memory:
        return Memory(self.states.index_select(0, idx), self.mask.index_select(0, idx))

    def repeat(self, n: int) -> Memory:
        return Memory(self.states.repeat_interleave(n, 0), self.mask.repeat_interleave(n, 0))


@dataclass
class DecoderCache:
    """Per decoder layer: {"self": {...}, "cross": {...}} states; ``length`` = decoder positions fed so far.

    Growing (default): the self-attention states grow by concatenation every step. Static (``max_len`` set, see
    :mod:`captioning.models.static_cache`): every layer's self states live in buffers of ``max_len`` positions
    allocated at the first step and written in place at the positions ``pos`` (a 0-d long device tensor, the
    device-side twin of ``length``) onwards; the batch size is fixed by the first step and ``reorder`` copies
    rows within the same buffers, so the storage never changes (what a CUDA graph needs)."""

    layers: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    length: int = 0
    max_len: int | None = None  # static: preallocated positions
    pos: torch.Tensor | None = None  # static: positions fed so far, on the device
    shared: bool = False  # the released ACORT step cache: positions of a shared layer share its "self" states

    @property
    def static(self) -> bool:
        return self.max_len is not None

    def reorder(self, idx: torch.Tensor, cross: bool = True) -> None:
        """Keep batch rows ``idx`` (beam search). ``cross=False`` leaves the cross-attention states alone (when
        every new row comes from a row of the same image, whose memory states are identical)."""
        seen: set[int] = set()
        parts: set[int] = set()
        for layer in self.layers:
            for name, part in layer.items():
                if (name == "cross" and not cross) or id(part) in parts:  # a shared part moves once
                    continue
                parts.add(id(part))
                for k, v in part.items():
                    if not isinstance(v, torch.Tensor) or k in static_cache.META:
                        continue
                    if not self.static:
                        part[k] = v.index_select(0, idx)
                    elif id(v) not in seen:  # in place; a buffer shared by two names (Share-kV) moves once
                        seen.add(id(v))
                        v.copy_(v.index_select(0, idx))

    def reset(self) -> None:
        """Static cache: start a new caption in the same buffers (keeps the cross states: see prime_cache)."""
        if not self.static:
            raise ValueError("only a static cache can be reset; make a new growing cache instead")
        self.length = 0
        self.pos.zero_()
