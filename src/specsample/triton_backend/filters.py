"""Triton kernel for min_p / top_k / top_p on the model's own logits (no sort, no FP32 copy).

Every filter keeps a prefix of the row in rank order (value descending, lower id first on
ties), so the survivors of a row are described by one cut: the value ``cut_v`` and id ``cut_i``
of the last kept token (keep ``y > cut_v``, or ``y == cut_v`` and ``id <= cut_i``).
``filter_kernel`` (one program per row) finds that cut exactly, with the decisions of
docs/semantics.md ("Filters in float32"):

* min_p: ``y >= m + T log(min_p)``, the cut in float64;
* top_k: the k-th largest value by a 16-ary search over order-preserving integer keys of the
  values (bf16 rows need 4 passes, fp16 5, fp32 8 at most), then the tie cut by id;
* top_p: the same search on the float64 mass of the survivors above a key.

Passes read only the vocabulary tiles whose maximum (from the statistics pass) reaches the
current search interval, and the interval starts from bounds derived from the per-tile
statistics: the k-th largest tile maximum for top_k, and for top_p the largest value v for
which ``sum_t max(0, mass_t - n_t exp((v - m) / T))`` (a lower bound of the mass at or above v)
already reaches top_p. On peaked LLM rows that is a handful of tiles.

The kernel then rewrites the tile sums of the statistics pass to the survivors' sums (tiles
without survivors get 0) and writes the survivors' log-normaliser, so the sampling kernels
draw from the filtered distribution with the same two-level Gumbel-max as without filters.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import _k_eff, _row_stats

INT_MAX = tl.constexpr(2147483647)
NQ = tl.constexpr(16)  # thresholds evaluated per pass of the search
SUB = tl.constexpr(512)  # elements per step inside a tile


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
def _load_keys(x_ptr, row_off, V, offs, cut_key, cut_i, SHIFT: tl.constexpr):
    """Values (float32), keys and survivor flags of the cut (key > cut_key, or key == cut_key
    and id <= cut_i) at token ids ``offs`` of a row."""
    y = tl.load(x_ptr + row_off + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    k = _key(y, SHIFT)
    return y, k, (k > cut_key) | ((k == cut_key) & (offs <= cut_i))


@triton.jit
def _count_mass(x_ptr, row_off, V, ttop_key, toffs, NT, thr, prune_key, m, t, cut_key, cut_i,
                NEED_MASS: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """For each threshold key of ``thr`` [NQ]: how many survivors of (cut_key, cut_i) have a key
    >= it, and (NEED_MASS) their mass sum exp((y - m) / t) in float64. Reads only the tiles
    whose maximum key is >= ``prune_key`` (no element below it can count)."""
    cnt = tl.zeros([NQ], tl.int32)
    mass = tl.zeros([NQ], tl.float64)
    for tile in range(0, NT):
        if _pick(ttop_key, toffs, tile) >= prune_key:
            for sub in tl.static_range(0, BLOCK, SUB):
                offs = tile * BLOCK + sub + tl.arange(0, SUB)
                y, k, alive = _load_keys(x_ptr, row_off, V, offs, cut_key, cut_i, SHIFT)
                ge = (k[None, :] >= thr[:, None]) & alive[None, :]
                cnt += tl.sum(ge.to(tl.int32), axis=1)
                if NEED_MASS:
                    e = tl.exp((y.to(tl.float64) - m.to(tl.float64)) / t.to(tl.float64))
                    e = tl.where(alive & (y > -float("inf")), e, 0.0)
                    mass += tl.sum(tl.where(ge, e[None, :], 0.0), axis=1)
    return cnt, mass


@triton.jit
def _search(x_ptr, row_off, V, ttop_key, toffs, NT, lo, hi, goal_count, goal_mass, m, t,
            cut_key, cut_i, BY_MASS: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
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
        cnt, mass = _count_mass(x_ptr, row_off, V, ttop_key, toffs, NT, thr, prune, m, t,
                                cut_key, cut_i, BY_MASS, SHIFT, BLOCK)
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
def _nth_tie(x_ptr, row_off, V, ttop_key, toffs, NT, key, n, cut_key, cut_i,
             SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Id of the n-th (1-based, id order) survivor of (cut_key, cut_i) whose key is ``key``."""
    seen = 0
    found = INT_MAX
    for tile in range(0, NT):
        if (found == INT_MAX) & (_pick(ttop_key, toffs, tile) >= key):
            for sub in tl.static_range(0, BLOCK, SUB):
                offs = tile * BLOCK + sub + tl.arange(0, SUB)
                y, k, alive = _load_keys(x_ptr, row_off, V, offs, cut_key, cut_i, SHIFT)
                eq = (k == key) & alive & (offs < V)
                run = seen + tl.cumsum(eq.to(tl.int32), axis=0)
                hit = tl.min(tl.where(eq & (run == n), offs, INT_MAX), axis=0)
                found = tl.where(found == INT_MAX, hit, found)
                seen += tl.sum(eq.to(tl.int32), axis=0)
    return found


@triton.jit
def _tile_masses(tilemax_ptr, tilesum_ptr, r, NT, toffs, m, t):
    """Per-tile masses sum exp((y - m) / t) from the statistics pass (float32), [NT_PAD]."""
    ok = toffs < NT
    tm = tl.load(tilemax_ptr + r.to(tl.int64) * NT + toffs, mask=ok, other=-float("inf"))
    ts = tl.load(tilesum_ptr + r.to(tl.int64) * NT + toffs, mask=ok, other=0.0)
    has = ok & (ts > 0) & (tm > -float("inf"))
    return tl.where(has, tl.exp((tl.where(has, tm, m) - m) / t) * ts, 0.0)


@triton.jit(do_not_specialize=["S", "NT"])
def filter_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr,
                  k_given_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                  part_m_ptr, part_s_ptr, part_f_ptr, S, tilemax_ptr, tilesum_ptr, tiletop_ptr,
                  NT, cut_v_ptr, cut_i_ptr, logz_ptr,
                  NT_PAD: tl.constexpr, SHIFT: tl.constexpr, S_MAX: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One program per row: the exact cut (cut_v, cut_i) of min_p -> top_k -> top_p, the tile
    sums rewritten to the survivors', and the survivors' log-normaliser ``logz``. Rows that are
    not live, greedy, invalid or unfiltered get cut (-inf, INT_MAX) and their plain logz."""
    r = tl.program_id(0)
    req = tl.load(row_req_ptr + r)
    j = tl.load(row_j_ptr + r)
    live = j <= _k_eff(draft_ids_ptr, draft_start_ptr, k_given_ptr, req)
    t_req = tl.load(temp_ptr + req)
    t = tl.where(t_req > 0, t_req, 1.0)
    m, logz, flags = _row_stats(part_m_ptr, part_s_ptr, part_f_ptr, r, S, t, False, S_MAX)
    top_k = tl.load(top_k_ptr + req)
    top_p = tl.load(top_p_ptr + req)
    min_p = tl.load(min_p_ptr + req)
    filtered = (min_p > 0) | ((top_k > 0) & (top_k < V)) | (top_p < 1)
    ok = live & (t_req > 0) & filtered & (m > -float("inf")) & (m < float("inf")) & (
        logz == logz)
    cut_key = _key(tl.full((), -float("inf"), tl.float32), SHIFT)
    cut_i = INT_MAX + 0 * r
    if ok:
        row_off = r.to(tl.int64) * stride
        toffs = tl.arange(0, NT_PAD)
        tt = tl.load(tiletop_ptr + r.to(tl.int64) * NT + toffs, mask=toffs < NT,
                     other=-float("inf"))
        ttop_key = _key(tt, SHIFT)
        hi = _key(m, SHIFT) + 1
        lowest = cut_key + 1  # the smallest finite value
        t64 = t.to(tl.float64)
        m64 = m.to(tl.float64)
        # min_p: keep y >= m + T log(min_p) (float64), i.e. key >= key(roundup_f32(cut)).
        if min_p > 0:
            c64 = m64 + t64 * tl.log(min_p)
            c_key = _key(c64.to(tl.float32), SHIFT)  # truncated to the dtype: one step low
            c_key += tl.where(_value(c_key, SHIFT).to(tl.float64) < c64, 1, 0)
            cut_key = tl.maximum(c_key, lowest)
        # top_k: the k-th largest survivor; start from the k-th largest tile maximum.
        if (top_k > 0) & (top_k < V):
            lo = tl.maximum(cut_key, lowest)
            if top_k <= NT:
                srt = tl.sort(ttop_key, descending=True)
                lo = tl.maximum(lo, _pick(srt, toffs, top_k - 1))
            kk = _search(x_ptr, row_off, V, ttop_key, toffs, NT, lo, hi, top_k, 0.0, m, t,
                         cut_key, cut_i, False, SHIFT, BLOCK)
            if kk >= lo:  # else fewer than k survivors: no cut
                above, _m = _count_mass(x_ptr, row_off, V, ttop_key, toffs, NT,
                                        tl.zeros([NQ], tl.int64) + kk + 1, kk + 1, m, t,
                                        cut_key, cut_i, False, SHIFT, BLOCK)
                need = top_k - tl.max(above, axis=0)
                cut_i = _nth_tie(x_ptr, row_off, V, ttop_key, toffs, NT, kk, need, cut_key,
                                 cut_i, SHIFT, BLOCK)
                cut_key = kk
        # top_p over the survivors so far.
        if top_p < 1:
            tmass = _tile_masses(tilemax_ptr, tilesum_ptr, r, NT, toffs, m, t)
            total_row = tl.sum(tmass, axis=0)
            goal = top_p.to(tl.float32) * total_row * 1.0001
            lo_d = 0.0
            hi_d = 128.0
            for _ in range(0, 30):  # smallest delta whose lower-bound mass reaches the goal
                mid = 0.5 * (lo_d + hi_d)
                lb = tl.sum(tl.maximum(tmass * 0.9999 - BLOCK * tl.exp(-mid), 0.0), axis=0)
                reach = lb >= goal
                hi_d = tl.where(reach, mid, hi_d)
                lo_d = tl.where(reach, lo_d, mid)
            lo_p = tl.where(hi_d < 128.0, _key(m - t * hi_d, SHIFT) - 1, lowest)
            unbounded = cut_key < lowest  # no min_p / top_k cut: tail tiles from statistics
            read_key = tl.where(unbounded, tl.maximum(lo_p, lowest), cut_key)
            cnt0, mass0 = _count_mass(x_ptr, row_off, V, ttop_key, toffs, NT,
                                      tl.zeros([NQ], tl.int64) + lowest, read_key, m, t,
                                      cut_key, cut_i, True, SHIFT, BLOCK)
            tail = tl.sum(tl.where(ttop_key < read_key, tmass, 0.0).to(tl.float64), axis=0)
            total = tl.max(mass0, axis=0) + tl.where(unbounded, tail, 0.0)
            goal64 = top_p * total
            lo = tl.maximum(tl.maximum(lo_p, cut_key), lowest)
            pk = _search(x_ptr, row_off, V, ttop_key, toffs, NT, lo, hi, 0, goal64, m, t,
                         cut_key, cut_i, True, SHIFT, BLOCK)
            if pk < lo:  # the bound was not met (rounding): search from the lowest key
                pk = _search(x_ptr, row_off, V, ttop_key, toffs, NT, tl.maximum(cut_key, lowest),
                             lo, 0, goal64, m, t, cut_key, cut_i, True, SHIFT, BLOCK)
            q = tl.arange(0, NQ)
            thr = tl.where(q == 0, pk + 1, pk)
            cnt, mass = _count_mass(x_ptr, row_off, V, ttop_key, toffs, NT, thr, pk, m, t,
                                    cut_key, cut_i, True, SHIFT, BLOCK)
            mass_gt = _pick(mass, q, 0)
            n_gt = _pick(cnt, q, 0)
            n_tie = _pick(cnt, q, 1) - n_gt
            e = tl.exp((_value(pk, SHIFT).to(tl.float64) - m64) / t64)
            # keep tie j (0-based) iff mass_gt + j e < goal: n = ceil((goal - mass_gt) / e)
            n = tl.ceil((goal64 - mass_gt) / e).to(tl.int32)
            n = tl.where(mass_gt + (n - 1).to(tl.float64) * e < goal64, n, n - 1)
            n = tl.where(mass_gt + n.to(tl.float64) * e < goal64, n + 1, n)
            n = tl.minimum(tl.maximum(n, 1), n_tie)
            cut_i = _nth_tie(x_ptr, row_off, V, ttop_key, toffs, NT, pk, n, cut_key, cut_i,
                             SHIFT, BLOCK)
            cut_key = pk
        # The survivors' tile sums (same references as the statistics pass) and normaliser.
        scale = 1.4426950408889634 / t
        tot = 0.0
        for tile in range(0, NT):
            o_t = r.to(tl.int64) * NT + tile
            ref = tl.load(tilemax_ptr + o_t)
            acc = 0.0
            if _pick(ttop_key, toffs, tile) >= cut_key:
                for sub in tl.static_range(0, BLOCK, SUB):
                    offs = tile * BLOCK + sub + tl.arange(0, SUB)
                    y, _k, keep = _load_keys(x_ptr, row_off, V, offs, cut_key, cut_i, SHIFT)
                    keep &= y > -float("inf")
                    acc += tl.sum(tl.where(keep, tl.exp2((y - ref) * scale), 0.0), axis=0)
            tl.store(tilesum_ptr + o_t, acc)
            tot += tl.where(acc > 0, acc * tl.exp((ref - m) / t), 0.0)
        logz = tl.log(tot)
    tl.store(cut_v_ptr + r, _value(cut_key, SHIFT))
    tl.store(cut_i_ptr + r, cut_i)
    tl.store(logz_ptr + r, logz)
