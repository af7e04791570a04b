"""The torch backend's draw of top_k / top_p rows from their candidates
(``torch_backend._candidate_cut`` / ``_candidate_draw``): the cut it finds is the exact cut of
``processing.filter_cut`` wherever it says found, the rows it does not find are drawn from
that exact cut (counted as ``cpu.candidates_missed``), its law is the filtered softmax
(G-test, with a power check: a sampler that ignores top_p must fail), and a row's tokens do
not depend on the other requests of its batch. Vocabularies above 64 sub-tiles of 128 take
the sub-tile route of the candidates (smaller ones rank the whole row)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from specsample import SamplingBatch, SamplingParams, paths, processing, reference, sample, verify
from specsample import torch_backend as tb
from specsample.plan import build_plan

SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def _rows(gen: np.random.Generator, rows: int, vocab: int, style: str) -> torch.Tensor:
    """Zipf-like rows (a few large values), ties (half-integers), flat rows, -inf chunks."""
    if style == "zipf":
        rank = np.arange(vocab)
        prof = gen.uniform(8, 20, (rows, 1)) - gen.uniform(1.5, 3, (rows, 1)) * np.log1p(rank)
        x = np.take_along_axis(prof + 0.25 * gen.normal(size=(rows, vocab)),
                               np.argsort(gen.random((rows, vocab)), 1), 1)
    elif style == "ties":
        x = np.round(gen.normal(size=(rows, vocab)) * 2) / 2
    elif style == "equal":
        x = np.zeros((rows, vocab))
    else:  # flat
        x = gen.normal(size=(rows, vocab)) * 0.05
    if gen.random() < 0.3:  # -inf chunks (bans), never the whole row
        x[:, : vocab // 3] = -np.inf
    return torch.from_numpy(x).float()


def _filters(x: torch.Tensor, params: list[SamplingParams]) -> processing.RowFilters:
    n, v = x.shape
    batch = SamplingBatch.from_params(params, vocab_size=v)
    plan = build_plan(x, batch, draft_token_ids=None, num_draft_tokens=[0] * n,
                      draft_logits=None, draft_probs=None, positions=torch.arange(n),
                      method="token")
    m = x.amax(-1)
    return processing.row_filters(x, torch.where(torch.isfinite(m), m, 0.0), plan)


def _kept(x: torch.Tensor, cut_v: torch.Tensor, cut_i: torch.Tensor) -> torch.Tensor:
    ids = torch.arange(x.shape[1])[None, :]
    keep = (x > cut_v[:, None]) | ((x == cut_v[:, None]) & (ids <= cut_i[:, None]))
    return keep & (x > -math.inf)


@st.composite
def case_st(draw):
    vocab = draw(st.sampled_from([5, 64, 100, 3000, 9000, 20000]))
    n = draw(st.integers(1, 4))
    style = draw(st.sampled_from(["zipf", "zipf", "ties", "equal", "flat"]))
    params = []
    for _ in range(n):
        kw = {"temperature": draw(st.sampled_from([0.05, 0.7, 1.0, 2.5]))}
        kw["top_k"] = draw(st.sampled_from([0, 1, 2, 20, 50, 63, 64, 65, 300, vocab - 1,
                                            vocab]))
        kw["top_p"] = draw(st.sampled_from([1.0, 0.999, 0.9, 0.5, 1e-6]))
        kw["min_p"] = draw(st.sampled_from([0.0, 0.0, 0.05, 0.5]))
        if not 0 < kw["top_k"] < vocab and kw["top_p"] == 1.0:
            kw["top_p"] = 0.8
        params.append(SamplingParams(**kw))
    x = _rows(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), n, vocab, style)
    return x, params, style


def _candidate_cut(x: torch.Tensor, params: list[SamplingParams]):
    """(the exact cut's kept sets [R, V], the candidates' kept sets [R, V], found [R])."""
    f = _filters(x, params)
    n, v = x.shape
    min_cut, t64, top_k, k_on, top_p, p_on = f.settings
    top_k = torch.where(k_on, top_k, v)[:, None]
    top_p = torch.where(p_on, top_p, 1.0)[:, None]
    min_cut = (min_cut if min_cut is not None else torch.full((n,), -math.inf))[:, None]
    t = t64.float()[:, None]
    need_total = bool((p_on & ~k_on).any())
    scale = (math.log2(math.e) / t64).float()[:, None]
    cand_v, cand_i, n_keep, found = tb._candidate_cut(x, f.m[:, None], t, min_cut, scale,
                                                      top_k, top_p, need_total)
    got = torch.zeros(n, v, dtype=torch.bool)
    for r in range(n):
        got[r, cand_i[r, : int(n_keep[r, 0])]] = True
    return _kept(x, *f.cut()), got, found[:, 0]


@SETTINGS
@given(case=case_st())
def test_found_cut_is_the_exact_cut(case):
    x, params, _style = case
    want, got, found = _candidate_cut(x, params)
    for r in range(x.shape[0]):
        if bool(found[r]):
            assert torch.equal(got[r], want[r]), (r, params[r])


def test_candidates_find_peaked_rows():
    """(The test above would pass if nothing were found.) Zipf-like rows under the filters of
    real traffic are nearly all found, with the exact cut."""
    gen = np.random.default_rng(11)
    x = _rows(gen, 48, 20000, "zipf")
    x[:, : 20000 // 3] = x[:, 20000 // 3: 2 * (20000 // 3)]  # (no -inf chunk here)
    params = [SamplingParams(temperature=[0.7, 1.0][i % 2], top_k=[0, 20, 50][i % 3],
                             top_p=[0.8, 0.9, 0.95, 1.0][i % 4] if i % 3 else 0.9,
                             min_p=0.05 * (i % 5 == 0)) for i in range(48)]
    want, got, found = _candidate_cut(x, params)
    assert int(found.sum()) >= 44, found
    assert torch.equal(got[found], want[found])


def _call(x, params, positions):
    batch = SamplingBatch.from_params(params, vocab_size=x.shape[1])
    return sample(x, batch, positions=positions).token_ids


@pytest.mark.parametrize("vocab", [3000, 20000])
def test_tokens_are_the_exact_cut_route(vocab):
    """Found rows give the tokens the draw of the exact cut gives (the same noise; the tile
    masses are summed from the survivors instead of the row: only rounding differs, and no
    row here sits that close to a tie); rows that are not found take that draw itself."""
    gen = np.random.default_rng(7)
    n = 48
    x = torch.cat([_rows(gen, n - 8, vocab, "zipf"), _rows(gen, 8, vocab, "flat")])
    params = [SamplingParams(temperature=[0.6, 1.0, 1.4][i % 3], seed=i,
                             top_k=[0, 20, 50][i % 3 if i % 4 else 0],
                             top_p=[0.9, 1.0, 0.8, 0.95][i % 4], min_p=0.02 * (i % 2))
              for i in range(n)]
    pos = torch.arange(n) * 1000
    paths.reset()
    got = _call(x, params, pos)
    missed = paths.counts().get("cpu.candidates_missed", {}).get("rows", 0)
    assert 1 <= missed <= 16  # (the flat rows' nuclei hold thousands of tokens)
    f = _filters(x, params)
    cut = f.cut()
    batch = SamplingBatch.from_params(params, vocab_size=vocab)
    want = tb._draw_with_cut(x, f.m, cut, batch.temperature, tb._seeds(batch), pos)
    assert torch.equal(got, want)


def test_tokens_do_not_depend_on_the_batch():
    """A top_p request's tokens alone, beside temperature-only and min_p requests (two
    compiled draws), and beside a row whose candidates miss (the exact cut's draw)."""
    gen = np.random.default_rng(3)
    vocab = 9000
    x = torch.cat([_rows(gen, 3, vocab, "zipf"), _rows(gen, 1, vocab, "flat")])
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=5),
              SamplingParams(temperature=0.7, seed=6),
              SamplingParams(temperature=1.0, min_p=0.1, seed=7),
              SamplingParams(temperature=1.0, top_p=0.95, seed=8)]
    pos = torch.tensor([11, 12, 13, 14])
    together = _call(x, params, pos)
    for i in range(4):
        assert int(_call(x[i:i + 1], params[i:i + 1], pos[i:i + 1])) == int(together[i])
    # one-hot verify (the draws and the match in one call) emits sample()'s tokens
    batch = SamplingBatch.from_params([params[0]] * 2, vocab_size=vocab)
    rows = torch.cat([x[:1]] * 3 + [x[1:2]] * 3)
    drafts = torch.cat([_call(rows[:2], [params[0]] * 2, torch.tensor([11, 12])),
                        torch.tensor([0, 1])])
    out = verify(rows, drafts, [2, 2], batch, positions=torch.tensor([11, 100]))
    alone = _call(rows[:3], [params[0]] * 3, torch.tensor([11, 12, 13]))
    assert out.token_ids[0].tolist() == alone.tolist()


def _exact_law(x: torch.Tensor, params: SamplingParams) -> np.ndarray:
    return reference.processed_probs(x[0].double().numpy(), params)


def _g_test(tokens: np.ndarray, law: np.ndarray) -> float:
    n = tokens.size
    counts = np.bincount(tokens, minlength=law.size)
    if counts[law <= 0].any():
        return 0.0  # a token the filters drop was emitted
    big = law * n >= 5
    f_exp = np.append(law[big] * n, law[~big].sum() * n)
    f_obs = np.append(counts[big], counts[~big].sum())
    if f_exp[-1] < 5:
        f_exp, f_obs = f_exp[:-1], f_obs[:-1]
    f_exp *= f_obs.sum() / f_exp.sum()
    return float(stats.power_divergence(f_obs, f_exp, lambda_="log-likelihood").pvalue)


LAW_CASES = [SamplingParams(temperature=1.3, top_p=0.9),  # (a nucleus of 42 tokens)
             SamplingParams(temperature=1.5, top_k=20, top_p=0.95),  # (15)
             SamplingParams(temperature=1.5, top_k=50, min_p=0.002)]  # (50)


def _law_row() -> torch.Tensor:
    """[1, 12000]: a Zipf-like row (rank r at -2 log(1 + r), slightly perturbed, shuffled)."""
    gen = np.random.default_rng(5)
    x = -2.0 * np.log1p(np.arange(12000)) + 0.1 * gen.normal(size=12000)
    return torch.from_numpy(x[np.argsort(gen.random(12000))]).float()[None, :]


def _draw_many(x: torch.Tensor, params: SamplingParams, n: int) -> np.ndarray:
    """n tokens of one row (one request per position, one seed)."""
    out = []
    for start in range(0, n, 1000):
        m = min(1000, n - start)
        batch = SamplingBatch.from_params([params] * m, vocab_size=x.shape[1])
        out.append(sample(x.expand(m, -1), batch,
                          positions=torch.arange(start, start + m)).token_ids)
    return torch.cat(out).numpy()


@pytest.mark.parametrize("case", range(len(LAW_CASES)))
def test_law_is_the_filtered_softmax(case):
    params = dataclasses.replace(LAW_CASES[case], seed=1234)
    x = _law_row()
    law = _exact_law(x, params)
    paths.reset()
    tokens = _draw_many(x, params, 6000)
    assert "cpu.candidates_missed" not in paths.counts()
    p = _g_test(tokens, law)
    assert p > 1e-3, p


def test_law_check_has_power(monkeypatch):
    """The same test rejects a candidate draw that ignores top_p."""
    real = tb._candidate_cut

    def no_top_p(x, m, t, min_cut, scale, top_k, top_p, need_total):
        return real(x, m, t, min_cut, scale, top_k, torch.ones_like(top_p), need_total)

    monkeypatch.setattr(tb, "_candidate_cut", no_top_p)
    params = dataclasses.replace(LAW_CASES[1], seed=1234)
    x = _law_row()
    p = _g_test(_draw_many(x, params, 6000), _exact_law(x, params))
    assert p < 1e-6, p


def test_histogram_nucleus_does_not_depend_on_the_batch():
    """processing.filter_cut's histogram route (wide nuclei) once took each row's running
    mass from one cumulative sum over the rows one after another: a row's sums were rounded
    by the rows before it, and a boundary that fell exactly on a tie (6 tokens of one value,
    top_p 0.5: keep 3) kept 4 in this batch (found by test_found_cut_is_the_exact_cut)."""
    x = _rows(np.random.default_rng(2708523566), 4, 9000, "ties")
    params = [SamplingParams(temperature=0.7, top_k=1, min_p=0.5),
              SamplingParams(temperature=0.05, top_k=65, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=0.7, top_p=0.9),  # (a nucleus of thousands)
              SamplingParams(temperature=0.05, top_k=20, top_p=0.5, min_p=0.5)]
    together = _filters(x, params).cut()
    alone = _filters(x[3:], params[3:]).cut()
    assert (int(together[1][3]), float(together[0][3])) == (int(alone[1][0]),
                                                             float(alone[0][0]))
    assert int(_kept(x[3:], *alone).sum()) == 3


def _nucleus_rows(n: int, v: int, width: int) -> torch.Tensor:
    """Rows whose top_p 0.9 nucleus at T = 0.8 holds about ``width`` tokens (more than the
    64 candidates), the rest far below."""
    g = torch.Generator().manual_seed(width)
    x = torch.randn(n, v, generator=g)
    x[:, :width] += 12.0 + 0.5 * torch.randn(n, width, generator=g)
    return x


def test_missed_rows_take_the_function_with_the_id_rule(monkeypatch):
    """Rows past their candidates are drawn by the pass's function with the id rule whatever
    their cut (a tie-free cut included), so which compiled function draws a row depends on
    the row alone and one variant serves every miss (the one a decode's warm-up compiles);
    their tokens are the exact cut's draw."""
    x = _nucleus_rows(3, 3000, 150)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(3)]
    f = _filters(x, params)
    assert (f.cut()[1] == x.shape[1]).any()  # (some cut splits no tie group)
    flags = []
    real = tb._call_rows

    def spy(name, fn, x_, per_row, token_stream, tile_stream, *fl):
        if name == "processed_rows":
            flags.append(fl)
        return real(name, fn, x_, per_row, token_stream, tile_stream, *fl)

    monkeypatch.setattr(tb, "_call_rows", spy)
    paths.reset()
    pos = torch.arange(3) * 7
    got = _call(x, params, pos)
    assert paths.counts()["cpu.candidates_missed"]["rows"] == 3
    assert flags == [(True,)]
    batch = SamplingBatch.from_params(params, vocab_size=x.shape[1])
    want = tb._draw_with_cut(x, f.m, f.cut(), batch.temperature, tb._seeds(batch), pos,
                             id_rule=True)
    assert torch.equal(got, want)
