"""Logit processors in PyTorch (float32): the general path shared by every backend.

``process_rows`` turns raw logits rows into the processed logits ``z'`` of docs/semantics.md:
logit_bias -> penalties -> temperature (after subtracting the row maximum) -> min_p -> top_k ->
top_p, the filters decided exactly on the float32 values (``filter_drop``). The Triton
backend's general path materialises this float32 tensor and then runs its kernels on it (a
named, counted fallback); the fused path applies temperature inside the kernel.
"""

from __future__ import annotations

import math

import torch

from .params import SamplingBatch
from .plan import Plan


def _output_counts(plan: Plan) -> torch.Tensor:
    """[T, V] float32 counts of output tokens per row: the request's outputs + drafts before j."""
    batch, dev = plan.batch, plan.logits.device
    n, v = batch.num_requests, plan.vocab_size
    per_req = torch.zeros(n, v, dtype=torch.float32, device=dev)
    per_req.index_put_((batch.output_req, batch.output_ids),
                       torch.ones_like(batch.output_ids, dtype=torch.float32), accumulate=True)
    counts = per_req[plan.row_req]
    # Drafts before row j: pairs (row of request i at j, draft j') for j' < j <= k_eff.
    rows, toks = plan.prior_draft_pairs()
    if rows.numel():
        counts.index_put_((rows, toks), torch.ones_like(rows, dtype=torch.float32),
                          accumulate=True)
    return counts


def apply_bias_and_penalties(z: torch.Tensor, plan: Plan) -> torch.Tensor:
    """In place on float32 ``z`` [T, V]: logit_bias, then repetition, frequency, presence."""
    batch = plan.batch
    if batch.needs_bias:
        bias = torch.zeros(batch.num_requests, plan.vocab_size, dtype=torch.float32,
                           device=z.device)
        bias.index_put_((batch.bias_req, batch.bias_ids), batch.bias_val, accumulate=True)
        z += bias[plan.row_req]
    if batch.needs_penalties:
        counts = _output_counts(plan)
        seen = counts > 0
        prompt = torch.zeros(batch.num_requests, plan.vocab_size, dtype=torch.bool,
                             device=z.device)
        prompt[batch.prompt_req, batch.prompt_ids] = True
        rep = batch.repetition_penalty[plan.row_req, None]
        mask = seen | prompt[plan.row_req]
        z.copy_(torch.where(mask, torch.where(z > 0, z / rep, z * rep), z))
        z -= batch.frequency_penalty[plan.row_req, None] * counts
        z -= batch.presence_penalty[plan.row_req, None] * seen
    return z


def _round_up_f32(t: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= each float64 value of ``t`` (so ``y < result`` for a float32
    ``y`` is exactly ``y < t`` in real arithmetic)."""
    t32 = t.float()
    up = torch.nextafter(t32, torch.full_like(t32, math.inf))
    return torch.where(t32.double() < t, up, t32)


def filter_drop(y: torch.Tensor, m: torch.Tensor, plan: Plan) -> torch.Tensor | None:
    """[T, V] bool: the tokens that min_p -> top_k -> top_p drop (sampled rows only), or None.

    ``y``: the rows before temperature (raw logits in any float dtype, or float32 after bias
    and penalties); ``m``: [T] float32 finite row maxima of ``y``. Decisions are made on ``y``
    itself, never on rounded sums (docs/semantics.md, "Filters in float32"):

    * min_p drops ``y < m + T log(min_p)``, the cut computed in float64 and rounded up to
      float32, so the test is exact for the float32 values;
    * top_k keeps the k largest values by rank alone (stable: lower ids first on ties), with no
      probability sum involved;
    * top_p sorts the survivors once and accumulates ``exp((y - m) / T)`` in float64; a token
      is kept iff the mass ranked before it is < top_p times the survivors' mass (float64,
      relative error about 1e-16 per token, so nothing saturates at 1).
    """
    batch = plan.batch
    req = plan.row_req
    v = y.shape[1]
    sampled = batch.temperature[req] > 0
    t64 = batch.temperature[req].double()
    drop = None
    min_p = batch.min_p[req]
    on = sampled & (min_p > 0)
    if bool(on.any()):
        cut = _round_up_f32(m.double() + t64 * torch.log(torch.where(on, min_p, 1.0)))
        drop = on[:, None] & (y < cut[:, None])
    k = batch.top_k[req]
    k_on = sampled & (k > 0) & (k < v)
    top_p = batch.top_p[req]
    p_on = sampled & (top_p < 1)
    rows = k_on | p_on
    if not bool(rows.any()):
        return drop
    idx = rows.nonzero().squeeze(1)
    sub = y[idx].float()
    if drop is not None:
        sub = sub.masked_fill(drop[idx], -math.inf)
    vals, order = torch.sort(sub, dim=-1, descending=True, stable=True)
    keep = vals > -math.inf
    rank = torch.arange(v, device=y.device)[None, :]
    keep &= ~k_on[idx, None] | (rank < k[idx, None])
    if bool(p_on.any()):
        e = torch.exp((vals.double() - m[idx, None].double()) / t64[idx, None])
        e = torch.where(keep, e, 0.0)
        before = torch.cumsum(e, dim=-1) - e
        total = e.sum(dim=-1, keepdim=True)
        keep &= ~p_on[idx, None] | (before < top_p[idx, None] * total)
    sub_drop = torch.zeros_like(keep).scatter_(1, order, ~keep)
    if drop is None:
        drop = torch.zeros(y.shape, dtype=torch.bool, device=y.device)
    drop[idx] = sub_drop
    return drop


def process_rows(plan: Plan, *, filters: bool = True,
                 row_max: torch.Tensor | None = None) -> torch.Tensor:
    """The processed float32 logits ``z'`` [T, V] of every row of ``plan`` (semantics.md §2).

    ``z' = (y - max y) / T`` (greedy rows: T = 1; the max maps to exactly 0) where ``y`` is the
    raw row after logit bias and penalties, then -inf where a filter drops the token
    (:func:`filter_drop`). Rows of invalid requests must have been sanitised by the caller.
    ``row_max``: [T] max of the raw rows if the caller has it; without logit bias or
    penalties ``y`` is then the raw logits themselves (no float32 copy before the subtraction).
    """
    batch: SamplingBatch = plan.batch
    if row_max is not None and not (batch.needs_bias or batch.needs_penalties):
        y, m = plan.logits, row_max.float()
    else:
        y = plan.logits.float().clone() if plan.logits.dtype == torch.float32 else (
            plan.logits.float())
        apply_bias_and_penalties(y, plan)
        m = y.amax(dim=-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows stay -inf
    t = batch.temperature[plan.row_req]
    t = torch.where(t > 0, t, torch.ones_like(t))
    drop = filter_drop(y, m, plan) if filters and batch.needs_filter else None
    z = torch.sub(y, m[:, None]).div_(t[:, None])
    if drop is not None:
        z.masked_fill_(drop, -math.inf)
    return z
