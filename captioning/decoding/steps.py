"""The decoding step pieces every search shares (greedy, sampling, beam search, and their CUDA-graph runners).

A search feeds the model groups of K tokens through a *stepper* (:class:`Stepper`: the growing cache, the
re-decoded prefix or the released ACORT step cache; :class:`StaticStepper`: the static cache, each step eager or a
captured graph passed in by the caller), masks the tokens that are never emitted (:func:`mask_specials`), and
chooses tokens (:func:`argmax`, :func:`race_sampler`), applying the decoding constraint (:func:`repeat_ban`,
:func:`ban`, :func:`choose_constrained`) where asked. :func:`decode_steps` turns ``max_len`` into the number of
steps, :class:`Decoded` is what the public functions return (:mod:`captioning.decoding.search` documents the
semantics).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from captioning.data import text

PAD = text.PAD
CHECK_EVERY = 4  # static engine: steps between host reads of "every caption finished"


@dataclass
class Decoded:
    """Decoded captions for B images, n per image (beams kept or samples), best first for beam search.

    ``L`` is the longest caption in the batch (``lengths.max()``, at most ``max_len``), not ``max_len``."""

    tokens: torch.Tensor  # (B, n, L) int64 output tokens, EOS included when produced, PAD after
    logprobs: torch.Tensor  # (B, n) float32: sum of the tokens' log-probs (EOS included)
    token_logprobs: torch.Tensor | None  # (B, n, L) float32 per-token log-probs, 0 at PAD
    lengths: torch.Tensor  # (B, n) int64 tokens incl. EOS

    def flat(self) -> torch.Tensor:
        """(B*n, L) tokens, rows image-major (image b's captions at rows b*n .. b*n+n-1)."""
        return self.tokens.reshape(-1, self.tokens.shape[-1])


# ---------------------------------------------------------------------- steppers
class Stepper:
    """Feeds groups of K tokens, cached (O(t) per step) or by re-decoding the prefix (the reference)."""

    def __init__(self, model, memory, use_cache: bool, released_cache: bool = False):
        self.model = model
        self.memory = memory
        self.cache = None
        if use_cache:
            self.cache = model.new_cache(released_acort_cache=True) if released_cache else model.new_cache()
        self.prefix: torch.Tensor | None = None  # (R, t) inputs fed so far (uncached path)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cache is not None:
            return self.model.decode_step(self.memory, tokens, self.cache)
        out = self.model.decode_step(self.memory, tokens, None, prefix=self.prefix)
        self.prefix = tokens if self.prefix is None else torch.cat([self.prefix, tokens], 1)
        return out

    def reorder(self, idx: torch.Tensor, memory: bool = True) -> None:
        """Keep rows ``idx`` (flat indices into the current rows). ``memory=False`` when every new row comes
        from a row of the same image (beam parents), whose memory rows are already identical."""
        if self.cache is not None:
            self.cache.reorder(idx, cross=memory)
        elif self.prefix is not None:
            self.prefix = self.prefix.index_select(0, idx)
        if memory:
            self.memory = self.memory.select(idx)


class StaticStepper:
    """Static cache, rows fixed for the whole search; each step eager or replayed from ``graph``, a captured step
    already started on the memory (:class:`captioning.decoding.graphs.GraphStep`, passed in by the caller)."""

    def __init__(self, model, memory, positions: int, graph=None):
        self.graph = graph
        if graph is None:
            self.model = model
            self.memory = memory
            self.cache = model.new_cache(static=True, max_len=positions, device=memory.states.device)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            return self.graph.step(tokens)
        return self.model.decode_step(self.memory, tokens, self.cache)

    def reorder(self, idx: torch.Tensor, memory: bool = False) -> None:
        """Keep rows ``idx``, every one a row of the same image (the memory is not reordered)."""
        if memory:
            raise ValueError("the static engine keeps its memory rows: reorder only within an image's rows")
        if self.graph is not None:
            self.graph.reorder(idx)
        else:
            self.cache.reorder(idx, cross=False)


# ---------------------------------------------------------------------- lengths and log-probs
def decode_steps(model, max_len: int) -> tuple[int, int]:
    """(effective max_len, number of decode steps)."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    k = int(model.group_size)
    cap = getattr(getattr(model, "cfg", None), "max_len", None)
    if cap is not None:
        max_len = min(max_len, (int(cap) // k) * k)
        if max_len < 1:
            raise ValueError(f"the model's {cap} positions cannot hold one group of {k}")
    return max_len, -(-max_len // k)


def mask_specials(model, logp: torch.Tensor) -> torch.Tensor:
    """PAD and BOS are never emitted. ``logp`` is a fresh tensor from the model: masked in place."""
    logp[..., PAD] = float("-inf")
    logp[..., int(model.bos)] = float("-inf")
    return logp


# ---------------------------------------------------------------------- the decoding constraint
def constraint_width(decoding_constraint: bool, word_tokens: int) -> int:
    """The constraint as the searches take it: d = ``word_tokens`` tokens per word when on, 0 when off."""
    if word_tokens < 1:
        raise ValueError(f"word_tokens must be >= 1, got {word_tokens}")
    return word_tokens if decoding_constraint else 0


def repeat_ban(hist: torch.Tensor, d: int) -> torch.Tensor | None:
    """The token that would repeat the previous word at the next output position, per row (-1: none), or None
    when the next position cannot complete a repeat. ``hist`` (R, p): each row's output tokens so far; a word is
    ``d`` tokens (1 for word models, the radix digits per word for radix models)."""
    p = hist.shape[1]
    if p % d != d - 1 or p < 2 * d - 1:  # the next token does not end a word, or there is no previous word
        return None
    prev = hist[:, p - 2 * d + 1 : p - d + 1]  # the previous word's d tokens
    same = (hist[:, p - d + 1 :] == prev[:, :-1]).all(1)  # the current word's first d-1 tokens repeat it so far
    return torch.where(same, prev[:, -1], torch.full_like(prev[:, -1], -1))


def ban(logp: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """``logp`` (R, V) with token ``banned[r]`` of row r set to -inf (none where banned < 0); in place."""
    if banned is not None:
        idx = banned.clamp(min=0)[:, None]
        logp.scatter_(-1, idx, torch.where(banned[:, None] >= 0, float("-inf"), logp.gather(-1, idx)))
    return logp


def choose_constrained(logp: torch.Tensor, past: torch.Tensor, d: int,
                       choose: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A group's K tokens chosen position by position, none repeating the word before it. ``logp`` (A, K, V)
    (banned entries set to -inf in place), ``past`` (A, t) the rows' earlier output tokens -> tokens (A, K)."""
    a, k, _ = logp.shape
    tok = torch.empty(a, k, dtype=torch.long, device=logp.device)
    for j in range(k):
        ban(logp[:, j], repeat_ban(torch.cat([past, tok[:, :j]], 1), d))
        tok[:, j] = choose(logp[:, j : j + 1]).squeeze(1)
    return tok


# ---------------------------------------------------------------------- choosing tokens
def argmax(logp: torch.Tensor) -> torch.Tensor:
    """``choose`` for greedy decoding: the arg-max at every position."""
    return logp.argmax(-1)


def race_sampler(temperature: float = 1.0,
                 generator: torch.Generator | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``choose`` for the static engine's sampling: one draw per position from ``softmax(logp / temperature)`` as
    the arg-max of ``p / E`` with ``E ~ Exp(1)`` drawn per token (an exponential race: the same distribution as
    ``torch.multinomial``, but no host sync and nothing data-dependent on the host, so a CUDA graph can replay
    it; the default CUDA generator is registered with graphs). Not the same draws as ``multinomial`` for a seed."""
    tiny = torch.finfo(torch.float32).tiny

    def choose(logp: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(logp / temperature, dim=-1)
        race = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=tiny)
        return (probs / race).argmax(-1)

    return choose


# ---------------------------------------------------------------------- results
def trim(toks: torch.Tensor, tlp: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row-wise outputs cut to the longest caption (at least one column)."""
    width = max(int(lengths.max()) if lengths.numel() else 1, 1)
    return toks[:, :width], tlp[:, :width], lengths


def pack(toks, tlp, lengths, b: int, per: int) -> Decoded:
    """Row-wise outputs of ``b * per`` rows (image-major) as :class:`Decoded`."""
    return Decoded(
        tokens=toks.view(b, per, -1),
        logprobs=tlp.sum(-1).view(b, per),
        token_logprobs=tlp.view(b, per, -1),
        lengths=lengths.view(b, per),
    )


def outside_inference(d: Decoded) -> Decoded:
    """``d`` cloned outside ``torch.inference_mode`` (ordinary tensors, usable in autograd expressions)."""

    def c(t):
        return None if t is None else t.clone()

    return Decoded(c(d.tokens), c(d.logprobs), c(d.token_logprobs), c(d.lengths))


__all__ = ["CHECK_EVERY", "PAD", "Decoded", "StaticStepper", "Stepper", "argmax", "ban", "choose_constrained",
           "constraint_width", "decode_steps", "mask_specials", "outside_inference", "pack", "race_sampler",
           "repeat_ban", "trim"]
