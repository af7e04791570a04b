"""Bans (allowed_token_ids, bad words, min_tokens), logit_bias and penalties applied inside the
Triton kernels (``triton_backend.penalties``): the same tokens, error bits and paths as the
torch backend, which the float64 reference and
the statistical tests check (tests/test_processing.py, tests/test_exactness.py).

On CPU the kernels run in Triton's interpreter (V <= 4096 and a few tiles); on a CUDA machine
the same tests run the compiled kernels. Each case also checks that its penalties change the
tokens, so that a kernel ignoring them would fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, paths, torch_backend
from specsample.plan import build_plan

triton_backend = pytest.importorskip("specsample.triton_backend")
triton = pytest.importorskip("triton")
tl = triton.language

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (name, params of the odd requests; the even ones keep temperature alone). All but "boost"
# change the tokens of these rows (checked: a kernel that ignored them would fail).
CASES = [
    ("repetition", dict(repetition_penalty=1.9)),
    ("frequency+presence", dict(frequency_penalty=1.7, presence_penalty=0.9)),
    ("bias", dict(logit_bias={0: 9.0, 5: -30.0, 2047: 10.0, 2048: 9.5, 4100: 8.0})),
    ("all", dict(repetition_penalty=2.5, frequency_penalty=0.3, presence_penalty=0.8,
                 logit_bias={1: 9.0, 3: -1.0, 2100: 8.0})),
    ("boost", dict(repetition_penalty=0.6, presence_penalty=-0.8)),
]


def _case(seed: int, n: int, vocab: int, dtype, params_kw: dict, *, k_max: int = 4,
          history: int = 40, bans=None):
    """Rows whose largest logits sit on tokens the requests have seen (their outputs and
    prompts, and their drafts: the drafts are the row's argmax most of the time), so that the
    penalties decide the draws. ``bans(outputs, prompt)``: more params of the odd requests
    (bans of their own tokens)."""
    gen = torch.Generator().manual_seed(seed)
    ks = [int(torch.randint(0, k_max + 1, (), generator=gen)) for _ in range(n)]
    rows = n + sum(ks)
    outputs = [[int(t) for t in torch.randint(0, vocab, (history,), generator=gen)]
               for _ in range(n)]
    prompts = [[int(t) for t in torch.randint(0, vocab, (8,), generator=gen)] for _ in range(n)]
    logits = torch.randn(rows, vocab, generator=gen) * 1.5
    drafts, r = [], 0
    for i, k in enumerate(ks):
        hot = torch.tensor(outputs[i][:6] + prompts[i][:3])
        logits[r:r + k + 1, hot] += 5.0
        for j in range(k):
            top = int(logits[r + j].argmax())
            drafts.append(top if torch.rand((), generator=gen) < 0.7 else
                          int(torch.randint(0, vocab, (), generator=gen)))
        r += k + 1
    temps = [0.0, 0.7, 1.0, 1.3]
    params = [SamplingParams(temperature=temps[i % 4], seed=500 + i,
                             **({} if i % 2 == 0 else {
                                 key: ({t: v for t, v in val.items() if t < vocab}
                                       if key == "logit_bias" else val)
                                 for key, val in params_kw.items()}
                                | (bans(outputs[i], prompts[i]) if bans else {})))
              for i in range(n)]
    # greedy requests with the processors too: every other greedy one
    params[2] = dataclasses.replace(params[2], **params[1].__dict__ | {"temperature": 0.0,
                                                                       "seed": 502})
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      prompt_token_ids=prompts, output_token_ids=outputs)
    pos = torch.randint(0, 2**33, (n,), generator=gen).to(DEVICE)
    return (logits.to(dtype).to(DEVICE), torch.tensor(drafts, dtype=torch.int64).to(DEVICE),
            ks, batch, pos)


def _triton_verify(logits, d, ks, batch, pos, **kw):
    paths.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMPLE_BACKEND", "triton")
        out = specsample.verify(logits, d, ks, batch, positions=pos, strict=False, **kw)
    return out, paths.counts()


def _torch_verify(logits, d, ks, batch, pos, method="token", **dist):
    """The torch backend's verify() of the case (``dist``: draft_logits or draft_probs):
    (out, error bits)."""
    plan = build_plan(logits, batch, draft_token_ids=d, num_draft_tokens=ks,
                      **{"draft_logits": None, "draft_probs": None, **dist}, positions=pos,
                      method=method)
    return torch_backend.verify(plan)


def _sample_both(logits, batch, pos):
    """sample() on the Triton backend, then on the torch backend: (out, ref)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMPLE_BACKEND", "triton")
        out = specsample.sample(logits, batch, positions=pos, strict=False)
        mp.setenv("SPECSAMPLE_BACKEND", "torch")
        ref = specsample.sample(logits, batch, positions=pos, strict=False)
    return out, ref


def _plain(batch: SamplingBatch) -> SamplingBatch:
    """The same requests with temperature and seed alone."""
    params = [SamplingParams(temperature=p.temperature, seed=p.seed) for p in batch.params]
    return SamplingBatch.from_params(params, vocab_size=batch.vocab_size, device=DEVICE)


def _verify_as_torch(logits, d, ks, batch, pos, path: str):
    """Triton verify() of the case on ``path`` with processing in the kernels, checked
    against the torch backend (tokens, accepted counts, no invalid request); its output."""
    out, counts = _triton_verify(logits, d, ks, batch, pos)
    assert path in counts and "triton.processing.fused" in counts
    assert not any(p.endswith(".general") for p in counts)
    ref, ref_err = _torch_verify(logits, d, ks, batch, pos)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu()), (out.token_ids, ref.token_ids)
    assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())
    assert not out.invalid.any() and not ref_err.any()
    return out


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_verify_matches_torch_backend(name, kw, dtype):
    vocab = 2 * 2048 + 37  # three tiles: bias entries and seen tokens in several of them
    logits, d, ks, batch, pos = _case(3, 6, vocab, dtype, kw)
    out = _verify_as_torch(logits, d, ks, batch, pos, "triton.verify.fused")
    if name != "boost":  # (power: without the processors the tokens differ)
        plain, _ = _triton_verify(logits, d, ks, _plain(batch), pos)
        assert not torch.equal(plain.token_ids.cpu(), out.token_ids.cpu())


def test_drafts_before_the_row_are_counted():
    # One request, drafts all equal to the rows' top token: with a strong frequency penalty
    # row j sees that token j + 1 times (one output, j drafts), so the rows' draws differ
    # from a count of the outputs alone.
    vocab = 600
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen)
    logits[:, 7] = 8.0
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.5)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      output_token_ids=[[7]])
    d = torch.tensor([7, 7, 7, 7])
    logits = logits.to(DEVICE)
    out, _ = _triton_verify(logits, d.to(DEVICE), [4], batch, torch.zeros(1, dtype=torch.int64,
                                                                         device=DEVICE))
    ref, _ = _torch_verify(logits, d.to(DEVICE), [4], batch,
                           torch.zeros(1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    # z_j(7) = x_j(7) - 1.5 (1 + j): greedy accepts 7 while it stays the row's maximum
    z = logits.cpu().clone()
    z[:, 7] -= 1.5 * (1 + torch.arange(5))
    acc = 0
    while acc < 4 and int(z[acc].argmax()) == 7:
        acc += 1
    assert int(out.num_accepted[0]) == acc and 0 < acc < 4, (acc, out.token_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sample_matches_torch_backend(dtype):
    vocab = 3000
    logits, _, _, batch, pos = _case(5, 8, vocab, dtype, CASES[3][1], k_max=0)
    paths.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMPLE_BACKEND", "triton")
        out = specsample.sample(logits, batch, positions=pos, strict=False)
    assert "triton.sample.fused" in paths.counts()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMPLE_BACKEND", "torch")
        ref = specsample.sample(logits, batch, positions=pos, strict=False)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())


def test_overflow_and_bad_rows_match_torch_backend():
    # A bias that pushes a finite float32 logit to +inf: ERR_PROCESSED_OVERFLOW; a NaN raw
    # logit stays ERR_LOGITS_NAN; a row that the repetition penalty leaves all -inf is fine
    # while it had a finite value.
    vocab = 300
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, vocab, generator=gen)
    logits[0, 9] = 3e38
    logits[1, 3] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=1, logit_bias={9: 3e38}),
              SamplingParams(temperature=1.0, seed=2, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, presence_penalty=0.5),
              SamplingParams(temperature=0.8, seed=4, logit_bias={4: 1.0})]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      output_token_ids=[[], [3], [5], []])
    logits = logits.to(DEVICE)
    d = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    pos = torch.arange(4, device=DEVICE)
    out, counts = _triton_verify(logits, d, [0] * 4, batch, pos)
    assert "triton.verify.fused" in counts
    ref, ref_err = _torch_verify(logits, d, [0] * 4, batch, pos)
    assert ref_err.tolist() == [torch_backend.ERR_PROCESSED_OVERFLOW,
                                torch_backend.ERR_LOGITS_NAN, 0, 0]
    assert out.invalid.tolist() == [True, True, False, False]
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    with pytest.MonkeyPatch.context() as mp, pytest.raises(specsample.SamplingError) as info:
        mp.setenv("SPECSAMPLE_BACKEND", "triton")
        specsample.verify(logits, d, [0] * 4, batch, positions=pos, strict=True)
    text = str(info.value)
    assert "request 0" in text and "pushed a logit" in text.split("request 1")[0]
    assert "NaN" in text.split("request 1")[1]


def test_long_history_and_persistent_batch():
    # Tens of thousands of output tokens per request, then append() of the emitted tokens:
    # the next call's penalties see them, with no rebuild of the batch.
    vocab = 1500
    gen = torch.Generator().manual_seed(2)
    outputs = [[int(t) for t in torch.randint(0, vocab, (30_000,), generator=gen)]
               for _ in range(3)]
    params = [SamplingParams(temperature=0.9, seed=7 + i, frequency_penalty=0.01,
                             presence_penalty=0.2, repetition_penalty=1.1) for i in range(3)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      output_token_ids=outputs)
    for step in range(3):
        logits = (torch.randn(3, vocab, generator=gen) * 2).to(DEVICE)
        pos = torch.full((3,), step, dtype=torch.int64, device=DEVICE)
        out, ref = _sample_both(logits, batch, pos)
        assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
        batch.append(out)
    assert int(batch.output_counts.sum()) == 3 * 30_003


DIST_KINDS = [(kind, method) for kind in ("draft_logits", "draft_probs")
              for method in ("token", "block")]


def _with_draft_dist(logits, ks, kind: str, seed: int) -> dict:
    """A draft distribution for the case's draft rows: the target rows of the drafted
    positions, raw, plus noise (a drafter that knows no penalties, so the processed target
    often rejects its drafts and the residual decides)."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0] + ks[:-1]).cumsum(0) + torch.arange(len(ks))
    rows = torch.cat([torch.arange(int(s), int(s) + k) for s, k in zip(starts, ks)])
    dl = logits.float().cpu()[rows] + torch.randn(len(rows), logits.shape[1], generator=gen)
    dist = dl if kind == "draft_logits" else torch.softmax(dl, -1)
    return {kind: dist.to(DEVICE)}


def _dist_outputs(logits, d, ks, batch, pos, method, extra):
    """Triton verify() with a draft distribution (checked fused, processing in the kernels),
    and the torch backend's: (out, ref)."""
    out, counts = _triton_verify(logits, d, ks, batch, pos, method=method, **extra)
    assert "triton.processing.fused" in counts
    assert not any(p.endswith(".general") for p in counts), counts
    ref, ref_err = _torch_verify(logits, d, ks, batch, pos, method, **extra)
    assert not ref_err.any()
    return out, ref


# every draft kind and method with every processor; bias alone, repetition alone and
# frequency + presence alone with one kind each
DIST_CASES = ([(3, k, m) for k, m in DIST_KINDS]
              + [(2, "draft_logits", "token"), (0, "draft_probs", "block"),
                 (1, "draft_logits", "block")])


@pytest.mark.parametrize("case,kind,method", DIST_CASES,
                         ids=[f"{CASES[c][0]}-{k}-{m}" for c, k, m in DIST_CASES])
def test_draft_distributions_match_torch_backend(case, kind, method):
    # Draft logits / probabilities with logit_bias and penalties: the statistics, the
    # finish's p(d_j) and the residual (token and block verification) read processed target
    # values, so the tokens are the torch backend's. Power: the processors change them.
    vocab = 2 * 2048 + 37
    logits, d, ks, batch, pos = _case(3, 6, vocab, torch.bfloat16, CASES[case][1])
    extra = _with_draft_dist(logits, ks, kind, 1)
    out, ref = _dist_outputs(logits, d, ks, batch, pos, method, extra)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu()), (out.token_ids, ref.token_ids)
    assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())
    plain, _ = _triton_verify(logits, d, ks, _plain(batch), pos, method=method, **extra)
    assert not torch.equal(plain.token_ids.cpu(), out.token_ids.cpu())


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces kernel functions (Triton's interpreter)")
@pytest.mark.parametrize("wrong", ["finish", "residual"])
def test_draft_distributions_fail_on_raw_target_values(wrong, monkeypatch):
    # Power of the test above for the kernels after the statistics: with the finish's
    # p(d_j), or the residual's weights, read from raw target values, some case of it gives
    # other tokens than the torch backend.
    from specsample.triton_backend import kernels

    if wrong == "finish":
        monkeypatch.setattr(kernels, "process_at", _raw_at)
    else:
        monkeypatch.setattr(kernels, "_residual_weights", _raw_weights)
    vocab = 2 * 2048 + 37
    differ = 0
    for kind, method in (DIST_KINDS[0], DIST_KINDS[3]):
        logits, d, ks, batch, pos = _case(3, 6, vocab, torch.bfloat16, CASES[3][1])
        out, ref = _dist_outputs(logits, d, ks, batch, pos, method,
                                 _with_draft_dist(logits, ks, kind, 1))
        differ += not torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    assert differ


@triton.jit
def _raw_at(x, tok, req, j, live, pen, PENALTIES: tl.constexpr):
    return x


@triton.jit
def _raw_weights(x_ptr, stride, V, xr, m, logz, t, d_ptr, dstride, DV, dr, dm, dlogz, dt, rho,
                 offs, lo, cut_v, cut_i, req, j, pen, DRAFT_PROBS: tl.constexpr,
                 PEN: tl.constexpr):
    return _RESIDUAL_WEIGHTS(x_ptr, stride, V, xr, m, logz, t, d_ptr, dstride, DV, dr, dm, dlogz,
                             dt, rho, offs, lo, cut_v, cut_i, req, j, pen, DRAFT_PROBS, 0)


_RESIDUAL_WEIGHTS = triton_backend.kernels._residual_weights


# (name, processors, filters) of requests that combine them: the filter kernels cut the
# processed rows. (Qwen2.5's generation defaults, repetition 1.05 with top_k 20 and top_p 0.8,
# are a bench case; here the penalties are strong enough to change these rows' tokens.)
FILTER_CASES = [
    ("repetition+top_k+top_p", dict(repetition_penalty=1.9), dict(top_k=20, top_p=0.8)),
    ("frequency+top_p", dict(frequency_penalty=1.7, presence_penalty=0.9), dict(top_p=0.7)),
    ("bias+min_p+top_k", dict(logit_bias={0: 4.0, 5: -30.0, 2047: 4.5, 2048: 3.5}),
     dict(min_p=0.05, top_k=3)),
    ("repetition+top_k", dict(repetition_penalty=2.5, presence_penalty=0.8), dict(top_k=2)),
    # penalties that raise values
    ("boost+top_k", dict(frequency_penalty=-0.2, presence_penalty=-2.0), dict(top_k=3)),
]


# every case on bf16 rows; float32 rows (keyed as they are) for two of them
FILTER_DTYPES = [(c, torch.bfloat16) for c in FILTER_CASES] + [
    (FILTER_CASES[i], torch.float32) for i in (0, 2)]


@pytest.mark.parametrize("case,dtype", FILTER_DTYPES,
                         ids=[f"{c[0]}-{str(d)[6:]}" for c, d in FILTER_DTYPES])
def test_filters_on_processed_rows_match_torch_backend(case, dtype):
    _, proc, filt = case
    vocab = 2 * 2048 + 37
    logits, d, ks, batch, pos = _case(3, 6, vocab, dtype, proc | filt)
    out = _verify_as_torch(logits, d, ks, batch, pos, "triton.verify.filtered")
    if dtype != torch.bfloat16:
        return  # (the power check below runs once per case, on its bf16 rows)
    # power: the processors alone, and the filters alone, give other tokens (the same
    # logits, drafts and seeds: _case draws them whatever the parameters)
    for part in (proc, filt):
        _, _, _, other_batch, _ = _case(3, 6, vocab, dtype, part)
        other, _ = _triton_verify(logits, d, ks, other_batch, pos)
        assert not torch.equal(other.token_ids.cpu(), out.token_ids.cpu()), part


def test_filters_on_processed_rows_overflow_and_sample():
    # Flat rows with top_p 0.95: the nucleus overflows the candidate buffer, so the serial
    # search reads the processed rows (counted); sample() takes the same kernels.
    vocab = 3000
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(5, vocab, generator=gen) * 0.3).to(torch.bfloat16).to(DEVICE)
    outputs = [[int(t) for t in torch.randint(0, vocab, (400,), generator=gen)]
               for _ in range(5)]
    params = [SamplingParams(temperature=1.0, seed=20 + i, top_p=0.95, frequency_penalty=0.4,
                             logit_bias={7 * i: 2.0}) for i in range(5)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      output_token_ids=outputs)
    pos = torch.arange(5, device=DEVICE)
    before = triton_backend.filter_serial_rows(DEVICE)
    paths.reset()
    out, ref = _sample_both(logits, batch, pos)
    counts = paths.counts()
    assert "triton.sample.filtered" in counts and "triton.processing.fused" in counts
    assert triton_backend.filter_serial_rows(DEVICE) - before == 5
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())


@pytest.mark.parametrize("proc,top_k,want", [
    (dict(presence_penalty=-2.0, frequency_penalty=-0.2), 2, {300, 5}),  # (raise D to 11)
    # (a bias raises D to 11, the repetition penalty lowers it to 10.48: the cut is D's, and
    # must be its processed value)
    (dict(logit_bias={300: 3.0}, repetition_penalty=1.05), 1, {300}),
    (dict(repetition_penalty=1.3, presence_penalty=0.5), 2, {5, 2048 + 7})])  # (lower D)
def test_candidates_raised_by_processing(proc, top_k, want):
    # Three tiles with maxima A = 10 (tile 0), B = 9, C = 8.5; token D = 8 in tile 0, seen 5
    # times. top_k's candidate bound is the k-th largest (processed) tile maximum, which raw
    # D misses: the gather must process D (and every token it reads) as the statistics pass
    # did, or the top 2 would be {A, B} instead of {D, A}, and top_k = 1's cut D's raw value.
    vocab = 2 * 2048 + 37
    n = 8
    row = torch.full((vocab,), -4.0)
    row[5], row[2048 + 7], row[4096 + 3], row[300] = 10.0, 9.0, 8.5, 8.0
    logits = row.repeat(n, 1).to(DEVICE)
    params = [SamplingParams(temperature=1.0, seed=40 + i, top_k=top_k, **proc)
              for i in range(n)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      output_token_ids=[[300] * 5] * n)
    pos = torch.arange(n, device=DEVICE)
    out, ref = _sample_both(logits, batch, pos)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    got = set(out.token_ids.view(-1).tolist())
    assert got == want, got


def test_more_than_32_top_n_logprobs_keep_the_general_path():
    # What the kernels do not serve with bans / bias / penalties: more than 32 top-n
    # logprobs take the counted general path; logprobs = 0 and top-n up to 32, raw or
    # processed, run in the kernels.
    vocab = 300
    logits, d, ks, batch, pos = _case(4, 4, vocab, torch.bfloat16, CASES[0][1])
    for extra, general in ((dict(logprobs=0), False), (dict(top_k=5, logprobs=0), False),
                           (dict(logprobs=3, logprobs_mode="processed"), False),
                           (dict(logprobs=33, logprobs_mode="processed"), True),
                           (dict(min_tokens=3, stop_token_ids=(4,), logprobs=2), False),
                           (dict(min_tokens=3, stop_token_ids=(4,), logprobs=40), True)):
        params = [dataclasses.replace(p, **extra) for p in batch.params]
        b = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      output_token_ids=[[1, 2]] * 4)
        _, counts = _triton_verify(logits, d, ks, b, pos)
        assert ("triton.verify.general" in counts) == general, extra
        assert ("triton.processing.fused" in counts) != general, extra


# Bans of each request's own likely tokens (``_case`` raises its outputs' first six and its
# prompt's first three tokens): every case changes the tokens (checked below).
BAN_CASES = [
    # the two likeliest tokens not allowed
    ("allowed", lambda o, p: dict(allowed_token_ids=o[2:6] + p[:3] + [0, 1, 2, 3])),
    # one-token words, a word completed by the last output (row 0), words completed by
    # drafts (rows after a draft o[2] or o[3])
    ("bad_words", lambda o, p: dict(bad_words_token_ids=[[o[0]], [o[-1], o[1]]] + [
        [h, h2] for h in o[2:4] for h2 in o[2:5]])),
    # (40 outputs so far: rows 0 and 1 ban the stop tokens, rows 2.. do not)
    ("min_tokens", lambda o, p: dict(min_tokens=42, stop_token_ids=o[:4])),
    ("all", lambda o, p: dict(allowed_token_ids=o[1:6] + p[:3] + [3, 2100] + list(range(
        200, 260)), bad_words_token_ids=[[o[1]], [o[2], o[3]]], min_tokens=41,
        stop_token_ids=[o[4], p[0]], top_k=5, top_p=0.9) | CASES[3][1]),
    # (the draft-distribution tests: bans alone, on the tokens drafted most)
    ("words+stops", lambda o, p: dict(bad_words_token_ids=[[o[0]], [o[2], o[1]]],
                                      min_tokens=42, stop_token_ids=o[1:4])),
]


def _bans_case(name: str, vocab: int = 2 * 2048 + 37, **kw):
    bans = dict(BAN_CASES)[name]
    return _case(3, 6, vocab, torch.bfloat16, {}, bans=bans, **kw)


@pytest.mark.parametrize("name", [c[0] for c in BAN_CASES[:4]])
def test_bans_match_torch_backend(name):
    # Bans in the kernels (with bias, penalties and filters in "all"): the torch backend's
    # tokens. Power: without the bans the tokens differ.
    logits, d, ks, batch, pos = _bans_case(name)
    path = "triton.verify.filtered" if name == "all" else "triton.verify.fused"
    out = _verify_as_torch(logits, d, ks, batch, pos, path)
    plain, _ = _triton_verify(logits, d, ks, _plain(batch), pos)
    assert not torch.equal(plain.token_ids.cpu(), out.token_ids.cpu())


@pytest.mark.parametrize("name,kind,method", [("words+stops", *DIST_KINDS[0]),
                                              ("words+stops", *DIST_KINDS[3]),
                                              ("all", *DIST_KINDS[1])])
def test_bans_with_draft_distributions_match_torch_backend(name, kind, method):
    # The finish's p(d_j) is 0 at a banned draft, and the residual excludes banned tokens.
    logits, d, ks, batch, pos = _bans_case(name)
    extra = _with_draft_dist(logits, ks, kind, 1)
    out, ref = _dist_outputs(logits, d, ks, batch, pos, method, extra)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu()), (out.token_ids, ref.token_ids)
    assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces kernel functions (Triton's interpreter)")
def test_bans_with_draft_distributions_fail_without_bans_at_the_finish(monkeypatch):
    # Power of the test above for the finish: with p(d_j) taken without the bans, a banned
    # draft can be accepted, and the tokens differ from the torch backend's.
    from specsample.triton_backend import kernels

    monkeypatch.setattr(kernels, "process_at", _at_without_bans)
    logits, d, ks, batch, pos = _bans_case("words+stops")
    out, ref = _dist_outputs(logits, d, ks, batch, pos, "token",
                             _with_draft_dist(logits, ks, "draft_logits", 1))
    assert not torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())


_PROCESS_AT = triton_backend.penalties.process_at


@triton.jit
def _at_without_bans(x, tok, req, j, live, pen, PENALTIES: tl.constexpr):
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV) = pen
    return _PROCESS_AT(x, tok, req, j, live, (
        rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
        draft_ids_ptr, draft_start_ptr, ban_ptr, 0, KP, aslot_ptr, amask_ptr, 0), PENALTIES)


def test_bans_sample_matches_torch_backend():
    logits, _, _, batch, pos = _bans_case("all", vocab=3000, k_max=0)
    out, ref = _sample_both(logits, batch, pos)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    plain, _ = _sample_both(logits, _plain(batch), pos)
    assert not torch.equal(plain.token_ids.cpu(), out.token_ids.cpu())


def test_ban_table_lists_the_ban_pairs_sorted():
    # The kernels' ban table holds, for every live row, exactly the tokens that the PyTorch
    # processing's (row, token) pairs ban there, sorted, then NO_ENTRY: more entries than one
    # step of the kernel (16 columns), words of 1-4 tokens matching the outputs and the drafts,
    # min_tokens running out within a request's rows, placeholders, requests without bans.
    from specsample import processing
    from specsample.triton_backend import penalties

    gen = torch.Generator().manual_seed(7)
    vocab, ks = 50, [6, 0, 3, 5, 2]
    outputs = [[int(t) for t in torch.randint(0, 6, (12,), generator=gen)] for _ in ks]
    d = torch.randint(0, 6, (sum(ks),), generator=gen)
    d[11] = -1  # (request 3's third draft: a placeholder; its rows 3.. are dead)
    params = []
    for i in range(len(ks)):
        words = [[int(t) for t in torch.randint(0, 6, (1 + w % 4,), generator=gen)]
                 for w in range(22)]
        params.append(SamplingParams(temperature=1.0, seed=i) if i == 1 else SamplingParams(
            temperature=1.0, seed=i, bad_words_token_ids=words, min_tokens=14 + i % 2,
            stop_token_ids=[40 + i, 45]))
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      output_token_ids=outputs)
    logits = torch.zeros(len(ks) + sum(ks), vocab, device=DEVICE)
    plan = build_plan(logits, batch, draft_token_ids=d.to(DEVICE), num_draft_tokens=ks,
                      draft_logits=None, draft_probs=None, positions=torch.arange(len(ks)),
                      method="token")
    table = triton_backend._ban_table(plan, plan.draft_token_ids).cpu()
    assert table.shape == (len(ks) * 7, batch.ban_width) and batch.ban_width > 16
    rows, toks = processing.ban_pairs(plan)
    want = {}
    for r, t in zip(rows.tolist(), toks.tolist()):
        want.setdefault(r, []).append(t)
    starts, live = plan.row_start.tolist(), plan.k_eff.tolist()
    for i in range(len(ks)):
        for j in range(live[i] + 1):  # (dead rows: anything, nobody reads them)
            got = table[i * 7 + j]
            assert torch.equal(got, got.sort().values)
            banned = got[got != penalties.NO_ENTRY.value].tolist()
            assert banned == sorted(want.get(starts[i] + j, [])), (i, j)
    assert len(want) > 10


@pytest.mark.parametrize("filt", [{}, dict(top_k=3)], ids=["fused", "filtered"])
def test_bans_that_leave_no_token_and_bad_rows_match_torch_backend(filt):
    # Bans that leave no finite logit: ERR_BANS (allowed tokens at -inf; a bad word on the
    # only finite token at row 0 and a stop token at row 1, both banned there); a NaN at a
    # token the allowed list bans stays ERR_LOGITS_NAN; a bias overflow at an allowed token
    # stays ERR_PROCESSED_OVERFLOW; a row with one allowed finite token is fine. With a
    # filter the finish launches apart from the draw: the same bits.
    vocab = 300
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, vocab, generator=gen)
    logits[0, 7] = float("-inf")
    logits[1, :] = float("-inf")
    logits[1, 5] = 1.0
    logits[2, 9] = float("nan")
    logits[3, 4] = 3e38
    logits[4:, :] = float("-inf")
    logits[4:, 6] = 2.0
    params = [SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[7], **filt),
              SamplingParams(temperature=0.0, bad_words_token_ids=[[5]]),
              SamplingParams(temperature=0.8, seed=3, allowed_token_ids=[1, 2], **filt),
              SamplingParams(temperature=1.0, seed=4, allowed_token_ids=[4, 8],
                             logit_bias={4: 3e38}, **filt),
              SamplingParams(temperature=1.0, seed=5, allowed_token_ids=[6, 8], min_tokens=1,
                             stop_token_ids=[9], **filt)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    logits = logits.to(DEVICE)
    d = torch.tensor([6], device=DEVICE)  # (request 4's draft, accepted: token 6)
    pos = torch.arange(5, device=DEVICE)
    ks = [0, 0, 0, 0, 1]
    out, counts = _triton_verify(logits, d, ks, batch, pos)
    path = "triton.verify.filtered" if filt else "triton.verify.fused"
    assert path in counts and "triton.processing.fused" in counts
    ref, ref_err = _torch_verify(logits, d, ks, batch, pos)
    assert ref_err.tolist() == [torch_backend.ERR_BANS, torch_backend.ERR_BANS,
                                torch_backend.ERR_LOGITS_NAN,
                                torch_backend.ERR_PROCESSED_OVERFLOW, 0]
    assert out.invalid.tolist() == [True, True, True, True, False]
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    assert out.token_ids[4].tolist() == [6, 6]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMPLE_BACKEND", "triton")
        with pytest.raises(specsample.SamplingError) as info:
            specsample.verify(logits, d, ks, batch, positions=pos, strict=True)
    text = str(info.value)
    assert info.value.requests == [0, 1, 2, 3]
    for reason in (torch_backend.ERR_BANS, torch_backend.ERR_LOGITS_NAN,
                   torch_backend.ERR_PROCESSED_OVERFLOW):
        assert torch_backend.ERROR_NAMES[reason] in text, text


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 262144])
@pytest.mark.parametrize("filt", [{}, dict(top_k=20, top_p=0.8), dict(top_p=0.9, min_p=0.02)],
                         ids=["no-filter", "top_k+top_p", "top_p+min_p"])
def test_gpu_equivalence_no_host_sync_and_capture(vocab, filt):
    # Real vocabularies: the same tokens as the torch backend; no host synchronisation; a
    # captured call replays with new logits and drafts and sees the outputs append() adds to
    # the batch's device state between replays. With filters, the filter kernels cut the
    # processed rows.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, _, _, batch, pos = _case(11, 16, vocab, torch.bfloat16, CASES[3][1] | filt,
                                history=2048)
    counts = _gpu_equivalence_and_capture(batch, pos, vocab, seed=12, replays=3)
    assert ("triton.verify.filtered" in counts) == bool(filt)


def _gpu_equivalence_and_capture(batch, pos, vocab: int, *, seed: int, replays: int) -> dict:
    """GPU: verify() of ``batch`` (K = 4 drafts each: the graph's shape) on random bf16 rows
    whose drafts are the rows' argmax gives the torch backend's tokens on the fused path
    with the processing in the kernels and no host synchronisation; a captured call replays
    ``replays`` times with new rows and drafts, the same tokens as the torch backend, and
    sees the outputs that ``batch.append()`` adds between replays. The first call's path
    counts."""
    from specsample.bench import capture_graph

    n = batch.num_requests
    ks = [4] * n
    gen = torch.Generator().manual_seed(seed)

    def inputs():
        rows = (torch.randn(n * 5, vocab, generator=gen) * 2).to(torch.bfloat16).to("cuda")
        drafts = rows.float().argmax(-1).view(n, 5)[:, :4].reshape(-1).contiguous()
        return rows, drafts

    rows, drafts = inputs()
    out, counts = _triton_verify(rows, drafts, ks, batch, pos)
    assert "triton.processing.fused" in counts
    ref, _ = _torch_verify(rows, drafts, ks, batch, pos)
    assert torch.equal(out.token_ids, ref.token_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        specsample.verify(rows, drafts, ks, batch, positions=pos, strict=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = {"x": rows.clone(), "d": drafts.clone(), "pos": pos.clone()}
    graph, graph_out = capture_graph(lambda: specsample.verify(
        static["x"], static["d"], ks, batch, positions=static["pos"], strict=False))
    for step in range(replays):
        rows, drafts = inputs()
        static["x"].copy_(rows)
        static["d"].copy_(drafts)
        static["pos"].add_(5)
        graph.replay()
        ref, _ = _torch_verify(rows, drafts, ks, batch, static["pos"].clone())
        torch.cuda.synchronize()
        assert torch.equal(graph_out.token_ids, ref.token_ids), step
        assert not graph_out.invalid.any()
        batch.append(graph_out)  # (the next replay's bans and penalties see these tokens)
    return counts



@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
def test_gpu_draft_distribution_equivalence_and_capture(kind):
    # Bias, penalties and filters with a draft distribution at V = 151,936: the torch
    # backend's tokens, no host synchronisation, and a captured call that replays with new
    # rows, drafts and draft distributions and sees the outputs append() adds between
    # replays.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specsample.bench import capture_graph

    vocab, n = 151936, 8
    _, _, _, batch, pos = _case(13, n, vocab, torch.bfloat16,
                                CASES[3][1] | dict(top_k=20, top_p=0.8), history=512)
    ks = [4] * n
    gen = torch.Generator().manual_seed(14)

    def inputs():
        rows = (torch.randn(n * 5, vocab, generator=gen) * 2).to(torch.bfloat16).to("cuda")
        drafts = rows.float().argmax(-1).view(n, 5)[:, :4].reshape(-1).contiguous()
        return rows, drafts, _with_draft_dist(rows, ks, kind, int(torch.randint(
            0, 1000, (), generator=gen)))

    rows, drafts, extra = inputs()
    out, ref = _dist_outputs(rows, drafts, ks, batch, pos, "token", extra)
    assert torch.equal(out.token_ids, ref.token_ids)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        specsample.verify(rows, drafts, ks, batch, positions=pos, strict=False, **extra)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = {"x": rows.clone(), "d": drafts.clone(), "q": extra[kind].clone(),
              "pos": pos.clone()}
    graph, graph_out = capture_graph(lambda: specsample.verify(
        static["x"], static["d"], ks, batch, positions=static["pos"], strict=False,
        **{kind: static["q"]}))
    for step in range(2):
        rows, drafts, extra = inputs()
        static["x"].copy_(rows)
        static["d"].copy_(drafts)
        static["q"].copy_(extra[kind])
        static["pos"].add_(5)
        graph.replay()
        ref, _ = _torch_verify(rows, drafts, ks, batch, static["pos"].clone(), **extra)
        torch.cuda.synchronize()
        assert torch.equal(graph_out.token_ids, ref.token_ids), step
        batch.append(graph_out)  # (the next replay's penalties count these tokens)


@pytest.mark.gpu
def test_gpu_bans_equivalence_no_host_sync_and_capture():
    # Bans with bias, penalties and filters at V = 151,936: the torch backend's tokens, no
    # host synchronisation, and a captured call whose replays see the output count (min_tokens
    # runs out after the first replays) and context tail (bad words) that append() updates.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vocab, n = 151936, 16

    def bans(o, p):
        return dict(allowed_token_ids=o[:1000] + list(range(5000, 9000)),
                    bad_words_token_ids=[[o[1]], [o[2], o[3]], [o[5], o[6], o[7]]],
                    min_tokens=2048 + 6, stop_token_ids=o[8:12], top_k=50, top_p=0.95)

    _, _, _, batch, pos = _case(15, n, vocab, torch.bfloat16, CASES[3][1], history=2048,
                                bans=bans)
    counts = _gpu_equivalence_and_capture(batch, pos, vocab, seed=16, replays=4)
    assert "triton.verify.filtered" in counts
