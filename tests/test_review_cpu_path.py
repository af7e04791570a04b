"""Regression tests from a review of the CPU path (three-level sampling, the processing
speed-ups, the workspace buffers, numpy Philox): 0-d RNG keys (a bug the review found), ties
across tiles, vocabulary sizes around the tile and sub-tile widths, Philox near 2**32 /
2**63, outputs that must not alias the per-thread scratch buffers, concurrent calls.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, processing, reference, rng, torch_backend

# --------------------------------------------------------------------------------------------
# Bugs the review found
# --------------------------------------------------------------------------------------------


def test_rng_uniform_and_gumbel_take_zero_dim_keys():
    """specsample.rng.uniform / gumbel take broadcastable int64 tensors; with every key 0-d
    the numpy path (32a46b5) hands a numpy scalar to torch.from_numpy: TypeError."""
    t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    seed = 1 | 2 << 32
    u = rng.uniform(t(1), t(2), t(3), t(4), rng.STREAM_SAMPLE)
    assert u.shape == () and float(u) == rng.uniform_scalar(seed, 3, 4, rng.STREAM_SAMPLE)
    g = rng.gumbel(t(1), t(2), t(3), t(4), rng.STREAM_SAMPLE)
    assert float(g) == pytest.approx(rng.gumbel_scalar(seed, 3, 4, rng.STREAM_SAMPLE), rel=1e-15)


# --------------------------------------------------------------------------------------------
# Regression tests (pass)
# --------------------------------------------------------------------------------------------


def test_numpy_philox_bit_exact_near_word_limits():
    """The numpy Philox (CPU tensors) against the scalar specification at positions and
    counters near 2**32 and 2**63, seeds near 2**64 and streams with a drafter's index."""
    positions = [0, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 2, 2**63 - 1]
    counters = [0, 1, 2**31, 2**32 - 1, 151935]
    seeds = [0, 2**32 - 1, 2**32, 2**64 - 1, 0xDEADBEEFCAFEBABE]
    streams = [rng.STREAM_SAMPLE, rng.STREAM_SAMPLE_SUB, rng.draft_streams(2**20 - 1)[0],
               rng.sub_stream(rng.draft_streams(7)[1])]
    p = torch.tensor(positions, dtype=torch.int64)[:, None]
    c = torch.tensor(counters, dtype=torch.int64)[None, :]
    for seed in seeds:
        k0, k1 = rng.split_seed(seed)
        for stream in streams:
            u = rng.uniform(torch.tensor([[k0]]), torch.tensor([[k1]]), p, c, stream)
            want = [[rng.uniform_scalar(seed, pp, cc, stream) for cc in counters]
                    for pp in positions]
            assert u.tolist() == want, (seed, stream)


@pytest.mark.parametrize("v", [2049, 4096, 6145])
def test_greedy_ties_across_tiles_take_the_lowest_id(v):
    x = torch.full((4, v), -5.0)
    x[0, 2048] = x[0, v - 1] = 3.0  # tie between tile 1 and the last tile
    x[1, 100] = x[1, min(2100, v - 1)] = 3.0  # tile 0 and tile 1
    x[2] = 1.0  # everything tied
    x[3, 10] = -0.0  # -0.0 in tile 0 ties with +0.0 in tile 1
    x[3, 2048] = 0.0
    params = [SamplingParams(temperature=0.0)] * 4 + [SamplingParams(temperature=1.0, seed=3)]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    rows = torch.cat([x, torch.randn(1, v)])
    out = specsample.sample(rows, batch, positions=[0] * 5)
    assert out.token_ids[:4].tolist() == [2048, 100, 0, 10]
    assert reference.sample(rows, batch, [0] * 5).token_ids[:4].tolist() == [2048, 100, 0, 10]
    # verify: the argmax rows are accepted / emitted the same way
    res = specsample.verify(torch.cat([x[:1], x[:1]]), [2048], [1],
                            SamplingBatch.from_params(params[:1], vocab_size=v), positions=[0])
    assert res.token_ids.tolist() == [[2048, 2048]]


def test_first_argmax_matches_torch_argmax():
    g = torch.Generator().manual_seed(1)
    for v in [1, 5, 2048, 2049, 4097, 10000]:
        z = torch.round(torch.randn(6, v, generator=g) * 2)  # many exact ties
        z[1] = 0.0
        z[2, :] = -math.inf
        z[2, v - 1] = 1.0
        assert torch.equal(torch_backend.first_argmax(z), z.argmax(-1)), v


def _snapshot(out):
    return {k: v.clone() for k, v in vars(out).items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_outputs_do_not_alias_the_workspace(mode):
    v = 3000
    g = torch.Generator().manual_seed(2)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=1, logprobs=3,
                             logprobs_mode=mode),
              SamplingParams(temperature=0.0, seed=2, logprobs=1, logprobs_mode=mode)]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    calls = [
        lambda x: specsample.sample(x[:2], batch, positions=[1, 2]),
        lambda x: specsample.verify(x, [1, 2, 3], [2, 1], batch, positions=[1, 2]),
        lambda x: specsample.verify(x, [1, 2, 3], [2, 1], batch, positions=[1, 2],
                                    draft_logits=x[:3] * 0.5, method="block"),
    ]
    for call in calls:
        first = call(torch.randn(5, v, generator=g))
        snap = _snapshot(first)
        call(torch.randn(5, v, generator=g) * 4)
        for k, t in snap.items():
            assert torch.equal(getattr(first, k), t), k
    p1 = specsample.probs(torch.randn(2, v, generator=g), batch)
    c1 = p1.clone()
    specsample.probs(torch.randn(2, v, generator=g), batch)
    assert torch.equal(p1, c1)


def test_concurrent_verify_equals_serial():
    v = 2500

    def case(s):
        g = torch.Generator().manual_seed(s)
        params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, logprobs=2),
                  SamplingParams(temperature=0.0, seed=s + 1),
                  SamplingParams(temperature=1.2, top_k=20, min_p=0.01, seed=s + 2)]
        batch = SamplingBatch.from_params(params, vocab_size=v)
        x = torch.randn(8, v, generator=g) * 3
        d = torch.randint(0, v, (5,), generator=g)
        kw = dict(positions=[s, s + 1, s + 2], draft_logits=torch.randn(5, v, generator=g),
                  method="block" if s % 2 else "token")
        return (x, d, [2, 0, 3], batch), kw

    cases = [case(s) for s in range(6)]
    serial = [specsample.verify(*a, **k) for a, k in cases]
    got = [[] for _ in cases]

    def worker(first):
        for _ in range(2):
            for i in range(first, len(cases), 2):
                got[i].append(specsample.verify(*cases[i][0], **cases[i][1]))

    threads = [threading.Thread(target=worker, args=(j,)) for j in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s, outs in zip(serial, got):
        assert len(outs) == 2
        for o in outs:
            for f in ("token_ids", "num_accepted", "logprobs", "logprob_token_ids", "invalid"):
                assert torch.equal(getattr(o, f), getattr(s, f)), f


def _naive_top_k(row: np.ndarray, k: int) -> np.ndarray:
    order = [i for i in np.argsort(-row, kind="stable") if row[i] > -np.inf]
    keep = np.zeros(row.shape[0], dtype=bool)
    keep[order[:k]] = True
    return keep


def _naive_nucleus(row: np.ndarray, keep: np.ndarray, m: float, t: float, top_p: float):
    r = np.where(keep, row, -np.inf)
    order = [i for i in np.argsort(-r, kind="stable") if r[i] > -np.inf]
    e = np.exp((r[order] - m) / t)
    out = np.zeros(row.shape[0], dtype=bool)
    before = 0.0
    for n, (i, ei) in enumerate(zip(order, e)):
        if n == 0 or before < top_p * e.sum():
            out[i] = True
        before += ei
    return out


def test_top_k_and_nucleus_against_a_stable_sort_on_tied_rows():
    """_top_k_cut (one top-k of k+1, tie pass) and _nucleus (float32 total estimate, growing
    candidate lists), applied as cuts (apply_cut), against a float64 stable sort, on rows full
    of exact ties (-0.0 / 0.0 included), -inf entries, mixed k_on rows and boundaries beyond
    the first candidates."""
    gen = np.random.default_rng(5)
    for _ in range(300):
        v = int(gen.choice([2, 3, 17, 64, 65, 513, 600, 3000]))
        r = int(gen.integers(1, 5))
        x = np.round(gen.normal(size=(r, v)) * float(gen.choice([0.5, 2.0, 8.0]))) / 4
        x[gen.random(size=x.shape) < 0.05] = -0.0
        if gen.random() < 0.5:
            x[gen.random(size=x.shape) < 0.3] = -np.inf
        x[np.arange(r), gen.integers(0, v, size=r)] = 1.0
        sub = torch.from_numpy(x).float()
        k = torch.from_numpy(gen.integers(1, v + 1, size=r))
        k_on = torch.from_numpy(gen.random(size=r) < 0.7) & (k < v)
        cv = torch.full((r,), -math.inf)
        ci = torch.full((r,), v, dtype=torch.int64)
        if bool(k_on.any()):
            cv, ci = processing._top_k_cut(sub, k, k_on, cv, ci)
        masked = processing.apply_cut(sub, cv, ci)
        keep = torch.isfinite(masked)
        for i in range(r):
            want = _naive_top_k(x[i], int(k[i])) if bool(k_on[i]) else np.isfinite(x[i])
            assert np.array_equal(keep[i].numpy(), want), (x[i], int(k[i]))
        m = sub.amax(-1)
        t64 = torch.from_numpy(gen.choice([0.3, 1.0, 2.0], size=r))
        top_p = torch.from_numpy(gen.choice([0.1, 0.5, 0.77, 0.9, 0.99], size=r))
        nv, ni = processing._tighter(*processing._nucleus(masked, m, t64, top_p), cv, ci)
        nucleus = torch.isfinite(processing.apply_cut(sub, nv, ni))
        for i in range(r):
            kept = keep[i].numpy()
            want = _naive_nucleus(x[i], kept, float(m[i]), float(t64[i]), float(top_p[i]))
            assert np.array_equal(nucleus[i].numpy(), want), (x[i], float(top_p[i]))


@pytest.mark.parametrize("v", [1, 2, 127, 128, 129, 2047, 2049, 4100])
def test_torch_backend_matches_reference_around_tile_widths(v):
    """Vocabulary sizes around SUBTILE and TILE (partial last sub-tile / tile), values tied
    across tile boundaries, -inf entries, every filter and greedy rows in one batch."""
    gen = np.random.default_rng(v)
    n = 6
    x = np.round(gen.normal(size=(n, v)) * 3) / 2
    x[1, gen.random(size=v) < 0.5] = -np.inf
    x[1, v - 1] = 0.0
    if v > 2048:
        x[2, 2047] = x[2, 2048] = x[2, v - 1] = x[2].max() + 1  # ties across tiles
    params = [SamplingParams(temperature=1.0, seed=11),
              SamplingParams(temperature=0.7, top_k=3, seed=12),
              SamplingParams(temperature=1.3, top_k=2, top_p=0.8, seed=13),
              SamplingParams(temperature=0.5, min_p=0.1, top_k=40, top_p=0.9, seed=14),
              SamplingParams(temperature=0.0, seed=15),
              SamplingParams(temperature=2.0, top_p=0.5, seed=16)]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    logits = torch.from_numpy(x).float()
    for pos in (0, 2**32 - 1, 2**62 + 5):
        positions = torch.full((n,), pos, dtype=torch.int64)
        out = specsample.sample(logits, batch, positions=positions)
        ref, traces = reference.sample(logits, batch, positions, return_traces=True)
        for i in range(n):
            if int(out.token_ids[i]) != int(ref.token_ids[i]):
                assert traces[i].fragile, (v, pos, i, out.token_ids[i], ref.token_ids[i])
        # batch invariance: each request alone
        for i in range(n):
            alone = specsample.sample(logits[i:i + 1], SamplingBatch.from_params(
                [params[i]], vocab_size=v), positions=positions[i:i + 1])
            assert int(alone.token_ids[0]) == int(out.token_ids[i])
