"""API.md guarantees 2-5 on the CPU (torch) backend.

2 no silent greedy, 3 batch invariance, 4 speculation invariance for one-hot drafts,
5 bad input gets a clear error and nothing else breaks.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams, paths, reference, rng

V = 16


def _logits(rows: int, v: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, v, generator=g) * scale


def _batch(params, v: int = V, **kw) -> SamplingBatch:
    return SamplingBatch.from_params(params, vocab_size=v, **kw)


# ------------------------------------------------------------------- 2. no silent greedy


@pytest.mark.parametrize("kind", ["onehot", "logits", "probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_no_silent_greedy(kind, method):
    n, k = 3000, 2
    row = torch.tensor([2.0, 1.5, 1.0, 0.0] + [-1.0] * (V - 4))
    params = SamplingParams(temperature=0.9)
    p = reference.processed_probs(row, params)
    logits = row.repeat(n * (k + 1), 1)
    argmax = int(row.argmax())
    # one-hot: the argmax as draft (a greedy drafter); draft distributions: drafts sampled
    # from q (uniform), as exactness requires
    drafts = torch.full((n * k,), argmax, dtype=torch.int64)
    if kind != "onehot":
        drafts = torch.randint(0, V, (n * k,), generator=torch.Generator().manual_seed(1))
    kw = {}
    if kind == "logits":
        kw["draft_logits"] = torch.zeros(n * k, V)
    elif kind == "probs":
        kw["draft_probs"] = torch.full((n * k, V), 1.0 / V)
    batch = _batch([dataclasses.replace(params, seed=s) for s in range(n)])
    paths.reset()
    out = specsample.verify(logits, drafts, [k] * n, batch,
                            positions=torch.zeros(n, dtype=torch.int64), method=method, **kw)
    counts = paths.counts()
    assert counts["requests.sampled"]["rows"] == n and "requests.greedy" not in counts
    # the first emitted token is exactly p-distributed: its non-argmax frequency is 1 - p_max
    first = out.token_ids[:, 0]
    frac = float((first != argmax).float().mean())
    expected = 1 - p[argmax]
    assert abs(frac - expected) < 5 * math.sqrt(expected * (1 - expected) / n)
    assert frac > 0.2


def test_sample_no_silent_greedy_and_path_counts():
    n = 4000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5])
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(n)]
    paths.reset()
    out = specsample.sample(row.repeat(n, 1), _batch(params, 4),
                            positions=torch.full((n,), 5, dtype=torch.int64))
    p = torch.softmax(row.double(), -1)
    freq = torch.bincount(out.token_ids, minlength=4).double() / n
    assert torch.all((freq - p).abs() < 5 * torch.sqrt(p * (1 - p) / n))
    assert paths.counts()["requests.sampled"] == {"calls": 1, "rows": n}


# ------------------------------------------------------------ 3. batch invariance


def _case(n: int, seed: int):
    g = np.random.default_rng(seed)
    ks = [int(x) for x in g.integers(0, 4, size=n)]
    params = [SamplingParams(temperature=float(g.choice([0.0, 0.7, 1.2])), top_k=int(
        g.choice([0, 5])), top_p=float(g.choice([1.0, 0.9])), seed=int(g.integers(0, 2**63)),
        frequency_penalty=float(g.choice([0.0, 0.5])), logprobs=int(g.choice([0, 2])))
        for _ in range(n)]
    rows = [_logits(k + 1, seed=seed * 100 + i) for i, k in enumerate(ks)]
    drafts = [torch.tensor([int(r[j].argmax()) if g.random() < 0.6 else int(g.integers(0, V))
                            for j in range(k)], dtype=torch.int64) for r, k in zip(rows, ks)]
    qrows = [_logits(k, seed=seed * 100 + 50 + i) for i, k in enumerate(ks)]
    outs = [list(g.integers(0, V, size=3)) for _ in range(n)]
    pos = [int(g.integers(0, 10**6)) for _ in range(n)]
    return params, ks, rows, drafts, qrows, outs, pos


def _run(items, kind: str, method: str):
    params, ks, rows, drafts, qrows, outs, pos = (list(x) for x in zip(*items))
    kw = {}
    if kind == "logits":
        kw["draft_logits"] = torch.cat(qrows)
    elif kind == "probs":
        kw["draft_probs"] = torch.softmax(torch.cat(qrows), -1)
    out = specsample.verify(torch.cat(rows), torch.cat(drafts), ks,
                            _batch(params, output_token_ids=outs), positions=torch.tensor(pos),
                            method=method, **kw)
    # logprob columns beyond the request's own n depend on the batch's max n: compare 1 + n
    return [(out.token_ids[i, : ks[i] + 1].tolist(),
             out.logprobs[i, : ks[i] + 1, : 1 + params[i].logprobs].tolist())
            for i in range(len(ks))]


@pytest.mark.parametrize("kind", ["onehot", "logits", "probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_batch_invariance(kind, method):
    items = list(zip(*_case(12, seed=3)))
    full = _run(items, kind, method)
    alone = [_run([it], kind, method)[0] for it in items]
    assert full == alone
    perm = np.random.default_rng(0).permutation(len(items))
    permuted = _run([items[i] for i in perm], kind, method)
    assert [permuted[list(perm).index(i)] for i in range(len(items))] == full
    chunks = _run(items[:5], kind, method) + _run(items[5:9], kind, method) + _run(
        items[9:], kind, method)
    assert chunks == full
    other = list(zip(*_case(7, seed=99)))  # other requests around it, different batch size
    mixed = _run(other[:3] + items[:4] + other[3:], kind, method)
    assert mixed[3:7] == full[:4]


def test_sample_batch_invariance():
    params = [SamplingParams(temperature=t, seed=s, top_p=0.9)
              for t, s in zip([0.5, 1.0, 0.0, 2.0], [1, 2, 3, 2**64 - 1])]
    logits = _logits(4, v=3000)
    pos = torch.tensor([0, 7, 2**40, 5])
    full = specsample.sample(logits, _batch(params, 3000), positions=pos).token_ids
    for i in range(4):
        one = specsample.sample(logits[i:i + 1], _batch(params[i:i + 1], 3000),
                                positions=pos[i:i + 1]).token_ids
        assert int(one[0]) == int(full[i])
    rev = specsample.sample(logits.flip(0), _batch(params[::-1], 3000),
                            positions=pos.flip(0)).token_ids
    assert rev.flip(0).tolist() == full.tolist()


# ---------------------------------------------------------- 4. speculation invariance


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("seed", range(6))
def test_speculation_invariance_onehot(method, seed):
    g = np.random.default_rng(seed)
    k = 5
    params = SamplingParams(temperature=float(g.choice([0.6, 1.0, 1.5])), top_k=int(
        g.choice([0, 4])), min_p=float(g.choice([0.0, 0.05])), seed=int(g.integers(0, 2**63)),
        presence_penalty=0.5, repetition_penalty=1.2)
    outputs, prompt = [1, 2], [3]
    rows = _logits(k + 1, seed=seed, scale=1.0)
    pos = int(g.integers(0, 2**40))
    # reference tokens: sample() row by row, penalties counting the drafts before the row
    for trial in range(4):
        if trial == 0:
            drafts = []
            for j in range(k):  # the exact samples: everything accepted
                b = _batch([params], output_token_ids=[outputs + drafts],
                           prompt_token_ids=[prompt])
                y = specsample.sample(rows[j:j + 1], b, positions=torch.tensor([pos + j]))
                drafts.append(int(y.token_ids[0]))
        else:
            drafts = [int(x) for x in g.integers(0, V, size=k)]
        b = _batch([params], output_token_ids=[outputs], prompt_token_ids=[prompt])
        out = specsample.verify(rows, torch.tensor(drafts), [k], b, positions=torch.tensor([pos]),
                                method=method)
        a = int(out.num_accepted[0])
        emitted = out.token_ids[0, : a + 1].tolist()
        for j in range(a + 1):
            b = _batch([params], output_token_ids=[outputs + drafts[:j]],
                       prompt_token_ids=[prompt])
            y = int(specsample.sample(rows[j:j + 1], b, positions=torch.tensor([pos + j]))
                    .token_ids[0])
            assert emitted[j] == y
            if j < a:
                assert drafts[j] == y
            elif j < k:
                assert drafts[j] != y
        if trial == 0:
            assert a == k


# ------------------------------------------------------------------ 5. bad input


def test_invalid_rows_strict_and_non_strict():
    params = [SamplingParams(seed=i, temperature=0.0 if i == 1 else 1.0) for i in range(5)]
    logits = _logits(5)
    logits[1, 3] = math.nan
    logits[3] = -math.inf
    logits[4, 0] = math.inf
    pos = torch.arange(5)
    with pytest.raises(SamplingError) as e:
        specsample.sample(logits, _batch(params), positions=pos)
    assert e.value.requests == [1, 3, 4]
    assert "1" in str(e.value) and "3" in str(e.value) and "4" in str(e.value)
    out = specsample.sample(logits, _batch(params), positions=pos, strict=False)
    assert out.invalid.tolist() == [False, True, False, True, True]
    assert out.token_ids[1] == -1 and out.token_ids[3] == -1 and out.token_ids[4] == -1
    alone = specsample.sample(logits[[0, 2]], _batch([params[0], params[2]]),
                              positions=pos[[0, 2]]).token_ids
    assert out.token_ids[[0, 2]].tolist() == alone.tolist()
    assert torch.all((out.token_ids == -1) | ((out.token_ids >= 0) & (out.token_ids < V)))


def test_all_bad_batch_never_emits_out_of_range():
    for fill in (math.nan, -math.inf, math.inf):
        logits = torch.full((6, V), fill)
        out = specsample.verify(logits, [0, V, -5], [2, 1, 0],
                                _batch([SamplingParams(), SamplingParams(temperature=0.0),
                                        SamplingParams()]), strict=False)
        assert out.invalid.all() and (out.token_ids == -1).all()
        assert (out.num_accepted == 0).all()


def test_out_of_range_draft_ids():
    logits = _logits(6)
    params = [SamplingParams(seed=i) for i in range(3)]
    drafts = torch.tensor([V, 0, -2, 3])  # request 0: id V; request 1: id -2
    with pytest.raises(SamplingError) as e:
        specsample.verify(torch.cat([logits, _logits(1)]), drafts, [1, 2, 1], _batch(params),
                          positions=torch.zeros(3, dtype=torch.int64))
    assert e.value.requests == [0, 1]
    out = specsample.verify(torch.cat([logits, _logits(1)]), drafts, [1, 2, 1], _batch(params),
                            positions=torch.zeros(3, dtype=torch.int64), strict=False)
    assert out.invalid.tolist() == [True, True, False]


@pytest.mark.parametrize("kind", ["onehot", "logits", "probs"])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_placeholder_behaves_as_truncation(kind, method, temperature):
    """-1 at draft index j == a request with j drafts; nothing at or after it is read."""
    k, j = 4, 2
    rows = _logits(k + 1, seed=5)
    drafts = [int(rows[0].argmax()), int(rows[1].argmax()), -1, 7]
    garbage = rows.clone()
    garbage[j + 1:] = math.nan  # rows after the bonus row j are not read
    q = torch.softmax(_logits(k, seed=6), -1)
    qg = q.clone()
    qg[j:] = math.nan  # draft rows at and after the placeholder are not read
    params = [SamplingParams(temperature=temperature, seed=11, logprobs=2)]
    kw_full, kw_trunc = {}, {}
    if kind == "logits":
        kw_full["draft_logits"], kw_trunc["draft_logits"] = torch.log(qg), torch.log(q[:j])
    elif kind == "probs":
        kw_full["draft_probs"], kw_trunc["draft_probs"] = qg, q[:j]
    pos = torch.tensor([100])
    a = specsample.verify(garbage, drafts, [k], _batch(params), positions=pos, method=method,
                          **kw_full)
    b = specsample.verify(rows[: j + 1], drafts[:j], [j], _batch(params), positions=pos,
                          method=method, **kw_trunc)
    assert not a.invalid.any()
    assert a.token_ids[0, : j + 1].tolist() == b.token_ids[0].tolist()
    assert (a.token_ids[0, j + 1:] == -1).all()
    assert a.num_accepted.tolist() == b.num_accepted.tolist()
    torch.testing.assert_close(a.logprobs[0, : j + 1], b.logprobs[0])


def test_placeholder_penalties_ignore_the_placeholder():
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0, seed=0)]
    rows = torch.zeros(3, 4)
    rows[:, 0] = 0.1  # argmax 0 unless penalised
    out = specsample.verify(rows, [-1, 0], [2], _batch(params, 4),
                            positions=torch.tensor([0]))
    assert out.token_ids[0].tolist() == [0, -1, -1]


def test_tiny_temperature_float16():
    logits = (_logits(8, v=300) * 3).half()
    params = [SamplingParams(temperature=1e-5, seed=i) for i in range(8)]
    out = specsample.sample(logits, _batch(params, 300), positions=torch.arange(8),
                            strict=True)
    assert out.token_ids.tolist() == logits.float().argmax(-1).tolist()
    k = 2
    rows = (_logits(8 * (k + 1), v=300, seed=3) * 3).half()
    drafts = rows.float().argmax(-1).reshape(8, k + 1)[:, :k].reshape(-1)
    v = specsample.verify(rows, drafts, [k] * 8, _batch(params, 300),
                          draft_logits=_logits(8 * k, v=300).half(), positions=torch.arange(8))
    assert (v.num_accepted == k).all()
    assert v.token_ids[:, k].tolist() == rows.float().argmax(-1).reshape(8, k + 1)[:, k].tolist()


def test_mixed_greedy_sampled_returns_token_ids():
    n = 64
    logits = _logits(n, v=1000, seed=7)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i) for i in range(n)]
    out = specsample.sample(logits, _batch(params, 1000), positions=torch.arange(n))
    greedy = out.token_ids[1::2]
    assert greedy.tolist() == logits[1::2].argmax(-1).tolist()
    assert (greedy != torch.arange(n)[1::2]).any()  # ids, not row positions
    assert ((out.token_ids >= 0) & (out.token_ids < 1000)).all()


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("kind", ["onehot", "probs", "logits"])
def test_zero_probability_draft_never_accepted(method, kind):
    """p(d) = 0 (d cut by top_k) is rejected even when u is the smallest uniform around."""
    row = torch.tensor([3.0, 2.0, 1.0, 0.0])
    d = 3  # dropped by top_k = 2
    # pick the seeds whose acceptance uniforms are the smallest of many
    cand = torch.arange(200_000)
    u = rng.uniform(cand & 0xFFFFFFFF, cand >> 32, torch.zeros_like(cand),
                    torch.zeros_like(cand), rng.STREAM_ACCEPT)
    ub = rng.uniform(cand & 0xFFFFFFFF, cand >> 32, torch.zeros_like(cand),
                     torch.ones_like(cand), rng.STREAM_BLOCK_ACCEPT)
    seeds = torch.cat([u.argsort()[:8], ub.argsort()[:8]]).tolist()
    assert float(u.min()) < 1e-4
    n = len(seeds)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=int(s)) for s in seeds]
    kw = {}
    if kind == "probs":
        kw["draft_probs"] = torch.tensor([[0.0, 0.0, 0.0, 1.0]]).repeat(n, 1)
    elif kind == "logits":
        kw["draft_logits"] = torch.tensor([[-50.0, -50.0, -50.0, 50.0]]).repeat(n, 1)
    out = specsample.verify(row.repeat(2 * n, 1), [d] * n, [1] * n, _batch(params, 4),
                            positions=torch.zeros(n, dtype=torch.int64), method=method, **kw)
    assert (out.num_accepted == 0).all()
    assert ((out.token_ids[:, 0] == 0) | (out.token_ids[:, 0] == 1)).all()


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_of_speculated_tokens(mode):
    k = 3
    rows = _logits(k + 1, seed=12)
    drafts = rows.argmax(-1)[:k]
    params = [SamplingParams(temperature=0.0, logprobs=1, logprobs_mode=mode, seed=0)]
    out = specsample.verify(rows, drafts, [k], _batch(params), positions=torch.tensor([0]))
    assert int(out.num_accepted[0]) == k
    lp = out.logprobs[0, :, 0]
    assert (lp < 0).all() and not (lp == 0).all()
    expected = torch.log_softmax(rows, -1).gather(1, out.token_ids[0][:, None]).squeeze(1)
    torch.testing.assert_close(lp, expected)
    assert out.logprob_token_ids[0, :, 1].tolist() == rows.argmax(-1).tolist()


def test_value_errors():
    b = _batch([SamplingParams(seed=1), SamplingParams(seed=2)])
    x = _logits(3)
    pos = torch.tensor([0, 0])
    bad_calls = [
        (lambda: specsample.sample(x[:2].long(), b, positions=pos), "float"),
        (lambda: specsample.sample(x[0], b, positions=pos), "2-D"),
        (lambda: specsample.sample(_logits(2, v=V + 1), b, positions=pos), "vocab_size"),
        (lambda: specsample.sample(x, b, positions=pos), "rows"),
        (lambda: specsample.sample(x[:2], b), "positions"),
        (lambda: specsample.sample(x[:2], b, positions=torch.tensor([0])), "positions"),
        (lambda: specsample.sample(x[:2], b, positions=torch.tensor([0.0, 1.0])), "positions"),
        (lambda: specsample.verify(x, [1], [1, 0], b, positions=pos, method="tree"), "method"),
        (lambda: specsample.verify(x, [1, 2], [1, 0], b, positions=pos), "draft_token_ids"),
        (lambda: specsample.verify(x, [1], [1, -1], b, positions=pos), "num_draft_tokens"),
        (lambda: specsample.verify(x, [1], [1], b, positions=pos), "num_draft_tokens"),
        (lambda: specsample.verify(x, [1], [1.0, 0], b, positions=pos), "num_draft_tokens"),
        (lambda: specsample.verify(x, [1], [1, 0], b, positions=pos,
                                   draft_logits=_logits(1), draft_probs=_logits(1)), "both"),
        (lambda: specsample.verify(x, [1], [1, 0], b, positions=pos,
                                   draft_logits=_logits(1, v=V + 1)), "columns"),
        (lambda: specsample.verify(x, [1], [1, 0], b, positions=pos,
                                   draft_probs=_logits(2)), "rows"),
        (lambda: specsample.verify(x, [1], [1, 0], b, positions=pos,
                                   draft_probs=_logits(1).double()), "float"),
        (lambda: specsample.verify(x, [1], [1, 0], "batch", positions=pos), "batch"),
    ]
    for call, match in bad_calls:
        with pytest.raises(ValueError, match=match):
            call()
