"""Logit processors in PyTorch (float32): the general path shared by every backend.

``process_rows`` turns raw logits rows into the processed logits ``z'`` of docs/semantics.md:
logit_bias -> penalties -> temperature (after subtracting the row maximum) -> min_p -> top_k ->
top_p. The Triton backend's general path materialises this float32 tensor and then runs its
kernels on it (a named, counted fallback); the fused path applies temperature inside the kernel.
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


def apply_temperature(z: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``(z - max) / T`` per row, in place; rows with T == 0 get ``z - max`` (T = 1).

    ``temperature``: [T] float32 per row. Subtracting the maximum first keeps every T > 0 safe
    in float32: the largest logit maps to 0, nothing overflows to +inf.
    """
    m = z.amax(dim=-1, keepdim=True)
    z -= torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows stay -inf
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    z /= t[:, None]
    return z


def apply_filters(z: torch.Tensor, plan: Plan) -> torch.Tensor:
    """min_p -> top_k -> top_p on sampled rows of max-0 processed logits ``z`` (in place)."""
    batch = plan.batch
    req = plan.row_req
    sampled = batch.temperature[req] > 0
    min_p = torch.where(sampled, batch.min_p[req], torch.zeros_like(batch.min_p[req]))
    if bool((min_p > 0).any()):
        log_min_p = torch.log(min_p)  # -inf where off (masked below); no clamp: exact
        z.masked_fill_((min_p[:, None] > 0) & (z < log_min_p[:, None]), -math.inf)
    top_k = torch.where(sampled, batch.top_k[req], torch.zeros_like(batch.top_k[req]))
    top_p = torch.where(sampled, batch.top_p[req], torch.ones_like(batch.top_p[req]))
    rows = ((top_k > 0) & (top_k < plan.vocab_size)) | (top_p < 1)
    if not bool(rows.any()):
        return z
    idx = rows.nonzero().squeeze(1)
    sub = z[idx]
    vals, order = torch.sort(sub, dim=-1, descending=True, stable=True)
    rank = torch.arange(sub.shape[1], device=z.device)[None, :]
    k = top_k[idx]
    keep = (k[:, None] <= 0) | (rank < k[:, None])
    vals = vals.masked_fill(~keep, -math.inf)
    probs = torch.softmax(vals, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    keep &= before < top_p[idx, None]
    drop = torch.zeros_like(keep).scatter_(1, order, ~keep)
    z[idx] = sub.masked_fill(drop, -math.inf)
    return z


def process_rows(plan: Plan, *, filters: bool = True,
                 row_max: torch.Tensor | None = None) -> torch.Tensor:
    """The processed float32 logits ``z'`` [T, V] of every row of ``plan`` (semantics.md §2).

    Rows of invalid requests must have been sanitised by the caller. ``row_max``: [T] max of
    the raw rows if the caller has it; without logit bias or penalties the result is then one
    subtraction and an in-place scaling, ``z' = (x - max) * (1 / T)`` (greedy rows: T = 1;
    the max maps to exactly 0).
    """
    batch: SamplingBatch = plan.batch
    if row_max is not None and not (batch.needs_bias or batch.needs_penalties):
        m = row_max.float()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        t = batch.temperature[plan.row_req]
        inv_t = 1.0 / torch.where(t > 0, t, torch.ones_like(t))
        z = torch.sub(plan.logits, m[:, None]).mul_(inv_t[:, None])
        if filters and batch.needs_filter:
            apply_filters(z, plan)
        return z
    z = plan.logits.float().clone() if plan.logits.dtype == torch.float32 else (
        plan.logits.float())
    apply_bias_and_penalties(z, plan)
    apply_temperature(z, batch.temperature[plan.row_req])
    if filters and batch.needs_filter:
        apply_filters(z, plan)
    return z
