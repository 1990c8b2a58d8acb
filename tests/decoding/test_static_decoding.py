"""The static decoder cache (CPU, every preset) and CUDA-graph-captured decoding (``gpu`` marker): both equal the
eager path with the growing cache."""

from __future__ import annotations

import functools

import pytest
import torch

from captioning.decoding import beam_search, greedy, sample
from captioning.models.encoder_decoder import Captioner
from captioning.models.registry import PRESETS, preset, scaled

R, D_IN = 5, 2048
TOL = {"atol": 1e-6, "rtol": 1e-6}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: one torch thread per module


def small_cfg(name: str):
    cfg = scaled(preset(name), d_model=32, layers=2, heads=4, d_ff=64).replace(vocab_size=40, max_len=40)
    return cfg.replace(bos=1, eos=2) if cfg.codec == "radix" else cfg


@functools.cache
def _model(name: str, eos_bias: float) -> Captioner:
    """Random weights; ``eos_bias`` > 0 makes captions end at different steps (rows finish while others run)."""
    torch.manual_seed(0)
    model = Captioner(small_cfg(name)).eval()
    with torch.no_grad():
        model.generator.bias[model.eos] += eos_bias
    return model


def _inputs(b: int, seed: int = 1, device: str = "cpu", regions: int = R):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, regions, D_IN, generator=g)
    xy = torch.rand(b, regions, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.1 + torch.rand(b, regions, 2, generator=g) * 0.4], -1)
    mask = torch.ones(b, regions, dtype=torch.bool)
    mask[-1, 3:] = False
    return feats.to(device), boxes.to(device), mask.to(device)


def _memory(model: Captioner, b: int, seed: int = 1, device: str = "cpu", regions: int = R):
    with torch.inference_mode():
        return model.encode(*_inputs(b, seed, device, regions))


def assert_same(got, ref, tol=TOL) -> None:
    assert torch.equal(got.tokens, ref.tokens)
    assert torch.equal(got.lengths, ref.lengths)
    torch.testing.assert_close(got.token_logprobs, ref.token_logprobs, **tol)
    torch.testing.assert_close(got.logprobs, ref.logprobs, atol=tol["atol"] * 20, rtol=tol["rtol"])


# ---------------------------------------------------------------------- CPU: static == growing
@pytest.mark.parametrize("name", list(PRESETS))
def test_static_steps_equal_growing_steps(name):
    """decode_step by decode_step, with a beam-style reorder in the middle (rows repeated and permuted)."""
    model = _model(name, 0.0)
    mem = _memory(model, 3)
    k = model.group_size
    with torch.inference_mode():
        grow, static = model.new_cache(), model.new_cache(static=True, max_len=6 * k)
        tokens = model.start_tokens(3)
        for s in range(6):
            a = model.decode_step(mem, tokens, grow)
            b = model.decode_step(mem, tokens, static)
            torch.testing.assert_close(b, a, **TOL)
            tokens = a.argmax(-1)
            if s == 2:
                idx = torch.tensor([2, 0, 0])
                ptrs = [t.data_ptr() for layer in static.layers for t in layer["self"].values()
                        if isinstance(t, torch.Tensor) and t.dim() > 1]
                grow.reorder(idx)
                static.reorder(idx)
                # in place: the static buffers keep their storage (what a captured graph reads)
                assert ptrs == [t.data_ptr() for layer in static.layers for t in layer["self"].values()
                                if isinstance(t, torch.Tensor) and t.dim() > 1]
                mem, tokens = mem.select(idx), tokens[idx]
        assert static.length == grow.length == 6 * k
        assert int(static.pos) == 6 * k


@pytest.mark.parametrize("eos_bias", [0.0, 1.5])
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("name", list(PRESETS))
def test_static_search_equals_eager(name, b, eos_bias):
    model = _model(name, eos_bias)
    mem = _memory(model, b)
    g_ref, g = greedy(model, mem, max_len=16), greedy(model, mem, max_len=16, static_cache=True)
    assert_same(g, g_ref)
    for n_best in (1, 3):
        ref = beam_search(model, mem, beam=3, max_len=16, n_best=n_best)
        got = beam_search(model, mem, beam=3, max_len=16, n_best=n_best, static_cache=True)
        assert_same(got, ref)
    if eos_bias and name == "aic":  # the case is meaningful: captions of several lengths, some cut short
        assert len(set(g_ref.lengths.flatten().tolist())) > 1 or b == 1


@pytest.mark.parametrize("name", ["aic", "satic-k4"])
def test_static_search_length_penalty_and_short_max_len(name):
    model = _model(name, 1.5)
    mem = _memory(model, 3)
    for max_len in (1, 5, 9):
        assert_same(greedy(model, mem, max_len=max_len, static_cache=True), greedy(model, mem, max_len=max_len))
        kw = {"beam": 4, "max_len": max_len, "n_best": 2, "length_penalty": 0.7}
        assert_same(beam_search(model, mem, static_cache=True, **kw), beam_search(model, mem, **kw))


def test_static_cache_limits_and_reset():
    model = _model("satic-k2", 0.0)
    mem = _memory(model, 2)
    with torch.inference_mode():
        cache = model.new_cache(static=True, max_len=4)
        tokens = model.start_tokens(2)
        first = [model.decode_step(mem, tokens, cache).clone() for _ in range(2)]
        with pytest.raises(ValueError, match="exceeds"):
            model.decode_step(mem, tokens, cache)
        cache.reset()
        assert cache.length == 0 and int(cache.pos) == 0
        again = [model.decode_step(mem, tokens, cache).clone() for _ in range(2)]
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)
        cache.reset()
        with pytest.raises(ValueError, match="rows"):  # a static cache serves one batch size
            model.decode_step(mem.select(torch.tensor([0])), tokens[:1], cache)
        with pytest.raises(ValueError):
            model.new_cache(static=True, max_len=model.cfg.max_len + 1)
    with pytest.raises(ValueError):
        model.new_cache().reset()


def test_engine_options():
    model = _model("aic", 0.0)
    mem = _memory(model, 2)
    with pytest.raises(ValueError, match="CUDA"):
        greedy(model, mem, graphs=True)  # the memory is on the CPU
    with pytest.raises(ValueError):
        beam_search(model, mem, use_cache=False, static_cache=True)
    # auto on the CPU is the eager path; sampling keeps it (SCST's draws do not change)
    assert_same(greedy(model, mem, graphs=None), greedy(model, mem, graphs=False, static_cache=False), tol={
        "atol": 0.0, "rtol": 0.0})
    a = sample(model, mem, n=3, generator=torch.Generator().manual_seed(4))
    b = sample(model, mem, n=3, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.tokens, b.tokens)


def test_prime_cache_writes_in_place():
    model = _model("acort-small", 0.0)  # Share-kV: cross keys and values are one tensor
    mem, other = _memory(model, 2, seed=1), _memory(model, 2, seed=2)
    with torch.inference_mode():
        cache = model.new_cache(static=True, max_len=8)
        model.prime_cache(mem, cache)
        ptrs = [(layer["cross"]["k"].data_ptr(), layer["cross"]["v"].data_ptr()) for layer in cache.layers]
        assert all(k == v for k, v in ptrs)
        model.prime_cache(other, cache, in_place=True)
        assert ptrs == [(layer["cross"]["k"].data_ptr(), layer["cross"]["v"].data_ptr()) for layer in cache.layers]
        out = model.decode_step(other, model.start_tokens(2), cache)
        ref = model.decode_step(other, model.start_tokens(2), model.new_cache())
        torch.testing.assert_close(out, ref, **TOL)
        with pytest.raises(ValueError):
            model.prime_cache(_memory(model, 3), cache, in_place=True)


# ---------------------------------------------------------------------- the graph runner's logic, on the CPU
class _FakeGraph:
    """Stands in for a captured CUDA graph on the CPU: ``replay`` runs the captured function again and leaves its
    result in the captured output tensor (where a real replay writes it)."""

    def __init__(self, fn, out):
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self):
        new = self.fn()
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
        elif isinstance(self.out, tuple):
            for o, n in zip(self.out, new, strict=True):
                o.copy_(n)
        self.replays += 1


def _fake_capture(fn):
    out = fn()
    return _FakeGraph(fn, out), out


@pytest.mark.parametrize("name", ["aic", "satic-k4", "expansionnet", "acort-small"])
def test_graph_runner_equals_eager_with_fake_graphs(monkeypatch, name):
    """The graph runners' bookkeeping (static inputs copied in, regions padded to the bucket with masked regions,
    cross states primed in place per batch, the position counter reset, reorders, one runner per shape) with
    stand-in graphs: the search equals the eager one for several batches through the same runners (greedy: one
    graph for the whole search, GraphRows; beam search: a graph per step and per reorder, GraphStep)."""
    from captioning.decoding import engines, graphs, steps

    monkeypatch.setattr(graphs, "_capture", _fake_capture)
    monkeypatch.setattr(graphs, "_on_side_stream", lambda device, fn: fn())
    model = _model(name, 1.5)
    tol = {"atol": 1e-5, "rtol": 1e-5}  # padded regions: longer (masked) cross-attention sums
    try:
        for seed in (1, 2):
            mem = _memory(model, 3, seed=seed)
            ref = greedy(model, mem, max_len=12)
            with torch.inference_mode():
                toks, tlp, lengths = engines.rows_static(model, mem, 12, True, steps.argmax)
            assert torch.equal(toks[:, None], ref.tokens) and torch.equal(lengths[:, None], ref.lengths)
            torch.testing.assert_close(tlp[:, None], ref.token_logprobs, **tol)
            ref = beam_search(model, mem, beam=3, max_len=12, n_best=2)
            with torch.inference_mode():
                got = engines.run_beam(model, mem, 3, 12, 0.0, 2, True, static=True, graphs=True)
            assert_same(got, ref, tol)
        runners = graphs._STORE[model]["graphs"]
        assert len(runners) == 2  # greedy (3 rows) and beam (9 rows), reused by the second batch
        assert {(type(r).__name__, r.rows, r.regions) for r in runners.values()} == {
            ("GraphRows", 3, graphs.REGION_BUCKET), ("GraphStep", 9, graphs.REGION_BUCKET)}
        whole = next(r for r in runners.values() if isinstance(r, graphs.GraphRows))
        assert whole.graph.replays == 2  # one replay per batch, not per step
        step = next(r for r in runners.values() if isinstance(r, graphs.GraphStep))
        assert step.step_graph.replays > 2 and step.reorder_graph.replays > 0  # beam search: per step, reorders
    finally:
        graphs.forget(model)


@pytest.mark.parametrize("name", ["aic", "satic-k2"])
def test_graph_sampling_runner_equals_eager_static_sampling_with_fake_graphs(monkeypatch, name):
    """The whole-search sampling graph's bookkeeping with stand-in graphs: after seeding the (default) generator,
    a replay draws what the eager static engine draws, batch after batch through one runner."""
    from captioning.decoding import engines, graphs, steps

    monkeypatch.setattr(graphs, "_capture", _fake_capture)
    monkeypatch.setattr(graphs, "_on_side_stream", lambda device, fn: fn())
    model = _model(name, 1.5)
    try:
        for seed in (1, 2, 3):
            mem = _memory(model, 2, seed=seed).repeat(3)
            with torch.inference_mode():
                engines.rows_static(model, mem, 12, True, None, 0, ("sample", 0.8))  # first use: capture
                torch.manual_seed(seed)
                got = engines.rows_static(model, mem, 12, True, None, 0, ("sample", 0.8))
                torch.manual_seed(seed)
                ref = engines.rows_static(model, mem, 12, False, steps.race_sampler(0.8))
            assert torch.equal(got[0], ref[0]) and torch.equal(got[2], ref[2])
            torch.testing.assert_close(got[1], ref[1], atol=1e-5, rtol=1e-5)
        (runner,) = graphs._STORE[model]["graphs"].values()
        assert runner.graph.replays == 6
    finally:
        graphs.forget(model)


# ---------------------------------------------------------------------- CUDA graphs == eager (GPU only)
GPU_TOL = {"atol": 1e-4, "rtol": 1e-4}


def _cuda_model(name: str, eos_bias: float = 1.5) -> Captioner:
    """A CUDA copy of the CPU test model (its own object: captured graphs are kept per model)."""
    model = _model(name, eos_bias)
    out = Captioner(model.cfg).eval()
    out.load_state_dict(model.state_dict())
    return out.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(PRESETS))
def test_graph_search_equals_eager_on_cuda(name):
    from captioning.decoding import graphs

    model = _cuda_model(name)
    for b in (1, 4):
        mem = _memory(model, b, device="cuda")
        ref = greedy(model, mem, max_len=16, graphs=False)
        assert_same(greedy(model, mem, max_len=16, graphs=True), ref, GPU_TOL)
        assert_same(greedy(model, mem, max_len=16), ref, GPU_TOL)  # auto = graphs on CUDA
        for n_best in (1, 3):
            ref = beam_search(model, mem, beam=3, max_len=16, n_best=n_best, graphs=False)
            got = beam_search(model, mem, beam=3, max_len=16, n_best=n_best, graphs=True)
            assert_same(got, ref, GPU_TOL)
    # greedy b=1, b=4 and beam (3 and 12 rows), all 16 positions: four captured shapes, reused above
    assert len(graphs._STORE[model]["graphs"]) == 4


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["aic", "satic-k2", "acort-small", "expansionnet"])
def test_graph_sampling_on_cuda(name):
    """Sampling replayed from one graph per search: well-formed, the policy's own log-probs, reproducible after
    seeding the default CUDA generator, new draws per replay, and at a tiny temperature the greedy captions."""
    from captioning.decoding import graphs
    from tests.decoding.test_decoding import check_well_formed, teacher_logprob

    model = _cuda_model(name)
    mem = _memory(model, 3, device="cuda")
    sample(model, mem, n=4, max_len=14, graphs=True)  # captures
    torch.manual_seed(11)
    a = sample(model, mem, n=4, max_len=14, graphs=True)
    torch.manual_seed(11)
    assert_same(sample(model, mem, n=4, max_len=14, graphs=True), a, {"atol": 0.0, "rtol": 0.0})
    check_well_formed(model, a, 14)
    cpu_model = _model(name, 1.5)  # the same weights on the CPU (teacher_logprob builds its inputs there)
    want = teacher_logprob(cpu_model, _memory(cpu_model, 3), a.flat().cpu())
    torch.testing.assert_close(a.logprobs.reshape(-1).cpu(), want, atol=1e-3, rtol=0)
    b = sample(model, mem, n=4, max_len=14)  # auto: graphs on CUDA in eval mode, a new draw
    assert not torch.equal(a.tokens, b.tokens)
    cold = sample(model, mem, n=2, max_len=14, temperature=1e-6, graphs=True)
    g = greedy(model, mem, max_len=14, graphs=False)
    assert torch.equal(cold.tokens[:, 0], g.tokens[:, 0]) and torch.equal(cold.tokens[:, 1], g.tokens[:, 0])
    kinds = {k[1] for k in graphs._STORE[model]["graphs"]}
    assert ("sample", 1.0) in kinds
    with pytest.raises(ValueError, match="generator"):
        sample(model, mem, graphs=True, generator=torch.Generator("cuda").manual_seed(0))


@pytest.mark.gpu
def test_graph_replays_new_inputs_and_weights():
    """A captured step reads its static inputs and the parameters' storage: new memories of the same shape and
    in-place weight updates (an optimizer step) are seen by the replays; moved weights are captured again."""
    from captioning.decoding import graphs

    model = _cuda_model("satic-k2")
    for seed in (1, 2, 3):
        mem = _memory(model, 3, seed=seed, device="cuda")
        assert_same(greedy(model, mem, graphs=True), greedy(model, mem, graphs=False), GPU_TOL)
    assert len(graphs._STORE[model]["graphs"]) == 1
    with torch.no_grad():
        model.generator.bias[model.eos] += 3.0
        for p in model.decoder.parameters():
            p.mul_(1.01)
    mem = _memory(model, 3, device="cuda")
    assert_same(greedy(model, mem, graphs=True), greedy(model, mem, graphs=False), GPU_TOL)
    assert_same(beam_search(model, mem, beam=2, graphs=True), beam_search(model, mem, beam=2, graphs=False),
                GPU_TOL)
    model.double().float()  # new storage: the old graphs must not be replayed
    assert_same(greedy(model, mem, graphs=True), greedy(model, mem, graphs=False), GPU_TOL)
    assert len(graphs._STORE[model]["graphs"]) == 1
    # the memory's regions are padded to a bucket with masked regions: 7 regions replay the graph of 5
    mem7 = _memory(model, 3, device="cuda", regions=7)
    assert_same(greedy(model, mem7, graphs=True), greedy(model, mem7, graphs=False), GPU_TOL)
    assert len(graphs._STORE[model]["graphs"]) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ort-small", "expansionnet", "zodiac-sigmoid"])
def test_graph_encoder_equals_eager_on_cuda(name):
    from captioning.decoding import graphs

    model = _cuda_model(name)
    with torch.inference_mode():
        for seed in (1, 2):  # the second batch replays the first one's graph
            x = _inputs(3, seed=seed, device="cuda")
            got, ref = graphs.encode(model, *x), model.encode(*x)
            torch.testing.assert_close(got.states, ref.states, **GPU_TOL)
            assert torch.equal(got.mask, ref.mask)
        assert len(graphs._STORE[model]["graphs"]) == 1
        assert_same(greedy(model, got, graphs=True), greedy(model, ref, graphs=False), GPU_TOL)


@pytest.mark.gpu
def test_graph_decoding_under_autocast():
    """Captured under bf16 autocast, replayed in a later autocast region after the first one's memory was freed
    and overwritten: the same captions (the captured casts are recomputed per replay, not cached)."""
    model = _cuda_model("aic")
    mem = _memory(model, 4, device="cuda")
    outs = []
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs.append(greedy(model, mem, max_len=12, graphs=True))
        torch.cuda.empty_cache()
        torch.full((1 << 22,), float("nan"), device="cuda")  # reuse freed blocks
    assert_same(outs[1], outs[0], {"atol": 0.0, "rtol": 0.0})
    assert torch.isfinite(outs[0].logprobs).all()
    # bf16 rounding differs between the eager and the captured shapes: compare the scores loosely
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = greedy(model, mem, max_len=1, graphs=False)
    torch.testing.assert_close(outs[0].token_logprobs[..., 0], ref.token_logprobs[..., 0], atol=0.1, rtol=0.05)


@pytest.mark.gpu
def test_graph_decoding_under_training_mode_is_eager():
    model = _cuda_model("aic").train()
    mem = _memory(model, 2, device="cuda")
    with pytest.raises(ValueError, match="eval"):
        greedy(model, mem, graphs=True)
    torch.manual_seed(0)
    greedy(model, mem)  # auto: dropout active -> eager, no capture
    from captioning.decoding import graphs

    assert graphs._STORE.get(model) is None
