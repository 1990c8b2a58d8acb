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
  finished" from the device only every :data:`CHECK_EVERY` steps, so a step needs no host sync. With
  ``graphs=True`` greedy search is one replayed CUDA graph for the whole search (every step, no host read in
  between) and beam search replays a graph per step (and per beam reorder) (:mod:`captioning.decoding.graphs`).
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

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from captioning.data import text

PAD = text.PAD
_UNK_WORD = text.UNK_WORD
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


# ---------------------------------------------------------------------- helpers
class _Stepper:
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


class _StaticStepper:
    """Static cache, rows fixed for the whole search; each step eager or a replayed CUDA graph."""

    def __init__(self, model, memory, positions: int, graphs: bool):
        self.graph = None
        if graphs:
            from captioning.decoding import graphs as cuda_graphs

            self.graph = cuda_graphs.graph_step(model, memory, positions)
        else:
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


def _dropout_active(model) -> bool:
    if isinstance(model, torch.nn.Module):
        return any(isinstance(m, torch.nn.Dropout) and m.training and m.p > 0 for m in model.modules())
    return bool(getattr(model, "training", False))


def _decoding_mode(model, use_cache: bool, static_cache: bool | None, graphs: bool | None,
                   released_acort_cache: bool | None) -> tuple[bool, bool | None, bool | None, bool]:
    """The options as the model allows them -> (use_cache, static_cache, graphs, released step cache): prefix
    models (``model.prefix_decoding``) re-decode the whole prefix eagerly; the released ACORT step cache is an
    eager growing cache (module docstring). Asking for what such a model cannot do is an error."""
    cfg = getattr(model, "cfg", None)
    released = (bool(getattr(cfg, "released_acort_cache", False)) if released_acort_cache is None
                else bool(released_acort_cache))
    if getattr(model, "prefix_decoding", False):
        if static_cache or graphs or released_acort_cache:
            raise ValueError("this model re-runs the whole prefix every step (the released ZoDIAC pooling): no static "
                             "cache, CUDA graphs or step cache")
        return False, False, False, False
    if released:
        if not use_cache:
            raise ValueError("released_acort_cache is a step cache; use_cache=False decodes the whole prefix")
        if static_cache or graphs:
            raise ValueError("the released ACORT step cache is an eager growing cache: no static cache or CUDA graphs")
        return True, False, False, True
    return use_cache, static_cache, graphs, False


def _engine(model, memory, use_cache: bool, static_cache: bool | None, graphs: bool | None) -> tuple[bool, bool]:
    """-> (static cache, CUDA graphs) for the options (None = auto)."""
    if graphs is None:
        from captioning.decoding import graphs as cuda_graphs

        graphs = (use_cache and static_cache is not False and memory.states.is_cuda and cuda_graphs.available()
                  and not _dropout_active(model) and not cuda_graphs.failed(model))
    elif graphs:
        if not use_cache or static_cache is False:
            raise ValueError("CUDA graphs decode with the static cache (use_cache=True, static_cache not False)")
        if not memory.states.is_cuda:
            raise ValueError("CUDA graphs need the memory on a CUDA device")
        if _dropout_active(model):
            raise ValueError("graph-captured decoding needs the model in eval mode (no active dropout)")
    if graphs:
        return True, True
    if static_cache and not use_cache:
        raise ValueError("static_cache=True needs use_cache=True")
    return bool(static_cache), False


def _run_engine(run, model, memory, use_cache: bool, static_cache: bool | None, graphs: bool | None):
    """``run(static, graphs)`` on the chosen engine; in auto mode a failed capture falls back to eager."""
    static, use_graphs = _engine(model, memory, use_cache, static_cache, graphs)
    if not use_graphs or graphs is not None:
        return run(static, use_graphs)
    from captioning.decoding import graphs as cuda_graphs

    try:
        return run(True, True)
    except RuntimeError as e:  # a model whose step cannot be captured: decode eagerly from now on
        cuda_graphs.mark_failed(model)
        warnings.warn(f"CUDA graph capture failed ({e}); decoding eagerly", RuntimeWarning, stacklevel=3)
        return run(bool(static_cache), False)


def _steps(model, max_len: int) -> tuple[int, int]:
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


def _mask_specials(model, logp: torch.Tensor) -> torch.Tensor:
    """PAD and BOS are never emitted. ``logp`` is a fresh tensor from the model: masked in place."""
    logp[..., PAD] = float("-inf")
    logp[..., int(model.bos)] = float("-inf")
    return logp


def _repeat_ban(hist: torch.Tensor, d: int) -> torch.Tensor | None:
    """The token that would repeat the previous word at the next output position, per row (-1: none), or None
    when the next position cannot complete a repeat. ``hist`` (R, p): each row's output tokens so far; a word is
    ``d`` tokens (1 for word models, the radix digits per word for radix models)."""
    p = hist.shape[1]
    if p % d != d - 1 or p < 2 * d - 1:  # the next token does not end a word, or there is no previous word
        return None
    prev = hist[:, p - 2 * d + 1 : p - d + 1]  # the previous word's d tokens
    same = (hist[:, p - d + 1 :] == prev[:, :-1]).all(1)  # the current word's first d-1 tokens repeat it so far
    return torch.where(same, prev[:, -1], torch.full_like(prev[:, -1], -1))


def _ban(logp: torch.Tensor, ban: torch.Tensor | None) -> torch.Tensor:
    """``logp`` (R, V) with token ``ban[r]`` of row r set to -inf (none where ban < 0); in place."""
    if ban is not None:
        idx = ban.clamp(min=0)[:, None]
        logp.scatter_(-1, idx, torch.where(ban[:, None] >= 0, float("-inf"), logp.gather(-1, idx)))
    return logp


def _choose_constrained(logp: torch.Tensor, past: torch.Tensor, d: int,
                        choose: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A group's K tokens chosen position by position, none repeating the word before it. ``logp`` (A, K, V)
    (banned entries set to -inf in place), ``past`` (A, t) the rows' earlier output tokens -> tokens (A, K)."""
    a, k, _ = logp.shape
    tok = torch.empty(a, k, dtype=torch.long, device=logp.device)
    for j in range(k):
        _ban(logp[:, j], _repeat_ban(torch.cat([past, tok[:, :j]], 1), d))
        tok[:, j] = choose(logp[:, j : j + 1]).squeeze(1)
    return tok


def _outside_inference(d: Decoded) -> Decoded:
    def c(t):
        return None if t is None else t.clone()

    return Decoded(c(d.tokens), c(d.logprobs), c(d.token_logprobs), c(d.lengths))


# ---------------------------------------------------------------------- greedy / sampling (independent rows)
def _row_outputs(model, n: int, dev, max_len: int):
    """What row-wise decoders share: (max_len, steps, K, eos) and the empty outputs of ``n`` rows on ``dev``
    (tokens (n, L) filled with PAD, token log-probs (n, L), lengths (n,)), L = steps * K."""
    max_len, steps = _steps(model, max_len)
    k, eos = int(model.group_size), int(model.eos)
    toks = torch.full((n, steps * k), PAD, dtype=torch.long, device=dev)
    tlp = torch.zeros(n, steps * k, dtype=torch.float32, device=dev)
    lengths = torch.zeros(n, dtype=torch.long, device=dev)
    return max_len, steps, k, eos, toks, tlp, lengths


def _rowwise(model, memory, max_len: int, use_cache: bool,
             choose: Callable[[torch.Tensor], torch.Tensor], constraint: int = 0,
             released_cache: bool = False) -> tuple[torch.Tensor, ...]:
    """Decode every memory row independently; ``choose(logp (A, K, V)) -> tokens (A, K)``.

    Finished rows leave the batch (cache, prefix and memory keep only the open rows), and decoding stops
    as soon as every row is finished. ``constraint`` d > 0: the decoding constraint with words of d tokens.
    Returns (tokens (N, L), token log-probs (N, L), lengths (N,))."""
    n, dev = memory.states.shape[0], memory.states.device
    max_len, steps, k, eos, toks, tlp, lengths = _row_outputs(model, n, dev, max_len)
    active = torch.arange(n, device=dev)  # original row of each open row
    offs = torch.arange(k, device=dev)
    stepper = _Stepper(model, memory, use_cache, released_cache)
    inp = model.start_tokens(n, device=dev)
    for s in range(steps):
        logp = _mask_specials(model, stepper.step(inp).float())  # (A, K, V)
        tok = _choose_constrained(logp, toks[active, : s * k], constraint, choose) if constraint else choose(logp)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        is_eos = tok == eos
        # a position is kept if it is not after the group's first EOS and within max_len
        keep = ((is_eos.cumsum(1) - is_eos.long()) == 0) & (s * k + offs < max_len)[None]
        toks[active, s * k : (s + 1) * k] = torch.where(keep, tok, PAD)
        tlp[active, s * k : (s + 1) * k] = torch.where(keep, lp, 0.0)
        lengths[active] += keep.sum(1)
        if (s + 1) * k >= max_len:
            break
        open_ = ~(is_eos & keep).any(1)
        if not bool(open_.all()):
            if not bool(open_.any()):
                break
            idx = open_.nonzero().squeeze(1)
            stepper.reorder(idx)
            active, tok = active[idx], tok[idx]
        inp = tok
    width = max(int(lengths.max()) if n else 1, 1)
    return toks[:, :width], tlp[:, :width], lengths


def _argmax(logp: torch.Tensor) -> torch.Tensor:
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


def static_rows(model, step: Callable[[torch.Tensor], torch.Tensor], n: int, device, max_len: int,
                choose: Callable[[torch.Tensor], torch.Tensor], constraint: int = 0,
                check_every: int | None = CHECK_EVERY) -> tuple[torch.Tensor, ...]:
    """The static engine's row-wise loop (greedy or sampling): every row stays in the batch, finished rows' outputs
    are ignored, ``step(tokens (n, K)) -> log-probs (n, K, V)`` feeds the static cache. The host reads "all
    finished" every ``check_every`` steps; ``None`` never (no host sync at all: what a whole-search CUDA graph
    records, running every step). Same results as ``_rowwise`` with the same ``choose`` when it is deterministic.
    Returns (tokens (n, steps*K), token log-probs (n, steps*K), lengths (n,)): the full width, PAD after."""
    max_len, steps, k, eos, toks, tlp, lengths = _row_outputs(model, n, device, max_len)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    offs = torch.arange(k, device=device)
    inp = model.start_tokens(n, device=device)
    for s in range(steps):
        logp = _mask_specials(model, step(inp).float())  # (N, K, V)
        tok = _choose_constrained(logp, toks[:, : s * k], constraint, choose) if constraint else choose(logp)
        lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        is_eos = tok == eos
        keep = ((is_eos.cumsum(1) - is_eos.long()) == 0) & (offs < max_len - s * k)[None] & ~done[:, None]
        toks[:, s * k : (s + 1) * k] = torch.where(keep, tok, PAD)
        tlp[:, s * k : (s + 1) * k] = torch.where(keep, lp, 0.0)
        lengths += keep.sum(1)
        if (s + 1) * k >= max_len:
            break
        done |= (is_eos & keep).any(1)
        if check_every and (s + 1) % check_every == 0 and bool(done.all()):
            break
        inp = tok
    return toks, tlp, lengths


def _trim(toks: torch.Tensor, tlp: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    width = max(int(lengths.max()) if lengths.numel() else 1, 1)
    return toks[:, :width], tlp[:, :width], lengths


def _rows_static(model, memory, max_len: int, graphs: bool, choose: Callable[[torch.Tensor], torch.Tensor],
                 constraint: int = 0, sampler: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """Row-wise decoding on the static engine. ``graphs``: the whole search replayed from one CUDA graph
    (:func:`captioning.decoding.graphs.run_rows`; ``sampler`` = ("greedy",) or ("sample", temperature) names
    ``choose`` there); else eager, checking "all finished" every CHECK_EVERY steps."""
    if graphs:
        from captioning.decoding import graphs as cuda_graphs

        return _trim(*cuda_graphs.run_rows(model, memory, max_len, sampler or ("greedy",), constraint))
    _, steps = _steps(model, max_len)
    stepper = _StaticStepper(model, memory, steps * int(model.group_size), False)
    n, dev = memory.states.shape[0], memory.states.device
    return _trim(*static_rows(model, stepper.step, n, dev, max_len, choose, constraint))


def _greedy_static(model, memory, max_len: int, graphs: bool, constraint: int = 0) -> tuple[torch.Tensor, ...]:
    """Greedy on the static engine (see :func:`_rows_static`). Same results as ``_rowwise`` with arg-max."""
    return _rows_static(model, memory, max_len, graphs, _argmax, constraint)


def _pack(toks, tlp, lengths, b: int, per: int) -> Decoded:
    return Decoded(
        tokens=toks.view(b, per, -1),
        logprobs=tlp.sum(-1).view(b, per),
        token_logprobs=tlp.view(b, per, -1),
        lengths=lengths.view(b, per),
    )


def _constraint(decoding_constraint: bool, word_tokens: int) -> int:
    if word_tokens < 1:
        raise ValueError(f"word_tokens must be >= 1, got {word_tokens}")
    return word_tokens if decoding_constraint else 0


def greedy(model, memory, max_len: int = 16, use_cache: bool = True, static_cache: bool | None = None,
           graphs: bool | None = None, decoding_constraint: bool = False, word_tokens: int = 1,
           released_acort_cache: bool | None = None) -> Decoded:
    """Greedy decoding: each step takes the arg-max at each of its K positions (n = 1). ``static_cache`` /
    ``graphs``: the engine (see the module's doc; ``graphs=None`` = CUDA graphs on CUDA in eval mode).
    ``decoding_constraint``: no word right after itself (words of ``word_tokens`` tokens; see the module's doc).
    ``released_acort_cache``: the released ORT/ACORT step cache (None = the model's setting; module doc)."""
    constraint = _constraint(decoding_constraint, word_tokens)
    use_cache, static_cache, graphs, released = _decoding_mode(model, use_cache, static_cache, graphs,
                                                               released_acort_cache)

    def run(static: bool, use_graphs: bool):
        if static:
            return _greedy_static(model, memory, max_len, use_graphs, constraint)
        return _rowwise(model, memory, max_len, use_cache, _argmax, constraint, released)

    with torch.inference_mode():
        b = memory.states.shape[0]
        toks, tlp, lengths = _run_engine(run, model, memory, use_cache, static_cache, graphs)
        out = _pack(toks, tlp, lengths, b, 1)
    return _outside_inference(out)


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
    constraint = _constraint(decoding_constraint, word_tokens)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature} (use greedy for arg-max)")
    if graphs and generator is not None:
        raise ValueError("graph-captured sampling draws from the default CUDA generator: pass generator=None")
    use_cache, static_cache, graphs, released = _decoding_mode(model, use_cache, static_cache, graphs,
                                                               released_acort_cache)

    def choose(logp: torch.Tensor) -> torch.Tensor:
        a, k, v = logp.shape
        probs = torch.softmax(logp / temperature, dim=-1).reshape(a * k, v)
        return torch.multinomial(probs, 1, generator=generator).view(a, k)

    def run(static: bool, use_graphs: bool):
        if static:
            return _rows_static(model, rows, max_len, use_graphs, race_sampler(temperature, generator), constraint,
                                ("sample", float(temperature)))
        return _rowwise(model, rows, max_len, use_cache, choose, constraint, released)

    with torch.inference_mode():
        b = memory.states.shape[0]
        rows = memory.repeat(n)
        auto = False if graphs is None and generator is not None else graphs
        toks, tlp, lengths = _run_engine(run, model, rows, use_cache, static_cache, auto)
        out = _pack(toks, tlp, lengths, b, n)
    return _outside_inference(out)


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
    constraint = _constraint(decoding_constraint, word_tokens)
    use_cache, static_cache, graphs, released = _decoding_mode(model, use_cache, static_cache, graphs,
                                                               released_acort_cache)
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    if not 1 <= n_best <= beam:
        raise ValueError(f"n_best must be in 1..beam ({beam}), got {n_best}")

    def run(static: bool, use_graphs: bool) -> Decoded:
        return _beam(model, memory, beam, max_len, float(length_penalty), n_best, use_cache, static, use_graphs,
                     constraint, released)

    with torch.inference_mode():
        out = _run_engine(run, model, memory, use_cache, static_cache, graphs)
    return _outside_inference(out)


def _beam(model, memory, w: int, max_len: int, alpha: float, n_best: int, use_cache: bool, static: bool = False,
          graphs: bool = False, constraint: int = 0, released_cache: bool = False) -> Decoded:
    max_len, steps = _steps(model, max_len)
    k, eos = int(model.group_size), int(model.eos)
    b = memory.states.shape[0]
    dev = memory.states.device
    neg_inf = float("-inf")

    scores = torch.full((b, w), neg_inf, dtype=torch.float32, device=dev)
    scores[:, 0] = 0.0  # one live hypothesis per image at the start
    fin = torch.zeros(b, w, dtype=torch.bool, device=dev)
    lengths = torch.zeros(b, w, dtype=torch.long, device=dev)
    toks = torch.full((b, w, steps * k), PAD, dtype=torch.long, device=dev)
    tlp = torch.zeros(b, w, steps * k, dtype=torch.float32, device=dev)
    # the row (of the current step's batch) that holds each slot's state: B rows at step 0, then B*w (static
    # engine: B*w rows from the start, step 0 reading the first copy of each image)
    if static:
        row = (torch.arange(b, device=dev) * w)[:, None].expand(b, w)
        stepper = _StaticStepper(model, memory.repeat(w), steps * k, graphs)
        inp = model.start_tokens(b * w, device=dev)
    else:
        row = torch.arange(b, device=dev)[:, None].expand(b, w)
        stepper = _Stepper(model, memory, use_cache, released_cache)
        inp = model.start_tokens(b, device=dev)

    for s in range(steps):
        logp = _mask_specials(model, stepper.step(inp).float())  # (R, K, V)
        v = logp.shape[-1]
        parent = row.clone()  # (b, w) row whose distributions each current hypothesis uses
        for j in range(k):
            p = s * k + j
            if p >= max_len:
                break
            lp_j = logp[:, j].index_select(0, parent.reshape(-1)).view(b, w, v)
            if constraint:
                _ban(lp_j.view(b * w, v), _repeat_ban(toks[:, :, :p].reshape(b * w, p), constraint))
            cand = scores[..., None] + lp_j  # open hypotheses: any token
            pad_only = torch.full_like(cand, neg_inf)
            pad_only[..., PAD] = scores
            cand = torch.where(fin[..., None], pad_only, cand)  # finished: frozen score, PAD only
            if alpha:
                cand_len = torch.where(fin, lengths, p + 1).clamp(min=1).float()
                key = cand / cand_len[..., None] ** alpha
            else:
                key = cand
            idx = key.view(b, w * v).topk(w, dim=1).indices  # (b, w), sorted best first
            src, tok = idx // v, idx % v
            was_fin = fin.gather(1, src)
            tok = torch.where(was_fin, PAD, tok)
            scores = cand.view(b, w * v).gather(1, idx)
            tok_lp = torch.where(was_fin, 0.0, lp_j.view(b, w * v).gather(1, idx))
            lengths = torch.where(was_fin, lengths.gather(1, src), p + 1)
            fin = was_fin | (tok == eos)
            gidx = src[..., None].expand(b, w, steps * k)
            toks = toks.gather(1, gidx)
            tlp = tlp.gather(1, gidx)
            toks[:, :, p] = tok
            tlp[:, :, p] = tok_lp
            parent = parent.gather(1, src)
        if (s + 1) * k >= max_len:
            break
        if not static or (s + 1) % CHECK_EVERY == 0:
            if alpha:
                done = bool(fin.all())
            else:  # slots are sorted by score; nothing open can overtake finished slots above it
                done = bool(fin[:, :n_best].all())
            if done:
                break
        # parents are rows of the same image: memory rows are identical, only the first expansion selects them
        stepper.reorder(parent.reshape(-1), memory=s == 0 and not static)
        row = torch.arange(b * w, device=dev).view(b, w)
        inp = toks[:, :, s * k : (s + 1) * k].reshape(b * w, k)

    if alpha:
        key = scores / lengths.clamp(min=1).float() ** alpha
        order = key.argsort(dim=1, descending=True, stable=True)[:, :n_best]
    else:
        order = torch.arange(n_best, device=dev)[None].expand(b, n_best)  # already sorted by score
    lengths = lengths.gather(1, order)
    width = max(int(lengths.max()) if b else 1, 1)
    gidx = order[..., None].expand(b, n_best, steps * k)
    return Decoded(
        tokens=toks.gather(1, gidx)[..., :width],
        logprobs=scores.gather(1, order),
        token_logprobs=tlp.gather(1, gidx)[..., :width],
        lengths=lengths,
    )


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
