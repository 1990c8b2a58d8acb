"""Decoding algorithms, written once for every architecture: greedy, group-aware beam search, sampling.

All of them drive a model through its decoding interface only (see :mod:`captioning.models.encoder_decoder`):
``start_tokens``, ``group_size``, ``bos``/``eos``, ``new_cache`` / ``DecoderCache.reorder`` and
``decode_step``, plus ``Memory.select`` / ``Memory.repeat``.

Semi-autoregressive groups (SATIC, group size K; K = 1 is ordinary autoregressive decoding): step 0 feeds the
K start tokens, and every step returns log-probs for the next K output positions, which are predicted in
parallel from the same prefix; the K tokens chosen for them are the next step's input. The output sequence is
``y = w_1 .. w_T, EOS``. A caption ends at its first EOS (later tokens of the same group are discarded and
become PAD). PAD (0) and BOS are never emitted (their log-probs are set to -inf; the remaining log-probs are
*not* renormalised, so every reported log-prob is the model's own and can be recomputed by teacher forcing).

Length: ``max_len`` counts output tokens, EOS included; a caption that reaches it without EOS is cut there
(length ``max_len``, no EOS). It is capped by what the model's positions allow
(``cfg.max_len // K * K`` when the model has a ``cfg.max_len``).

``use_cache=True`` feeds only the new K tokens per step (O(t)); ``use_cache=False`` re-decodes the whole
prefix each step (``decode_step(memory, tokens, None, prefix=...)``, the O(t^2) reference).

Models that must re-run the whole prefix (``model.prefix_decoding``: an imported released ZoDIAC, whose pooled
gate changes every earlier position's output as the prefix grows) are always decoded that way, whatever
``use_cache`` says, on the eager engine; their pooling is computed per row as the released code computes it for
one image alone (:meth:`captioning.models.layers.MultiHeadAttention._released_pool`), so a caption does not
depend on the other images, beams or samples decoded with it, nor on finished rows leaving the batch.

``released_acort_cache`` (greedy, beam search, sampling; None = the model's ``cfg.released_acort_cache``): decode
with the released ORT/ACORT code's step cache, where a decoder layer shared by several positions keeps one
self-attention cache for all of them (:mod:`captioning.models.encoder_decoder`). It reproduces the published ACORT
captions of a released checkpoint, but it is not the function the model was trained with (teacher forcing and
``use_cache=False``, which capflow's own cache equals); off by default, eager growing cache only.

The public functions run under ``torch.inference_mode`` and return ordinary tensors (cloned outside inference
mode), so that e.g. SCST can use ``token_logprobs`` / ``lengths`` in autograd expressions.

Greedy and beam search have two cached engines with the same results (tests hold them equal):
- eager (the reference, and the default on CPU): a growing cache; finished greedy rows leave the batch;
- static (``static_cache=True``): a static cache (:mod:`captioning.models.static_cache`) with the rows fixed
  for the whole search (finished greedy rows keep decoding, their outputs ignored; beam search expands the
  memory to B*beam rows before step 0, whose other copies are ignored) and reorders in place; it reads "all
  finished" from the device only every :data:`~captioning.decoding.steps.CHECK_EVERY` steps, so a step needs no
  host sync. With ``graphs=True`` greedy search is one replayed CUDA graph for the whole search (every step, no
  host read in between) and beam search replays a graph per step (and per beam reorder)
  (:mod:`captioning.decoding.graphs`; the engine is chosen in :mod:`captioning.decoding.engines`).
  ``graphs=None`` (auto) picks graphs when the memory is on a CUDA device, the cache is used and the model has
  no active dropout (eval mode, or dropout rates of 0), falling back to eager with a warning if capturing fails.
Sampling has the same engines (see :func:`sample`): the eager one draws with ``torch.multinomial`` (finished rows
leave the batch, so the draws depend on which rows are still open); the static one and its whole-search graph
draw by an exponential race, so a replay has no host sync.

Decoding constraint (``decoding_constraint=True``; greedy, beam search, sampling): a word is never emitted right
after itself - the option of the same name in the released SATIC code (inherited from ruotianluo's
self-critical.pytorch, "not allowing same word in a row", off by default there; the released code applies it only
at a group's first position). Here it holds at every position, inside a group too: the K positions of a group
are then chosen one after the other (greedy: arg-max of each position without the word chosen just before;
beam search expands position by position anyway). Radix models write a word as ``word_tokens`` digits: the
constraint bans the last digit that would complete the previous word again. Banned tokens only leave the choice;
every reported log-prob stays the model's own.
"""

from __future__ import annotations

import torch

from captioning.data import text
from captioning.decoding.engines import decoding_mode, rows_static, run_beam, run_engine
from captioning.decoding.rows import rowwise
from captioning.decoding.steps import (
    PAD,
    Decoded,
    argmax,
    constraint_width,
    outside_inference,
    pack,
    race_sampler,
)

_UNK_WORD = text.UNK_WORD


# ---------------------------------------------------------------------- greedy / sampling (independent rows)
def greedy(model, memory, max_len: int = 16, use_cache: bool = True, static_cache: bool | None = None,
           graphs: bool | None = None, decoding_constraint: bool = False, word_tokens: int = 1,
           released_acort_cache: bool | None = None) -> Decoded:
    """Greedy decoding: each step takes the arg-max at each of its K positions (n = 1). ``static_cache`` /
    ``graphs``: the engine (see the module's doc; ``graphs=None`` = CUDA graphs on CUDA in eval mode).
    ``decoding_constraint``: no word right after itself (words of ``word_tokens`` tokens; see the module's doc).
    ``released_acort_cache``: the released ORT/ACORT step cache (None = the model's setting; module doc)."""
    constraint = constraint_width(decoding_constraint, word_tokens)
    use_cache, static_cache, graphs, released = decoding_mode(model, use_cache, static_cache, graphs,
                                                              released_acort_cache)

    def run(static: bool, use_graphs: bool):
        if static:
            return rows_static(model, memory, max_len, use_graphs, argmax, constraint)
        return rowwise(model, memory, max_len, use_cache, argmax, constraint, released)

    with torch.inference_mode():
        b = memory.states.shape[0]
        toks, tlp, lengths = run_engine(run, model, memory, use_cache, static_cache, graphs)
        out = pack(toks, tlp, lengths, b, 1)
    return outside_inference(out)


def sample(model, memory, n: int = 5, max_len: int = 16, temperature: float = 1.0,
           generator: torch.Generator | None = None, use_cache: bool = True, decoding_constraint: bool = False,
           word_tokens: int = 1, static_cache: bool | None = None, graphs: bool | None = None,
           released_acort_cache: bool | None = None) -> Decoded:
    """``n`` samples per image from ``softmax(log p / temperature)`` (PAD/BOS excluded).

    The K positions of a group are sampled independently (they are predicted in parallel). The reported
    ``token_logprobs`` / ``logprobs`` are the *model's* log-probs of the sampled tokens (temperature-free
    log-softmax, PAD/BOS not renormalised away), i.e. the policy's log-prob that SCST needs - not the log-prob
    under the tempered sampling distribution. Reproducible with ``generator`` (on the memory's device).
    Samples of image b are rows ``b*n .. b*n+n-1`` of the flattened output. ``decoding_constraint``: see greedy
    (the banned word is not sampled; the others keep their probabilities relative to each other).

    Engines: eager (the default on CPUs, and wherever a ``generator`` is given): finished rows leave the batch,
    ``torch.multinomial`` draws; static (``static_cache=True``) or one CUDA graph for the whole search
    (``graphs``; ``None`` = on CUDA, with the cache, no active dropout and the default generator): every row
    runs every step and each draw is an exponential race (:func:`race_sampler`) - the same distribution, other
    draws for the same seed."""
    constraint = constraint_width(decoding_constraint, word_tokens)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use greedy for arg-max)")
    if graphs and generator is not None:
        raise ValueError("graph-captured sampling draws from the default CUDA generator: pass generator=None")
    use_cache, static_cache, graphs, released = decoding_mode(model, use_cache, static_cache, graphs,
                                                              released_acort_cache)

    def choose(logp: torch.Tensor) -> torch.Tensor:
        a, k, v = logp.shape
        probs = torch.softmax(logp / temperature, dim=-1).reshape(a * k, v)
        return torch.multinomial(probs, 1, generator=generator).view(a, k)

    def run(static: bool, use_graphs: bool):
        if static:
            return rows_static(model, rows, max_len, use_graphs, race_sampler(temperature, generator), constraint,
                               ("sample", float(temperature)))
        return rowwise(model, rows, max_len, use_cache, choose, constraint, released)

    with torch.inference_mode():
        b = memory.states.shape[0]
        rows = memory.repeat(n)
        auto = False if graphs is None and generator is not None else graphs
        toks, tlp, lengths = run_engine(run, model, rows, use_cache, static_cache, auto)
        out = pack(toks, tlp, lengths, b, n)
    return outside_inference(out)


# ---------------------------------------------------------------------- beam search
def beam_search(model, memory, beam: int = 3, max_len: int = 16, length_penalty: float = 0.0, n_best: int = 1,
                use_cache: bool = True, static_cache: bool | None = None, graphs: bool | None = None,
                decoding_constraint: bool = False, word_tokens: int = 1,
                released_acort_cache: bool | None = None) -> Decoded:
    """Group-aware beam search; returns the ``n_best`` best hypotheses per image, best first.

    Scores are sums of token log-probs (no length normalisation by default). Inside a group the K positions
    share one step's distributions, so hypotheses are expanded position by position: for position j every
    hypothesis is extended with every token using the distribution of its *parent row* (the row that ran the
    step) at position j, the best ``beam`` candidates per image survive, and position j+1 continues from them.
    After the group, the cache (and the prefix on the uncached path) is reordered to the parents' rows and one
    ``decode_step`` feeds every hypothesis's K chosen tokens.

    Finished hypotheses (EOS emitted) keep their score and are extended by PAD only; they keep competing for the
    ``beam`` slots with open ones. Step 0 starts from a single live hypothesis per image (decoded on B rows,
    then expanded to B*beam rows) so the beam never holds duplicates.

    ``length_penalty`` alpha: every comparison (the per-position pruning and the final ranking) uses
    ``score / length**alpha`` with length in output tokens incl. EOS (simple normalisation, not GNMT's
    ((5+len)/6)**alpha). Open hypotheses all have the same length at a given position, so alpha only changes
    how finished hypotheses compare with open ones and with each other. The returned ``logprobs`` stay the raw
    sums. With alpha = 0 the search stops as soon as every image's ``n_best`` best slots are finished
    (scores can only fall, so nothing can overtake them); otherwise when every slot is finished or at max_len.
    (The static engine looks every CHECK_EVERY steps; the extra steps only append PAD to finished slots.)
    ``static_cache`` / ``graphs``: the engine (see the module's doc). ``decoding_constraint``: no hypothesis is
    extended with the word it just ended with (words of ``word_tokens`` tokens; see the module's doc).
    ``released_acort_cache``: the released ORT/ACORT step cache (None = the model's setting; module doc).
    """
    constraint = constraint_width(decoding_constraint, word_tokens)
    use_cache, static_cache, graphs, released = decoding_mode(model, use_cache, static_cache, graphs,
                                                              released_acort_cache)
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    if not 1 <= n_best <= beam:
        raise ValueError(f"n_best must be in 1..beam ({beam}), got {n_best}")

    def run(static: bool, use_graphs: bool) -> Decoded:
        return run_beam(model, memory, beam, max_len, float(length_penalty), n_best, use_cache, static, use_graphs,
                        constraint, released)

    with torch.inference_mode():
        out = run_engine(run, model, memory, use_cache, static_cache, graphs)
    return outside_inference(out)


# ---------------------------------------------------------------------- strings
def word_ids(row, codec=None) -> tuple[list[int], bool]:
    """One output row -> (its word ids, whether it ended with EOS). Skips BOS, stops at EOS/PAD; radix rows
    go through ``codec.decode_caption``."""
    if codec is not None:
        return codec.decode_caption(row), codec.eos in row
    ids = []
    for t in row:
        t = int(t)
        if t in (text.EOS, PAD):
            return ids, t == text.EOS
        if t != text.BOS:
            ids.append(t)
    return ids, False


def to_words(tokens: torch.Tensor, vocab, codec=None) -> list[str]:
    """(N, L) output tokens -> N caption strings (never raises on model output).

    Word models: tokens are word ids; stop at EOS/PAD, skip BOS. Radix models (``codec`` given): digits go
    through ``codec.decode_caption`` (stops at EOS/PAD, drops an incomplete last group, invalid groups become
    ``<unk>``), then word ids become words. Ids outside the vocabulary become ``<unk>``."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() == 1:
            tokens = tokens[None]
        rows = tokens.detach().cpu().tolist()
    else:
        rows = [list(r) for r in tokens]
    out = []
    for r in rows:
        ids, _ = word_ids(r, codec)
        words = []
        for i in ids:
            try:
                words.append(vocab.word_of(int(i)))
            except (IndexError, KeyError, ValueError):
                words.append(_UNK_WORD)
        out.append(" ".join(words))
    return out


__all__ = ["Decoded", "beam_search", "greedy", "sample", "to_words", "word_ids"]
