"""Logit processors in PyTorch (float32): the general path shared by every backend.

``process_rows`` turns raw logits rows into the processed logits ``z'`` of docs/semantics.md:
bans (allowed_token_ids, bad words, min_tokens) -> logit_bias -> penalties -> temperature (after
subtracting the row maximum) -> min_p -> top_k -> top_p, the filters decided exactly on the
float32 values (``filter_drop``). The Triton
backend's general path materialises this float32 tensor and then runs its kernels on it (a
named, counted fallback); the fused path applies temperature inside the kernel.
"""

from __future__ import annotations

import math

import torch

from . import workspace
from .params import SamplingBatch
from .plan import Plan


def _output_counts(plan: Plan) -> torch.Tensor:
    """[T, V] float32 counts of output tokens per row: the request's outputs (the batch's
    ``output_counts``) + its drafts before j."""
    counts = plan.batch.output_counts[plan.row_req]
    # Drafts before row j: pairs (row of request i at j, draft j') for j' < j <= k_eff.
    rows, toks = plan.prior_draft_pairs()
    if rows.numel():
        counts.index_put_((rows, toks), torch.ones_like(rows, dtype=torch.float32),
                          accumulate=True)
    return counts


def outputs_before_row(plan: Plan, req: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Output tokens that min_tokens counts at row ``j`` of request ``req`` (broadcast int64):
    the request's outputs plus its drafts 0..j-1 (a live row has no placeholder before it)."""
    return plan.batch.num_output[req] + j


def ban_pairs(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs [M] int64 that bad words and min_tokens ban (duplicates allowed).

    Bad word ``(w_1 .. w_L)`` of request i bans ``w_L`` at row j when the context before row j
    (the batch's ``context_tail`` of prompt + outputs, then drafts 0..j-1) ends with
    ``w_1 .. w_{L-1}``; a stop token of request i is banned at row j while
    :func:`outputs_before_row` is below its min_tokens. Rows j <= k_i of every request are
    covered (rows past a placeholder too: nobody reads them).
    """
    batch = plan.batch
    dev = plan.logits.device
    j = torch.arange(plan.max_k + 1, device=dev)
    rows, toks = [], []
    if batch.bad_req.numel():
        req = batch.bad_req
        width = batch.bad_prefix.shape[1]
        prefix = batch.bad_prefix[:, None, :]  # [nw, 1, W]
        if width:
            seq = torch.cat([batch.context_tail, plan.draft_grid], dim=1)[req]  # [nw, W + K]
            tails = seq[:, j[:, None] + torch.arange(width, device=dev)]  # [nw, K + 1, W]
            match = ((tails == prefix) | (prefix < 0)).all(-1)
        else:
            match = torch.ones(req.shape[0], j.shape[0], dtype=torch.bool, device=dev)
        ok = match & (j <= plan.k_given[req][:, None])
        rows.append((plan.row_start[req][:, None] + j)[ok])
        toks.append(batch.bad_last[:, None].expand_as(ok)[ok])
    if batch.stop_req.numel():
        req = batch.stop_req
        ok = (outputs_before_row(plan, req[:, None], j) < batch.min_tokens[req][:, None]) & (
            j <= plan.k_given[req][:, None])
        rows.append((plan.row_start[req][:, None] + j)[ok])
        toks.append(batch.stop_ids[:, None].expand_as(ok)[ok])
    if not rows:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return empty, empty
    return torch.cat(rows), torch.cat(toks)


def _allowed_rows(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R], their request's slot in ``batch.allowed_mask`` [R]) of the requests that
    have allowed_token_ids: every row of such a request (dead rows too; nobody reads them).

    Found on the device from ``plan.row_req``, so host and device layouts alike; the row count
    R is read on the host (one synchronisation, on the general path, which has others).
    """
    batch, dev = plan.batch, plan.logits.device
    slot_of = torch.full((batch.num_requests,), -1, dtype=torch.int64)
    slot_of[list(batch.allowed_users)] = torch.arange(len(batch.allowed_users))
    slot = slot_of.to(dev)[plan.row_req]
    rows = (slot >= 0).nonzero().squeeze(1)
    return rows, slot[rows]


def apply_bans(y: torch.Tensor, plan: Plan) -> torch.Tensor:
    """In place on float32 ``y`` [T, V]: -inf at every banned token (allowed_token_ids, bad
    words, min_tokens); a no-op unless ``batch.needs_bans``."""
    batch = plan.batch
    if not batch.needs_bans:
        return y
    if batch.allowed_users:
        rows, slots = _allowed_rows(plan)
        y[rows] = y[rows].masked_fill(~batch.allowed_mask[slots], -math.inf)
    rows, toks = ban_pairs(plan)
    if rows.numel():
        y[rows, toks] = -math.inf
    return y


def rows_emptied_by_bans(plan: Plan) -> torch.Tensor:
    """[T] bool: rows whose bans leave no finite logit (such a request is invalid).

    The rows must be sanitised as for :func:`process_rows` (no NaN / +inf; every row of a
    valid request has a finite logit). Costs one float32 copy of the rows; all False without
    bans.
    """
    if not plan.batch.needs_bans:
        return torch.zeros(plan.num_rows, dtype=torch.bool, device=plan.logits.device)
    y = plan.logits.to(torch.float32, copy=True)
    return torch.isneginf(apply_bans(y, plan).amax(-1))


def apply_bias_and_penalties(z: torch.Tensor, plan: Plan) -> torch.Tensor:
    """In place on float32 ``z`` [T, V]: logit_bias, then repetition, frequency, presence."""
    batch = plan.batch
    if batch.needs_bias:
        bias = torch.zeros(batch.num_requests, plan.vocab_size, dtype=torch.float32,
                           device=z.device)
        bias.index_put_((batch.bias_req, batch.bias_ids), batch.bias_val, accumulate=True)
        z += bias[plan.row_req]
    if batch.needs_penalties:
        # Only the penalties some request sets, and repetition only at the tokens it touches
        # (the same float32 operations on those entries; the others are unchanged).
        counts = _output_counts(plan)
        seen = counts > 0
        req = plan.row_req
        if any(p.repetition_penalty != 1 for p in batch.params):
            rows, cols = (seen | batch.prompt_mask[req]).nonzero(as_tuple=True)
            rep = batch.repetition_penalty[req][rows]
            vals = z[rows, cols]
            z[rows, cols] = torch.where(vals > 0, vals / rep, vals * rep)
        if any(p.frequency_penalty != 0 for p in batch.params):
            z -= batch.frequency_penalty[req, None] * counts
        if any(p.presence_penalty != 0 for p in batch.params):
            z -= batch.presence_penalty[req, None] * seen
    return z


def _round_up_f32(t: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= each float64 value of ``t`` (so ``y < result`` for a float32
    ``y`` is exactly ``y < t`` in real arithmetic)."""
    t32 = t.float()
    up = torch.nextafter(t32, torch.full_like(t32, math.inf))
    return torch.where(t32.double() < t, up, t32)


def filter_settings(y: torch.Tensor, m: torch.Tensor, plan: Plan, vocab: int) -> tuple:
    """Per-row filter settings of ``plan``'s rows and min_p's decision (sampled rows only):
    (drop [T, W] bool or None, t64 [T] float64 temperature, top_k [T], k_on [T], top_p [T]
    float64, p_on [T]). ``y`` [T, W]: the rows (or a vocabulary shard of them) before
    temperature; ``m`` [T]: the rows' global maxima; ``vocab``: the global V (top_k >= V is
    off). min_p drops ``y < m + T log(min_p)``, the cut computed in float64 and rounded up to
    float32 (exact for float32 values)."""
    batch, req = plan.batch, plan.row_req
    sampled = batch.temperature[req] > 0
    t64 = batch.temperature[req].double()
    drop = None
    min_p = batch.min_p[req]
    on = sampled & (min_p > 0)
    if bool(on.any()):
        cut = _round_up_f32(m.double() + t64 * torch.log(torch.where(on, min_p, 1.0)))
        drop = y < torch.where(on, cut, -math.inf)[:, None]
    k = batch.top_k[req]
    k_on = sampled & (k > 0) & (k < vocab)
    top_p = batch.top_p[req]
    p_on = sampled & (top_p < 1)
    return drop, t64, k, k_on, top_p, p_on


def filter_drop(y: torch.Tensor, m: torch.Tensor, plan: Plan) -> torch.Tensor | None:
    """[T, V] bool: the tokens that min_p -> top_k -> top_p drop (sampled rows only), or None.

    ``y``: the rows before temperature (raw logits in any float dtype, or float32 after bias
    and penalties); ``m``: [T] float32 finite row maxima of ``y``. Decisions are made on ``y``
    itself, never on rounded sums (docs/semantics.md, "Filters in float32"):

    * min_p drops ``y < m + T log(min_p)``, the cut computed in float64 and rounded up to
      float32, so the test is exact for the float32 values;
    * top_k keeps the k largest values by rank alone (lower ids first on ties), with no
      probability sum involved (one top-k of k + 1 values, no sort of the row; a tie pass only
      when the (k+1)-th value equals the k-th);
    * top_p accumulates ``exp((y - m) / T)`` in float64 over the survivors in rank order; a
      token is kept iff the mass ranked before it is < top_p times the survivors' mass
      (float64, relative error about 1e-16 per token, so nothing saturates at 1);
      :func:`_nucleus` ranks only the top candidates.
    """
    v = y.shape[1]
    drop, t64, k, k_on, top_p, p_on = filter_settings(y, m, plan, v)
    rows = k_on | p_on
    if not bool(rows.any()):
        return drop
    every = bool(rows.all())
    idx = None if every else rows.nonzero().squeeze(1)
    sub = y.float() if every else y[idx].float()
    if drop is not None:
        sub = sub.masked_fill(drop if every else drop[idx], -math.inf)
    keep = None  # (None: every finite value of ``sub``)
    k_sub, p_sub = (k_on, p_on) if every else (k_on[idx], p_on[idx])
    if bool(k_sub.any()):
        keep = _top_k_keep(sub, k if every else k[idx], k_sub)
    if bool(p_sub.any()):
        m_p, t_p, top_p = (m, t64, top_p) if every else (m[idx], t64[idx], top_p[idx])
        nucleus = _nucleus(sub, keep, m_p, t_p, top_p)
        if not bool(p_sub.all()):
            nucleus |= ~p_sub[:, None]
        keep = nucleus if keep is None else keep & nucleus
    sub_drop = ~keep
    if every and drop is None:
        return sub_drop
    if drop is None:
        drop = torch.zeros(y.shape, dtype=torch.bool, device=y.device)
    if every:
        return drop | sub_drop
    drop[idx] = drop[idx] | sub_drop
    return drop


def _top_k_keep(sub: torch.Tensor, k: torch.Tensor, k_on: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: the top_k survivors of rows ``sub`` (-inf = dropped already) for the rows
    ``k_on`` ([R] bool; other rows keep every finite value): the k largest values, lower ids
    first on ties. One top-k of k + 1 values finds the k-th value v_k; when the next value is
    smaller (no tie crosses the boundary) the kept set is ``sub >= v_k``, else a tie pass
    keeps the lowest ids of the v_k group."""
    r, v = sub.shape
    kk = torch.where(k_on, k, 1).clamp(1, v - 1)[:, None]
    width = min(int(kk.max()) + 1, v)
    top = torch.topk(sub, width, dim=-1).values
    v_k = torch.where(k_on[:, None], top.gather(1, kk - 1), -math.inf)
    v_next = top.gather(1, kk.clamp_max(width - 1))
    if bool(((v_next < v_k) | (v_k == -math.inf)).all()):
        if bool((v_k > -math.inf).all()):
            return sub >= v_k
        return (sub >= v_k) & (sub > -math.inf)
    above = sub > v_k
    tie = (sub == v_k) & (sub > -math.inf)
    cut = above | (tie & (tie.cumsum(-1) <= kk - above.sum(-1, keepdim=True)))
    return cut | (~k_on[:, None] & (sub > -math.inf))


#: Relative bound on the float32 estimate of a top_p total mass (see :func:`_nucleus`).
NUCLEUS_TOTAL_TOL = 1e-5


def _nucleus(sub: torch.Tensor, keep: torch.Tensor | None, m: torch.Tensor, t64: torch.Tensor,
             top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: the top_p nucleus of the survivors ``keep`` (None: every finite value) of
    rows ``sub`` (float32).

    A token is kept iff the float64 mass of the survivors ranked before it (value, then lower
    id) is < top_p times their total mass. Only the highest-ranked candidates are ranked, by a
    top-k that grows until the boundary token lies inside them (a full sort of the row is the
    last resort): the tie group at the candidates' smallest value may be cut arbitrarily by
    the top-k, so a boundary there counts as not found yet. The candidates' masses are float64;
    the total is first estimated from float32 ``exp((y - m) / T)`` summed in float64, whose
    relative error is below ``2 log(V) 2**-24`` plus exp's ulp (the mean |z| under softmax(z)
    is at most log V), far inside ``NUCLEUS_TOTAL_TOL``: when the kept count is the same at
    both ends of that bound the decision is the exact one, else the total is recomputed in
    float64 from every survivor.
    """
    r, v = sub.shape
    masked = sub if keep is None else sub.masked_fill(~keep, -math.inf)
    m64, t = m.double()[:, None], t64[:, None]
    e32 = torch.sub(masked, m[:, None]).div_(t64.float()[:, None]).exp_()
    total = e32.sum(-1, keepdim=True, dtype=torch.float64)
    goals = (top_p[:, None] * total * (1 - NUCLEUS_TOTAL_TOL),
             top_p[:, None] * total * (1 + NUCLEUS_TOTAL_TOL))
    c = min(v, 64)
    while True:
        cand_v, cand_i = torch.topk(masked, c, dim=-1)
        order = torch.sort(cand_i, dim=-1).indices  # by id, then (stably) by value: rank order
        cand_v, cand_i = cand_v.gather(1, order), cand_i.gather(1, order)
        order = torch.sort(cand_v, dim=-1, descending=True, stable=True).indices
        cand_v, cand_i = cand_v.gather(1, order), cand_i.gather(1, order)
        ce = torch.exp((cand_v.double() - m64) / t)
        before = torch.cumsum(ce, dim=-1) - ce
        live = cand_v > -math.inf
        n_lo, n_hi = (((before < g) & live).sum(-1, keepdim=True).clamp_min(1) for g in goals)
        if not bool((n_lo == n_hi).all()):  # within the bound: the exact float64 total
            e = torch.exp((masked.double() - m64) / t)
            goal = top_p[:, None] * e.sum(-1, keepdim=True)
            n_lo = n_hi = ((before < goal) & live).sum(-1, keepdim=True).clamp_min(1)
            goals = (goal, goal)
        n_keep = n_lo
        last_v = cand_v.gather(1, n_keep - 1)
        found = (n_keep < c) & (last_v > cand_v[:, -1:])
        if c == v or bool(found.all()):
            break
        c = min(v, 8 * c)
    last_i = cand_i.gather(1, n_keep - 1)
    if c > 1 and bool((cand_v.gather(1, n_keep.clamp_max(c - 1)) < last_v).all()):
        return sub >= last_v  # no token of last_v's value ranks after the boundary
    ids = torch.arange(v, device=sub.device)[None, :]
    return (sub > last_v) | ((sub == last_v) & (ids <= last_i))


def process_rows(plan: Plan, *, filters: bool = True,
                 row_max: torch.Tensor | None = None) -> torch.Tensor:
    """The processed float32 logits ``z'`` [T, V] of every row of ``plan`` (semantics.md §2).

    ``z' = (y - max y) / T`` (greedy rows: T = 1; the max maps to exactly 0) where ``y`` is the
    raw row after bans (-inf), logit bias and penalties, then -inf where a filter drops the
    token (:func:`filter_drop`). A row whose bans leave nothing is all -inf. Rows of invalid
    requests must have been sanitised by the caller. ``row_max``: [T] max of the raw rows if
    the caller has it; without bans, logit bias or penalties ``y`` is then the raw logits
    themselves (no float32 copy before the subtraction). On CPU the result is the reusable
    ``workspace`` buffer "z": valid until the thread's next call.
    """
    batch: SamplingBatch = plan.batch
    if row_max is not None and not (batch.needs_bias or batch.needs_penalties
                                    or batch.needs_bans):
        y, m = plan.logits, row_max.float()
    else:
        y = plan.logits.float().clone() if plan.logits.dtype == torch.float32 else (
            plan.logits.float())
        apply_bans(y, plan)
        apply_bias_and_penalties(y, plan)
        m = y.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows stay -inf
    t = batch.temperature[plan.row_req]
    t = torch.where(t > 0, t, torch.ones_like(t))
    drop = filter_drop(y, m, plan) if filters and batch.needs_filter else None
    if y.requires_grad and torch.is_grad_enabled():  # (out= takes no autograd inputs)
        z = torch.sub(y, m[:, None])
    else:
        z = workspace.buffer("z", tuple(y.shape), torch.float32, y.device)
        torch.sub(y, m[:, None], out=z)
    if batch.any_sampled:  # (greedy rows divide by 1)
        z.div_(t[:, None])
    if drop is not None:
        z.masked_fill_(drop, -math.inf)
    return z
