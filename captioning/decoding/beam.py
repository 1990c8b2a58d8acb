"""Group-aware beam search's loop (the public :func:`captioning.decoding.search.beam_search` documents the search).

Each step feeds every hypothesis's K tokens through a stepper the caller opens (:func:`search_beams`'s
``open_stepper``: the eager growing cache / prefix, or the static cache with each step eager or replayed from a
captured graph), then expands the hypotheses position by position (:func:`_expand_group`: :func:`_candidates`,
:func:`_ranking_key`, :func:`_prune`), checks whether the search is over (:func:`_done`) and reorders the stepper
to the surviving hypotheses' parents; :func:`_best` ranks the final slots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from captioning.decoding.steps import CHECK_EVERY, PAD, Decoded, ban, decode_steps, mask_specials, repeat_ban

NEG_INF = float("-inf")


@dataclass
class _Beams:
    """The ``w`` hypothesis slots of each of ``b`` images, sorted best first after every pruning."""

    scores: torch.Tensor  # (b, w) float32 sums of token log-probs (-inf: an empty slot)
    fin: torch.Tensor  # (b, w) bool: EOS emitted
    lengths: torch.Tensor  # (b, w) int64 output tokens incl. EOS
    toks: torch.Tensor  # (b, w, L) int64 output tokens, PAD after
    tlp: torch.Tensor  # (b, w, L) float32 per-token log-probs, 0 at PAD

    @classmethod
    def start(cls, b: int, w: int, width: int, dev) -> _Beams:
        """One live hypothesis per image (slot 0, score 0); the other slots empty."""
        scores = torch.full((b, w), NEG_INF, dtype=torch.float32, device=dev)
        scores[:, 0] = 0.0
        return cls(scores=scores,
                   fin=torch.zeros(b, w, dtype=torch.bool, device=dev),
                   lengths=torch.zeros(b, w, dtype=torch.long, device=dev),
                   toks=torch.full((b, w, width), PAD, dtype=torch.long, device=dev),
                   tlp=torch.zeros(b, w, width, dtype=torch.float32, device=dev))


def search_beams(model, memory, w: int, max_len: int, alpha: float, n_best: int, static: bool,
                 open_stepper: Callable, constraint: int = 0) -> Decoded:
    """Beam search of width ``w`` over ``memory`` (B images) -> the ``n_best`` best hypotheses per image.

    ``open_stepper(memory, positions)`` opens the stepper for the search's rows: B rows of ``memory`` (eager;
    expanded to B*w rows at the first reorder), or B*w rows from the start when ``static`` (the memory repeated,
    step 0 reading the first copy of each image; "all finished" read every CHECK_EVERY steps).
    ``alpha``: the length penalty; ``constraint`` d > 0: the decoding constraint with words of d tokens."""
    max_len, steps = decode_steps(model, max_len)
    k, eos = int(model.group_size), int(model.eos)
    b = memory.states.shape[0]
    dev = memory.states.device
    beams = _Beams.start(b, w, steps * k, dev)
    # the row (of the current step's batch) that holds each slot's state: B rows at step 0, then B*w (static
    # engine: B*w rows from the start, step 0 reading the first copy of each image)
    if static:
        row = (torch.arange(b, device=dev) * w)[:, None].expand(b, w)
        stepper = open_stepper(memory.repeat(w), steps * k)
        inp = model.start_tokens(b * w, device=dev)
    else:
        row = torch.arange(b, device=dev)[:, None].expand(b, w)
        stepper = open_stepper(memory, steps * k)
        inp = model.start_tokens(b, device=dev)

    for s in range(steps):
        logp = mask_specials(model, stepper.step(inp).float())  # (R, K, V)
        beams, parent = _expand_group(beams, logp, row, s, k, max_len, alpha, constraint, eos)
        if (s + 1) * k >= max_len:
            break
        if (not static or (s + 1) % CHECK_EVERY == 0) and _done(beams, alpha, n_best):
            break
        # parents are rows of the same image: memory rows are identical, only the first expansion selects them
        stepper.reorder(parent.reshape(-1), memory=s == 0 and not static)
        row = torch.arange(b * w, device=dev).view(b, w)
        inp = beams.toks[:, :, s * k : (s + 1) * k].reshape(b * w, k)
    return _best(beams, alpha, n_best)


def _expand_group(beams: _Beams, logp: torch.Tensor, row: torch.Tensor, s: int, k: int, max_len: int,
                  alpha: float, constraint: int, eos: int) -> tuple[_Beams, torch.Tensor]:
    """Step ``s``'s K positions, one after the other: every hypothesis extended with every token by the
    distribution of its parent row at that position, the best ``w`` kept per image. ``logp`` (R, K, V) the
    step's log-probs, ``row`` (b, w) the row holding each slot's state -> (the slots, the row (b, w) each
    surviving hypothesis descends from)."""
    b, w = row.shape
    v = logp.shape[-1]
    parent = row.clone()  # (b, w) row whose distributions each current hypothesis uses
    for j in range(k):
        p = s * k + j
        if p >= max_len:
            break
        lp_j = logp[:, j].index_select(0, parent.reshape(-1)).view(b, w, v)
        if constraint:
            ban(lp_j.view(b * w, v), repeat_ban(beams.toks[:, :, :p].reshape(b * w, p), constraint))
        cand = _candidates(beams, lp_j)
        beams, src = _prune(beams, cand, lp_j, _ranking_key(cand, beams, p, alpha), p, eos)
        parent = parent.gather(1, src)
    return beams, parent


def _candidates(beams: _Beams, lp_j: torch.Tensor) -> torch.Tensor:
    """(b, w, V) scores of every one-token extension: open hypotheses any token, finished ones PAD only at their
    frozen score."""
    cand = beams.scores[..., None] + lp_j  # open hypotheses: any token
    pad_only = torch.full_like(cand, NEG_INF)
    pad_only[..., PAD] = beams.scores
    return torch.where(beams.fin[..., None], pad_only, cand)  # finished: frozen score, PAD only


def _ranking_key(cand: torch.Tensor, beams: _Beams, p: int, alpha: float) -> torch.Tensor:
    """What the pruning at position ``p`` compares: the scores, or ``score / length**alpha``."""
    if alpha:
        cand_len = torch.where(beams.fin, beams.lengths, p + 1).clamp(min=1).float()
        return cand / cand_len[..., None] ** alpha
    return cand


def _prune(beams: _Beams, cand: torch.Tensor, lp_j: torch.Tensor, key: torch.Tensor, p: int,
           eos: int) -> tuple[_Beams, torch.Tensor]:
    """The best ``w`` candidates per image by ``key``, written at position ``p`` -> (the new slots, sorted best
    first; each one's source slot (b, w))."""
    b, w, v = cand.shape
    idx = key.view(b, w * v).topk(w, dim=1).indices  # (b, w), sorted best first
    src, tok = idx // v, idx % v
    was_fin = beams.fin.gather(1, src)
    tok = torch.where(was_fin, PAD, tok)
    scores = cand.view(b, w * v).gather(1, idx)
    tok_lp = torch.where(was_fin, 0.0, lp_j.view(b, w * v).gather(1, idx))
    lengths = torch.where(was_fin, beams.lengths.gather(1, src), p + 1)
    fin = was_fin | (tok == eos)
    gidx = src[..., None].expand(b, w, beams.toks.shape[-1])
    toks = beams.toks.gather(1, gidx)
    tlp = beams.tlp.gather(1, gidx)
    toks[:, :, p] = tok
    tlp[:, :, p] = tok_lp
    return _Beams(scores=scores, fin=fin, lengths=lengths, toks=toks, tlp=tlp), src


def _done(beams: _Beams, alpha: float, n_best: int) -> bool:
    """Whether nothing can change the result any more (a host read)."""
    if alpha:
        return bool(beams.fin.all())
    # slots are sorted by score; nothing open can overtake finished slots above it
    return bool(beams.fin[:, :n_best].all())


def _best(beams: _Beams, alpha: float, n_best: int) -> Decoded:
    """The ``n_best`` best slots per image, best first (by ``score / length**alpha`` when ``alpha``), cut to the
    longest of them."""
    b = beams.scores.shape[0]
    dev = beams.scores.device
    if alpha:
        key = beams.scores / beams.lengths.clamp(min=1).float() ** alpha
        order = key.argsort(dim=1, descending=True, stable=True)[:, :n_best]
    else:
        order = torch.arange(n_best, device=dev)[None].expand(b, n_best)  # already sorted by score
    lengths = beams.lengths.gather(1, order)
    width = max(int(lengths.max()) if b else 1, 1)
    gidx = order[..., None].expand(b, n_best, beams.toks.shape[-1])
    return Decoded(
        tokens=beams.toks.gather(1, gidx)[..., :width],
        logprobs=beams.scores.gather(1, order),
        token_logprobs=beams.tlp.gather(1, gidx)[..., :width],
        lengths=lengths,
    )


__all__ = ["search_beams"]
