"""Logprobs inside the Triton path: the emitted token's logprob and the top-n, no [rows, V]
float32 buffer, no sort of a row, no host synchronisation (docs/semantics.md, Outputs).

The top-n rest on the statistics pass's tile maxima. Rank a row's tiles by (maximum
descending, tile ascending): the tile of rank q holds at most n - q of the row's top n
entries (the q tiles ranked above it each hold an entry, their maximum, that beats every
entry of it), and no entry below L, the maximum of the tile of rank n - 1, is among them.
So the top n lie in the n best-ranked tiles, at most n(n+1)/2 candidates in all.

1. ``rank_tiles`` (inside ``kernels.sample_kernel``, per row of a request that asks for
   top-n): sorts the row's tile maxima as one int64 key each and writes the n best tiles and
   L.
2. ``topn_partial_kernel`` (grid emitted positions x max(n, splits)): program q takes the
   tile of rank q and extracts its best n - q entries >= L, one reduction of packed
   (value, id) keys per entry; and, when the sampling statistics do not give the raw row's
   normaliser (raw logprobs with a temperature other than 0 / 1, a filter cut, or the
   general path's processed rows), split q's max and sum of exp at temperature 1.
3. ``logprob_merge_kernel`` (grid positions): column 0 from one gathered logit and the
   normaliser, columns 1..n by extracting the best keys of the position's candidates;
   -inf / -1 padding. Positions past the accepted prefix exit at once in every kernel.

When the batch wants column 0 alone and the statistics give it (:func:`in_finish`),
neither kernel runs: the requests' finish (``kernels.finish_kernel``, or the single launch's)
writes column 0 with the tokens (and ``kernels._residual_draw`` at a redrawn
correction), saving a launch.

Ranking is by the values before normalisation (the raw logits, the general path's processed
float32 logits), so two entries that round to the same logprob keep their exact order; ties
go to the lower id. In processed mode the filters' survivors are a prefix of that order, so
the top-n are the ranked entries while they survive, then the dropped tokens at -inf, lowest
ids first (as the PyTorch backend ranks them). Raw top-n on the general path (whose tile
maxima are of the processed rows) take the PyTorch path.

When the kernels apply bans, logit_bias and penalties (``penalties``; PEN), the tile maxima
are of the processed rows z, and every value these kernels read is processed again where it
is read (a tile by ``penalties.process``, a token by ``penalties.process_at``: the same
float32 bits). With logit_bias or penalties processed top-n rank by z' = (z - m) / T as the
PyTorch backend does (ZRANK; ``rank_tiles`` ranks the tiles by the z' maxima of the
filtered row): the filters' dropped tokens are set to -inf before that division, only
finite entries are candidates, and every -inf entry comes from the lowest ids.
Raw top-n rank the raw row, whose tile maxima the processed statistics do not give: the
raw normaliser's pass writes them (RAWTOP) and ``raw_topn_kernel`` ranks and extracts
them, one launch more.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import rng, workspace
from ..params import MAX_FUSED_TOP_N
from ..plan import Plan
from .launch import launch, wait_for_prior_grid
from .penalties import process, process_at, setup

BLOCK_TILE = rng.TILE
TILE_C = tl.constexpr(BLOCK_TILE)
NPAD = MAX_FUSED_TOP_N  # most top-n logprobs per request on this path (more: PyTorch code)
CAND = NPAD * (NPAD + 1) // 2  # candidates per position: n(n+1)/2 at most
S_MAX = 32  # most vocabulary splits per row for the raw normaliser
BIG = tl.constexpr(2147483647)
NPAD_MAX = tl.constexpr(NPAD)
# below every key of a value (-inf's key is about -2**63 + 2**55)
EMPTY = tl.constexpr(-9223372036854775807)


@triton.jit
def _key(v, ids):
    """One int64 per (value, id) whose order is (value descending, id ascending): the float's
    bits made order-preserving as a signed integer, above BIG - id. -0.0 counts as 0.0."""
    b = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    o = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (o.to(tl.int64) << 32) | (2147483647 - ids.to(tl.int64))  # (BIG - id)


@triton.jit
def _unkey(k):
    """(value float32, id int32) of a key from :func:`_key`."""
    o = (k >> 32).to(tl.int32)
    b = o ^ ((o >> 31) & 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True), (2147483647 - (k & 0xFFFFFFFF)).to(tl.int32)


@triton.jit
def rank_tiles(tiletop_ptr, r, NT, rank_ptr, count_ptr, m, t, cut_v, cut_i,
               NT_SORT: tl.constexpr, NPAD: tl.constexpr, ZRANK: tl.constexpr):
    """Row ``r``'s NPAD best tiles by (maximum desc, tile asc) as keys (``_key`` of (maximum,
    tile), EMPTY past the row's tiles) into rank[r], and its candidate count reset to 0.
    ZRANK: the maxima of the row as processed top-n rank it when the batch sets logit_bias or
    penalties: a tile whose maximum the filters' cut (cut_v, cut_i) drops is all dropped and
    ranks at -inf (the tile that holds id cut_i keeps its maximum: token cut_i is kept at
    cut_v), and the others as z' = (z - m) / t (``m`` the row's maximum, ``t`` its
    temperature, 1 for greedy rows; IEEE division, as PyTorch's). So the tiles rank by the
    maxima of the filtered row in z', the order the candidates are extracted in."""
    t_idx = tl.arange(0, NT_SORT)
    tops = tl.load(tiletop_ptr + r.to(tl.int64) * NT + t_idx, mask=t_idx < NT,
                   other=-float("inf"))
    if ZRANK:
        gone = (tops < cut_v) | ((tops == cut_v) & (t_idx * TILE_C > cut_i))
        tops = tl.div_rn(tl.where(gone, -float("inf"), tops) - m, t)
    srt = tl.sort(tl.where(t_idx < NT, _key(tops, t_idx), EMPTY), descending=True)
    tl.store(rank_ptr + r.to(tl.int64) * NPAD + t_idx, srt, mask=t_idx < NPAD)
    tl.store(count_ptr + r, 0)


@triton.jit
def _position(p, K1, num_acc_ptr, invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr,
              temp_ptr, cut_v_ptr, cut_i_ptr, filtered, GENERAL: tl.constexpr):
    """Decode grid position ``p``: (request, row, emitted, raw mode, n wanted, whether the
    sampling statistics are the raw row's (temperature 0 / 1, no filter cut, rows not
    processed: GENERAL is the general path's rows or the kernels' processing), the divisor of
    processed logprobs)."""
    i = p // K1
    j = p % K1
    emitted = (j <= tl.load(num_acc_ptr + i)) & (tl.load(invalid_ptr + i) == 0)
    r = tl.load(row_start_ptr + i) + j
    raw = tl.load(lp_proc_ptr + i) == 0
    n_want = tl.minimum(tl.maximum(tl.load(lp_n_ptr + i), 0), NPAD_MAX).to(tl.int32)
    t = tl.load(temp_ptr + i)
    t_eff = tl.where(t > 0, t, 1.0)
    keep_all = t_eff == 1.0
    if filtered:
        cut_v = tl.load(cut_v_ptr + r, mask=emitted, other=-float("inf"))
        cut_i = tl.load(cut_i_ptr + r, mask=emitted, other=BIG)
        keep_all = keep_all & (cut_v == -float("inf")) & (cut_i == BIG)
    if GENERAL:
        keep_all = t_eff < 0.0  # (never)
    return i, j, r, emitted, raw, n_want, keep_all, t_eff


@triton.jit
def _survives(x, ids, cut_v, cut_i):
    """Whether values ``x`` at ``ids`` are among the filters' survivors (the cut of
    ``filters.select_kernel``): a prefix of the row in rank order, up to the token (cut_v,
    cut_i). Unfiltered rows have cut (-inf, INT_MAX)."""
    return (x > cut_v) | ((x == cut_v) & (ids <= cut_i))


@triton.jit
def _ranked_values(x, offs, lo, hi, i, j, m, t, cut_v, cut_i, pen, PEN: tl.constexpr,
                   ZRANK: tl.constexpr):
    """The values processed top-n rank row ``j`` of request ``i`` by, at ids ``offs`` (lo <=
    offs < hi) from its raw float32 values ``x`` (NaN lanes, the caller's padding, stay NaN):
    with PEN the processed z (``penalties.process``), with ZRANK then z' = (z - m) / t with
    the filters' dropped tokens at -inf."""
    if PEN:
        x, _ = process(x, offs, lo, hi, i, j, setup(lo, i, j, pen), pen, PEN == 2)
        if ZRANK:
            x = tl.where(_survives(x, offs, cut_v, cut_i) | (x != x), x, -float("inf"))
            x = tl.div_rn(x - m, t)
    return x


@triton.jit
def _append_tile(x, offs, v, lo, n_left, p, r, count_ptr, cand_ptr, finite_only,
                 NPAD: tl.constexpr, CAND: tl.constexpr):
    """Append the best ``n_left`` entries >= ``lo`` of a tile (values ``x`` at ids ``offs``,
    NaN where nothing is; ``v`` its maximum) to position ``p``'s candidates, in key order:
    per entry one minimum of ids (the lowest id at the value) and one maximum of what is
    left >= lo; finite entries only when ``finite_only``. One atomic add on row ``r``'s
    count places them."""
    slots = tl.arange(0, NPAD)
    got = tl.full([NPAD], EMPTY, tl.int64)
    c = 0
    best = tl.min(tl.where(x == v, offs, BIG), axis=0)
    more = (best < BIG) & (v >= lo) & ((v > -float("inf")) | (finite_only == 0))
    while (c < n_left) & more:
        got = tl.where(slots == c, _key(v, best), got)
        x = tl.where(offs == best, float("nan"), x)
        c += 1
        v = tl.max(tl.where(x >= lo, x, -float("inf")), axis=0)
        best = tl.min(tl.where(x == v, offs, BIG), axis=0)
        more = (best < BIG) & (v >= lo) & ((v > -float("inf")) | (finite_only == 0))
    if c > 0:
        at = tl.atomic_add(count_ptr + r, c)
        tl.store(cand_ptr + p.to(tl.int64) * CAND + at + slots, got, mask=slots < c)


@triton.jit(do_not_specialize=["K1", "S", "CPS", "G", "NT", "filtered", "BW", "KP", "AV"])
def topn_partial_kernel(raw_ptr, raw_stride, proc_ptr, proc_stride, V, K1, num_acc_ptr,
                        invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
                        cut_v_ptr, cut_i_ptr, stats_ptr, rank_ptr, count_ptr, pm_ptr, ps_ptr,
                        cand_ptr, rawtop_ptr, NT, S, CPS, G, filtered,
                        rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr,
                        bids_ptr, bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
                        aslot_ptr, amask_ptr, AV,
                        GENERAL: tl.constexpr, PEN: tl.constexpr, ZRANK: tl.constexpr,
                        RAWTOP: tl.constexpr, NPAD: tl.constexpr, CAND: tl.constexpr,
                        BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Program (position, q) of an emitted position: for each rank rq = q, q + G, ... below
    n, the best n - rq entries >= L of the tile of rank rq (``rank_tiles``) of the row the
    position ranks (the rows sampled from, unmasked: merging applies the filters' cut; with
    PEN processed as they load, and with ZRANK as z' with the dropped tokens at -inf, finite
    entries only), appended as keys to the position's candidates (an atomic count per row;
    n(n+1)/2 at most, so never past CAND); with q < S when the raw normaliser is needed, the
    raw row's max and sum of exp over split q (CPS tiles), and with RAWTOP (raw top-n with
    PEN, whose tiles the processed statistics do not rank) each of those tiles' raw maximum
    into rawtop [positions, NT] for ``raw_topn_kernel``, which extracts raw top-n.

    The extraction starts from the tile's maximum (its rank key holds it)."""
    wait_for_prior_grid(GDC)
    p = tl.program_id(0)
    q = tl.program_id(1)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV)
    i, j, r, emitted, raw, n_want, keep_all, t_eff = _position(
        p, K1, num_acc_ptr, invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
        cut_v_ptr, cut_i_ptr, filtered, GENERAL)
    lanes = tl.arange(0, BLOCK)
    if emitted & raw & ~keep_all & (q < S):
        m = -float("inf")
        acc = 0.0
        for c in range(q * CPS, q * CPS + CPS):  # tiles past the row end are fully masked
            offs = c * BLOCK + lanes
            x = tl.load(raw_ptr + r.to(tl.int64) * raw_stride + offs, mask=offs < V,
                        other=-float("inf")).to(tl.float32)
            x_max = tl.max(x, axis=0)
            if RAWTOP:
                tl.store(rawtop_ptr + p.to(tl.int64) * NT + c, x_max, mask=c < NT)
            m_new = tl.maximum(m, x_max)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            acc = acc * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
            m = m_new
        o = p.to(tl.int64) * S + q
        tl.store(pm_ptr + o, m)
        tl.store(ps_ptr + o, acc)
    # (programs q >= G only compute normaliser splits; raw top-n with PEN: raw_topn_kernel)
    if emitted & (q < n_want) & (q < G) & ~(raw & (PEN != 0)):
        o_rank = r.to(tl.int64) * NPAD
        k_lo = tl.load(rank_ptr + o_rank + n_want - 1)
        lo, _ = _unkey(k_lo)
        lo = tl.where(k_lo == EMPTY, -float("inf"), lo)
        m_row = 0.0
        cut_v = -float("inf")
        cut_i = 2147483647
        if ZRANK:
            m_row = tl.load(stats_ptr + r.to(tl.int64) * 3)
            if filtered:
                cut_v = tl.load(cut_v_ptr + r)
                cut_i = tl.load(cut_i_ptr + r)
        for rq in range(q, n_want, G):  # the ranks this program takes
            k_tile = tl.load(rank_ptr + o_rank + rq)
            if k_tile != EMPTY:
                v, tile = _unkey(k_tile)
                offs = tile * BLOCK + lanes
                # (NaN: past the row, or taken; never >= L nor equal to a value)
                x = tl.load(proc_ptr + r.to(tl.int64) * proc_stride + offs, mask=offs < V,
                            other=float("nan")).to(tl.float32)
                x = _ranked_values(x, offs, tile * BLOCK, tile * BLOCK + BLOCK, i, j, m_row,
                                   t_eff, cut_v, cut_i, pen, PEN, ZRANK)
                # (with ZRANK the -inf entries come from the lowest ids: _emit_sorted)
                _append_tile(x, offs, v, lo, n_want - rq, p, r, count_ptr, cand_ptr,
                             ZRANK, NPAD, CAND)


@triton.jit(do_not_specialize=["K1", "NT", "G", "filtered"])
def raw_topn_kernel(raw_ptr, raw_stride, V, K1, num_acc_ptr, invalid_ptr, row_start_ptr,
                    lp_n_ptr, lp_proc_ptr, temp_ptr, cut_v_ptr, cut_i_ptr, count_ptr,
                    cand_ptr, rawtop_ptr, NT, G, filtered, NT_SORT: tl.constexpr,
                    NPAD: tl.constexpr, CAND: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Raw top-n of the emitted positions in raw mode when the kernels process the rows (so
    that the statistics pass's tile maxima are of the processed rows): program (position, q)
    ranks the position's raw tile maxima (``topn_partial_kernel``'s rawtop, as
    ``rank_tiles`` ranks) and appends the best n - rq entries >= L of the raw tiles of rank
    rq = q, q + G, ... below n to its candidates."""
    wait_for_prior_grid(GDC)
    p = tl.program_id(0)
    q = tl.program_id(1)
    i, j, r, emitted, raw, n_want, keep_all, t_eff = _position(
        p, K1, num_acc_ptr, invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
        cut_v_ptr, cut_i_ptr, filtered, True)
    if emitted & raw & (q < n_want):
        t_idx = tl.arange(0, NT_SORT)
        tops = tl.load(rawtop_ptr + p.to(tl.int64) * NT + t_idx, mask=t_idx < NT,
                       other=-float("inf"))
        srt = tl.sort(tl.where(t_idx < NT, _key(tops, t_idx), EMPTY), descending=True)
        k_lo = tl.sum(tl.where(t_idx == n_want - 1, srt, 0), axis=0)
        lo, _ = _unkey(k_lo)
        lo = tl.where(k_lo == EMPTY, -float("inf"), lo)
        lanes = tl.arange(0, BLOCK)
        for rq in range(q, n_want, G):
            k_tile = tl.sum(tl.where(t_idx == rq, srt, 0), axis=0)
            if k_tile != EMPTY:
                v, tile = _unkey(k_tile)
                offs = tile * BLOCK + lanes
                x = tl.load(raw_ptr + r.to(tl.int64) * raw_stride + offs, mask=offs < V,
                            other=float("nan")).to(tl.float32)
                _append_tile(x, offs, v, lo, n_want - rq, p, r, count_ptr, cand_ptr, 0,
                             NPAD, CAND)


@triton.jit
def _emit_sorted(keys, n_want, m, div, logz, cut_v, cut_i, proc_ptr, proc_stride, r, V,
                 out_v_ptr, out_i_ptr, o_out, cols, filtered, raw, i, j, t, pen,
                 NPAD: tl.constexpr, PEN: tl.constexpr, ZRANK: tl.constexpr):
    """Columns 1..n of one position from its candidate keys (any order, EMPTY padding): the
    best while they survive the filters' cut (a prefix), then the dropped tokens at -inf,
    lowest ids first (found among the first 2 * NPAD ids), then -inf / -1. With ZRANK, at a
    position in processed mode (not ``raw``), the keys hold z' (``m`` the row's maximum,
    used for the lowest ids' z' only), the survivors are the finite ones and every -inf
    token comes from the lowest ids."""
    srt = tl.sort(keys, descending=True)
    v, ids = _unkey(srt)
    idx = tl.arange(0, keys.shape[0])
    zr = ZRANK & ~raw
    surv = (srt != EMPTY) & tl.where(zr, v > -float("inf"), _survives(v, ids, cut_v, cut_i))
    vals = tl.where(zr, v - logz, (v - m) / div - logz)
    kept = tl.sum((surv & (idx < n_want)).to(tl.int32), axis=0)
    live = idx < kept
    tl.store(out_v_ptr + o_out + 1 + idx, vals, mask=live)
    tl.store(out_i_ptr + o_out + 1 + idx, ids.to(tl.int64), mask=live)
    filled = kept
    if (filtered & ~raw) | zr:  # (processed positions; raw mode has no cut)
        low = tl.arange(0, 2 * NPAD)
        x_low = tl.load(proc_ptr + r.to(tl.int64) * proc_stride + low, mask=low < V,
                        other=0.0).to(tl.float32)
        x_low = _ranked_values(x_low, low, 0, 2 * NPAD, i, j, m, t, cut_v, cut_i, pen, PEN,
                               ZRANK)
        if ZRANK:
            dropped = (low < V) & (x_low == -float("inf"))
        else:
            dropped = (low < V) & ~_survives(x_low, low, cut_v, cut_i)
        col = kept + tl.cumsum(dropped.to(tl.int32), axis=0)  # 1-based
        put = dropped & (col <= n_want)
        tl.store(out_v_ptr + o_out + col, tl.full([2 * NPAD], -float("inf"), tl.float32),
                 mask=put)
        tl.store(out_i_ptr + o_out + col, low.to(tl.int64), mask=put)
        filled += tl.sum(put.to(tl.int32), axis=0)
    rest = (cols > filled) & (cols <= n_want)
    tl.store(out_v_ptr + o_out + cols, tl.full(cols.shape, -float("inf"), tl.float32),
             mask=rest)
    tl.store(out_i_ptr + o_out + cols, tl.full(cols.shape, -1, tl.int64), mask=rest)


@triton.jit(do_not_specialize=["K1", "S", "NOUT", "filtered", "BW", "KP", "AV"])
def logprob_merge_kernel(raw_ptr, raw_stride, proc_ptr, proc_stride, V, K1, num_acc_ptr,
                         invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
                         cut_v_ptr, cut_i_ptr, stats_ptr, token_ids_ptr, pm_ptr, ps_ptr,
                         cand_ptr, count_ptr, S, out_v_ptr, out_i_ptr, NOUT, filtered,
                         rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr,
                         bids_ptr, bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
                         aslot_ptr, amask_ptr, AV,
                         GENERAL: tl.constexpr, PEN: tl.constexpr, ZRANK: tl.constexpr,
                         NPAD: tl.constexpr, CAND: tl.constexpr, CAND_PAD: tl.constexpr,
                         SMALL: tl.constexpr, S_MAX: tl.constexpr, OUT_PAD: tl.constexpr,
                         GDC: tl.constexpr):
    """Per position: column 0 (the emitted token's logprob; with PEN its processed value from
    ``penalties.process_at``), columns 1..n (``_emit_sorted`` of its candidates when at most
    SMALL hold them, as they usually do, else of the best n of its up to CAND_PAD), -inf / -1
    elsewhere and at positions not emitted."""
    wait_for_prior_grid(GDC)
    p = tl.program_id(0)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV)
    tok = tl.load(token_ids_ptr + p)  # (with the position's scalars: one round of loads fewer)
    i, j, r, emitted, raw, n_want, keep_all, t_eff = _position(
        p, K1, num_acc_ptr, invalid_ptr, row_start_ptr, lp_n_ptr, lp_proc_ptr, temp_ptr,
        cut_v_ptr, cut_i_ptr, filtered, GENERAL)
    cols = tl.arange(0, OUT_PAD)
    o_out = p.to(tl.int64) * NOUT
    start = tl.where(emitted, n_want + 1, 0)
    pad = (cols >= start) & (cols < NOUT)
    tl.store(out_v_ptr + o_out + cols, tl.full([OUT_PAD], -float("inf"), tl.float32), mask=pad)
    tl.store(out_i_ptr + o_out + cols, tl.full([OUT_PAD], -1, tl.int64), mask=pad)
    if emitted:
        m = tl.load(stats_ptr + r.to(tl.int64) * 3)
        logz = tl.load(stats_ptr + r.to(tl.int64) * 3 + 1)
        cut_v = tl.full((), -float("inf"), tl.float32)
        cut_i = tl.full((), BIG, tl.int32)
        div = tl.where(raw, 1.0, t_eff)
        m_row = m
        if raw:
            if ~keep_all:  # the partial kernel's splits: the raw row's own normaliser
                so = tl.arange(0, S_MAX)
                o_s = p.to(tl.int64) * S + so
                pm = tl.load(pm_ptr + o_s, mask=so < S, other=-float("inf"))
                ps = tl.load(ps_ptr + o_s, mask=so < S, other=0.0)
                m = tl.max(pm, axis=0)
                m_safe = tl.where(m == -float("inf"), 0.0, m)
                logz = tl.log(tl.sum(tl.where(pm == -float("inf"), 0.0,
                                              ps * tl.exp(pm - m_safe)), axis=0))
            val = tl.load(raw_ptr + r.to(tl.int64) * raw_stride + tok).to(tl.float32) - m - logz
        else:
            x_tok = tl.load(proc_ptr + r.to(tl.int64) * proc_stride + tok).to(tl.float32)
            if PEN:  # (two lanes, lane 0 the token's: process_at takes vectors)
                two = tl.arange(0, 2)
                x_tok = tl.max(tl.where(two == 0, process_at(
                    x_tok + tl.zeros([2], tl.float32), tok + two * 0, i, j + two * 0,
                    two == 0, pen, PEN == 2), -float("inf")), axis=0)
            if filtered:
                cut_v = tl.load(cut_v_ptr + r)
                cut_i = tl.load(cut_i_ptr + r)
                x_tok = tl.where(_survives(x_tok, tok, cut_v, cut_i), x_tok, -float("inf"))
            if ZRANK:
                val = tl.div_rn(x_tok - m, t_eff) - logz
            else:
                val = (x_tok - m) / div - logz
        tl.store(out_v_ptr + o_out, val)
        tl.store(out_i_ptr + o_out, tok)
        if n_want > 0:
            count = tl.load(count_ptr + r)
            o_c = p.to(tl.int64) * CAND
            cs = tl.arange(0, SMALL)
            if count <= SMALL:
                keys = tl.load(cand_ptr + o_c + cs, mask=cs < count, other=EMPTY)
            else:  # (rare) their best n, one maximum at a time: no sort of CAND_PAD keys,
                cb = tl.arange(0, CAND_PAD)  # whose code took seconds to compile
                pool = tl.load(cand_ptr + o_c + cb, mask=cb < count, other=EMPTY)
                keys = tl.full([SMALL], EMPTY, tl.int64)
                for c in range(0, n_want):
                    best = tl.max(pool, axis=0)  # (keys are distinct: one id each)
                    keys = tl.where(cs == c, best, keys)
                    pool = tl.where(pool == best, EMPTY, pool)
            if ZRANK:  # (processed: the row's maximum, for the z' of its lowest ids)
                m = tl.where(raw, m, m_row)
            _emit_sorted(keys, n_want, m, div, logz, cut_v, cut_i, proc_ptr, proc_stride, r,
                         V, out_v_ptr, out_i_ptr, o_out, cols, filtered, raw, i, j, t_eff,
                         pen, NPAD, PEN, ZRANK)


def supported(plan: Plan, general: bool) -> bool:
    """Whether this path serves ``plan``'s logprobs: at most NPAD top-n per request; on the
    general path (whose tile maxima are of the processed rows z') no raw top-n, and processed
    top-n only when logit_bias or penalties make z' the order they rank by (semantics.md;
    with bans alone they rank by the raw logits). With the processing in the kernels
    (``general`` False) every case."""
    batch = plan.batch
    if not 0 <= batch.max_logprobs <= NPAD:
        return False
    if not general or batch.max_logprobs == 0:
        return True
    if any(p.logprobs_mode == "raw" and (p.logprobs or 0) > 0 for p in batch.params):
        return False
    return batch.needs_bias or batch.needs_penalties


def ranks_by_z_prime(batch) -> bool:
    """Whether processed top-n rank by z' = (z - m) / T rather than by z (docs/semantics.md,
    Outputs): when the batch sets logit_bias or penalties, as the PyTorch backend ranks."""
    return batch.needs_bias or batch.needs_penalties


def _needs_raw_normaliser(plan: Plan, general: bool, filtered: bool) -> bool:
    """Whether a request in raw mode (column 0 is filled for every request, raw by default)
    needs a normaliser the sampling statistics do not give (temperature other than 0 / 1, a
    filter cut, or the general path's processed rows)."""
    return any(p.logprobs_mode == "raw" and (
        general or filtered or p.temperature not in (0.0, 1.0)) for p in plan.batch.params)


def in_finish(plan: Plan, general: bool, filtered: bool) -> bool:
    """Whether the batch's logprobs are column 0 alone (logprobs = 0) from the sampling
    statistics, which the requests' finish (``kernels.finish_kernel``) writes with the
    tokens: no launch of their own (the fused path only, no raw normaliser to compute)."""
    return (plan.batch.max_logprobs == 0 and not general
            and not _needs_raw_normaliser(plan, False, filtered))


def emitted_logprobs(plan: Plan, raw: torch.Tensor, proc: torch.Tensor, temp: torch.Tensor,
                     stats: torch.Tensor, filtered: bool, general: bool, cut_v: torch.Tensor,
                     cut_i: torch.Tensor, token_ids: torch.Tensor, num_accepted: torch.Tensor,
                     invalid: torch.Tensor, ranking: tuple[torch.Tensor, torch.Tensor] | None,
                     splits: int, num_warps: int, programs: int, pen: tuple
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N, K+1, 1+n] float32 and their ids int64 (semantics.md, Outputs).

    ``raw``: [R, V] the rows' raw logits (model dtype, contiguous rows); ``proc``: the rows the
    kernels sampled from (``raw`` itself, or the general path's float32 processed logits);
    ``temp`` [N] the temperatures the kernels used; ``stats`` [R, 3] (max, log-normaliser,
    flags), the filters' cuts and ``ranking`` ([R, NPAD] int64 each row's best tiles as keys,
    [R] int32 candidate counts: ``rank_tiles``, None when no request asks for top-n) from
    ``draw_rows``;
    ``token_ids`` [N, K+1] int64, ``num_accepted`` [N] int64, ``invalid`` [N] bool: the final
    outputs; ``splits``: the raw normaliser's vocabulary splits per row (at most S_MAX);
    ``programs``: about how many programs the top-n extraction spreads over. ``pen``: (the
    kernels' PEN kind, their ``penalties`` tuple, placeholders with kind 0); when the kernels
    processed the rows (``fused_processing``; ``proc`` is then ``raw``) the processed values
    are made again where read,
    processed top-n rank by z' when the batch sets logit_bias or penalties, and raw top-n
    rank the raw tiles' maxima (``raw_topn_kernel``, one launch more). No host
    synchronisation.
    """
    batch, dev = plan.batch, raw.device
    n, k1 = token_ids.shape
    n_max = batch.max_logprobs
    vocab = raw.shape[1]
    p = n * k1
    nt = max(1, math.ceil(vocab / BLOCK_TILE))
    s = max(1, min(splits, S_MAX, nt))
    cps = math.ceil(nt / s)
    s = math.ceil(nt / cps)
    out_v = torch.empty(n, k1, n_max + 1, dtype=torch.float32, device=dev)
    out_i = torch.empty(n, k1, n_max + 1, dtype=torch.int64, device=dev)
    if p == 0:
        return out_v, out_i
    pm = workspace.scratch("logprobs.pm", (p, s), torch.float32, dev)
    ps = workspace.scratch("logprobs.ps", (p, s), torch.float32, dev)
    cand = workspace.scratch("logprobs.cand", (p, CAND if n_max > 0 else 1), torch.int64, dev)
    rank, count = ranking if ranking is not None else (cand, cand.view(torch.int32))
    common = (num_accepted, invalid.view(torch.uint8), plan.row_start, batch.logprobs_n,
              batch.logprobs_processed.view(torch.uint8), temp, cut_v, cut_i, stats)
    pen_kind, pen_args = pen
    zrank = bool(pen_kind) and ranks_by_z_prime(batch)
    # (the float32 steps of penalties.process)
    options = {"enable_fp_fusion": False} if pen_kind else {}
    processed = general or bool(pen_kind)  # (the statistics are never the raw row's)
    flags = dict(GENERAL=processed, PEN=pen_kind, ZRANK=zrank, **options)
    # the raw normaliser, where the sampling statistics are not the raw row's
    need_full = _needs_raw_normaliser(plan, processed, filtered)
    # ranks per program: about `programs` programs in all (most positions are not emitted)
    g = min(n_max, max(1, math.ceil(programs / p)))
    q = max(g, s if need_full else 0)
    # raw top-n with the processing in the kernels: the raw tiles' maxima, their own ranking
    raw_top = bool(pen_kind) and any(
        p_.logprobs_mode == "raw" and (p_.logprobs or 0) > 0 for p_ in batch.params)
    rawtop = workspace.scratch("logprobs.rawtop", (p, nt), torch.float32, dev) if raw_top else pm
    warps = 4 if num_warps > 1 else 1
    if q > 0:
        launch(topn_partial_kernel)[(p, q)](
            raw, raw.stride(0), proc, proc.stride(0), vocab, k1, *common, rank, count, pm, ps,
            cand, rawtop, nt, s, cps, max(g, 1), int(filtered), *pen_args, RAWTOP=raw_top,
            NPAD=NPAD, CAND=CAND, BLOCK=BLOCK_TILE, num_warps=warps, **flags)
    if raw_top:
        launch(raw_topn_kernel)[(p, g)](
            raw, raw.stride(0), vocab, k1, *common[:-1], count, cand, rawtop, nt, g,
            int(filtered), NT_SORT=max(NPAD, triton.next_power_of_2(nt)), NPAD=NPAD, CAND=CAND,
            BLOCK=BLOCK_TILE, num_warps=warps)
    launch(logprob_merge_kernel)[(p,)](
        raw, raw.stride(0), proc, proc.stride(0), vocab, k1, *common, token_ids, pm, ps,
        cand, count, s, out_v, out_i, n_max + 1, int(filtered), *pen_args, **flags,
        NPAD=NPAD, CAND=CAND, CAND_PAD=triton.next_power_of_2(CAND), SMALL=2 * NPAD, S_MAX=S_MAX,
        OUT_PAD=triton.next_power_of_2(NPAD + 1),
        num_warps=1)  # (a sort of 64 keys: one warp, no cross-warp steps; 4 were 0.3-1 us slower)
    return out_v, out_i
