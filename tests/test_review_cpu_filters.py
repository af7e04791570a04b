"""Regression tests from a review of the CPU filters as per-row cuts (3003191, 2942b42), the
all-greedy argmax shortcut (1af7748) and the restructured numpy Philox (92dc3cb).

The kept sets of ``processing.process_rows`` are checked against a direct transcription of
docs/semantics.md (min_p -> top_k -> top_p as rank-order prefixes, value then lower id, top_p's
masses in float64) on batches that mix greedy rows, filter combinations, ties at every
boundary, -inf entries, bf16 / fp16 logits, more than ``CUT_ROW_LOOP`` rows and sub-tile
candidate growth; ``apply_cut``'s threshold at every float32 edge value; ``_top_candidates``'
multiset; the top_p estimate's fallback to the exact float64 total.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, processing, reference, rng, torch_backend
from specsample.plan import build_plan


def _plan(logits: torch.Tensor, params: list[SamplingParams]):
    n = logits.shape[0]
    batch = SamplingBatch.from_params(params, vocab_size=logits.shape[1])
    return build_plan(logits, batch, draft_token_ids=None, num_draft_tokens=[0] * n,
                      draft_logits=None, draft_probs=None, positions=list(range(n)),
                      method="token")


def _spec_kept(y: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, bool]:
    """(kept [V] bool, near tie) of float32 row ``y`` by docs/semantics.md, token by token."""
    keep = np.isfinite(y)
    if p.temperature == 0:
        return keep, False
    t = float(np.float32(p.temperature))
    m = float(y[keep].max())
    if p.min_p > 0:  # y >= m + T log(min_p), the cut in float64 rounded up to float32
        cut = m + t * math.log(p.min_p)
        c32 = np.float32(cut)
        if float(c32) < cut:
            c32 = np.nextafter(c32, np.float32(np.inf))
        keep &= y >= c32
    order = sorted(np.flatnonzero(keep).tolist(), key=lambda i: (-float(y[i]), i))
    if 0 < p.top_k < y.shape[0]:
        keep[order[p.top_k:]] = False
        order = order[:p.top_k]
    near = False
    if p.top_p < 1:
        mass = np.array([math.exp((float(y[i]) - m) / t) for i in order])
        before = np.cumsum(mass) - mass
        goal = p.top_p * mass.sum()
        n_keep = max(1, int((before < goal).sum()))
        near = bool(np.any(np.abs(before - goal) <= 1e-9 * goal))
        keep[order[n_keep:]] = False
    return keep, near


def _assert_kept_sets(logits: torch.Tensor, params: list[SamplingParams]) -> int:
    z = processing.process_rows(_plan(logits, params)).clone()
    checked = 0
    for r in range(logits.shape[0]):
        want, near = _spec_kept(logits[r].float().numpy(), params[r])
        if near:
            continue
        got = torch.isfinite(z[r]).numpy()
        diff = np.flatnonzero(want ^ got)
        assert diff.size == 0, (r, params[r], diff[:10])
        checked += 1
    return checked


def _random_case(rs: random.Random, g: torch.Generator, vocabs, rows):
    v = rs.choice(vocabs)
    n = rs.choice(rows)
    kind = rs.choice(["int", "halves", "randn", "const", "wide"])
    if kind == "int":
        x = torch.randint(-4, 4, (n, v), generator=g).float()
    elif kind == "halves":
        x = torch.randint(-2, 2, (n, v), generator=g).float() * 0.5
    elif kind == "randn":
        x = torch.randn(n, v, generator=g) * rs.choice([0.1, 1.0, 5.0, 30.0])
    elif kind == "const":
        x = torch.zeros(n, v)
    else:
        x = torch.randn(n, v, generator=g) * 1000
    if rs.random() < 0.4:  # bans: many -inf entries, one finite per row kept
        x[torch.rand(n, v, generator=g) < rs.choice([0.1, 0.5, 0.99])] = -math.inf
        x[:, rs.randrange(v)] = 1.0
    if rs.random() < 0.3:
        x = x.to(rs.choice([torch.bfloat16, torch.float16]))
    params = []
    for _ in range(n):
        if rs.random() < 0.2:
            params.append(SamplingParams(temperature=0.0))
            continue
        kw = dict(temperature=rs.choice([1.0, 0.5, 2.0, 0.01, 7.0]), seed=1)
        if rs.random() < 0.5:
            kw["top_k"] = rs.choice([1, 2, 3, 5, 16, 17, 100, 300, max(1, v - 1), v, v + 5])
        if rs.random() < 0.5:
            kw["top_p"] = rs.choice([0.1, 0.5, 0.9, 0.99, 0.999999, 1e-6])
        if rs.random() < 0.4:
            kw["min_p"] = rs.choice([0.01, 0.1, 0.5, 0.9, 1.0])
        params.append(SamplingParams(**kw))
    return x, params


@pytest.mark.parametrize("seed", range(4))
def test_cut_kept_sets_match_the_specification_small_rows(seed):
    # vocabularies around the sub-tile (128) width, batches above CUT_ROW_LOOP (70 rows: the
    # mask path of apply_cut), ties at every boundary, -inf entries, bf16 / fp16 logits
    rs = random.Random(1000 + seed)
    g = torch.Generator().manual_seed(1000 + seed)
    checked = 0
    for _ in range(25):
        x, params = _random_case(rs, g, [1, 2, 3, 5, 17, 127, 128, 129, 255, 300, 1000],
                                 [1, 2, 3, 8, 70])
        checked += _assert_kept_sets(x, params)
    assert checked > 100


@pytest.mark.parametrize("seed", range(2))
def test_cut_kept_sets_match_the_specification_large_rows(seed):
    # sub-tile candidates (_top_candidates) and their 4x growth for top_k and top_p
    rs = random.Random(2000 + seed)
    g = torch.Generator().manual_seed(2000 + seed)
    for _ in range(8):
        x, params = _random_case(rs, g, [2049, 4100, 20037], [1, 2, 3])
        _assert_kept_sets(x, params)


def test_cut_boundaries_inside_tie_groups_and_short_rows():
    # every filter's boundary inside a tie group, together, and rows with fewer survivors than k
    v = 700
    x = torch.full((8, v), -3.0)
    x[:, 40:90] = 1.0  # 50 tied maxima
    x[:, 500:560] = 0.0  # 60 tied seconds
    x[3, :] = -math.inf
    x[3, [5, 600, 601]] = 2.0  # three survivors, k = 10
    x[4, :] = -math.inf
    x[4, 650] = 0.25  # one survivor
    x[5] = 0.0  # everything tied
    params = [
        SamplingParams(temperature=1.0, top_k=20, seed=1),  # top_k inside the maxima
        SamplingParams(temperature=1.0, top_k=70, top_p=0.5, seed=1),  # top_p in the maxima
        SamplingParams(temperature=1.0, top_k=75, top_p=0.999, seed=1),  # top_k in the seconds
        SamplingParams(temperature=1.0, top_k=10, top_p=0.9, seed=1),
        SamplingParams(temperature=0.5, top_k=3, top_p=0.3, min_p=0.5, seed=1),
        SamplingParams(temperature=1.0, top_k=300, top_p=0.2501, seed=1),  # 76 of 300
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, min_p=math.exp(-0.5), top_k=55, seed=1),
    ]
    assert _assert_kept_sets(x, params) == 8
    z = processing.process_rows(_plan(x, params))
    kept = torch.isfinite(z)
    assert kept[0].nonzero().squeeze(1).tolist() == list(range(40, 60))
    assert kept[2].nonzero().squeeze(1).tolist() == list(range(40, 90)) + list(range(500, 525))
    assert kept[3].nonzero().squeeze(1).tolist() == [5, 600, 601]
    assert kept[5].nonzero().squeeze(1).tolist() == list(range(76))


def test_cut_agrees_with_the_float64_reference():
    g = torch.Generator().manual_seed(7)
    x = torch.randint(-3, 3, (6, 3000), generator=g).float()
    x[1, ::3] = -math.inf
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=mp, seed=1)
              for t, k, p, mp in [(1.0, 1000, 0.9, 0.0), (0.7, 0, 0.5, 0.05),
                                  (1.3, 17, 1.0, 0.3), (1.0, 2999, 0.999, 0.0),
                                  (0.2, 0, 0.0001, 0.0), (1.0, 1500, 0.6, 0.2)]]
    z = processing.process_rows(_plan(x, params))
    for r, p in enumerate(params):
        trace = reference.RequestTrace()
        row = reference.process_row(x[r], p, trace=trace)
        if not trace.fragile:
            assert torch.isfinite(z[r]).numpy().tolist() == np.isfinite(row.z).tolist(), r


def test_nucleus_falls_back_to_the_exact_total_inside_the_estimate_band():
    # A constant row: the mass before token i is exactly i, the total V. top_p = 0.1 +- 1e-12
    # puts the goal within NUCLEUS_TOTAL_TOL of the 101st token's mass-before: only the exact
    # float64 total decides (101 kept, resp. 100).
    for v in (1000, 20000):
        x = torch.zeros(2, v)
        params = [SamplingParams(temperature=1.0, top_p=0.1 + 1e-12, seed=1),
                  SamplingParams(temperature=1.0, top_p=0.1 - 1e-12, seed=1)]
        z = processing.process_rows(_plan(x, params))
        assert torch.isfinite(z).sum(-1).tolist() == [v // 10 + 1, v // 10]
        assert torch.isfinite(z[0]).nonzero().squeeze(1).tolist() == list(range(v // 10 + 1))


_EDGES = [-math.inf, math.inf, 0.0, -0.0, 1e-45, -1e-45, 3e-45, -3e-45, 1.1754942e-38,
          -1.1754942e-38, 1.17549435e-38, -1.17549435e-38, 3.4028235e38, -3.4028235e38, 1.0,
          -1.0, 1.0000001, 0.99999994, -0.99999994, -1.0000001]


@pytest.mark.parametrize("copies", [1, 5])  # 20 rows (threshold loop) and 100 rows (mask)
def test_apply_cut_keeps_exactly_y_at_least_cut_at_float32_edges(copies):
    vals = torch.tensor(_EDGES, dtype=torch.float32)
    y = vals[None, :].repeat(len(_EDGES) * copies, 1)
    cut_v = vals.repeat(copies)
    cut_i = torch.full_like(cut_v, y.shape[1], dtype=torch.int64)
    got = processing.apply_cut(y, cut_v, cut_i)
    want = torch.where(y >= cut_v[:, None], y, -math.inf)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # -0.0 kept as -0.0
    # a cut splitting the tie group keeps the ids up to cut_i only
    cut_i = torch.arange(len(_EDGES) * copies) % len(_EDGES)
    got = processing.apply_cut(y, cut_v, cut_i)
    ids = torch.arange(len(_EDGES))
    want_keep = (y > cut_v[:, None]) | ((y == cut_v[:, None]) & (ids <= cut_i[:, None]))
    want = torch.where(want_keep, y, -math.inf)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_top_candidates_are_the_largest_values():
    rs = random.Random(3)
    for it in range(400):
        v = rs.choice([1, 2, 100, 127, 128, 129, 255, 256, 257, 383, 513, 1025, 3000, 4097])
        nsub = -(-v // rng.SUBTILE)
        c = max(1, min(v, rs.choice([nsub // 2 - 1, nsub // 2, nsub // 2 + 1, 1, 2, 16,
                                     rs.randint(1, v)])))
        g = torch.Generator().manual_seed(it)
        kind = rs.choice(["int", "randn", "inf", "allinf", "tail"])
        r = rs.choice([1, 3])
        x = (torch.randint(-3, 3, (r, v), generator=g).float() if kind in ("int", "inf")
             else torch.randn(r, v, generator=g))
        if kind == "inf":
            x[torch.rand(r, v, generator=g) < 0.98] = -math.inf
        elif kind == "allinf":
            x[:] = -math.inf
        elif kind == "tail":  # only the last (possibly partial) sub-tile is finite
            w = v % rng.SUBTILE or rng.SUBTILE
            x[:] = -math.inf
            x[:, v - w:] = torch.randn(r, w, generator=g)
        vals, ids = processing._top_candidates(x, c)
        want = torch.topk(x, c, dim=-1).values.sort(-1).values
        assert torch.equal(vals.sort(-1).values, want), (it, v, c, kind)
        assert bool(((ids >= 0) & (ids < v)).all())
        fin = torch.isfinite(vals)
        assert torch.equal(torch.where(fin, x.gather(1, ids), vals), vals)
        for row in range(r):
            assert len(set(ids[row][fin[row]].tolist())) == int(fin[row].sum())


def test_block_total_within_its_bound():
    g = torch.Generator().manual_seed(5)
    for v in (1, 15, 16, 17, 1000, 49153):
        e = torch.exp(torch.randn(3, v, generator=g) * 4).float()
        e[1] = torch.rand(v, generator=g) * 2.0 ** -126  # subnormal terms
        e[2, ::2] = 0.0
        got = processing.block_total(e)
        exact = e.double().sum(-1, keepdim=True)
        assert got.shape == (3, 1) and got.dtype == torch.float64
        assert bool(((got - exact).abs() <= 15 * 2.0 ** -24 * exact + 1e-300).all())


def test_logits_that_require_grad_filter_the_same():
    # the gradient path (no torch.threshold, apply_cut without out=) keeps the same tokens
    g = torch.Generator().manual_seed(9)
    for n in (3, 70):
        x = torch.randint(-3, 3, (n, 3000), generator=g).float()
        params = [SamplingParams(temperature=0.7, top_k=(5, 0, 40)[i % 3],
                                 top_p=(0.8, 0.6, 1.0)[i % 3], min_p=(0.05, 0.0, 0.3)[i % 3],
                                 seed=1) for i in range(n)]
        batch = SamplingBatch.from_params(params, vocab_size=3000)
        want = specsample.probs(x, batch)
        xg = x.clone().requires_grad_()
        got = specsample.probs(xg, batch)
        assert got.requires_grad and torch.equal(got.detach(), want)
        got.sum().backward()
        assert bool(torch.isfinite(xg.grad).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_greedy_verify_takes_the_argmax_of_the_processed_logits(dtype):
    # 1af7748: an all-greedy batch without logprobs takes first_argmax of the cleaned raw
    # logits; ties (lowest id), invalid requests (NaN, +inf, all -inf) and dead rows (after a
    # placeholder) must give the reference's tokens, and the same as with a sampled request
    # (which processes the logits) or with logprobs.
    v = 5000
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-3, 3, (13, v), generator=g).float()
    x[0, [7, 4000]] = 9.0  # tie across tiles
    x[1] = -math.inf
    x[1, [4999, 2048, 2049]] = -2.0
    x[4, 10] = math.nan  # request 1 invalid
    x[8, 3] = math.inf  # request 2 invalid
    x[10] = -math.inf  # request 3 invalid
    x[11, :] = -0.0
    x[11, 4090] = 0.0
    x = x.to(dtype)
    ks = [3, 3, 1, 2]
    d = torch.tensor([7, 2048, -1, 1, 2, 3, 4, 5, 6])
    params = [SamplingParams(temperature=0.0)] * 4
    batch = SamplingBatch.from_params(params, vocab_size=v)
    out = specsample.verify(x, d, ks, batch, positions=[0, 1, 2, 3], strict=False)
    ref = reference.verify(x, d, ks, batch, positions=[0, 1, 2, 3], strict=False)
    assert out.token_ids.tolist() == ref.token_ids.tolist()
    assert out.token_ids[0, :2].tolist() == [7, 2048]
    assert out.invalid.tolist() == [False, True, True, True]
    lp = SamplingBatch.from_params([SamplingParams(temperature=0.0, logprobs=0)] * 4,
                                   vocab_size=v)
    out_lp = specsample.verify(x, d, ks, lp, positions=[0, 1, 2, 3], strict=False)
    assert out_lp.token_ids.tolist() == out.token_ids.tolist()


def test_numpy_philox_matches_the_scalar_for_caller_shapes():
    rs = np.random.default_rng(0)
    shape_sets = [((), (), (), (), (), ()),
                  ((3, 1), (1, 4), (3, 1), (), (3, 1), (3, 1)),
                  ((3, 4), (3, 4), (3, 4), (), (3, 4), (3, 4)),
                  ((1, 4), (3, 1), (1, 1), (), (1, 1), (3, 1)),
                  ((2, 3, 1), (1, 1, 5), (2, 3, 1), (), (2, 1, 1), (2, 1, 1)),
                  ((), (), (), (), (4, 1), (1, 3))]
    for shapes in shape_sets:
        arrs = [np.asarray(rs.integers(0, 2**32, size=s, dtype=np.uint64)) for s in shapes]
        w0, w1 = rng._philox_numpy(*arrs)
        shape = np.broadcast_shapes(*shapes)
        assert w0.shape == w1.shape == shape
        full = np.broadcast_arrays(*arrs)
        for idx in np.ndindex(*shape):
            want = rng.philox_scalar(*(int(a[idx]) for a in full))[:2]
            assert (int(w0[idx]), int(w1[idx])) == want, (shapes, idx)


def test_min_p_cut_between_two_float32_values():
    # the float64 cut m + T log(min_p) lies between two float32 values: the one below is
    # dropped, the one above kept (the cut rounded up, not to nearest)
    for min_p, t, m in [(0.5, 1.0, 0.0), (0.1, 0.7, 3.0), (0.3, 1.3, -2.5), (1e-3, 2.0, 10.0)]:
        cut = m + float(np.float32(t)) * math.log(min_p)
        near = np.float32(cut)
        row = sorted({float(near), float(np.nextafter(near, np.float32(-np.inf))),
                      float(np.nextafter(near, np.float32(np.inf)))})
        x = torch.tensor([[m] + row + [-1e9]], dtype=torch.float32)
        p = [SamplingParams(temperature=t, min_p=min_p, seed=1)]
        got = torch.isfinite(processing.process_rows(_plan(x, p))[0]).tolist()
        assert got == [True] + [r >= cut for r in row] + [False], (min_p, t, m)


def test_rows_nobody_reads_take_no_candidate_search():
    # A placeholder leaves the rows after it dead; they are zeroed (constant rows), where top_p
    # ties every token: ranking them grew the candidates to a full sort (13x slower). Dead
    # rows now keep the cut (-inf, V), and the zeroed rows' maximum is their own (0).
    v = 4096
    x = torch.randn(4, v, generator=torch.Generator().manual_seed(0)) * 3
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.05, top_p=0.9, seed=1)],
                                      vocab_size=v)
    plan = build_plan(x, batch, draft_token_ids=torch.tensor([5, -1, 7]), num_draft_tokens=[3],
                      draft_logits=None, draft_probs=None, positions=torch.tensor([0]),
                      method="token")
    plan, z, err = torch_backend.processed_logits(plan)
    dead = ~plan.row_live
    assert dead.tolist() == [False, False, True, True]
    cut_v, cut_i = processing.filter_cut(plan.logits, torch.zeros(4), plan)
    assert torch.isinf(cut_v[dead]).all() and (cut_i[dead] == v).all()
    assert torch.isfinite(cut_v[~dead]).all()
    assert (z[dead] == 0).all()  # (y - max) / T of a zeroed row with its own max, 0


def _nucleus_by_sort(x: torch.Tensor, t: float, top_p: float) -> tuple[float, int]:
    """The top_p cut (value, id of the last kept token) by a full stable sort in float64."""
    vals, order = torch.sort(x, descending=True, stable=True)
    fin = vals > -math.inf
    e = torch.where(fin, torch.exp((vals.double() - vals[0].double()) / t), 0.0)
    keep = ((torch.cumsum(e, 0) - e) < top_p * e.sum()) & fin
    n = max(int(keep.sum()), 1)
    return float(vals[n - 1]), int(order[n - 1])


@pytest.mark.parametrize("case", ["flat", "bf16_ties", "signed_zeros", "neg_inf", "wide"])
def test_nucleus_by_histogram_matches_a_full_sort(case):
    # The wide-nucleus path of the CPU filters (processing._nucleus_by_histogram): masses
    # summed per coarse value bin, then the edge bin ranked exactly. Its cut must be the one
    # of a full stable sort: flat rows, bf16-valued float32 rows (thousands of exact ties in
    # one bin), -0.0 and +0.0 (one value: the lower id first), -inf (dropped) entries, and
    # values over many binades.
    g = torch.Generator().manual_seed(11)
    v = 6000
    if case == "flat":
        x = torch.randn(4, v, generator=g) * 0.05
    elif case == "bf16_ties":
        x = torch.randn(4, v, generator=g).to(torch.bfloat16).float()
    elif case == "signed_zeros":
        x = torch.randint(-1, 2, (4, v), generator=g).float() * 0.5
        x[:, ::3] = -0.0
        x[:, 1::3] = 0.0
    elif case == "neg_inf":
        x = torch.randn(4, v, generator=g)
        x[torch.rand(4, v, generator=g) < 0.7] = -math.inf
    else:
        x = torch.randn(4, v, generator=g) * torch.logspace(-30, 3, v)[torch.randperm(v,
                                                                                generator=g)]
    for t, top_p in ((1.0, 0.9), (0.7, 0.5), (3.0, 0.999), (1.0, 1e-9)):
        m = x.amax(-1)
        cut_v, cut_i = processing._nucleus_by_histogram(
            x, m, torch.full((4,), t, dtype=torch.float64),
            torch.full((4,), top_p, dtype=torch.float64))
        for r in range(4):
            want_v, want_i = _nucleus_by_sort(x[r], t, top_p)
            assert (float(cut_v[r]), int(cut_i[r])) == (want_v, want_i), (case, t, top_p, r)
