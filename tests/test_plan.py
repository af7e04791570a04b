"""The plan's derived layout: the host shortcuts for uniform, placeholder-free calls
(``Plan.uniform``, ``Plan.placeholder_free``) give exactly the general formulas' tensors."""

from __future__ import annotations

import pytest
import torch

from specsample import SamplingBatch, SamplingParams
from specsample import plan as plan_mod
from specsample.plan import build_plan


def _plan(ks, drafts, max_k=None, device_layout=False, monkeypatch=None):
    n, v = len(ks), 16
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.8, seed=i)
                                       for i in range(n)], vocab_size=v)
    logits = torch.randn(n + sum(ks), v, generator=torch.Generator().manual_seed(0))
    num = torch.tensor(ks) if device_layout else ks
    return build_plan(logits, batch, draft_token_ids=torch.tensor(drafts, dtype=torch.int64),
                      num_draft_tokens=num, draft_logits=None, draft_probs=None,
                      positions=torch.arange(n), method="token", max_num_draft_tokens=max_k)


def _general(plan):
    """k_eff, draft_grid and row_live by their general formulas, written out."""
    k_eff, grid = [], []
    d = plan.draft_token_ids.tolist()
    for i in range(plan.num_requests):
        s, k = int(plan.draft_start[i]), int(plan.k_given[i])
        own = d[s:s + k]
        ke = own.index(-1) if -1 in own else k
        k_eff.append(ke)
        grid.append(own[:ke] + [-1] * (plan.max_k - ke))
    live = [int(j) <= k_eff[int(r)] for r, j in zip(plan.row_req, plan.row_j)]
    grid = torch.tensor(grid, dtype=torch.int64).view(plan.num_requests, plan.max_k)
    return torch.tensor(k_eff), grid, torch.tensor(live)


@pytest.mark.parametrize("ks,drafts,max_k,uniform,free", [
    ([3, 3], [1, 2, 3, 4, 5, 6], None, True, True),
    ([3, 3], [1, -1, 3, 4, 5, 6], None, True, False),  # a placeholder
    ([3, 1], [1, 2, 3, 4], None, False, True),
    ([2, 2], [1, 2, 3, 4], 3, False, True),  # K above every k_i
    ([0, 0], [], None, True, True),
])
def test_host_shortcuts_match_the_general_layout(ks, drafts, max_k, uniform, free):
    plan = _plan(ks, drafts, max_k)
    assert plan.uniform is uniform and plan.placeholder_free is free
    k_eff, grid, live = _general(plan)
    assert torch.equal(plan.k_eff, k_eff)
    assert torch.equal(plan.draft_grid, grid)
    assert torch.equal(plan.row_live, live)


def test_device_layout_takes_no_shortcut(monkeypatch):
    monkeypatch.setattr(plan_mod, "_is_device_tensor", lambda t: isinstance(t, torch.Tensor))
    plan = _plan([3, 3], [1, 2, 3, 4, 5, 6], max_k=3, device_layout=True)
    assert plan.num_draft is None
    assert not plan.uniform and not plan.placeholder_free
    k_eff, grid, live = _general(plan)
    assert torch.equal(plan.k_eff, k_eff) and torch.equal(plan.draft_grid, grid)


def _general_prior_pairs(plan):
    """Plan.prior_draft_pairs by its definition: draft j' of request i (live, id in [0, V))
    at rows j' + 1 .. k_eff of the request, as a sorted list of (row, token)."""
    k_eff, _, _ = _general(plan)
    d = plan.draft_token_ids.tolist()
    pairs = []
    for i in range(plan.num_requests):
        s, r = int(plan.draft_start[i]), int(plan.row_start[i])
        for jp in range(int(k_eff[i])):
            if 0 <= d[s + jp] < plan.vocab_size:
                pairs += [(r + j, d[s + jp]) for j in range(jp + 1, int(k_eff[i]) + 1)]
    return sorted(pairs)


@pytest.mark.parametrize("ks,drafts,max_k", [
    ([3, 3], [1, 2, 3, 4, 5, 6], None),
    ([3, 3], [1, -1, 3, 4, 5, 6], None),  # a placeholder: the general formula
    ([3, 1, 0, 2], [1, 2, 3, 4, 5, 6], None),
    ([2, 2], [1, 2, 3, 4], 3),
    ([1], [7], None),
])
def test_prior_draft_pairs_of_the_cached_pattern_match_the_definition(ks, drafts, max_k):
    plan = _plan(ks, drafts, max_k)
    rows, toks = plan.prior_draft_pairs()
    assert sorted(zip(rows.tolist(), toks.tolist())) == _general_prior_pairs(plan)


def test_prior_draft_pairs_clamp_an_id_outside_the_vocabulary_to_its_own_rows():
    plan = _plan([2, 2], [1, 99, 3, 4])  # request 0 is invalid (ERR_DRAFT_ID), V = 16
    rows, toks = plan.prior_draft_pairs()
    assert toks.min() >= 0 and toks.max() < plan.vocab_size
    ok = sorted(p for p in zip(rows.tolist(), toks.tolist()) if p[0] >= 3)
    assert ok == [p for p in _general_prior_pairs(plan) if p[0] >= 3]  # request 1 unchanged
