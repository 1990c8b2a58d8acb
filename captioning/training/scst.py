"""Self-critical sequence training (SCST) on CIDEr-D.

Per batch: encode the images (train mode, with gradients), draw ``samples`` captions per image from the model
(:func:`captioning.decoding.sample`; on a CUDA device with the dropout rates at 0, the whole sampling search is
one replayed CUDA graph, its draws exponential races: see :mod:`captioning.decoding.search`), reward each with
CIDEr-D against the image's references, subtract a baseline (mean of the *other* samples of the same image, or
the greedy caption's reward), and re-score the sampled tokens by teacher forcing to get differentiable log-probs:

    loss = - sum_{i,t} (r_i - b_i) * log p(y_{i,t}) / number of rewarded tokens (over the global batch)

Rewards are computed on *words* (radix digits are decoded first) with the end-of-sentence token included: the
references all end in ``<eos>`` and a sample gets its ``<eos>`` appended when it emitted one, so a caption is
rewarded for stopping in the right place (the convention of the SCST/M2 code bases). Document frequencies come
from the training references, computed once.

Training runs through :func:`captioning.training.loop.train` with this loss (constant learning rate by default),
so SCST has the same checkpoint/resume guarantees as XE: sampling draws from torch's global generator, whose
state is saved with every epoch checkpoint.

The model is in train mode throughout, but by default with its dropout rates at 0 (``students.scst.dropout``,
applied by :func:`captioning.training.stages.fit_scst`): the released SCST/M2 code samples with the XE dropout
on, which improves a policy that greedy and beam decoding (dropout off) never run; measured at the ``learning``
preset, that kept ExpansionNet (dropout 0.3) from gaining at all and gained less for ACORT (docs/training.md,
"SCST recipe").
Precision: under reduced-precision autocast (``run.precision`` bf16/fp16 on CUDA) the encoder and the
teacher-forced re-scoring run in the 16-bit type, but the sampling loop (and the greedy baseline) runs in
fp32 by default (``sample_autocast=False``): it feeds one position per step for B x n rows, so it is
launch-bound, and autocast re-casts every decoder weight at every step (the weight-cast cache cannot be used
there: casts cached under ``inference_mode`` cannot be reused by the re-scoring's autograd), roughly doubling
its kernels; fp32 sampling draws from the fp32 policy. On CPUs autocast is never on: nothing changes there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from captioning.data.text import EOS, PAD, RadixCodec
from captioning.decoding import greedy, sample, word_ids
from captioning.metrics.cider import CiderD
from captioning.models.encoder_decoder import Memory


@dataclass
class ScstStats:
    reward: float = 0.0
    baseline: float = 0.0
    samples: int = 0

    def as_metrics(self) -> dict[str, float]:
        n = max(self.samples, 1)
        return {"reward": self.reward / n, "baseline_reward": self.baseline / n}


class ScstLoss:
    """The SCST objective as a ``loss_fn(model, batch)`` for :func:`captioning.training.loop.train`.

    ``references``: the training images' references, caption word ids without BOS/EOS: compact arrays
    (:class:`captioning.training.recipe.References`, what :func:`~captioning.training.recipe.references` returns)
    or ``{image id: [caption word ids, ...]}``. Either way the reward is built from CSR arrays
    (:meth:`CiderD.from_csr`, ``<eos>`` appended to every reference) - the same rewards, bit for bit, as
    ``CiderD.from_token_ids`` on the references as lists with ``<eos>`` appended.
    ``codec``: the radix codec when the model emits radix digits. ``max_tokens``: longest sampled output
    (tokens, EOS included). ``sample_autocast``: sample (and decode the greedy baseline) under the step's
    autocast instead of in fp32 (see the module's doc). ``graphs``: the decoding engine's CUDA-graph switch
    (None = auto: graphs on CUDA without active dropout; False = the eager engine)."""

    def __init__(self, references, *, samples: int = 5,
                 baseline: str = "mean", max_tokens: int = 17, codec: RadixCodec | None = None,
                 temperature: float = 1.0, sample_autocast: bool = False, graphs: bool | None = None):
        if baseline not in ("mean", "greedy"):
            raise ValueError(f"baseline must be 'mean' or 'greedy', got {baseline!r}")
        if baseline == "mean" and samples < 2:
            raise ValueError("the mean-of-others baseline needs at least 2 samples per image")
        if not references:
            raise ValueError("SCST needs reference captions")
        self.cider = reward_scorer(references)
        self.samples, self.baseline, self.max_tokens = samples, baseline, max_tokens
        self.codec, self.temperature = codec, temperature
        self.sample_autocast = sample_autocast
        self.graphs = graphs
        self.stats = ScstStats()

    # ------------------------------------------------------------------ rewards
    def words(self, tokens: torch.Tensor) -> list[list[int]]:
        """Output tokens (N, L) -> word ids per row, with EOS appended when the row emitted one."""
        out = []
        for row in tokens.tolist():
            ids, ended = word_ids(row, self.codec)
            out.append([*ids, EOS] if ended else ids)
        return out

    def rewards(self, tokens: torch.Tensor, image_ids: Sequence[Hashable]) -> np.ndarray:
        """CIDEr-D of each row of ``tokens`` against the references of ``image_ids`` (one per row)."""
        return self.cider.score_batch(self.words(tokens), list(image_ids))

    def pop_stats(self) -> dict[str, float]:
        out = self.stats.as_metrics()
        self.stats = ScstStats()
        return out

    @contextlib.contextmanager
    def _decoding_precision(self, memory: Memory):
        """Where the decoding loops run: autocast switched off (fp32; the memory as fp32) unless
        ``sample_autocast``; a no-op where autocast is off anyway (CPUs, fp32)."""
        dev = memory.states.device.type
        if self.sample_autocast or not torch.is_autocast_enabled(dev):
            yield memory
            return
        with torch.autocast(dev, enabled=False):
            yield Memory(memory.states.float(), memory.mask)

    # ------------------------------------------------------------------ loss
    def __call__(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the per-token losses, number of rewarded tokens): the trainer divides by the global count,
        so data-parallel training is exact."""
        memory = model.encode(batch.features, batch.boxes, batch.region_mask)
        toks, adv = self._advantages(model, memory, batch.image_ids.tolist())
        return self._policy_loss(model, memory, toks, adv)

    def _advantages(self, model, memory: Memory, ids: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples (B*n, L) of ``memory``'s images, rewarded and baselined: (tokens, advantages (B*n,))."""
        n = self.samples
        with self._decoding_precision(memory) as dec_memory:
            drawn = sample(model, dec_memory, n=n, max_len=self.max_tokens, temperature=self.temperature,
                           graphs=self.graphs)
        toks = drawn.tokens.reshape(-1, drawn.tokens.shape[-1])  # (B*n, L), image b -> rows b*n..b*n+n-1
        reward = self.rewards(toks, [i for i in ids for _ in range(n)]).reshape(len(ids), n)
        if self.baseline == "mean":
            base = (reward.sum(1, keepdims=True) - reward) / (n - 1)
        else:
            with self._decoding_precision(memory) as dec_memory:
                g = greedy(model, dec_memory, max_len=self.max_tokens, graphs=self.graphs)
            base = np.repeat(self.rewards(g.flat(), ids)[:, None], n, axis=1)
        self.stats.reward += float(reward.sum())
        self.stats.baseline += float(base.sum())
        self.stats.samples += reward.size
        adv = torch.as_tensor((reward - base).reshape(-1), dtype=torch.float32, device=toks.device)
        return toks, adv

    def _policy_loss(self, model, memory: Memory, toks: torch.Tensor, adv: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        targets = torch.cat([torch.full_like(toks[:, :1], model.bos), toks], 1)
        inputs, y = model.teacher_inputs(targets)
        logp = model.forward(None, None, None, inputs, memory=memory.repeat(self.samples))
        tok_logp = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
        mask = (y != PAD).float()
        return -(adv[:, None] * tok_logp * mask).sum(), mask.sum()

    # ------------------------------------------------------------------ the step split for a CUDA graph
    # ``run.compile: graphs`` (single process): sampling and rewards (host work, data-dependent lengths) run
    # eagerly in draw(); the update (encoder with gradients, teacher-forced re-scoring, loss) has fixed shapes -
    # the samples padded to max_tokens - and is replayed from a graph (captioning.training.graphs.GraphedXeStep)
    graph_inputs = ("features", "boxes", "region_mask", "tokens", "adv")

    def draw(self, model, batch) -> Drawn:
        """Samples, rewards and advantages of ``batch`` (no gradient; the encoder runs once more in the update,
        so with dropout on - ``students.scst.dropout: null`` - the two encodings draw different masks, as the
        one-piece loss's sampling and re-scoring already do in the decoder): the graph-captured update's
        inputs, the samples padded with PAD to ``max_tokens``."""
        with torch.no_grad():
            memory = model.encode(batch.features, batch.boxes, batch.region_mask)
            toks, adv = self._advantages(model, memory, batch.image_ids.tolist())
        padded = toks.new_full((toks.shape[0], self.max_tokens), PAD)
        padded[:, : toks.shape[1]] = toks
        return Drawn(batch.features, batch.boxes, batch.region_mask, padded, adv)

    def graph_loss(self, model, drawn: Drawn) -> torch.Tensor:
        """The update's loss from :meth:`draw`'s inputs: the same value as ``__call__``'s sum / count for the
        same samples (trailing PAD positions are masked, and a causal decoder's earlier positions never see
        them); the count stays on the device."""
        memory = model.encode(drawn.features, drawn.boxes, drawn.region_mask)
        total, count = self._policy_loss(model, memory, drawn.tokens, drawn.adv)
        return total / count.clamp(min=1)


def _csr_of(references: Mapping[Hashable, Sequence[Sequence[int]]]):
    """``{image id: [token ids, ...]}`` as CSR arrays (None when an id is not an integer)."""
    keys = list(references)
    if not all(isinstance(k, (int, np.integer)) for k in keys):
        return None
    caps = [references[k] for k in keys]
    n_caps = np.fromiter(map(len, caps), np.int64, len(caps))
    flat = [c.tolist() if hasattr(c, "tolist") else list(c) for refs in caps for c in refs]
    lengths = np.fromiter(map(len, flat), np.int64, len(flat))
    tokens = np.fromiter(chain.from_iterable(flat), np.int64, int(lengths.sum()))
    return (tokens, np.concatenate([[0], np.cumsum(lengths)]), np.concatenate([[0], np.cumsum(n_caps)]),
            np.asarray(keys, np.int64))


def reward_scorer(references) -> CiderD:
    """SCST's CIDEr-D: the references (see :class:`ScstLoss`) with ``<eos>`` appended, df from them."""
    if hasattr(references, "caption_offsets"):  # compact references (captioning.training.recipe.References)
        return CiderD.from_csr(references.tokens, references.token_offsets, references.caption_offsets,
                               references.image_ids, append=EOS)
    arrays = _csr_of(references)
    if arrays is None:
        return CiderD.from_token_ids({k: [[*map(int, r), EOS] for r in refs] for k, refs in references.items()})
    return CiderD.from_csr(*arrays, append=EOS)


@dataclass
class Drawn:
    """A batch's samples and advantages, as the graph-captured SCST update reads them."""

    features: torch.Tensor
    boxes: torch.Tensor
    region_mask: torch.Tensor
    tokens: torch.Tensor  # (B*n, max_tokens) sampled output tokens, PAD after each caption
    adv: torch.Tensor  # (B*n,) reward minus baseline

    def __len__(self) -> int:
        return int(self.features.shape[0])
