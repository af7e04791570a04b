"""Triton kernels for min_p / top_k / top_p on the model's own logits (no full sort, no FP32
copy, no host synchronisation).

Every filter keeps a prefix of the row in rank order (value descending, lower id first on
ties), so the survivors of a row are described by one cut: the value ``cut_v`` and id ``cut_i``
of the last kept token (keep ``y > cut_v``, or ``y == cut_v`` and ``id <= cut_i``). The cut is
found exactly, with the decisions of docs/semantics.md ("Filters in float32"): min_p's cut in
float64, top_k by rank, top_p on float64 masses. Four launches after the statistics pass:

0. ``bounds_kernel`` (one program per row): a lower bound L of the cut from the per-tile
   statistics (the k-th largest tile maximum for top_k; for top_p the largest value v at which
   ``sum_t min(mass_t, n_t exp((v - m) / T))``, an upper bound of the mass below v, fits in
   the 1 - top_p tail; min_p's own cut), written once for the row's gather programs. Skipped,
   with the gather pass, when no request has top_k or top_p (min_p's cut needs neither).
1. ``gather_kernel`` (rows x splits of a few tiles): the candidates (tokens >= L) of the tiles
   that can hold any, packed as order-preserving (key, id) integers into a per-row buffer of
   ``CAP`` (a slot per candidate from its own atomic: no scan, no barrier), and the float64
   mass below L that top_p's total needs. On LLM rows that is tens to hundreds of candidates.
2. ``select_kernel`` (one program per row): sorts the row's candidates and reads the cut off
   them (rank for top_k, a float64 cumulative sum for top_p). A row with more than ``CAP``
   candidates (a nucleus of thousands of tokens, top_k above the number of tiles) takes the
   histogram search (``_hist_cut``): exact per-key counts of bf16 / fp16 keys, in chunks of
   NB keys from the row's maximum down, give the k-th key, or the float64 masses (count x the
   key's mass) and the nucleus's last key; then one pass finds the id among its ties. A few
   reads of the row; counted (``filter_histogram_rows``). Float32 rows, and rows whose tokens
   need more than NCH chunks, take the serial search (``_serial_cut``: a 16-ary search over
   the keys, exact but slow), counted too (``filter_serial_rows``).
3. ``rewrite_kernel`` (rows x splits): the tile sums of the statistics pass become the
   survivors' sums (tiles without survivors get 0), so the sampling kernels draw from the
   filtered distribution with the same three-level Gumbel-max as without filters. A row cut
   from its candidates holds every survivor in them: ``select_kernel`` writes its sums from
   there and this pass skips it (no second read of its tiles).

With bans, logit_bias or penalties (PEN 1 or 2, ``triton_backend.fused_processing``) every
read of a row goes through ``penalties.process`` (:func:`_load_values`), so the cut is that of
the processed row z, as docs/semantics.md orders them (bans -> bias -> penalties ->
temperature -> min_p -> top_k -> top_p). Its keys are then float32 keys (SHIFT 0: a biased or
penalised value need not be a bf16 / fp16 value), so its overflowing rows take the serial
search, as float32 rows do.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _k_eff, _load_tiles, _row_stats
from .launch import wait_for_prior_grid
from .penalties import process, setup

INT_MAX = tl.constexpr(2147483647)
NQ = tl.constexpr(16)  # thresholds evaluated per pass of the search
SUB = tl.constexpr(512)  # elements per step inside a tile
S_G_MAX = tl.constexpr(128)  # most gather splits of one row
NB = tl.constexpr(4096)  # keys per chunk of the exact-key histogram search
NCH = tl.constexpr(16)  # most chunks of the histogram search; more go to the serial search
TG = tl.constexpr(16)  # tiles per step of select_kernel's tile sums


@triton.jit
def _key(y, SHIFT: tl.constexpr):
    """Order-preserving int64 key of float32 values (-0.0 keyed as +0.0). SHIFT drops mantissa
    bits that are zero for every value of the input dtype (16 for bf16, 13 for fp16)."""
    y = tl.where(y == 0.0, 0.0, y)
    b = y.to(tl.int32, bitcast=True) >> SHIFT
    flip: tl.constexpr = (1 << (31 - SHIFT)) - 1
    return tl.where(b >= 0, b, b ^ flip).to(tl.int64)


@triton.jit
def _value(key, SHIFT: tl.constexpr):
    """The float32 value of a key of :func:`_key`."""
    flip: tl.constexpr = (1 << (31 - SHIFT)) - 1
    k = key.to(tl.int32)
    b = tl.where(k >= 0, k, k ^ flip) << SHIFT
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _pick(vec, offs, idx):
    """Element ``idx`` of a 1-D vector (a reduction, no memory access)."""
    return tl.sum(tl.where(offs == idx, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def _row_src(x_ptr, stride, r, row_req_ptr, row_j_ptr, pen_ptrs):
    """:func:`_load_values`' ``src`` of row ``r``; ``pen_ptrs`` the kernel's ``penalties``
    arguments (rep .. bias values, draft ids, draft_start)."""
    return (x_ptr + r.to(tl.int64) * stride, tl.load(row_req_ptr + r), tl.load(row_j_ptr + r),
            pen_ptrs)


@triton.jit
def _load_values(src, V, offs, lo, PEN: tl.constexpr):
    """Float32 values at token ids ``offs`` (lo <= offs < lo + len(offs); -inf at ids >= V) of
    the row ``src`` = (pointer to its first logit, its request, its index j in the request,
    the ``penalties`` arguments): the logits as they are, or with PEN (1 logit_bias, 2
    penalties too) the processed z of ``penalties.process``, on which the filters decide
    (docs/semantics.md, "Filters in float32")."""
    base, req, j, pen = src
    y = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    if PEN:
        y, _st = process(y, offs, lo, lo + offs.shape[0], req, j, setup(lo, req, j, pen), pen,
                         PEN == 2)
    return y


@triton.jit
def _load_keys(src, V, offs, lo, cut_key, cut_i, SHIFT: tl.constexpr, PEN: tl.constexpr):
    """Values (float32, :func:`_load_values`), keys and survivor flags of the cut (key >
    cut_key, or key == cut_key and id <= cut_i) at token ids ``offs`` (from ``lo``) of a row."""
    y = _load_values(src, V, offs, lo, PEN)
    k = _key(y, SHIFT)
    return y, k, (k > cut_key) | ((k == cut_key) & (offs <= cut_i))


@triton.jit
def _count_mass(src, V, ttop_ptr, NT, thr, prune_key, m, t, cut_key, cut_i,
                NEED_MASS: tl.constexpr, SHIFT: tl.constexpr, PEN: tl.constexpr,
                BLOCK: tl.constexpr):
    """For each threshold key of ``thr`` [NQ]: how many survivors of (cut_key, cut_i) have a key
    >= it, and (NEED_MASS) their mass sum exp((y - m) / t) in float64. Reads only the tiles
    whose maximum (``ttop_ptr``: the row's tile maxima) has a key >= ``prune_key`` (no element
    below it can count)."""
    cnt = tl.zeros([NQ], tl.int32)
    mass = tl.zeros([NQ], tl.float64)
    for tile in range(0, NT):
        if _key(tl.load(ttop_ptr + tile), SHIFT) >= prune_key:
            for sub in range(0, BLOCK, SUB):
                offs = tile * BLOCK + sub + tl.arange(0, SUB)
                y, k, alive = _load_keys(src, V, offs, tile * BLOCK + sub, cut_key, cut_i,
                                         SHIFT, PEN)
                ge = (k[None, :] >= thr[:, None]) & alive[None, :]
                cnt += tl.sum(ge.to(tl.int32), axis=1)
                if NEED_MASS:
                    e = tl.exp((y.to(tl.float64) - m.to(tl.float64)) / t.to(tl.float64))
                    e = tl.where(alive & (y > -float("inf")), e, 0.0)
                    mass += tl.sum(tl.where(ge, e[None, :], 0.0), axis=1)
    return cnt, mass


@triton.jit(noinline=True)  # (a body of its own: the kernel's stays smaller to compile)
def _search(src, V, ttop_ptr, NT, lo, hi, goal_count, goal_mass, m, t,
            cut_key, cut_i, BY_MASS: tl.constexpr, SHIFT: tl.constexpr, PEN: tl.constexpr,
            BLOCK: tl.constexpr):
    """The largest key in [lo, hi) whose count (or float64 mass) of survivors at or above it
    reaches the goal, by a 16-ary search; ``lo`` must satisfy it (else ``lo - 1`` comes back,
    meaning no key does), and ``hi`` must not."""
    q = tl.arange(0, NQ).to(tl.int64)
    ok_lo = True
    first = True
    while hi - lo > 1:
        step = (hi - lo + NQ - 1) // NQ
        thr = lo + q * step
        thr = tl.where(thr < hi, thr, hi)  # never true at hi
        prune = tl.where(first, lo, lo + step)
        cnt, mass = _count_mass(src, V, ttop_ptr, NT, thr, prune, m, t,
                                cut_key, cut_i, BY_MASS, SHIFT, PEN, BLOCK)
        if BY_MASS:
            cond = mass >= goal_mass
        else:
            cond = cnt >= goal_count
        cond = cond & (thr < hi)
        if first:
            ok_lo = _pick(cond.to(tl.int32), q, 0) != 0
            first = False
        best = tl.max(tl.where(cond, q, 0), axis=0)
        new_lo = lo + best * step
        hi = tl.minimum(hi, new_lo + step)
        lo = new_lo
        if not ok_lo:
            hi = lo  # stop: no key qualifies
    return tl.where(ok_lo, lo, lo - 1)


@triton.jit
def _nth_tie(src, V, ttop_ptr, NT, key, n, cut_key, cut_i,
             SHIFT: tl.constexpr, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """Id of the n-th (1-based, id order) survivor of (cut_key, cut_i) whose key is ``key``
    (``ttop_ptr``: the row's tile maxima)."""
    return _find_nth_tie(src, V, ttop_ptr, NT, tl.cast(key, tl.int64),
                         tl.cast(n, tl.int32), tl.cast(cut_key, tl.int64),
                         tl.cast(cut_i, tl.int32), SHIFT, PEN, BLOCK)


@triton.jit(noinline=True)  # (one body for the four calls, their types made alike: compile time)
def _find_nth_tie(src, V, ttop_ptr, NT, key, n, cut_key, cut_i,
                  SHIFT: tl.constexpr, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_nth_tie`."""
    seen = 0
    found = INT_MAX
    for tile in range(0, NT):
        if (found == INT_MAX) & (_key(tl.load(ttop_ptr + tile), SHIFT) >= key):
            offs = tile * BLOCK + tl.arange(0, BLOCK)  # (a whole tile per load: one wait)
            y, k, alive = _load_keys(src, V, offs, tile * BLOCK, cut_key, cut_i, SHIFT, PEN)
            eq = (k == key) & alive & (offs < V)
            run = seen + tl.cumsum(eq.to(tl.int32), axis=0)
            hit = tl.min(tl.where(eq & (run == n), offs, INT_MAX), axis=0)
            found = tl.where(found == INT_MAX, hit, found)
            seen += tl.sum(eq.to(tl.int32), axis=0)
    return found


@triton.jit
def _tile_masses(tilemax_ptr, tilesum_ptr, r, NT, toffs, m, t):
    """Per-tile masses sum exp((y - m) / t) from the statistics pass (float32), [NT_PAD]."""
    tm, ts, has = _load_tiles(tilemax_ptr, tilesum_ptr, r, NT, toffs)
    return tl.where(has, tl.exp((tl.where(has, tm, m) - m) / t) * ts, 0.0)


@triton.jit
def _row_setup(r, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr, k_given_ptr,
               temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr, part_m_ptr, part_s_ptr, part_f_ptr, S,
               S_MAX: tl.constexpr):
    """A row's filter settings: (ok, m, t, top_k, top_p, min_p, k_on, p_on, min_on); ok when
    the row is live, sampled, valid and filtered."""
    req = tl.load(row_req_ptr + r)
    j = tl.load(row_j_ptr + r)
    live = j <= _k_eff(draft_ids_ptr, draft_start_ptr, k_given_ptr, req, False)
    t_req = tl.load(temp_ptr + req)
    t = tl.where(t_req > 0, t_req, 1.0)
    m, logz, flags = _row_stats(part_m_ptr, part_s_ptr, part_f_ptr, r, S, t, False, S_MAX)
    top_k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    min_p = tl.load(min_p_ptr + req)
    k_on = (top_k > 0) & (top_k < V)
    p_on = top_p < 1
    min_on = min_p > 0
    ok = live & (t_req > 0) & (k_on | p_on | min_on) & (m > -float("inf")) & (
        m < float("inf")) & (logz == logz)
    return ok, m, t, top_k, top_p, min_p, k_on, p_on, min_on


@triton.jit
def _bounds(r, m, t, top_k, top_p, min_p, k_on, p_on, min_on, tilemax_ptr, tilesum_ptr,
            tiletop_ptr, NT, NT_PAD: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """(The smallest finite key, min_p's cut key, the candidates' lower bound L, the lowest key
    whose tiles must be read R)."""
    toffs = tl.arange(0, NT_PAD)
    tt = tl.load(tiletop_ptr + r.to(tl.int64) * NT + toffs, mask=toffs < NT,
                 other=-float("inf"))
    ttop_key = _key(tt, SHIFT)
    lowest = _key(tl.full((), -float("inf"), tl.float32), SHIFT) + 1
    c_key = lowest
    if min_on:  # keep y >= m + T log(min_p) (float64): the smallest key at or above it
        c64 = m.to(tl.float64) + t.to(tl.float64) * tl.log(min_p)
        c_key = _key(c64.to(tl.float32), SHIFT)  # truncated to the dtype: may be one step low
        c_key += tl.where(_value(c_key, SHIFT).to(tl.float64) < c64, 1, 0)
        c_key = tl.maximum(c_key, lowest)
    lo = c_key
    if k_on:
        if top_k <= NT:
            srt = tl.sort(ttop_key, descending=True)
            lo = tl.maximum(lo, _pick(srt, toffs, top_k - 1))
    elif p_on:
        # The mass below v = m - T delta is at most sum_t min(mass_t, n_t exp(-delta)): find the
        # smallest delta at which that bound fits in the (1 - top_p) tail. (Float rounding can
        # only make L too high; select_kernel then sees the nucleus overflow its candidates and
        # takes the serial search.)
        tmass = _tile_masses(tilemax_ptr, tilesum_ptr, r, NT, toffs, m, t)
        budget = ((1.0 - top_p) * tl.sum(tmass, axis=0)).to(tl.float32)
        lo_d = 0.0
        hi_d = 128.0
        for _ in range(0, 30):
            mid = 0.5 * (lo_d + hi_d)
            tail = tl.sum(tl.minimum(tmass, BLOCK * tl.exp(-mid)), axis=0)
            reach = tail <= budget
            hi_d = tl.where(reach, mid, hi_d)
            lo_d = tl.where(reach, lo_d, mid)
        lo_p = tl.where(hi_d < 128.0, _key(m - t * hi_d, SHIFT) - 1, lowest)
        lo = tl.maximum(lo, lo_p)
    read = tl.where((~k_on) & p_on & min_on, c_key, lo)
    return lowest, c_key, lo, read


@triton.jit(do_not_specialize=["S", "NT"])
def bounds_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr,
                  k_given_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                  part_m_ptr, part_s_ptr, part_f_ptr, S, tilemax_ptr, tilesum_ptr, tiletop_ptr,
                  NT, bnd_ptr, mt_ptr, count_ptr, NT_PAD: tl.constexpr, SHIFT: tl.constexpr,
                  S_MAX: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """One program per row: what ``gather_kernel``'s programs of the row need, computed once
    (``bnd`` [T, 4] int64: flags (1 gather, 2 top_p's tail is needed, 4 min_p on), L, the
    lowest key whose tiles are read, min_p's cut key; ``mt`` [T, 2] float32: m, T), and the
    row's candidate count (``count`` [T] int32) set to 0 for the gather's atomics (the
    buffer is reused between calls)."""
    wait_for_prior_grid(GDC)
    r = tl.program_id(0)
    ok, m, t, top_k, top_p, min_p, k_on, p_on, min_on = _row_setup(
        r, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr, k_given_ptr, temp_ptr,
        top_k_ptr, top_p_ptr, min_p_ptr, part_m_ptr, part_s_ptr, part_f_ptr, S, S_MAX)
    flags = r * 0
    lo = _key(tl.full((), -float("inf"), tl.float32), SHIFT)
    read = lo
    c_key = lo
    if ok & (k_on | p_on):
        _lowest, c_key, lo, read = _bounds(
            r, m, t, top_k, top_p, min_p, k_on, p_on, min_on, tilemax_ptr, tilesum_ptr,
            tiletop_ptr, NT, NT_PAD, SHIFT, BLOCK)
        flags = 1 + tl.where(p_on & ~k_on, 2, 0) + tl.where(min_on, 4, 0)
    o = r.to(tl.int64) * 4
    tl.store(bnd_ptr + o, flags.to(tl.int64))
    tl.store(bnd_ptr + o + 1, lo)
    tl.store(bnd_ptr + o + 2, read)
    tl.store(bnd_ptr + o + 3, c_key)
    tl.store(mt_ptr + r.to(tl.int64) * 2, m)
    tl.store(mt_ptr + r.to(tl.int64) * 2 + 1, t)
    tl.store(count_ptr + r, 0)


@triton.jit(do_not_specialize=["NT", "TPS", "BW", "KP", "AV"])
def gather_kernel(x_ptr, stride, V, tilemax_ptr, tilesum_ptr, tiletop_ptr, NT, TPS, bnd_ptr,
                  mt_ptr, cand_ptr, count_ptr, tail_ptr, row_req_ptr, row_j_ptr, draft_ids_ptr,
                  draft_start_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV,
                  bstart_ptr, bids_ptr, bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                  CAP: tl.constexpr, SHIFT: tl.constexpr,
                  PEN: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Per (row, split of TPS tiles), with the row's bounds from ``bounds_kernel``: append the
    candidates (key >= L) to the row's buffer (``count`` [T] must be zero before) and write
    the float64 mass of the tokens below L that top_p's total needs (``tail`` [T, splits]).
    PEN: the rows are processed as they are loaded (:func:`_load_values`; ``rep_ptr`` ..
    ``bval_ptr`` as ``kernels.stats_kernel``'s)."""
    wait_for_prior_grid(GDC)
    r = tl.program_id(0)
    s = tl.program_id(1)
    o = r.to(tl.int64) * 4
    flags = tl.load(bnd_ptr + o)
    tail = tl.zeros((), tl.float64)
    if (flags & 1) != 0:
        lo = tl.load(bnd_ptr + o + 1)
        read = tl.load(bnd_ptr + o + 2)
        c_key = tl.load(bnd_ptr + o + 3)
        m = tl.load(mt_ptr + r.to(tl.int64) * 2)
        t = tl.load(mt_ptr + r.to(tl.int64) * 2 + 1)
        need_tail = (flags & 2) != 0
        min_on = (flags & 4) != 0
        lowest = _key(tl.full((), -float("inf"), tl.float32), SHIFT) + 1
        src = _row_src(x_ptr, stride, r, row_req_ptr, row_j_ptr,
                       (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr,
                        bids_ptr, bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
                        aslot_ptr, amask_ptr, AV))
        for tile in range(s * TPS, tl.minimum(s * TPS + TPS, NT)):
            o_t = r.to(tl.int64) * NT + tile
            tk = _key(tl.load(tiletop_ptr + o_t), SHIFT)
            if tk >= read:  # (the whole tile in one load)
                offs = tile * BLOCK + tl.arange(0, BLOCK)
                y, k, _alive = _load_keys(src, V, offs, tile * BLOCK, lowest, 0, SHIFT, PEN)
                cand = (k >= lo) & (offs < V)
                # a slot per candidate from its own atomic (no scan, no barrier: the buffer's
                # order does not matter, select_kernel sorts it)
                pos = tl.atomic_add(count_ptr + r + tl.zeros_like(offs), 1, mask=cand)
                packed = (k << 32) + (2147483647 - offs.to(tl.int64))
                tl.store(cand_ptr + r.to(tl.int64) * CAP + pos, packed,
                         mask=cand & (pos < CAP))
                if need_tail:
                    e = tl.exp((y.to(tl.float64) - m.to(tl.float64)) / t.to(tl.float64))
                    below = (k < lo) & (k >= c_key) & (y > -float("inf"))
                    tail += tl.sum(tl.where(below, e, 0.0), axis=0)
            elif need_tail & ~min_on:  # a tile wholly below L: its mass from the statistics
                tm = tl.load(tilemax_ptr + o_t)
                ts = tl.load(tilesum_ptr + o_t)
                tail += tl.where((ts > 0) & (tm > -float("inf")),
                                 tl.exp((tm - m) / t) * ts, 0.0).to(tl.float64)
    tl.store(tail_ptr + r.to(tl.int64) * tl.num_programs(1) + s, tail)


@triton.jit(noinline=True)
def _serial_cut(src, V, m, t, top_k, top_p, k_on, p_on, ttop_ptr, NT, lowest,
                c_key, lo, SHIFT: tl.constexpr, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """The cut (key, id) by the serial 16-ary search (rows with too many candidates; ``lo``
    and ``c_key`` from :func:`_bounds`, ``ttop_ptr`` the row's tile maxima)."""
    cut_key = c_key
    cut_i = INT_MAX + 0 * NT
    hi = _key(m, SHIFT) + 1
    m64 = m.to(tl.float64)
    t64 = t.to(tl.float64)
    if k_on:  # the k-th largest survivor, from _bounds' k-th largest tile maximum
        kk = _search(src, V, ttop_ptr, NT, lo, hi, top_k, 0.0, m, t,
                     cut_key, cut_i, False, SHIFT, PEN, BLOCK)
        if kk >= lo:  # else fewer than k survivors: no cut
            above, _m = _count_mass(src, V, ttop_ptr, NT,
                                    tl.zeros([NQ], tl.int64) + kk + 1, kk + 1, m, t,
                                    cut_key, cut_i, False, SHIFT, PEN, BLOCK)
            need = top_k - tl.max(above, axis=0)
            cut_i = _nth_tie(src, V, ttop_ptr, NT, kk, need, cut_key,
                             cut_i, SHIFT, PEN, BLOCK)
            cut_key = kk
    if p_on:  # top_p over the survivors so far, from the lowest surviving key
        cnt0, mass0 = _count_mass(src, V, ttop_ptr, NT,
                                  tl.zeros([NQ], tl.int64) + lowest, cut_key, m, t,
                                  cut_key, cut_i, True, SHIFT, PEN, BLOCK)
        total = tl.max(mass0, axis=0)
        goal64 = top_p * total
        pk = _search(src, V, ttop_ptr, NT, cut_key, hi, 0, goal64, m, t,
                     cut_key, cut_i, True, SHIFT, PEN, BLOCK)
        q = tl.arange(0, NQ)
        thr = tl.where(q == 0, pk + 1, pk)
        cnt, mass = _count_mass(src, V, ttop_ptr, NT, thr, pk, m, t,
                                cut_key, cut_i, True, SHIFT, PEN, BLOCK)
        mass_gt = _pick(mass, q, 0)
        n_gt = _pick(cnt, q, 0)
        n_tie = _pick(cnt, q, 1) - n_gt
        e = tl.exp((_value(pk, SHIFT).to(tl.float64) - m64) / t64)
        n = _ties_kept(mass_gt, e, goal64, n_tie)
        cut_i = _nth_tie(src, V, ttop_ptr, NT, pk, n, cut_key, cut_i,
                         SHIFT, PEN, BLOCK)
        cut_key = pk
    return cut_key, cut_i


@triton.jit
def _chunk_hist(src, V, ttop_ptr, NT, hi_key, floor, cut_key, cut_i, hist_ptr,
                SHIFT: tl.constexpr, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """(Counts [NB] int32 of the survivors of (cut_key, cut_i) by exact key, bin b counting
    key ``hi_key - b`` for keys in [max(floor, hi_key - NB + 1), hi_key]; the largest key of
    a token in [floor, bottom of the chunk), where the next chunk starts (floor - 1 if none),
    so that empty key ranges cost nothing). The counts from :func:`_fill_hist`."""
    nxt = _fill_hist(src, V, ttop_ptr, NT, hi_key, floor, cut_key, cut_i, hist_ptr,
                     SHIFT, PEN, BLOCK)
    return tl.load(hist_ptr + tl.arange(0, NB), volatile=True), nxt


@triton.jit(noinline=True)  # (one body for the three calls of _hist_cut: compile time)
def _fill_hist(src, V, ttop_ptr, NT, hi_key, floor, cut_key, cut_i, hist_ptr,
               SHIFT: tl.constexpr, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """:func:`_chunk_hist`'s counts, written to the row's scratch ``hist_ptr`` [NB] (every
    thread's writes done on return), and its next key. One read of the tiles whose maximum
    (``ttop_ptr``: the row's tile maxima) reaches the chunk's bottom, a whole tile per load
    (a single program is bound by load latency); the counts are atomic adds (tl.histogram
    with this many bins is far slower on a GPU); a tile wholly below the chunk gives its
    maximum."""
    bottom = tl.maximum(floor, hi_key - NB + 1)
    bins = tl.arange(0, NB)
    tl.debug_barrier()  # (every thread done reading the previous chunk's counts)
    tl.store(hist_ptr + bins, tl.zeros([NB], tl.int32))
    tl.debug_barrier()
    nxt = floor - 1
    for tile in range(0, NT):
        tk = _key(tl.load(ttop_ptr + tile), SHIFT)
        if (tk < bottom) & (tk >= floor):
            nxt = tl.maximum(nxt, tk)
        if tk >= bottom:
            offs = tile * BLOCK + tl.arange(0, BLOCK)
            y, k, alive = _load_keys(src, V, offs, tile * BLOCK, cut_key, cut_i, SHIFT, PEN)
            alive &= offs < V
            inr = alive & (k >= bottom) & (k <= hi_key)
            tl.atomic_add(hist_ptr + tl.where(inr, hi_key - k, 0), 1, mask=inr, sem="relaxed")
            lower = alive & (k < bottom) & (k >= floor)
            nxt = tl.maximum(nxt, tl.max(tl.where(lower, k, floor - 1), axis=0))
    tl.debug_barrier()
    return nxt


@triton.jit
def _bin_mass(h, hi_key, m, t, SHIFT: tl.constexpr):
    """(float64 mass of each bin of :func:`_chunk_hist`: count x exp((value - m) / t), the
    mass of one token of each bin). Every token of a bin has the same value, so the masses
    are the per-token float64 masses summed, with one exponential per key, not per token."""
    b = tl.arange(0, NB)
    v = _value(hi_key - b, SHIFT).to(tl.float64)
    e = tl.exp((v - m.to(tl.float64)) / t.to(tl.float64))
    e = tl.where(h > 0, e, 0.0)  # (keys past the dtype's range: no token, maybe no value)
    return h.to(tl.float64) * e, e


@triton.jit(noinline=True)
def _hist_cut(src, V, m, t, top_k, top_p, k_on, p_on, ttop_ptr, NT, c_key,
              lo, tail, hist_ptr, SHIFT: tl.constexpr, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """The cut (key, id) of a row whose candidates overflowed, from exact per-key counts (``lo``
    and ``c_key`` from :func:`_bounds`, ``tail`` from :func:`_tail_mass`), and
    whether it was found (else the serial search runs: the tokens from the row's maximum down
    to the bound hold more than NCH chunks of NB distinct keys, or rounding put top_p's bound
    L above the cut).

    top_k: chunks of NB keys from the row's maximum down (skipping keys no token has) until
    the count reaches k; the k-th survivor's key, and among its ties the id that keeps
    exactly k (``_nth_tie``). top_p, over the survivors so far: each chunk's float64 mass
    (count x the key's mass; plus ``tail``, the gather pass's mass below L, when no top_k
    comes first), then the last key whose mass before it is below top_p x total, and the
    ties kept (``_ties_kept``). A few reads of the row, where the serial search makes tens."""
    top = _key(m, SHIFT)
    b = tl.arange(0, NB)
    q = tl.arange(0, NCH)
    cut_key = c_key
    cut_i = INT_MAX + 0 * NT
    ok = tl.full((), True, tl.int1)
    if k_on:
        floor = lo  # (_bounds: the k-th largest tile maximum, at least k tokens reach it)
        seen = 0
        j = 0
        hi = top
        kk = c_key
        need = 0
        while (need == 0) & (j < NCH) & (hi >= floor):
            h, nxt = _chunk_hist(src, V, ttop_ptr, NT, hi, floor, c_key,
                                 INT_MAX + 0 * NT, hist_ptr, SHIFT, PEN, BLOCK)
            run = seen + tl.cumsum(h, axis=0)
            bk = tl.min(tl.where(run >= top_k, b, NB), axis=0)
            if bk < NB:
                kk = hi - bk
                need = (top_k - (_pick(run, b, bk) - _pick(h, b, bk))).to(tl.int32)
            seen += tl.sum(h, axis=0)
            hi = nxt
            j += 1
        if need > 0:
            cut_i = _nth_tie(src, V, ttop_ptr, NT, kk, need, c_key,
                             INT_MAX + 0 * NT, SHIFT, PEN, BLOCK)
            cut_key = kk
        else:  # fewer than k survivors (no cut) only if every key down to the floor was seen
            ok = hi < floor
    if p_on & ok:
        floor = cut_key
        if not k_on:
            floor = lo  # (_bounds: top_p's bound, at or above min_p's cut)
        cm = tl.zeros([NCH], tl.float64)  # each chunk's mass
        his = tl.zeros([NCH], tl.int64)  # each chunk's top key
        h_last = tl.zeros([NB], tl.int32)
        j = 0
        hi = top
        while (j < NCH) & (hi >= floor):
            h_last, nxt = _chunk_hist(src, V, ttop_ptr, NT, hi, floor,
                                      cut_key, cut_i, hist_ptr, SHIFT, PEN, BLOCK)
            mass, _e = _bin_mass(h_last, hi, m, t, SHIFT)
            cm = tl.where(q == j, tl.sum(mass, axis=0), cm)
            his = tl.where(q == j, hi, his)
            hi = nxt
            j += 1
        total = tl.sum(cm, axis=0)
        if not k_on:
            total += tail
        goal = top_p * total
        before = tl.cumsum(cm, axis=0) - cm  # float64 mass of the chunks above each
        jc = tl.max(tl.where((cm > 0) & (before < goal), q, -1), axis=0)
        # every key down to the floor seen, and the cut above it (rounding of L: _bounds)
        ok = (hi < floor) & (jc >= 0) & (tl.sum(cm, axis=0) >= goal)
        if ok:
            h = h_last
            hc = _pick(his, q, jc)
            if jc != j - 1:
                h, _n = _chunk_hist(src, V, ttop_ptr, NT, hc, floor,
                                    cut_key, cut_i, hist_ptr, SHIFT, PEN, BLOCK)
            mass, e = _bin_mass(h, hc, m, t, SHIFT)
            m_before = _pick(before, q, jc) + tl.cumsum(mass, axis=0) - mass
            bp = tl.max(tl.where((h > 0) & (m_before < goal), b, -1), axis=0)
            pk = hc - bp
            n = _ties_kept(_pick(m_before, b, bp), _pick(e, b, bp), goal, _pick(h, b, bp))
            cut_i = _nth_tie(src, V, ttop_ptr, NT, pk, n, cut_key, cut_i,
                             SHIFT, PEN, BLOCK)
            cut_key = pk
    return cut_key, cut_i, ok


@triton.jit
def _tail_mass(tail_ptr, r, SG):
    """Row ``r``'s float64 mass below the candidates' bound L, summed over the gather pass's
    SG splits (``gather_kernel``'s ``tail``)."""
    toff = tl.arange(0, S_G_MAX)
    return tl.sum(tl.load(tail_ptr + r.to(tl.int64) * SG + toff, mask=toff < SG, other=0.0),
                  axis=0)


@triton.jit
def _ties_kept(mass_gt, e, goal, n_tie):
    """How many of ``n_tie`` tokens of mass ``e`` each (after ``mass_gt``) top_p keeps: tie j
    (0-based) is kept iff mass_gt + j e < goal; at least 1 (the boundary token)."""
    r = tl.minimum((goal - mass_gt) / tl.where(e > 0, e, 1.0), 1e9)
    n = tl.ceil(r).to(tl.int32)
    n = tl.where(mass_gt + (n - 1).to(tl.float64) * e < goal, n, n - 1)
    n = tl.where(mass_gt + n.to(tl.float64) * e < goal, n + 1, n)
    n = tl.where(e > 0, n, n_tie)
    return tl.minimum(tl.maximum(n, 1), n_tie)


@triton.jit(do_not_specialize=["S", "NT", "SG", "BW", "KP", "AV"])
def select_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr,
                  k_given_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                  part_m_ptr, part_s_ptr, part_f_ptr, S, tilemax_ptr, tilesum_ptr, tiletop_ptr,
                  NT, SG, cand_ptr, count_ptr, tail_ptr, cut_v_ptr, cut_i_ptr, serial_ptr,
                  hist_ptr, done_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV,
                  bstart_ptr, bids_ptr, bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                  CAP: tl.constexpr, NT_PAD: tl.constexpr,
                  SHIFT: tl.constexpr, PEN: tl.constexpr, S_MAX: tl.constexpr,
                  BLOCK: tl.constexpr, GDC: tl.constexpr):
    """One program per row: the exact cut (cut_v, cut_i) of min_p -> top_k -> top_p from the
    row's sorted candidates (or the serial search when they overflowed ``CAP``). Rows that are
    not live, greedy, invalid or unfiltered get (-inf, INT_MAX). A row cut from its candidates
    holds all its survivors in them: its tile sums are rewritten here (``done`` [T] int32 = 1,
    ``rewrite_kernel`` skips it); others get ``done`` = 0. PEN: as :func:`gather_kernel`'s
    (the serial search reads the processed rows)."""
    wait_for_prior_grid(GDC)
    r = tl.program_id(0)
    done = r * 0
    ok, m, t, top_k, top_p, min_p, k_on, p_on, min_on = _row_setup(
        r, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr, k_given_ptr, temp_ptr,
        top_k_ptr, top_p_ptr, min_p_ptr, part_m_ptr, part_s_ptr, part_f_ptr, S, S_MAX)
    cut_key = _key(tl.full((), -float("inf"), tl.float32), SHIFT)
    cut_i = INT_MAX + 0 * r
    if ok:
        lowest, c_key, lo, _read = _bounds(
            r, m, t, top_k, top_p, min_p, k_on, p_on, min_on, tilemax_ptr, tilesum_ptr,
            tiletop_ptr, NT, NT_PAD, SHIFT, BLOCK)
        cut_key = c_key
        if k_on | p_on:
            n_cand = tl.load(count_ptr + r)
            serial = n_cand > CAP
            if not serial:
                slot = tl.arange(0, CAP)
                packed = tl.load(cand_ptr + r.to(tl.int64) * CAP + slot, mask=slot < n_cand,
                                 other=-9223372036854775807 - 1)
                packed = tl.sort(packed, descending=True)  # rank order: value, then lower id
                keys = packed >> 32
                ids = (2147483647 - (packed & 0xFFFFFFFF)).to(tl.int32)
                keep = slot < n_cand
                if k_on:
                    keep &= slot < top_k
                n_keep = tl.sum(keep.to(tl.int32), axis=0)
                if p_on:
                    e = tl.exp((_value(keys, SHIFT).to(tl.float64) - m.to(tl.float64))
                               / t.to(tl.float64))
                    e = tl.where(keep, e, 0.0)
                    total = tl.sum(e, axis=0)
                    if not k_on:
                        total += _tail_mass(tail_ptr, r, SG)
                    before = tl.cumsum(e, axis=0) - e
                    keep &= before < top_p * total
                    n_keep = tl.sum(keep.to(tl.int32), axis=0)
                    # the bound L must hold the nucleus (it always does but for rounding)
                    serial = (~k_on) & (tl.sum(e, axis=0) < top_p * total)
                last = slot == n_keep - 1
                cut_key = tl.sum(tl.where(last, keys, 0), axis=0)
                cut_i = tl.sum(tl.where(last, ids, 0), axis=0)
                if not serial:
                    # the survivors (slots < n_keep) give the tile sums of rewrite_kernel:
                    # sum exp2((y - ref) * log2(e) / T) per tile, 0 for tiles without any
                    surv = slot < n_keep
                    tile_of = tl.where(surv, ids // BLOCK, -1)
                    o_r = r.to(tl.int64) * NT
                    ref = tl.load(tilemax_ptr + o_r + tile_of, mask=surv, other=0.0)
                    term = tl.where(surv, tl.exp2((_value(keys, SHIFT) - ref)
                                                  * (1.4426950408889634 / t)), 0.0)
                    tg = tl.arange(0, TG)
                    for g in range(0, NT, TG):
                        hit = tile_of[:, None] == (g + tg)[None, :]
                        sums = tl.sum(tl.where(hit, term[:, None], 0.0), axis=0)
                        tl.store(tilesum_ptr + o_r + g + tg, sums, mask=g + tg < NT)
                    done = r * 0 + 1
            if serial:
                src = _row_src(x_ptr, stride, r, row_req_ptr, row_j_ptr,
                               (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV,
                                bstart_ptr, bids_ptr, bval_ptr, draft_ids_ptr, draft_start_ptr,
                                ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV))
                found = False
                # (float32 values, and processed rows, are nearly all distinct: a key per token)
                if SHIFT > 0 and PEN == 0:
                    cut_key, cut_i, found = _hist_cut(
                        src, V, m, t, top_k, top_p, k_on, p_on,
                        tiletop_ptr + r.to(tl.int64) * NT, NT, c_key, lo,
                        _tail_mass(tail_ptr, r, SG),
                        hist_ptr + r.to(tl.int64) * NB, SHIFT, PEN, BLOCK)
                if found:
                    tl.atomic_add(serial_ptr + 1, 1)
                else:
                    tl.atomic_add(serial_ptr, 1)
                    cut_key, cut_i = _serial_cut(src, V, m, t,
                                                 top_k, top_p, k_on, p_on,
                                                 tiletop_ptr + r.to(tl.int64) * NT, NT,
                                                 lowest, c_key, lo, SHIFT, PEN, BLOCK)
    tl.store(cut_v_ptr + r, _value(cut_key, SHIFT))
    tl.store(cut_i_ptr + r, cut_i)
    tl.store(done_ptr + r, done)


@triton.jit(do_not_specialize=["NT", "TPS", "BW", "KP", "AV"])
def rewrite_kernel(x_ptr, stride, V, tilemax_ptr, tilesum_ptr, tiletop_ptr, NT, TPS, temp_ptr,
                   row_req_ptr, cut_v_ptr, cut_i_ptr, done_ptr, row_j_ptr, draft_ids_ptr,
                   draft_start_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV,
                   bstart_ptr, bids_ptr, bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                   PEN: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Per (row, split of TPS tiles) of a filtered row (cut_v > -inf) that ``select_kernel``
    did not rewrite (``done`` 0: min_p alone, or candidates that overflowed): each tile's sum
    becomes the survivors' sum of exp2((y - ref) * log2(e) / T), with the statistics pass's
    reference ``ref``; tiles whose maximum is below the cut get 0. PEN: as
    :func:`gather_kernel`'s."""
    wait_for_prior_grid(GDC)
    r = tl.program_id(0)
    s = tl.program_id(1)
    cut_v = tl.load(cut_v_ptr + r)
    cut_i = tl.load(cut_i_ptr + r)
    if (cut_v > -float("inf")) & (tl.load(done_ptr + r) == 0):
        t = tl.load(temp_ptr + tl.load(row_req_ptr + r))
        scale = 1.4426950408889634 / tl.where(t > 0, t, 1.0)
        src = _row_src(x_ptr, stride, r, row_req_ptr, row_j_ptr,
                       (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr,
                        bids_ptr, bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
                        aslot_ptr, amask_ptr, AV))
        for tile in range(s * TPS, tl.minimum(s * TPS + TPS, NT)):
            o_t = r.to(tl.int64) * NT + tile
            acc = 0.0
            if tl.load(tiletop_ptr + o_t) >= cut_v:  # (the whole tile in one load)
                ref = tl.load(tilemax_ptr + o_t)
                offs = tile * BLOCK + tl.arange(0, BLOCK)
                y = _load_values(src, V, offs, tile * BLOCK, PEN)
                keep = ((y > cut_v) | ((y == cut_v) & (offs <= cut_i))) & (y > -float("inf"))
                acc += tl.sum(tl.where(keep, tl.exp2((y - ref) * scale), 0.0), axis=0)
            tl.store(tilesum_ptr + o_t, acc)
