"""Reusable scratch buffers (specsample.workspace): the CPU path's never leak into results; the
Triton path's intermediates are per name, shape, thread and CUDA stream."""

import math
import threading

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, paths, workspace

V = 3000
# CPU tensors on the Triton backend run in Triton's interpreter, which a CUDA machine's test
# run does not switch on (SPECSAMPLE_BACKEND=triton then refuses CPU tensors)
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="CPU tensors through Triton's interpreter")


def _batch(n: int = 2, **kw) -> SamplingBatch:
    params = [SamplingParams(temperature=0.8, seed=i, top_p=0.9, logprobs=3,
                             logprobs_mode="processed", **kw) for i in range(n)]
    return SamplingBatch.from_params(params, vocab_size=V)


def _call(x: torch.Tensor, batch: SamplingBatch):
    return specsample.sample(x, batch, positions=torch.arange(x.shape[0]))


def test_outputs_do_not_alias_the_buffers():
    batch = _batch()
    x = torch.randn(2, V, generator=torch.Generator().manual_seed(0)) * 3
    first = _call(x, batch)
    kept = (first.token_ids.clone(), first.logprobs.clone(), first.logprob_token_ids.clone())
    p = specsample.probs(x, batch)
    p_kept = p.clone()
    _call(torch.randn(2, V) * 3, batch)  # the same buffers, other values
    specsample.probs(torch.randn(2, V), batch)
    assert torch.equal(first.token_ids, kept[0]) and torch.equal(first.logprobs, kept[1])
    assert torch.equal(first.logprob_token_ids, kept[2]) and torch.equal(p, p_kept)


def test_a_first_call_in_inference_mode_leaves_usable_buffers():
    workspace.release()
    batch = _batch()
    x = torch.randn(2, V) * 3
    with torch.inference_mode():
        inside = _call(x, batch)
    outside = _call(x, batch)  # writes the buffers made inside inference mode
    assert torch.equal(inside.token_ids, outside.token_ids)


def test_logits_that_require_grad_keep_their_graph():
    batch = _batch()
    x = (torch.randn(2, V) * 3).requires_grad_()
    out = _call(x, batch)
    assert out.logprobs.requires_grad  # processed logprobs stay differentiable
    assert torch.equal(out.token_ids, _call(x.detach(), batch).token_ids)
    assert specsample.probs(x, batch).requires_grad


def test_grad_after_an_inference_mode_call():
    # The row layout is cached across calls: made inside torch.inference_mode() it holds
    # inference tensors, which sample()'s no-draft path once passed to autograd (it failed
    # only after another test had filled the cache that way).
    batch = _batch()
    with torch.inference_mode():
        _call(torch.randn(2, V), batch)
    x = (torch.randn(2, V) * 3).requires_grad_()
    assert _call(x, batch).logprobs.requires_grad


def test_threads_get_their_own_buffers():
    batch = _batch()
    xs = [torch.randn(2, V, generator=torch.Generator().manual_seed(s)) * 3 for s in range(8)]
    serial = [_call(x, batch).token_ids for x in xs]
    got = [None] * len(xs)

    def work(i: int) -> None:
        for _ in range(5):
            got[i] = _call(xs[i], batch).token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(a, b) for a, b in zip(got, serial))


# ---- workspace.scratch: the Triton path's per-call intermediates

def test_scratch_returns_the_same_tensor_per_name_and_shape():
    dev = torch.device("cpu")
    workspace.release()
    a = workspace.scratch("a", (3, 4), torch.float32, dev)
    assert workspace.scratch("a", (3, 4), torch.float32, dev) is a
    b = workspace.scratch("b", (3, 4), torch.float32, dev)
    assert b.data_ptr() != a.data_ptr()  # two names, two buffers
    c = workspace.scratch("a", (2,), torch.float32, dev)  # a smaller shape: the same buffer
    assert c.data_ptr() == a.data_ptr() and c.shape == (2,)
    assert workspace.scratch("a", (3, 4), torch.int32, dev).data_ptr() != a.data_ptr()
    big = workspace.scratch("a", (100,), torch.float32, dev)  # grown: a new buffer
    assert big.shape == (100,) and big.is_contiguous()
    again = workspace.scratch("a", (3, 4), torch.float32, dev)
    assert again is not a and again.data_ptr() == big.data_ptr()  # (views of the old dropped)
    assert workspace.scratch("e", (0, 5), torch.int64, dev).shape == (0, 5)
    workspace.release()


def test_scratch_threads_and_inference_mode():
    dev = torch.device("cpu")
    workspace.release()
    with torch.inference_mode():
        a = workspace.scratch("t", (8,), torch.float32, dev)
    assert not a.is_inference()
    a.fill_(1.0)  # (writable outside inference mode)
    other = []
    th = threading.Thread(target=lambda: other.append(
        workspace.scratch("t", (8,), torch.float32, dev)))
    th.start()
    th.join()
    assert other[0].data_ptr() != a.data_ptr()
    workspace.release()


def test_zeros_are_kept_and_zero():
    dev = torch.device("cpu")
    workspace.release()
    z = workspace.zeros((3,), torch.int64, dev)
    assert z.tolist() == [0, 0, 0] and workspace.zeros((3,), torch.int64, dev) is z
    assert workspace.scratch("<zeros>", (3,), torch.int64, dev) is not z
    workspace.release()


def test_scratch_keeps_the_buffers_of_a_few_streams():
    # (a caller making a new CUDA stream per call must not keep one set of buffers per
    # stream it ever used; streams are faked here by their keys)
    dev = torch.device("cpu")
    workspace.release()
    first = workspace._stream_cache(dev, 101)
    assert workspace._stream_cache(dev, 101) is first
    for s in range(workspace.SCRATCH_STREAMS):
        workspace._stream_cache(dev, 200 + s)
    assert len(workspace._LOCAL.streams) == workspace.SCRATCH_STREAMS
    assert workspace._stream_cache(dev, 101) is not first  # (dropped, then made again)
    workspace.release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_scratch_per_stream_and_fresh_under_capture():
    dev = torch.device("cuda")
    a = workspace.scratch("s", (16,), torch.float32, dev)
    assert workspace.scratch("s", (16,), torch.float32, torch.device("cuda", 0)) is a
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        b = workspace.scratch("s", (16,), torch.float32, dev)
    assert b.data_ptr() != a.data_ptr()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        c = workspace.scratch("s", (16,), torch.float32, dev)
    assert c.data_ptr() not in (a.data_ptr(), b.data_ptr())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calls_on_two_streams_at_once_match_one_at_a_time():
    # The Triton path's intermediates are reused between calls: calls queued on two streams
    # without synchronisation must not share them.
    v = 151_936
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [SamplingParams(temperature=0.7, seed=i, top_k=20, top_p=0.8) for i in range(8)]
    batch = SamplingBatch.from_params(params, vocab_size=v, device="cuda")
    xs = [(torch.randn(8, v, generator=gen, device="cuda") * 3).to(torch.bfloat16)
          for _ in range(6)]
    pos = torch.arange(8, device="cuda")
    want = [specsample.sample(x, batch, positions=pos).token_ids for x in xs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    got = []
    for i, x in enumerate(xs):
        with torch.cuda.stream(streams[i % 2]):
            got.append(specsample.sample(x, batch, positions=pos, strict=False).token_ids)
    torch.cuda.synchronize()
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@INTERPRETER_ONLY
def test_garbage_in_the_triton_intermediates_never_reaches_a_result(monkeypatch):
    # Every intermediate a call reads is written first in that call: fill all of them with
    # garbage between two identical calls and the results must not change. Floats NaN,
    # int32 3 (a candidate counter not reset would read 3 unwritten slots), int64 a packed
    # candidate (value key, then id) above every real one: token 0 at the top of the row.
    import dataclasses

    pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    v = 700
    pos = torch.arange(3)

    def poison() -> int:
        n = 0
        for bufs, _views in workspace._LOCAL.__dict__.get("streams", {}).values():
            for (_name, dtype), b in bufs.items():
                b.fill_(math.nan if dtype.is_floating_point else True if dtype == torch.bool
                        else 3 if dtype == torch.int32 else 0x7FFFFFFF7FFFFFFF)
                n += 1
        return n

    def calls(params):
        b = SamplingBatch.from_params(params, vocab_size=v)
        g = torch.Generator().manual_seed(len(params[0].__repr__()))
        x = (torch.randn(3, v, generator=g) * 3).to(torch.bfloat16)
        rows = (torch.randn(9, v, generator=g) * 3).to(torch.bfloat16)
        drafts = torch.randint(0, v, (6,), generator=g)
        dl = torch.randn(6, v, generator=g)
        out = [specsample.sample(x, b, positions=pos, strict=False),
               # (one-hot drafts: the same kernels for both methods)
               specsample.verify(rows, drafts, [2, 2, 2], b, positions=pos, strict=False)]
        for method in ("token", "block"):
            out.append(specsample.verify(rows, drafts, [2, 2, 2], b, draft_logits=dl,
                                         positions=pos, method=method, strict=False))
        out.append(specsample.verify_tree(
            rows[:7], [5, 6, 7, 8, 9], [0, 1, 1, 0, 1], [3, 2],
            SamplingBatch.from_params(params[1:], vocab_size=v), strict=False,
            positions=pos[:2]))  # (the first set's: a min_p-only batch)
        return [getattr(o, f.name) for o in out for f in dataclasses.fields(o)
                if isinstance(getattr(o, f.name), torch.Tensor)]

    P = SamplingParams
    for params in ([P(temperature=0.8, seed=1, top_k=7), P(temperature=0.8, seed=2, min_p=0.05),
                    P(temperature=0.8, seed=6, min_p=0.05)],
                   [P(temperature=0.9, seed=3, top_p=0.5), P(temperature=0.0),
                    P(temperature=1.2, seed=4, top_k=50, top_p=0.9)],
                   [P(temperature=0.8, seed=1, top_k=7, logprobs=3,
                      logprobs_mode="processed")] * 3,
                   [P(temperature=0.8, seed=5, top_p=0.3, logprobs=0)] * 3):
        workspace.release()
        ref = calls(params)
        assert poison() > 10
        for a, b in zip(ref, calls(params), strict=True):
            assert torch.equal(a, b) if not a.is_floating_point() else torch.allclose(
                a, b, equal_nan=True)
    workspace.release()


def test_call_block_looks_the_stream_up_once(monkeypatch):
    # An eager call asks for a dozen scratch tensors; each once asked CUDA for the capture
    # state and the current stream (3-5 us of host time each on an H200 host). Within a
    # call() block they are looked up once; the tensors are the ones asked for outside it.
    lookups = []
    real = workspace.stream_key
    monkeypatch.setattr(workspace, "stream_key", lambda d: lookups.append(d) or real(d))
    cpu = torch.device("cpu")
    outside = [workspace.scratch(f"t{i}", (3,), torch.float32, cpu) for i in range(4)]
    assert len(lookups) == 4
    lookups.clear()
    with workspace.call(cpu):
        inside = [workspace.scratch(f"t{i}", (3,), torch.float32, cpu) for i in range(4)]
        zeros = workspace.counters("c", (2,), cpu)
        assert not workspace.capturing(cpu)
        with workspace.call(cpu):  # (nested)
            workspace.scratch("t0", (3,), torch.float32, cpu)
        workspace.scratch("t1", (3,), torch.float32, torch.device("meta"))  # another device
    assert len(lookups) == 3  # (the two blocks, the other device)
    assert all(a is b for a, b in zip(inside, outside)) and zeros.eq(0).all()
    workspace.scratch("t0", (3,), torch.float32, cpu)  # (after the block: looked up again)
    assert len(lookups) == 4


@INTERPRETER_ONLY
def test_triton_calls_look_the_stream_up_once_per_call(monkeypatch):
    # verify() and verify_tree() on the Triton backend each run in one call() block (a review
    # found verify_tree's path outside it: 19 look-ups per call); verify_tree also keys its
    # cached tree shapes by the stream (one more).
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    lookups = []
    real = workspace.stream_key
    monkeypatch.setattr(workspace, "stream_key", lambda d: lookups.append(d) or real(d))
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.8, seed=i, top_k=5, logprobs=2) for i in range(2)],
        vocab_size=300)
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    specsample.verify(x, torch.tensor([1, 2, 3, 4]), [2, 2], batch, positions=torch.arange(2))
    assert len(lookups) == 1
    lookups.clear()
    specsample.verify_tree(x, [1, 2, 3, 4], [0, 0, 0, 1], [2, 2], batch,
                           positions=torch.arange(2))
    assert len(lookups) == 2


# ---- capture memory: zeros and counters that a captured graph reads without a fill node

@pytest.fixture
def cpu_capture(monkeypatch):
    """Calls on CPU tensors as if the stream captured a graph, with capture memory for the
    CPU (made, on CUDA, by the first call outside capture)."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(workspace, "_capturing_now", lambda d: True)
    monkeypatch.setitem(workspace._CAPTURE_MEMORY, cpu, workspace._CaptureMemory(cpu))
    paths.reset()
    return workspace._CAPTURE_MEMORY[cpu]


def test_capture_counters_are_slices_no_other_capture_gets(cpu_capture):
    cpu = torch.device("cpu")
    got = [workspace.counters("draw", (n,), cpu) for n in (5, 1, 3, 8)]
    base = cpu_capture.counters.data_ptr()
    spans = sorted((t.data_ptr() - base, t.data_ptr() - base + 4 * t.numel()) for t in got)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    assert all(t.data_ptr() % 16 == 0 and t.eq(0).all() for t in got)  # (Triton's alignment)
    assert all(t.untyped_storage().data_ptr() == base for t in got)
    z = workspace.zeros((2, 3), torch.float32, cpu)
    assert z.shape == (2, 3) and z.eq(0).all()
    assert z.data_ptr() == cpu_capture.zeros.data_ptr()
    assert workspace.zeros((1,), torch.int64, cpu).data_ptr() == z.data_ptr()
    assert paths.counts() == {}  # (no fill)
    workspace.release()  # (the capture memory stays: graphs keep reading it)
    assert workspace._CAPTURE_MEMORY[cpu] is cpu_capture


def test_capture_memory_used_up_falls_back_to_a_counted_fill(cpu_capture, monkeypatch):
    cpu = torch.device("cpu")
    cpu_capture.used = workspace.CAPTURE_COUNTERS - 4
    a = workspace.counters("draw", (4,), cpu)  # the last slice
    b = workspace.counters("draw", (4,), cpu)  # none left: a tensor of its own
    assert a.untyped_storage().data_ptr() == cpu_capture.counters.data_ptr()
    assert b.untyped_storage().data_ptr() != cpu_capture.counters.data_ptr() and b.eq(0).all()
    big = workspace.zeros((workspace.CAPTURE_ZEROS,), torch.int32, cpu)
    assert big.eq(0).all() and big.numel() == workspace.CAPTURE_ZEROS
    assert paths.counts() == {"workspace.capture_fill.counters": {"calls": 1, "rows": 1},
                              "workspace.capture_fill.zeros": {"calls": 1, "rows": 1}}
    monkeypatch.delitem(workspace._CAPTURE_MEMORY, cpu)  # (no call made it outside capture)
    workspace.counters("draw", (4,), cpu)
    assert paths.counts()["workspace.capture_fill.counters"]["calls"] == 2


@INTERPRETER_ONLY
def test_captured_single_launch_leaves_its_counters_zero(cpu_capture, monkeypatch):
    # The single launch counts finished splits and rows in its counters and sets them back
    # to 0 (a graph replays it with the same slice, and no fill node): after a "captured"
    # call the slice is zero again, and the tokens are the eager call's.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    # (rows that are not live too: a placeholder at j = 0 and at j = 1, a request without
    # drafts, a greedy request)
    v = 700
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.8, seed=i) for i in range(4)]
        + [SamplingParams(temperature=0.0)],
        vocab_size=v)
    g = torch.Generator().manual_seed(0)
    ks = [2, 2, 0, 2, 3]
    rows = torch.randn(sum(ks) + 5, v, generator=g) * 3
    drafts = torch.randint(0, v, (sum(ks),), generator=g)
    drafts[0] = drafts[3] = -1
    pos = torch.arange(5)
    captured = specsample.verify(rows, drafts, ks, batch, positions=pos, strict=False)
    sampled = specsample.sample(rows[:5], batch, positions=pos, strict=False)
    assert cpu_capture.used > 0 and cpu_capture.counters.eq(0).all()
    assert cpu_capture.zeros.eq(0).all()
    assert "triton.one_launch" in paths.counts()
    assert not any(k.startswith("workspace.capture_fill") for k in paths.counts())
    monkeypatch.setattr(workspace, "_capturing_now", lambda d: False)
    eager = specsample.verify(rows, drafts, ks, batch, positions=pos, strict=False)
    assert torch.equal(captured.token_ids, eager.token_ids)
    assert captured.num_accepted[0] == 0 and captured.num_accepted[1] <= 1
    assert torch.equal(sampled.token_ids,
                       specsample.sample(rows[:5], batch, positions=pos).token_ids)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_calls_hold_no_fill_nodes():
    # verify() and sample() on the single launch captured into graphs: each replay runs that
    # one kernel (no fill or memset of counters or placeholders before it); each capture
    # takes its own slice of the capture counters, and two graphs captured alike and
    # replayed in turn with new logits give the eager tokens; with the capture counters used
    # up, a counted fill node keeps the result right.
    from torch.profiler import ProfilerActivity, profile

    from specsample.bench import capture_graph

    v, n = 151_936, 8
    batch = SamplingBatch.from_params([SamplingParams(temperature=1.0, seed=i)
                                       for i in range(n)], vocab_size=v, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def logits(rows):
        return (torch.randn(rows, v, generator=gen, device="cuda") * 3).to(torch.bfloat16)

    pos = torch.arange(n, device="cuda")
    drafts = torch.randint(0, v, (4 * n,), generator=gen, device="cuda")
    static = [logits(5 * n), logits(5 * n), logits(n)]
    paths.reset()
    specsample.sample(static[2], batch, positions=pos)  # (the capture memory exists now)
    mem = workspace._CAPTURE_MEMORY[torch.device("cuda", torch.cuda.current_device())]
    used = [mem.used]
    graphs = []
    for x in static[:2]:
        graphs.append(capture_graph(lambda x=x: specsample.verify(
            x, drafts, [4] * n, batch, positions=pos, strict=False)))
        used.append(mem.used)
    graphs.append(capture_graph(lambda: specsample.sample(static[2], batch, positions=pos,
                                                          strict=False)))
    used.append(mem.used)
    # (counters [rows + requests], slices rounded up to 16 bytes)
    assert [b - a for a, b in zip(used, used[1:])] == [5 * n + n, 5 * n + n, n + n]
    assert not any(k.startswith("workspace.capture_fill") for k in paths.counts())
    for graph, _out in graphs:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        assert [k for k in names if "fill" in k.lower() or "memset" in k.lower()] == []
        assert any("stats_draw_kernel" in k for k in names)
    for _ in range(3):
        for x in static:
            x.copy_(logits(x.shape[0]))
        for graph, _out in graphs:
            graph.replay()
        for x, (_graph, out) in zip(static, graphs):
            if x is static[2]:
                want = specsample.sample(x, batch, positions=pos).token_ids
            else:
                want = specsample.verify(x, drafts, [4] * n, batch, positions=pos).token_ids
            assert torch.equal(out.token_ids, want)
    kept, mem.used = mem.used, workspace.CAPTURE_COUNTERS
    try:
        graph, out = capture_graph(lambda: specsample.verify(
            static[0], drafts, [4] * n, batch, positions=pos, strict=False))
    finally:
        mem.used = kept
    assert paths.counts()["workspace.capture_fill.counters"]["calls"] >= 1
    for _ in range(2):
        static[0].copy_(logits(5 * n))
        graph.replay()
        want = specsample.verify(static[0], drafts, [4] * n, batch, positions=pos).token_ids
        assert torch.equal(out.token_ids, want)
