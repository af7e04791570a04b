"""A device-resident ``num_draft_tokens`` with ``max_num_draft_tokens``: the row layout is
derived on the device (no host read) and gives exactly the outputs of the host layout.

On CPU the device path is forced by treating CPU tensors as device tensors
(``plan._is_device_tensor``); the GPU test captures and replays a CUDA graph whose draft
counts change between replays.
"""

from __future__ import annotations

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams
from specsample import plan as plan_mod
from specsample.plan import ERR_NUM_DRAFT_TOKENS, _device_layout, _layout, build_plan

K = 3


@pytest.fixture
def device_path(monkeypatch):
    """Every num_draft_tokens tensor takes the device layout (CPU tensors too)."""
    monkeypatch.setattr(plan_mod, "_is_device_tensor", lambda t: isinstance(t, torch.Tensor))


def _params(gen: torch.Generator, n: int, general: bool) -> list[SamplingParams]:
    out = []
    for i in range(n):
        t = [0.0, 0.7, 1.0, 1.3][int(torch.randint(0, 4, (), generator=gen))]
        kw = [dict(), dict(top_k=5, top_p=0.9), dict(min_p=0.05), dict(logprobs=2)][i % 4]
        if general and i % 2:
            kw = dict(kw, presence_penalty=0.3, repetition_penalty=1.2, logit_bias={1: 2.0},
                      bad_words_token_ids=[[2, 3], [4]], min_tokens=3, stop_token_ids=[5],
                      allowed_token_ids=None if i % 4 == 1 else list(range(0, 40, 2)))
        out.append(SamplingParams(temperature=t, seed=50 + i, **kw))
    return out


def _case(seed: int, n: int, vocab: int, kind: str, general: bool):
    gen = torch.Generator().manual_seed(seed)
    ks = [int(torch.randint(0, K + 1, (), generator=gen)) for _ in range(n)]
    logits = torch.randn(n + sum(ks), vocab, generator=gen) * 8
    d = torch.randint(0, vocab, (sum(ks),), generator=gen)
    top = logits.argmax(-1)
    r = s = 0
    for k in ks:  # the row's argmax half the time (accepted often)
        for j in range(k):
            if torch.rand((), generator=gen) < 0.5:
                d[s + j] = top[r + j]
        r, s = r + k + 1, s + k
    if d.numel() > 1:  # a placeholder: the request's drafts end there
        d[int(torch.randint(0, d.numel(), (), generator=gen))] = -1
    extra = {}
    if kind == "draft_logits":
        extra["draft_logits"] = torch.randn(d.numel(), vocab, generator=gen) * 3
    elif kind == "draft_probs":
        extra["draft_probs"] = torch.softmax(torch.randn(d.numel(), vocab, generator=gen), -1)
    batch = SamplingBatch.from_params(_params(gen, n, general), vocab_size=vocab,
                                      prompt_token_ids=[[2, 7]] * n,
                                      output_token_ids=[[2, 1]] * n, eos_token_ids=[6])
    pos = torch.randint(0, 2**33, (n,), generator=gen)
    return logits, d, ks, batch, pos, extra


def _assert_same(a, b):
    assert torch.equal(a.token_ids, b.token_ids), (a.token_ids, b.token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.invalid, b.invalid)
    assert (a.logprobs is None) == (b.logprobs is None)
    if a.logprobs is not None:
        assert torch.equal(a.logprobs, b.logprobs)
        assert torch.equal(a.logprob_token_ids, b.logprob_token_ids)


def _host_and_device(case, method, monkeypatch):
    logits, d, ks, batch, pos, extra = case
    host = specsample.verify(logits, d, ks, batch, positions=pos, method=method,
                             strict=False, max_num_draft_tokens=K, **extra)
    with monkeypatch.context() as mp:
        mp.setattr(plan_mod, "_is_device_tensor", lambda t: isinstance(t, torch.Tensor))
        dev = specsample.verify(logits, d, torch.tensor(ks), batch, positions=pos,
                                method=method, strict=False, max_num_draft_tokens=K, **extra)
    return host, dev


@pytest.mark.parametrize("seed", range(6))
def test_device_layout_tensors_match_host_layout(seed):
    gen = torch.Generator().manual_seed(seed)
    n = 1 + seed
    ks = [int(torch.randint(0, K + 1, (), generator=gen)) for _ in range(n)]
    host = _layout(tuple(ks), torch.device("cpu"))
    *dev, err = _device_layout(torch.tensor(ks), K, n + sum(ks), sum(ks))
    for h, x in zip(host, dev, strict=True):
        assert torch.equal(h, x)
    assert not err.any()


@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("general", [False, True])
def test_device_layout_same_outputs_torch(kind, method, general, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    for seed in range(4):
        host, dev = _host_and_device(_case(seed, 5, 64, kind, general), method, monkeypatch)
        assert host.token_ids.shape[1] == K + 1
        _assert_same(host, dev)


@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("general", [False, True])
def test_device_layout_same_outputs_triton(kind, method, general, monkeypatch):
    pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    accepted = 0
    # (one batch with processors: the interpreter runs their kernels slowly, 10 s a batch)
    for seed in (20 + len(kind), 12 + len(kind))[:1 if general else 2]:
        host, dev = _host_and_device(_case(seed, 4, 300, kind, general), method, monkeypatch)
        _assert_same(host, dev)
        accepted += int(host.num_accepted.sum())
    assert accepted > 0  # drafts were verified, not only bonus rows


def test_max_num_draft_tokens_widens_host_output():
    logits, d, ks, batch, pos, extra = _case(3, 4, 64, "onehot", False)
    narrow = specsample.verify(logits, d, ks, batch, positions=pos, strict=False)
    wide = specsample.verify(logits, d, ks, batch, positions=pos, strict=False,
                             max_num_draft_tokens=K + 2)
    assert wide.token_ids.shape == (4, K + 3)
    kmax = max(ks)
    assert torch.equal(wide.token_ids[:, :kmax + 1], narrow.token_ids)
    assert (wide.token_ids[:, kmax + 1:] == -1).all()
    assert torch.equal(wide.num_accepted, narrow.num_accepted)


def test_host_values_are_still_validated():
    logits, d, ks, batch, pos, _ = _case(1, 4, 64, "onehot", False)
    with pytest.raises(ValueError, match="max_num_draft_tokens"):
        specsample.verify(logits, d, ks, batch, positions=pos, max_num_draft_tokens=0)
    with pytest.raises(ValueError, match="max_num_draft_tokens must be None or an int"):
        specsample.verify(logits, d, ks, batch, positions=pos, max_num_draft_tokens=1.5)
    with pytest.raises(ValueError, match=">= 0"):
        specsample.verify(logits, d, ks, batch, positions=pos, max_num_draft_tokens=-1)
    bad = list(ks)
    bad[0] = -1
    with pytest.raises(ValueError, match=">= 0"):
        specsample.verify(logits, d, torch.tensor(bad), batch, positions=pos,
                          max_num_draft_tokens=K)


def test_device_layout_shape_errors_are_host_checked(device_path):
    logits, d, ks, batch, pos, _ = _case(2, 4, 64, "onehot", False)
    with pytest.raises(ValueError, match="expected N \\+ len\\(draft_token_ids\\)"):
        specsample.verify(logits[:-1], d, torch.tensor(ks), batch, positions=pos,
                          max_num_draft_tokens=K)
    with pytest.raises(ValueError, match="entries for 4 requests"):
        specsample.verify(logits, d, torch.tensor(ks[:3]), batch, positions=pos,
                          max_num_draft_tokens=K)
    with pytest.raises(ValueError, match="integer tensor"):
        specsample.verify(logits, d, torch.tensor(ks, dtype=torch.float32), batch,
                          positions=pos, max_num_draft_tokens=K)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_device_entries_that_do_not_fit_make_requests_invalid(backend, device_path,
                                                               monkeypatch):
    if backend == "triton":
        pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", backend)
    n, v = 4, 64
    gen = torch.Generator().manual_seed(5)
    batch = SamplingBatch.from_params([SamplingParams(seed=i, logprobs=1) for i in range(n)],
                                      vocab_size=v)
    pos = torch.arange(n)
    # S = 6 drafts, T = 10 rows. A count above K = 3 (same sum): only that request.
    logits = torch.randn(n + 6, v, generator=gen)
    d = torch.randint(0, v, (6,), generator=gen)
    ks = torch.tensor([1, 4, 0, 1])
    out = specsample.verify(logits, d, ks, batch, positions=pos, strict=False,
                            max_num_draft_tokens=3)
    assert out.invalid.tolist() == [False, True, False, False]
    assert (out.token_ids[1] == -1).all() and out.num_accepted[1] == 0
    assert (out.logprob_token_ids[1] == -1).all() and (out.logprobs[1] == -float("inf")).all()
    # The other requests are laid out as with the host list [1, 4, 0, 1] (K = 4).
    ref = specsample.verify(logits, d, [1, 4, 0, 1], batch, positions=pos, strict=False)
    for i in (0, 2, 3):
        assert torch.equal(out.token_ids[i], ref.token_ids[i, :4])
    # A wrong sum or a negative entry: every request.
    for bad in ([1, 2, 0, 1], [3, 3, 1, 1], [-1, 3, 3, 1]):
        out = specsample.verify(logits, d, torch.tensor(bad), batch, positions=pos,
                                strict=False, max_num_draft_tokens=3)
        assert out.invalid.all() and (out.token_ids == -1).all(), bad
        assert (out.num_accepted == 0).all()
    with pytest.raises(SamplingError, match="num_draft_tokens entry negative or above"):
        specsample.verify(logits, d, ks, batch, positions=pos, max_num_draft_tokens=3)


def test_huge_device_entries_do_not_overflow():
    ks = torch.tensor([2**62, 2**62, -(2**63)])
    *layout, err = _device_layout(ks, 3, 3 + 4, 4)
    assert (err == ERR_NUM_DRAFT_TOKENS).all()
    row_start, draft_start, row_req, row_j, draft_req, draft_j, k_given = layout
    assert row_start.tolist() == [0, 1, 2] and (k_given == 0).all()
    assert row_req.max() <= 2 and draft_req.max() <= 2 and (row_j >= 0).all()


def test_device_plan_reads_nothing_on_host(device_path, monkeypatch):
    # The plan's build never converts the counts to Python values.
    logits, d, ks, batch, pos, _ = _case(4, 3, 64, "onehot", False)
    t = torch.tensor(ks)

    def forbidden(*args, **kwargs):
        raise AssertionError("num_draft_tokens was read on the host")

    monkeypatch.setattr(plan_mod, "_num_draft_tuple", forbidden)
    plan = build_plan(logits, batch, draft_token_ids=d, num_draft_tokens=t, draft_logits=None,
                      draft_probs=None, positions=pos, method="token", max_num_draft_tokens=K)
    assert plan.num_draft is None and plan.max_k == K


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["onehot", "draft_probs"])
def test_cuda_graph_with_device_draft_counts(kind):
    from specsample.bench import capture_graph

    n, v, k_max, s = 4, 32000, 3, 6
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=[0.0, 0.8, 1.0, 0.6][i], seed=i, top_k=[0, 0, 50, 0][i])
         for i in range(n)], vocab_size=v, device="cuda")

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        logits = (torch.randn(n + s, v, generator=g) * 3).to("cuda", torch.bfloat16)
        d = torch.randint(0, v, (s,), generator=g).cuda()
        q = torch.softmax(torch.randn(s, v, generator=g), -1).cuda()
        return logits, d, q, torch.randint(0, 2**40, (n,), generator=g).cuda()

    logits, d, q, pos = inputs(1)
    static = dict(logits=logits.clone(), d=d.clone(), q=q.clone(), pos=pos.clone(),
                  ks=torch.tensor([3, 0, 2, 1], device="cuda"))

    def call():
        return specsample.verify(static["logits"], static["d"], static["ks"], batch,
                                 draft_probs=static["q"] if kind == "draft_probs" else None,
                                 positions=static["pos"], strict=False,
                                 max_num_draft_tokens=k_max)

    graph, graph_out = capture_graph(call)
    # Counts change between replays (same sum S = 6), then do not fit (a count above K, a
    # wrong sum): those requests / the batch come back invalid.
    for seed, ks in enumerate(([1, 2, 0, 3], [2, 2, 2, 0], [0, 0, 3, 3], [3, 3, 0, 0],
                               [0, 4, 1, 1], [1, 1, 1, 1]), start=2):
        logits, d, q, pos = inputs(seed)
        for name, value in (("logits", logits), ("d", d), ("q", q), ("pos", pos)):
            static[name].copy_(value)
        static["ks"].copy_(torch.tensor(ks))
        graph.replay()
        torch.cuda.synchronize()
        if max(ks) <= k_max and sum(ks) == s:
            eager = specsample.verify(logits, d, ks, batch, positions=pos, strict=False,
                                      draft_probs=q if kind == "draft_probs" else None,
                                      max_num_draft_tokens=k_max)
            assert torch.equal(graph_out.token_ids, eager.token_ids), ks
            assert torch.equal(graph_out.num_accepted, eager.num_accepted)
            assert not graph_out.invalid.any()
        elif sum(ks) == s:
            assert graph_out.invalid.tolist() == [k > k_max for k in ks]
        else:
            assert graph_out.invalid.all() and (graph_out.token_ids == -1).all()
