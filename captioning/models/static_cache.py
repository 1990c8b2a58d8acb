"""Static-size decoder state: preallocated buffers written in place at positions held in a device tensor.

The growing cache (``torch.cat`` per step) gives every step new shapes; a static cache gives every step the
same shapes and the same storage, so one decoder step can be captured in a CUDA graph and replayed.

A static layer part (the ``"self"`` dict of one decoder layer in :class:`~captioning.models.encoder_decoder.
DecoderCache`) holds ``SIZE`` (the number of preallocated positions, an int) and, during a step, ``INDEX``: the
(t,) long device tensor of the positions the step writes. A module keeps any per-position state under its own
names; :func:`write` allocates a buffer (zeros, ``SIZE`` positions along ``dim``, the new values' dtype and
device) at the first write and copies the new positions into it with ``index_copy_``. Positions not written
yet hold zeros (or a previous caption's finite values): the decoder's mask gives them no weight, so a step sees
the same numbers as with the growing cache.
"""

from __future__ import annotations

from typing import Any

import torch

INDEX = "index"  # (t,) long: positions written by the current step
SIZE = "size"  # int: preallocated positions
META = frozenset({INDEX, SIZE})  # entries that are not per-row state (never reordered)


def is_static(part: dict[str, Any] | None) -> bool:
    return part is not None and SIZE in part


def write(part: dict[str, Any], name: str, x: torch.Tensor, dim: int) -> torch.Tensor:
    """Copy ``x``'s positions (along ``dim``) into ``part[name]`` at ``part[INDEX]``; returns the whole buffer."""
    buf = part.get(name)
    if buf is None:
        shape = list(x.shape)
        shape[dim] = part[SIZE]
        buf = part[name] = x.new_zeros(shape)
    elif buf.shape[0] != x.shape[0] or buf.dtype != x.dtype:
        raise ValueError(f"static cache {name!r} holds {buf.shape[0]} rows of {buf.dtype}, the step feeds "
                         f"{x.shape[0]} rows of {x.dtype}: a static cache serves one batch shape and dtype")
    buf.index_copy_(dim, part[INDEX], x)
    return buf
