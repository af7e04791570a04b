"""Reusable scratch buffers (specsample.workspace): the CPU path's never leak into results; the
Triton path's intermediates are per name, shape, thread and CUDA stream."""

import threading

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, workspace

V = 3000


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
