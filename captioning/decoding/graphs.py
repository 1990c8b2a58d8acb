"""CUDA-graph-captured decoder steps for greedy and beam search (beam search's host loop stays in ``beam.py``).

On a GPU a decoder step of these models is launch-bound: a few hundred small kernels whose launches cost far
more than their arithmetic. :class:`GraphRows` captures a whole greedy or sampling search (every step's decoder
layers, generator, log-softmax, choice and bookkeeping, over a static cache, :mod:`captioning.models.
static_cache`) into one ``torch.cuda.CUDAGraph``: one launch per batch, no host sync until the result is read.
Beam search keeps host logic between steps: :class:`GraphStep` captures one ``model.decode_step`` and replays it
once per step (and beam reorders through a second graph).

A graph is tied to its shapes and storage: the number of rows, the memory's regions (padded to a multiple of
:data:`REGION_BUCKET` with masked regions, so adaptive region counts share graphs), the cache's positions, the
memory dtype and the autocast state. Static inputs (the step's tokens, the memory states and mask, the cross
keys/values, the position counter) are copied into before a caption, the step's output is one static tensor
(overwritten by the next replay: read it before). Inside the captured step there is no host value and no
host-side control flow depending on the data: positions come from the cache's device counter, which the graph
itself advances. Beam search's row reordering (an ``index_select`` into the same buffers) is captured too.

:func:`encode` does the same for ``model.encode`` (one graph per input shape), for callers whose batch-1
latency would otherwise be the encoder's kernel launches (``capflow bench decode``'s graph rows).

Graphs are kept per model (weakly; at most :data:`MAX_GRAPHS`, least recently used first out) and dropped when
the model's parameters or buffers move (``.to()``, ``.half()``): in-place updates (an optimizer step,
``load_state_dict``) are seen by the replays, as the graph reads the parameters' storage.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import OrderedDict

import torch

from captioning.decoding.rows import static_rows
from captioning.decoding.steps import argmax, decode_steps, race_sampler
from captioning.models.encoder_decoder import Memory

REGION_BUCKET = 12  # fixed-36 features need no padding; adaptive 10..100 regions give 9 shapes
MAX_GRAPHS = 8  # per model
WARMUP = 2  # eager steps on a side stream before capture

_STORE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {"fingerprint", "graphs"}
_FAILED: weakref.WeakSet = weakref.WeakSet()  # models whose step could not be captured (auto mode: eager)


def available() -> bool:
    return torch.cuda.is_available()


def failed(model) -> bool:
    return model in _FAILED


def mark_failed(model) -> None:
    _FAILED.add(model)
    forget(model)


def _fingerprint(model) -> tuple:
    if not isinstance(model, torch.nn.Module):
        return ()
    return tuple((t.data_ptr(), t.dtype) for t in itertools.chain(model.parameters(), model.buffers()))


def _autocast_state(device: torch.device) -> tuple:
    if not torch.is_autocast_enabled(device.type):
        return (False,)
    return True, torch.get_autocast_dtype(device.type)


class GraphStep:
    """One captured decoder step for ``rows`` rows, ``regions`` memory regions and ``positions`` positions."""

    def __init__(self, model, rows: int, regions: int, d_memory: int, dtype: torch.dtype, positions: int,
                 device: torch.device):
        self.model = model
        self.rows, self.regions, self.positions = rows, regions, positions
        self.device = device
        k = int(model.group_size)
        self.memory = Memory(torch.zeros(rows, regions, d_memory, dtype=dtype, device=device),
                             torch.zeros(rows, regions, dtype=torch.bool, device=device))
        self.memory.mask[:, 0] = True  # capture-time content only; every caption copies its memory in
        self.tokens = model.start_tokens(rows, device=device)
        self.order = torch.arange(rows, device=device)  # beam search: rows to keep
        self.cache = model.new_cache(static=True, max_len=positions, device=device)
        if positions < k:
            raise ValueError(f"{positions} positions cannot hold one group of {k}")

        # one eager step on the current stream allocates the static buffers (and the cross states) there
        model.prime_cache(self.memory, self.cache)
        self._eager_step()
        # warm-up on a side stream, so that lazy initialisation (library handles, workspaces) is not captured
        _on_side_stream(device, lambda: [self._eager_step() for _ in range(WARMUP)])
        self.cache.reset()
        self.step_graph, self.out = _capture(lambda: model.decode_step(self.memory, self.tokens, self.cache))
        self.reorder_graph, _ = _capture(lambda: self.cache.reorder(self.order, cross=False))
        self.cache.reset()  # the capture ran the host code (length) but no kernel
        self.length = 0

    def _eager_step(self) -> None:
        self.cache.reset()
        self.model.decode_step(self.memory, self.tokens, self.cache)
        self.cache.reorder(self.order, cross=False)

    def start(self, memory: Memory) -> None:
        """A new caption (batch) for ``memory`` (rows x at most ``regions`` regions)."""
        _copy_memory(self.memory, memory)
        self.model.prime_cache(self.memory, self.cache, in_place=True)
        self.cache.reset()
        self.length = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens`` (rows, t); returns the static output (rows, t, V), valid until the next step."""
        if self.length + tokens.shape[1] > self.positions:
            raise ValueError(f"decoder position {self.length + tokens.shape[1]} exceeds the graph's "
                             f"{self.positions} positions")
        self.tokens.copy_(tokens)
        with _on_device(self.device):
            self.step_graph.replay()
        self.length += tokens.shape[1]
        return self.out

    def reorder(self, idx: torch.Tensor) -> None:
        self.order.copy_(idx)
        with _on_device(self.device):
            self.reorder_graph.replay()


class GraphRows:
    """A whole row-wise search (greedy or sampling) captured as one graph for ``rows`` rows and ``regions``
    regions: the cross states primed from the static memory, the position counter reset, and every step with
    its choices and bookkeeping (:func:`captioning.decoding.rows.static_rows` without host reads, so every
    step runs; the steps after the last row finished only write PAD). One replay per batch."""

    def __init__(self, model, rows: int, regions: int, d_memory: int, dtype: torch.dtype, max_len: int,
                 sampler: tuple, constraint: int, device: torch.device):
        self.rows, self.regions = rows, regions
        self.device = device
        max_len, steps = decode_steps(model, max_len)
        self.memory = Memory(torch.zeros(rows, regions, d_memory, dtype=dtype, device=device),
                             torch.zeros(rows, regions, dtype=torch.bool, device=device))
        self.memory.mask[:, 0] = True  # capture-time content only; every batch copies its memory in
        self.cache = model.new_cache(static=True, max_len=steps * int(model.group_size), device=device)
        model.prime_cache(self.memory, self.cache)  # allocates the cross states the graph primes in place
        if sampler[0] == "greedy":
            choose = argmax
        elif sampler[0] == "sample":
            choose = race_sampler(sampler[1])
        else:
            raise ValueError(f"unknown sampler {sampler!r}")

        def search_all():
            model.prime_cache(self.memory, self.cache, in_place=True)
            self.cache.reset()
            return static_rows(model, lambda t: model.decode_step(self.memory, t, self.cache), rows, device,
                               max_len, choose, constraint, check_every=None)

        search_all()  # on the current stream: allocates the static buffers
        _on_side_stream(device, lambda: [search_all() for _ in range(WARMUP)])
        self.graph, self.out = _capture(search_all)

    def run(self, memory: Memory) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, token log-probs, lengths) for ``memory``: the graph's static outputs, valid until the next run."""
        _copy_memory(self.memory, memory)
        with _on_device(self.device):
            self.graph.replay()
        return self.out


def run_rows(model, memory: Memory, max_len: int, sampler: tuple = ("greedy",),
             constraint: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole greedy (``("greedy",)``) or sampling (``("sample", temperature)``) search of ``memory`` replayed
    from its graph (captured on first use per shape): (tokens (N, steps*K), token log-probs, lengths), clones."""
    states = memory.states
    device = states.device
    rows, r, d = states.shape
    regions = -(-r // REGION_BUCKET) * REGION_BUCKET
    entry = _entry(model)
    key = ("rows", tuple(sampler), int(constraint), rows, regions, d, states.dtype, int(max_len), str(device),
           _autocast_state(device))
    runner = entry["graphs"].get(key)
    if runner is None:
        with _capturing(device):
            runner = GraphRows(model, rows, regions, d, states.dtype, max_len, tuple(sampler), constraint, device)
        _keep(entry["graphs"], key, runner)
    entry["graphs"].move_to_end(key)
    return tuple(t.clone() for t in runner.run(memory))


def _copy_memory(static: Memory, memory: Memory) -> None:
    """``memory`` into a graph's static memory (more regions: the rest zeroed and masked out)."""
    r = memory.states.shape[1]
    static.states[:, :r].copy_(memory.states)
    static.mask[:, :r].copy_(memory.mask)
    if r < static.states.shape[1]:
        static.states[:, r:].zero_()
        static.mask[:, r:] = False


def _on_device(device: torch.device):
    """The graph's device as the current one (replays and captures run on the current device's stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@contextlib.contextmanager
def _capturing(device: torch.device):
    """Around warm-up and capture: the graph's device, and autocast (if on) without its weight-cast cache - a
    cast cached by the warm-up would be read, not recomputed, by the replays, and freed when the caller's
    autocast region ends."""
    with _on_device(device):
        if device.type == "cuda" and torch.is_autocast_enabled(device.type):
            with torch.autocast(device.type, dtype=torch.get_autocast_dtype(device.type), cache_enabled=False):
                yield
        else:
            yield


def _on_side_stream(device: torch.device, fn) -> None:
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        fn()
    main.wait_stream(side)


def _capture(fn) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's result): ``fn`` captured (its kernels recorded, not run; a private memory pool). Only this
    thread's CUDA calls are restricted during the capture (a loader's pin-memory thread may go on)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    return graph, out


def graph_step(model, memory: Memory, positions: int) -> GraphStep:
    """The captured step for ``model`` and ``memory``'s shapes (captured on first use), started on ``memory``."""
    states = memory.states
    device = states.device
    rows, r, d = states.shape
    regions = -(-r // REGION_BUCKET) * REGION_BUCKET
    entry = _entry(model)
    key = ("step", rows, regions, d, states.dtype, positions, str(device), _autocast_state(device))
    runner = entry["graphs"].get(key)
    if runner is None:
        with _capturing(device):
            runner = GraphStep(model, rows, regions, d, states.dtype, positions, device)
        _keep(entry["graphs"], key, runner)
    entry["graphs"].move_to_end(key)
    runner.start(memory)
    return runner


def _entry(model) -> dict:
    """``model``'s graphs, dropped when its parameters or buffers moved."""
    entry = _STORE.get(model)
    fp = _fingerprint(model)
    if entry is None or entry["fingerprint"] != fp:
        entry = _STORE[model] = {"fingerprint": fp, "graphs": OrderedDict()}
    return entry


def _keep(graphs: OrderedDict, key, runner) -> None:
    graphs[key] = runner
    while len(graphs) > MAX_GRAPHS:
        graphs.popitem(last=False)


class GraphEncode:
    """``model.encode`` captured for one (rows, regions) shape; inputs copied into static tensors."""

    def __init__(self, model, features: torch.Tensor, boxes: torch.Tensor, region_mask: torch.Tensor):
        self.features, self.boxes, self.mask = features.clone(), boxes.clone(), region_mask.clone()

        def run():
            return model.encode(self.features, self.boxes, self.mask).states

        run()
        _on_side_stream(features.device, lambda: [run() for _ in range(WARMUP)])
        self.graph, self.out = _capture(run)
        self.device = features.device

    def __call__(self, features, boxes, region_mask) -> Memory:
        self.features.copy_(features)
        self.boxes.copy_(boxes)
        self.mask.copy_(region_mask)
        with _on_device(self.device):
            self.graph.replay()
        return Memory(self.out.clone(), self.mask.clone())


def encode(model, features: torch.Tensor, boxes: torch.Tensor, region_mask: torch.Tensor) -> Memory:
    """``model.encode`` replayed from a CUDA graph per input shape (captured on first use; eval mode). The
    returned memory is the caller's own (copied out of the graph's output)."""
    if not features.is_cuda:
        raise ValueError("a graph-captured encoder needs its inputs on a CUDA device")
    if any(isinstance(m, torch.nn.Dropout) and m.training and m.p > 0 for m in model.modules()):
        raise ValueError("a graph-captured encoder needs the model in eval mode (no active dropout)")
    entry = _entry(model)
    key = ("encode", tuple(features.shape), features.dtype, tuple(boxes.shape), boxes.dtype, region_mask.dtype,
           str(features.device), _autocast_state(features.device))
    runner = entry["graphs"].get(key)
    if runner is None:
        with _capturing(features.device):
            runner = GraphEncode(model, features, boxes, region_mask)
        _keep(entry["graphs"], key, runner)
    entry["graphs"].move_to_end(key)
    return runner(features, boxes, region_mask)


def forget(model) -> None:
    """Drop ``model``'s captured graphs (and their memory)."""
    _STORE.pop(model, None)
