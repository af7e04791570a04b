"""Logprobs inside the Triton path: the emitted token's logprob and the top-n, no [rows, V]
float32 buffer, no sort of a row, no host synchronisation (docs/semantics.md, Outputs).

Two launches over the output grid (request i, position j); only the emitted positions
(j <= num_accepted[i]) of valid requests do work, the others exit at once. (One program per
position, not per request looping over its positions: the per-row work is latency-bound,
and at B = 128 the per-request loop measured 157 us against 129 us for top-5.)

1. ``topn_partial_kernel`` (grid positions x vocabulary splits), for the emitted positions
   that need it (top-n asked for, or raw logprobs whose normaliser the sampling statistics
   do not give: temperature other than 0 / 1, a filter cut, or the general path). Per
   split: the raw row's max and sum of exp (online softmax at temperature 1) when needed,
   and the split's best ``n`` entries by (value descending, id ascending). The statistics
   pass wrote each tile's maximum; the n-th largest of them, L, is a lower bound of the
   n-th largest value, so only tiles whose maximum reaches L are read (about n of a row's
   tiles) and only their entries >= L are extracted into the list.
2. ``logprob_merge_kernel`` (grid positions): column 0 from one gathered logit and the
   normaliser (the sampling statistics' max and log-normaliser, or the merged raw splits),
   columns 1..n by merging the splits' lists; -inf / -1 padding.

Ranking is by the values before normalisation (the raw logits, the general path's processed
float32 logits), so two entries that round to the same logprob keep their exact order; ties
go to the lower id. In processed mode the filters' survivors are a prefix of that order, so
the top-n are the ranked entries while they survive, then the dropped tokens at -inf, lowest
ids first (as the PyTorch backend ranks them).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import rng
from ..plan import Plan

BLOCK_TILE = rng.TILE
NPAD = 32  # most top-n logprobs per request on this path (more take the PyTorch path)
S_MAX = 32  # most vocabulary splits per row of the partial kernel
BIG = tl.constexpr(2147483647)
NPAD_MAX = tl.constexpr(NPAD)


@triton.jit
def _position(p, K1, num_acc_ptr, invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr,
              temp_ptr, cut_v_ptr, cut_i_ptr, FILTERED: tl.constexpr, GENERAL: tl.constexpr):
    """Decode grid position ``p``: (request, row, emitted, raw mode, n wanted, whether the
    partial kernel runs for it, whether the sampling statistics are the raw row's (temperature
    0 / 1, no filter cut, not the general path), the divisor of processed logprobs)."""
    i = p // K1
    j = p % K1
    emitted = (j <= tl.load(num_acc_ptr + i)) & (tl.load(invalid_ptr + i) == 0)
    r = tl.load(row_start_ptr + i) + j
    raw = tl.load(lp_proc_ptr + i) == 0
    n_want = tl.minimum(tl.maximum(tl.load(lp_n_ptr + i), 0), NPAD_MAX).to(tl.int32)
    t = tl.load(temp_ptr + i)
    t_eff = tl.where(t > 0, t, 1.0)
    keep_all = t_eff == 1.0
    if FILTERED:
        cut_v = tl.load(cut_v_ptr + r, mask=emitted, other=-float("inf"))
        cut_i = tl.load(cut_i_ptr + r, mask=emitted, other=BIG)
        keep_all = keep_all & (cut_v == -float("inf")) & (cut_i == BIG)
    if GENERAL:
        keep_all = t_eff < 0.0  # (never)
    need = emitted & ((n_want > 0) | (raw & ~keep_all))
    return i, j, r, emitted, raw, n_want, need, keep_all, t_eff


@triton.jit(do_not_specialize=["K1", "NT", "S", "CPS"])
def topn_partial_kernel(raw_ptr, raw_stride, proc_ptr, proc_stride, V, K1, num_acc_ptr,
                        invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
                        cut_v_ptr, cut_i_ptr, tiletop_ptr, NT, pm_ptr, ps_ptr, cand_v_ptr,
                        cand_i_ptr, S, CPS, FILTERED: tl.constexpr, GENERAL: tl.constexpr,
                        HAS_TOP: tl.constexpr, NT_SORT: tl.constexpr, NPAD: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Per (position, split): the raw row's max and sum exp (temperature 1) when the sampling
    statistics do not give its normaliser, and the split's best ``n`` entries by (value desc,
    id asc) of the row the position ranks (raw logits in raw mode, else the rows sampled from,
    unmasked: merging applies the filters' cut) as [NPAD] lists; slots past ``n`` hold
    (+inf, -1), unfilled ones (-inf, BIG).

    With HAS_TOP (the statistics pass wrote each tile's maximum) the n-th largest tile
    maximum L bounds the n-th largest value from below: only tiles whose maximum reaches L
    are read (about n of them) and only their entries >= L are collected."""
    p = tl.program_id(0)
    s = tl.program_id(1)
    i, j, r, emitted, raw, n_want, need, keep_all, t_eff = _position(
        p, K1, num_acc_ptr, invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
        cut_v_ptr, cut_i_ptr, FILTERED, GENERAL)
    if need:
        full = raw & ~keep_all  # the raw normaliser: every tile
        lo = -float("inf")
        if HAS_TOP:
            t_idx = tl.arange(0, NT_SORT)
            tops = tl.load(tiletop_ptr + r.to(tl.int64) * NT + t_idx, mask=t_idx < NT,
                           other=-float("inf"))
            srt = tl.sort(tops, descending=True)
            lo = tl.max(tl.where(t_idx == n_want - 1, srt, -float("inf")), axis=0)
            if GENERAL:  # (the tile maxima are of the processed rows, not the raw ones)
                lo = tl.where(raw, -float("inf"), lo)
        slots = tl.arange(0, NPAD)
        live_slot = slots < n_want
        bv = tl.where(live_slot, -float("inf"), float("inf"))
        bi = tl.where(live_slot, BIG, -1)
        wv = tl.min(bv, axis=0)
        wi = tl.max(tl.where(bv == wv, bi, -1), axis=0)
        wslot = tl.min(tl.where((bv == wv) & (bi == wi), slots, NPAD), axis=0)
        m = -float("inf")
        acc = 0.0
        lanes = tl.arange(0, BLOCK)
        for c in range(s * CPS, s * CPS + CPS):  # tiles past the row end are fully masked
            read = full
            if HAS_TOP:
                top = tl.load(tiletop_ptr + r.to(tl.int64) * NT + c, mask=c < NT,
                              other=-float("inf"))
                read = read | ((c < NT) & (top >= lo))
            else:
                read = read | (c < NT)
            if read:
                offs = c * BLOCK + lanes
                mask = offs < V
                if raw:
                    x = tl.load(raw_ptr + r.to(tl.int64) * raw_stride + offs, mask=mask,
                                other=-float("inf")).to(tl.float32)
                    if full:
                        cmax = tl.max(x, axis=0)
                        m_new = tl.maximum(m, cmax)
                        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                        acc = acc * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
                        m = m_new
                else:
                    x = tl.load(proc_ptr + r.to(tl.int64) * proc_stride + offs, mask=mask,
                                other=-float("inf")).to(tl.float32)
                rk = x
                ids = tl.where(mask, offs, BIG)
                v = tl.max(rk, axis=0)
                go = (v >= lo) & ((v > wv) | ((v == wv) & (wi == BIG)))
                while go:
                    best_i = tl.min(tl.where(rk == v, ids, BIG), axis=0)
                    ok = (best_i < BIG) & ((v > wv) | ((v == wv) & (best_i < wi)))
                    put = (slots == wslot) & ok
                    bv = tl.where(put, v, bv)
                    bi = tl.where(put, best_i, bi)
                    wv = tl.min(bv, axis=0)
                    wi = tl.max(tl.where(bv == wv, bi, -1), axis=0)
                    wslot = tl.min(tl.where((bv == wv) & (bi == wi), slots, NPAD), axis=0)
                    taken = ids == best_i
                    rk = tl.where(taken, -float("inf"), rk)
                    ids = tl.where(taken, BIG, ids)
                    v = tl.max(rk, axis=0)
                    go = ok & (v >= lo) & ((v > wv) | ((v == wv) & (wi == BIG)))
        o = p.to(tl.int64) * S + s
        tl.store(pm_ptr + o, m)
        tl.store(ps_ptr + o, acc)
        tl.store(cand_v_ptr + o * NPAD + slots, bv)
        tl.store(cand_i_ptr + o * NPAD + slots, bi)


@triton.jit(do_not_specialize=["K1", "S", "NOUT"])
def logprob_merge_kernel(raw_ptr, raw_stride, proc_ptr, proc_stride, V, K1, num_acc_ptr,
                         invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
                         cut_v_ptr, cut_i_ptr, stats_ptr, token_ids_ptr, pm_ptr, ps_ptr,
                         cand_v_ptr, cand_i_ptr, S, out_v_ptr, out_i_ptr, NOUT,
                         FILTERED: tl.constexpr, GENERAL: tl.constexpr, NPAD: tl.constexpr,
                         S_MAX: tl.constexpr, OUT_PAD: tl.constexpr):
    """Per position: column 0 (the emitted token's logprob), columns 1..n (the top-n merged
    from the splits' lists), -inf / -1 elsewhere and at positions not emitted.

    Processed mode with a filter cut: the survivors are a prefix of the row in (value, id)
    order, so the top-n are the merged entries while they survive, then the dropped tokens
    at -inf, lowest ids first (found among the first 2 * NPAD ids)."""
    p = tl.program_id(0)
    i, j, r, emitted, raw, n_want, need, keep_all, t_eff = _position(
        p, K1, num_acc_ptr, invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
        cut_v_ptr, cut_i_ptr, FILTERED, GENERAL)
    cols = tl.arange(0, OUT_PAD)
    o_out = p.to(tl.int64) * NOUT
    start = tl.where(emitted, n_want + 1, 0)
    pad = (cols >= start) & (cols < NOUT)
    tl.store(out_v_ptr + o_out + cols, tl.full([OUT_PAD], -float("inf"), tl.float32), mask=pad)
    tl.store(out_i_ptr + o_out + cols, tl.full([OUT_PAD], -1, tl.int64), mask=pad)
    if emitted:
        tok = tl.load(token_ids_ptr + p)
        m = tl.load(stats_ptr + r.to(tl.int64) * 3)
        logz = tl.load(stats_ptr + r.to(tl.int64) * 3 + 1)
        cut_v = tl.full((), -float("inf"), tl.float32)
        cut_i = tl.full((), BIG, tl.int32)
        div = tl.where(raw, 1.0, t_eff)
        if raw:
            if ~keep_all:  # the partial kernel merged: the raw row's own normaliser
                so = tl.arange(0, S_MAX)
                o_s = p.to(tl.int64) * S + so
                pm = tl.load(pm_ptr + o_s, mask=so < S, other=-float("inf"))
                ps = tl.load(ps_ptr + o_s, mask=so < S, other=0.0)
                m = tl.max(pm, axis=0)
                m_safe = tl.where(m == -float("inf"), 0.0, m)
                logz = tl.log(tl.sum(tl.where(pm == -float("inf"), 0.0,
                                              ps * tl.exp(pm - m_safe)), axis=0))
            x_tok = tl.load(raw_ptr + r.to(tl.int64) * raw_stride + tok).to(tl.float32)
        else:
            x_tok = tl.load(proc_ptr + r.to(tl.int64) * proc_stride + tok).to(tl.float32)
            if FILTERED:
                cut_v = tl.load(cut_v_ptr + r)
                cut_i = tl.load(cut_i_ptr + r)
                keep = (x_tok > cut_v) | ((x_tok == cut_v) & (tok <= cut_i))
                x_tok = tl.where(keep, x_tok, -float("inf"))
        tl.store(out_v_ptr + o_out, (x_tok - m) / div - logz)
        tl.store(out_i_ptr + o_out, tok)
        if n_want > 0:
            c = tl.arange(0, S_MAX * NPAD)
            o_c = p.to(tl.int64) * S * NPAD + c
            ok = c < S * NPAD
            cv = tl.load(cand_v_ptr + o_c, mask=ok, other=-float("inf"))
            ci = tl.load(cand_i_ptr + o_c, mask=ok, other=BIG)
            ci = tl.where(cv == float("inf"), BIG, ci)  # (slots past n)
            cv = tl.where(cv == float("inf"), -float("inf"), cv)
            # the dropped tokens of a filtered row, lowest ids first, and their rank
            low = tl.arange(0, 2 * NPAD)
            dropped = low < 0
            if FILTERED:
                x_low = tl.load(proc_ptr + r.to(tl.int64) * proc_stride + low, mask=low < V,
                                other=0.0).to(tl.float32)
                dropped = (low < V) & ~((x_low > cut_v) | ((x_low == cut_v) & (low <= cut_i)))
            d_rank = tl.cumsum(dropped.to(tl.int32), axis=0) - 1
            kept = tl.zeros((), tl.int32)
            tail = n_want < 0
            for col in range(1, n_want + 1):
                v = tl.max(cv, axis=0)
                best = tl.min(tl.where(cv == v, ci, BIG), axis=0)
                tail = tail | (best == BIG) | ~((v > cut_v) | ((v == cut_v) & (best <= cut_i)))
                if tail:
                    best = tl.min(tl.where(dropped & (d_rank == col - 1 - kept), low, BIG),
                                  axis=0)
                    lp = tl.full((), -float("inf"), tl.float32)
                else:
                    lp = (v - m) / div - logz
                    kept += 1
                found = best < BIG
                tl.store(out_v_ptr + o_out + col, tl.where(found, lp, -float("inf")))
                tl.store(out_i_ptr + o_out + col, tl.where(found, best, -1).to(tl.int64))
                taken = ci == best
                cv = tl.where(taken, -float("inf"), cv)
                ci = tl.where(taken, BIG, ci)


def supported(plan: Plan) -> bool:
    """Whether this path serves ``plan``'s logprobs (at most NPAD top-n per request)."""
    return 0 <= plan.batch.max_logprobs <= NPAD


def emitted_logprobs(plan: Plan, raw: torch.Tensor, proc: torch.Tensor, temp: torch.Tensor,
                     stats: torch.Tensor, filtered: bool, general: bool, cut_v: torch.Tensor,
                     cut_i: torch.Tensor, token_ids: torch.Tensor, num_accepted: torch.Tensor,
                     invalid: torch.Tensor, tile_tops: torch.Tensor | None, splits: int,
                     num_warps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N, K+1, 1+n] float32 and their ids int64 (semantics.md, Outputs).

    ``raw``: [R, V] the rows' raw logits (model dtype, contiguous rows); ``proc``: the rows the
    kernels sampled from (``raw`` itself, or the general path's float32 processed logits);
    ``temp`` [N] the temperatures the kernels used; ``stats`` [R, 3] (max, log-normaliser,
    flags), the filters' cuts and [R, NT] each tile's maximum (None when the statistics
    pass did not write them) from ``draw_rows``; ``token_ids`` [N, K+1] int64,
    ``num_accepted`` [N] int64, ``invalid`` [N] bool: the final outputs; ``splits``: the
    partial kernel's vocabulary splits per row (at most S_MAX). No host synchronisation.
    """
    batch, dev = plan.batch, raw.device
    n, k1 = token_ids.shape
    nout = batch.max_logprobs + 1
    vocab = raw.shape[1]
    p = n * k1
    nt = max(1, math.ceil(vocab / BLOCK_TILE))
    s = max(1, min(splits, S_MAX, nt))
    cps = math.ceil(nt / s)
    s = math.ceil(nt / cps)
    out_v = torch.empty(n, k1, nout, dtype=torch.float32, device=dev)
    out_i = torch.empty(n, k1, nout, dtype=torch.int64, device=dev)
    if p == 0:
        return out_v, out_i
    pm = torch.empty(p, s, dtype=torch.float32, device=dev)
    ps = torch.empty(p, s, dtype=torch.float32, device=dev)
    cand_v = torch.empty(p, s, NPAD, dtype=torch.float32, device=dev)
    cand_i = torch.empty(p, s, NPAD, dtype=torch.int32, device=dev)
    common = (num_accepted, invalid.view(torch.uint8), plan.row_start, batch.logprobs_n,
              batch.logprobs_processed.view(torch.uint8), temp, cut_v, cut_i)
    run_partial = batch.max_logprobs > 0 or general or filtered or any(
        p_.logprobs_mode == "raw" and p_.temperature not in (0.0, 1.0) for p_ in batch.params)
    has_top = tile_tops is not None and batch.max_logprobs > 0
    nt_sort = max(16, triton.next_power_of_2(nt))
    if run_partial:
        topn_partial_kernel[(p, s)](
            raw, raw.stride(0), proc, proc.stride(0), vocab, k1, *common,
            tile_tops if has_top else pm, nt, pm, ps, cand_v, cand_i, s, cps,
            FILTERED=filtered, GENERAL=general, HAS_TOP=has_top, NT_SORT=nt_sort, NPAD=NPAD,
            BLOCK=BLOCK_TILE, num_warps=num_warps)
    logprob_merge_kernel[(p,)](
        raw, raw.stride(0), proc, proc.stride(0), vocab, k1, *common, stats, token_ids, pm, ps,
        cand_v, cand_i, s, out_v, out_i, nout, FILTERED=filtered, GENERAL=general, NPAD=NPAD,
        S_MAX=S_MAX, OUT_PAD=triton.next_power_of_2(NPAD + 1),
        num_warps=4 if num_warps > 1 else 1)
    return out_v, out_i

