"""The CPU path's reusable scratch buffers (specsample.workspace) never leak into results."""

import threading

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
