"""GPU suite for the Triton backend (``pytest -m gpu``; skipped without CUDA).

Real vocabulary sizes, CUDA-graph capture and replay with new data, no host synchronisation on
the fused path, and the warmup compile guard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, paths, torch_backend
from specsample.bench import capture_graph
from specsample.plan import build_plan

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from specsample import triton_backend


def _realistic(n_rows: int, vocab: int, gen: torch.Generator, dtype) -> torch.Tensor:
    """Peaked, Zipf-like rows: logit of rank r ~ 12 - 2.2 log(1 + r) plus noise, permuted."""
    ranks = torch.arange(vocab, dtype=torch.float32)
    profile = 12.0 - 2.2 * torch.log1p(ranks)
    rows = []
    for _ in range(n_rows):
        perm = torch.randperm(vocab, generator=gen)
        rows.append(profile[perm] + 0.5 * torch.randn(vocab, generator=gen))
    return torch.stack(rows).to("cuda", dtype)


FILTERS = [dict(top_k=20, top_p=0.8), dict(top_p=0.9), dict(min_p=0.1), dict(top_k=50),
           dict(top_k=1), dict(top_p=0.999), dict(top_k=2000, min_p=1e-4)]


def _inputs(vocab, dtype, kind, n=8, seed=0, temps=(0.0, 0.7, 1.0, 1.3), filters=False):
    gen = torch.Generator().manual_seed(seed)
    ks = [4] * n
    ks[1] = 0
    logits = _realistic(n + sum(ks), vocab, gen, dtype)
    top = logits.float().argmax(-1).cpu()
    drafts, r = [], 0
    for k in ks:
        for j in range(k):
            drafts.append(int(top[r + j]) if torch.rand((), generator=gen) < 0.7 else
                          int(torch.randint(0, vocab, (), generator=gen)))
        r += k + 1
    d = torch.tensor(drafts, dtype=torch.int64, device="cuda")
    extra = {}
    target_rows = torch.cat([logits[sum(ks[:i]) + i: sum(ks[:i]) + i + ks[i]] for i in range(n)])
    if kind == "draft_logits":
        extra["draft_logits"] = (target_rows.float() + torch.randn(
            target_rows.shape, generator=gen).to("cuda")).to(dtype)
    elif kind == "draft_probs":
        extra["draft_probs"] = torch.softmax(target_rows.float() / 0.9, -1)
    params = [SamplingParams(temperature=temps[i % len(temps)], seed=100 + i,
                             **(FILTERS[i % len(FILTERS)] if filters else {}))
              for i in range(n)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device="cuda")
    pos = torch.arange(n, dtype=torch.int64, device="cuda") * 1000 + 17
    return logits, d, ks, batch, pos, extra


@pytest.mark.parametrize("vocab", [151936, 248320])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_equivalence_real_vocab(vocab, dtype, kind, method):
    _check_equivalence(vocab, dtype, kind, method)


@pytest.mark.parametrize("kind", ["onehot", "draft_logits"])
def test_equivalence_vocab_262144(kind):
    _check_equivalence(262144, torch.bfloat16, kind, "token")


@pytest.mark.parametrize("vocab", [151936, 262144])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_filtered_equivalence(vocab, dtype, kind, method):
    # min_p / top_k / top_p on the fused path: the torch backend's tokens, no general path.
    _check_equivalence(vocab, dtype, kind, method, filters=True)


def _check_equivalence(vocab, dtype, kind, method, filters=False):
    logits, d, ks, batch, pos, extra = _inputs(vocab, dtype, kind, filters=filters, n=14)
    plan = build_plan(logits, batch, draft_token_ids=d, num_draft_tokens=ks,
                      draft_logits=extra.get("draft_logits"),
                      draft_probs=extra.get("draft_probs"), positions=pos, method=method)
    ref, ref_err = torch_backend.verify(plan)
    paths.reset()
    with paths.forbid("triton.*.general", "torch.*"):
        out = specsample.verify(logits, d, ks, batch, positions=pos, method=method,
                                strict=False, **extra)
    assert paths.counts()["triton.verify." + ("filtered" if filters else "fused")]["calls"] == 1
    assert torch.equal(out.invalid, ref_err != 0)
    assert torch.equal(out.token_ids, ref.token_ids), (out.token_ids, ref.token_ids)
    assert torch.equal(out.num_accepted, ref.num_accepted)


@pytest.mark.parametrize("vocab", [151936, 248320, 262144])
@pytest.mark.parametrize("filters", [False, True])
def test_sample_equivalence_and_no_host_sync(vocab, filters):
    logits, _, _, batch, pos, _ = _inputs(vocab, torch.bfloat16, "onehot", n=64,
                                          filters=filters)
    logits = logits[:64]
    ref = specsample.sample(logits, batch, positions=pos)  # warm (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = specsample.sample(logits, batch, positions=pos, strict=False)
        d = torch.zeros(0, dtype=torch.int64, device="cuda")
        specsample.verify(logits, d, [0] * 64, batch, positions=pos, strict=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    plan = build_plan(logits, batch, draft_token_ids=None, num_draft_tokens=[0] * 64,
                      draft_logits=None, draft_probs=None, positions=pos, method="token")
    tref, _ = torch_backend.verify(plan)
    assert torch.equal(out.token_ids, ref.token_ids)
    assert torch.equal(out.token_ids, tref.token_ids[:, 0])


@pytest.mark.parametrize("kind", ["onehot", "draft_logits"])
@pytest.mark.parametrize("filters", [False, True])
def test_cuda_graph_capture_and_replay(kind, filters):
    vocab = 151936
    logits, d, ks, batch, pos, extra = _inputs(vocab, torch.bfloat16, kind, n=8, seed=1,
                                               filters=filters)
    static = {"logits": logits.clone(), "d": d.clone(), "pos": pos.clone()}
    if kind == "draft_logits":
        static["dl"] = extra["draft_logits"].clone()

    def call():
        return specsample.verify(static["logits"], static["d"], ks, batch,
                                 draft_logits=static.get("dl"), positions=static["pos"],
                                 strict=False)

    graph, graph_out = capture_graph(call)
    for seed in (2, 3):
        logits2, d2, _, _, pos2, extra2 = _inputs(vocab, torch.bfloat16, kind, n=8, seed=seed)
        static["logits"].copy_(logits2)
        static["d"].copy_(d2)
        static["pos"].copy_(pos2)
        if kind == "draft_logits":
            static["dl"].copy_(extra2["draft_logits"])
        graph.replay()
        eager = specsample.verify(logits2, d2, ks, batch, draft_logits=extra2.get(
            "draft_logits"), positions=pos2, strict=False)
        torch.cuda.synchronize()
        assert torch.equal(graph_out.token_ids, eager.token_ids)
        assert torch.equal(graph_out.num_accepted, eager.num_accepted)


def test_warmup_then_no_compilation():
    try:
        _warmup_then_no_compilation()
    finally:
        triton_backend.disarm_compile_guard()


def _warmup_then_no_compilation():
    vocab = 32000
    specsample.warmup("cuda", vocab_size=vocab, on_compile="raise")
    assert triton_backend.compilations_after_warmup() == []
    # the parallel compile ran (variants compiled earlier in this process are not listed)
    report = triton_backend.warmup_report()
    assert "error" not in report, report
    assert report["failed"] == [] and report["compiled"] + report["cached"] == report["variants"]
    # calls that take the single launch (eager or captured) and the separate launches
    for separate in (False, True):
        with triton_backend.separate_launches() if separate else contextlib.nullcontext():
            _calls_after_warmup(vocab)
    assert triton_backend.compilations_after_warmup() == []
    paths.reset()


def _calls_after_warmup(vocab):
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for kind in ("onehot", "draft_logits", "draft_probs"):
            for method in ("token", "block"):
                logits, d, ks, batch, pos, extra = _inputs(vocab, dtype, kind, n=5,
                                                           seed=int(torch.randint(0, 99, (),
                                                                                  generator=gen)))
                specsample.verify(logits, d, ks, batch, positions=pos, method=method,
                                  strict=False, **extra)
                # device draft counts (the layout kernels), a width above every count, with
                # and without logprobs
                for b in (batch, SamplingBatch.from_params(
                        [dataclasses.replace(p, logprobs=2) for p in batch.params],
                        vocab_size=vocab, device="cuda")):
                    specsample.verify(logits, d, torch.tensor(ks, device="cuda"), b,
                                      positions=pos, method=method, strict=False,
                                      max_num_draft_tokens=max(ks) + 2, **extra)
        specsample.sample(logits[:5], batch, positions=pos, strict=False)
        general = SamplingBatch.from_params(
            [SamplingParams(temperature=0.5, top_k=3, seed=1)] * 5, vocab_size=vocab,
            device="cuda")
        specsample.sample(logits[:5], general, positions=pos, strict=False)
        for n_top in (0, 5, 20):  # logprobs: raw and processed, fused / filtered / general
            lp = SamplingBatch.from_params(
                [SamplingParams(temperature=t, seed=1, logprobs=n_top, logprobs_mode=mode, **kw)
                 for t, mode, kw in ((0.7, "raw", {}), (1.0, "processed", {}),
                                     (0.0, "raw", {}))] * 2
                + [SamplingParams(temperature=0.9, top_p=0.9, seed=2, logprobs=n_top,
                                  logprobs_mode="processed", **bias)
                   for bias in ({}, dict(logit_bias={1: 0.5}))], vocab_size=vocab,
                device="cuda")
            specsample.sample(logits[:8], lp, positions=torch.arange(8, device="cuda"),
                              strict=False)


def test_cuda_graph_replays_draw_fresh_noise_without_positions():
    # Unseeded requests with positions=None: every replay reads and advances the batch's
    # device counter (no torch generator inside the graph), so replays with the same inputs
    # draw new tokens; strict=True inside capture is refused with a clear error.
    n, vocab, replays = 64, 8, 8
    torch.manual_seed(0)
    batch = SamplingBatch.from_params([SamplingParams()] * n, vocab_size=vocab, device="cuda")
    logits = torch.zeros(2 * n, vocab, device="cuda", dtype=torch.bfloat16)  # uniform rows
    drafts = torch.zeros(n, dtype=torch.int64, device="cuda")
    ks = [1] * n

    def call():
        return specsample.verify(logits, drafts, ks, batch, strict=False)

    graph, graph_out = capture_graph(call)
    c0 = int(batch.fresh_counter)
    firsts = []
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        firsts.append(graph_out.token_ids[:, 0].clone())
    assert int(batch.fresh_counter) == c0 + replays
    for a, b in zip(firsts, firsts[1:]):
        assert not torch.equal(a, b)  # P(equal) = 8**-64 with fresh noise
    counts = torch.bincount(torch.cat(firsts), minlength=vocab).cpu().double()
    assert counts.sum() == n * replays
    chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001

    with pytest.raises(ValueError, match=r"strict=True.*CUDA-graph capture.*strict=False"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            specsample.verify(logits, drafts, ks, batch, strict=True)
    torch.cuda.synchronize()
    assert int(batch.fresh_counter) == c0 + replays


def _capture_case(kind, seed, vocab=151936):
    """Inputs of every option at once: greedy, seeded and unseeded sampled requests, filters,
    logprobs raw and processed, draft counts 0..4 and a placeholder."""
    gen = torch.Generator().manual_seed(seed)
    ks = [0, 1, 2, 3, 4, 4, 2, 3]
    n = len(ks)
    logits = _realistic(n + sum(ks), vocab, gen, torch.bfloat16)
    drafts = torch.randint(0, vocab, (sum(ks),), generator=gen)
    top = logits.float().argmax(-1).cpu()
    r = s = 0
    for k in ks:  # the target's argmax often, so that drafts are accepted
        for j in range(k):
            if torch.rand((), generator=gen) < 0.7:
                drafts[s + j] = top[r + j]
        r, s = r + k + 1, s + k
    drafts[sum(ks[:5]) + 2] = -1  # request 5: a placeholder at draft 2
    extra = {}
    draft_rows = torch.cat([logits[sum(ks[:i]) + i:sum(ks[:i]) + i + ks[i]] for i in range(n)])
    noisy = draft_rows.float() + torch.randn(draft_rows.shape, generator=gen).to("cuda")
    if kind == "draft_logits":
        extra["draft_logits"] = noisy.to(torch.bfloat16)
    elif kind == "draft_probs":
        extra["draft_probs"] = torch.softmax(noisy, -1)
    pos = torch.randint(0, 2**40, (n,), generator=gen).to("cuda")
    return logits, drafts.to("cuda"), ks, pos, extra


@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_capture_and_replay_every_option(kind, method):
    # One captured verify() with every option a fused batch can set, replayed twice with new
    # data copied into the same buffers: the tokens, counts and logprobs equal eager calls.
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.7, seed=3, top_k=20, top_p=0.8, logprobs=3,
                             logprobs_mode="processed"),
              SamplingParams(temperature=1.0),  # unseeded: its random seed, given positions
              SamplingParams(temperature=0.6, seed=5, top_p=0.9, logprobs=0),
              SamplingParams(temperature=1.0, seed=6, min_p=0.1, logprobs=1,
                             logprobs_mode="processed"),
              SamplingParams(temperature=1.0, seed=7, top_k=50),
              SamplingParams(temperature=1.3, seed=8),
              SamplingParams(temperature=0.0, top_k=5)]
    batch = SamplingBatch.from_params(params, vocab_size=151936, device="cuda")
    logits, d, ks, pos, extra = _capture_case(kind, 1)
    static = {"logits": logits.clone(), "d": d.clone(), "pos": pos.clone(),
              **{k: v.clone() for k, v in extra.items()}}

    def call(logits=None, d=None, pos=None, **dist):
        if logits is None:
            logits, d, pos = static["logits"], static["d"], static["pos"]
            dist = {k: static[k] for k in extra}
        return specsample.verify(logits, d, ks, batch, positions=pos, method=method,
                                 strict=False, **dist)

    graph, graph_out = capture_graph(call)
    for seed in (2, 3):
        logits2, d2, _, pos2, extra2 = _capture_case(kind, seed)
        static["logits"].copy_(logits2)
        static["d"].copy_(d2)
        static["pos"].copy_(pos2)
        for k, v in extra2.items():
            static[k].copy_(v)
        graph.replay()
        eager = call(logits2, d2, pos2, **extra2)
        torch.cuda.synchronize()
        assert torch.equal(graph_out.token_ids, eager.token_ids)
        assert torch.equal(graph_out.num_accepted, eager.num_accepted)
        assert torch.equal(graph_out.logprob_token_ids, eager.logprob_token_ids)
        assert torch.equal(graph_out.logprobs, eager.logprobs)
        assert int(eager.num_accepted[5]) <= 2  # the placeholder ends request 5's drafts


def test_capture_refuses_the_general_path():
    # (logit_bias is applied in the kernels and captures, with top_k and logprobs too; with
    # more than 32 top-n logprobs it is general)
    batch = SamplingBatch.from_params([SamplingParams(seed=1, logit_bias={3: 1.0}, top_k=5,
                                                      logprobs=33)],
                                      vocab_size=1024, device="cuda")
    logits = torch.randn(1, 1024, device="cuda")
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    specsample.sample(logits, batch, positions=pos, strict=False)  # eager: fine
    with pytest.raises(ValueError, match="general path"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            specsample.sample(logits, batch, positions=pos, strict=False)
    torch.cuda.synchronize()


@pytest.mark.parametrize("n,vocab", [(2, 248320), (16, 151936), (128, 151936)])
def test_one_launch_matches_separate_launches_under_load(n, vocab):
    # The single launch of eager calls (kernels.stats_draw_kernel) hands each row from its
    # split programs to the one that draws it, and each request from its rows to the one that
    # finishes it, through acquire-release counters: a missing barrier or fence would show as
    # a token or logprob that differs now and then. Many calls (greedy and sampled requests,
    # logprobs 0 for some), against the separate launches (separate_launches()), and a graph
    # replay of the single launch; the counters end at zero.
    from specsample import triton_backend, workspace

    logits, d, ks, batch, pos, _ = _inputs(vocab, torch.bfloat16, "onehot", n=n, seed=n)
    # (logprobs 0 in processed mode: the finish inside the launch writes them)
    batch = SamplingBatch.from_params(
        [dataclasses.replace(p, logprobs=0 if i % 3 == 0 else None, logprobs_mode="processed")
         for i, p in enumerate(batch.params)], vocab_size=vocab, device="cuda")
    call = functools.partial(specsample.verify, logits, d, ks, batch, positions=pos,
                             strict=False)
    with triton_backend.separate_launches():
        want = call()
    graph, out = capture_graph(call)
    graph.replay()
    torch.cuda.synchronize()
    results = [call() for _ in range(40)] + [out]
    paths.reset()
    call()
    assert {"triton.one_launch", "triton.logprobs.finish"} <= set(paths.counts())
    for got in results:
        for name in ("token_ids", "num_accepted", "logprobs", "logprob_token_ids"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    done = workspace.counters("draw", (logits.shape[0] + n,), torch.device("cuda"))
    assert not done.any()


BAD_ROWS = ["all_nan", "one_nan", "nan_first_chunk", "posinf", "all_neginf", "neginf_one_nan"]


def _spoil(row: torch.Tensor, bad: str) -> None:
    if bad == "all_nan":
        row.fill_(float("nan"))
    elif bad == "one_nan":
        row[row.shape[0] - 3] = float("nan")  # (in the last, partial chunk)
    elif bad == "nan_first_chunk":
        row[:4096] = float("nan")
    elif bad == "posinf":
        row[7] = float("inf")
    elif bad == "all_neginf":
        row.fill_(-float("inf"))
    else:
        row.fill_(-float("inf"))
        row[1000] = float("nan")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bad", BAD_ROWS)
@pytest.mark.parametrize("option", ["plain", "top_k", "logprobs", "logit_bias", "draft_logits",
                                    "sample"])
def test_error_codes_match_the_torch_backend(dtype, bad, option):
    # The kernels' per-request error bits equal the torch backend's for every kind of bad
    # row (what a strict call's message says): NaN anywhere in a row is "NaN or +inf", also
    # when the whole row, or a whole chunk of it, is NaN (a max that skips NaN must not make
    # it "no finite logit"); a row of -inf alone is "no finite logit".
    vocab, n, ks = 151936, 4, [2, 2, 2, 2]
    gen = torch.Generator().manual_seed(3)
    kw = {"top_k": dict(top_k=20), "logprobs": dict(logprobs=5),
          "logit_bias": dict(logit_bias={5: 1.0})}.get(option, {})
    batch = SamplingBatch.from_params(
        [SamplingParams(temperature=0.0 if i == 1 else 1.0, seed=i, **kw) for i in range(n)],
        vocab_size=vocab, device="cuda")
    sample = option == "sample"
    rows = n if sample else n + sum(ks)
    logits = _realistic(rows, vocab, gen, dtype)
    spoiled = [0, 1] if sample else [1, 3]  # request 0 (T = 1) row 1, request 1 (greedy) row 0
    for r in spoiled:
        _spoil(logits[r], bad)
    d = None if sample else torch.randint(0, vocab, (sum(ks),), generator=gen).cuda()
    extra = {}
    if option == "draft_logits":
        extra["draft_logits"] = _realistic(sum(ks), vocab, gen, dtype)
        _spoil(extra["draft_logits"][4], bad)  # request 2's first draft row
    pos = torch.arange(n, device="cuda")
    plan = build_plan(logits, batch, draft_token_ids=d, num_draft_tokens=[0] * n if sample
                      else ks, draft_logits=extra.get("draft_logits"), draft_probs=None,
                      positions=pos, method="token")
    _, want = torch_backend.verify(plan)
    assert want[:2].all() and (option != "draft_logits" or want[2])  # (the rows are bad)
    for separate in (False, True):
        ctx = triton_backend.separate_launches() if separate else contextlib.nullcontext()
        with ctx:
            _, got = triton_backend.run(plan, "sample" if sample else "verify")
        assert got.tolist() == want.tolist(), (separate, got.tolist(), want.tolist())


@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
@pytest.mark.parametrize("n", [2, 128])
def test_residual_in_one_launch_under_load(kind, n):
    # kernels.residual_kernel hands each rejected request from its split programs (which sum
    # the residual's tile masses) to the one that draws the correction, through an
    # acquire-release counter: a missing barrier or fence, or two programs drawing, would
    # show as a token that differs now and then. Many calls with rejections, against the
    # torch backend, and a graph replay; the counters end at zero.
    from specsample import workspace

    vocab = 151936
    logits, d, ks, batch, pos, extra = _inputs(vocab, torch.bfloat16, kind, n=n, seed=n + 7,
                                                temps=(0.7, 1.0, 0.0, 1.3))
    d = torch.randint(0, vocab, d.shape, device="cuda",
                      generator=torch.Generator("cuda").manual_seed(n))  # (rejections)
    plan = build_plan(logits, batch, draft_token_ids=d, num_draft_tokens=ks,
                      draft_logits=extra.get("draft_logits"),
                      draft_probs=extra.get("draft_probs"), positions=pos, method="token")
    want, _ = torch_backend.verify(plan)
    sampled = torch.tensor([p.temperature > 0 for p in batch.params], device="cuda")
    assert ((want.num_accepted < torch.tensor(ks, device="cuda")) & sampled).any()
    call = functools.partial(specsample.verify, logits, d, ks, batch, positions=pos,
                             strict=False, **extra)
    graph, out = capture_graph(call)
    graph.replay()
    torch.cuda.synchronize()
    results = [call() for _ in range(30)] + [out]
    for got in results:
        assert torch.equal(got.token_ids, want.token_ids)
        assert torch.equal(got.num_accepted, want.num_accepted)
    assert not workspace.counters("residual", (n,), torch.device("cuda")).any()


@pytest.mark.parametrize("kind", ["onehot", "draft_logits"])
def test_logits_on_another_device_than_the_current_one(kind, monkeypatch):
    """Logits on cuda:1 while cuda:0 is current: every launch runs with cuda:1 current (the
    Triton launches address the current device), and the tokens are those of calls made with
    cuda:1 current; sample(), fresh positions and device draft counts too."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from specsample.triton_backend import launch as launch_module

    devices = []
    real_call = launch_module._Launch.__call__

    def spy(self, *args, **meta):
        devices.append(torch.cuda.current_device())
        return real_call(self, *args, **meta)

    monkeypatch.setattr(launch_module._Launch, "__call__", spy)
    logits, d, ks, batch, pos, extra = _inputs(151936, torch.bfloat16, kind)
    one = torch.device("cuda", 1)
    batch1 = SamplingBatch.from_params(batch.params, vocab_size=151936, device=one)
    d1, pos1, x1 = d.to(one), pos.to(one), logits.to(one)
    extra1 = {k: v.to(one) for k, v in extra.items()}
    firsts = torch.tensor([sum(ks[:i]) + i for i in range(len(ks))], device=one)

    def run():
        out = specsample.verify(x1, d1, ks, batch1, positions=pos1, **extra1)
        dev_counts = specsample.verify(x1, d1, torch.tensor(ks, device=one), batch1,
                                       positions=pos1, max_num_draft_tokens=4, **extra1)
        s = specsample.sample(x1, batch1, positions=pos1, logits_index=firsts)
        return [t.cpu() for t in (out.token_ids, out.num_accepted, dev_counts.token_ids,
                                  s.token_ids)]

    with torch.cuda.device(0):
        got = [run() for _ in range(3)]  # (the later calls where a replay would be)
        unseeded = SamplingBatch.from_params([SamplingParams(temperature=1.0)] * len(ks),
                                             vocab_size=151936, device=one)
        fresh = specsample.verify(x1, d1, ks, unseeded, **extra1)  # (fresh positions)
        assert fresh.token_ids.device == one
    assert devices and set(devices) == {1}, sorted(set(devices))
    with torch.cuda.device(1):
        want = run()
    for g in got:
        for a, b in zip(g, want):
            assert torch.equal(a, b)
