"""Triton kernels: one pass over the logits, temperature fused, no FP32 copy.

The stages of a call:

1. ``stats_kernel`` (grid rows x vocabulary splits): reads each live row once in its own dtype
   and writes, per split, the running max, the sum of exp((x - max) / T) (online softmax), the
   argmax (lowest id) and validity flags; and, per ``rng.TILE``-wide vocabulary tile, the tile's
   max and its sum of exp((x - tile max) / T), i.e. the tile's log-mass. Draft logits or
   probabilities: the draft rows' split statistics (no tiles), in the same launch (more
   than 64 rows of probabilities: a launch of their own).
2. ``sample_kernel`` (grid rows): per row, the exact three-level Gumbel-max draw (a tile
   from the tile log-masses, a sub-tile of it, then a token inside that sub-tile: one tile
   re-read and noise for NT + 16 + 128 values instead of V), or the argmax of a greedy row;
   and the combine of draft row j's splits into its (max, log-normaliser, flags).
3. ``finish_kernel`` (grid requests): greedy / one-hot prefix matching, token-level rejection
   sampling (Leviathan et al. 2023, Alg. 1) or block verification (Sun et al. 2024, Alg. 2),
   and the outputs; the residual kernels then draw a correction over the rejected row pair
   only.

``stats_draw_kernel`` runs stages 1-3 as one launch, eager or captured in a CUDA graph, for
calls without filter kernels, draft distributions or top-n logprobs (the last program of a
row draws it, the last row of a request finishes it; see its docstring).

The random numbers are ``specsample.rng``'s Philox4x32-10 function bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import rng
from .launch import wait_for_prior_grid
from .logprobs import _survives, rank_tiles
from .penalties import ban, ban_setup, process, process_at, setup

STREAM_SAMPLE = tl.constexpr(rng.STREAM_SAMPLE)
STREAM_ACCEPT = tl.constexpr(rng.STREAM_ACCEPT)
STREAM_RESIDUAL = tl.constexpr(rng.STREAM_RESIDUAL)
STREAM_BLOCK_ACCEPT = tl.constexpr(rng.STREAM_BLOCK_ACCEPT)
STREAM_SAMPLE_TILE = tl.constexpr(rng.STREAM_SAMPLE_TILE)
STREAM_RESIDUAL_TILE = tl.constexpr(rng.STREAM_RESIDUAL_TILE)
STREAM_SAMPLE_SUB = tl.constexpr(rng.STREAM_SAMPLE_SUB)
STREAM_RESIDUAL_SUB = tl.constexpr(rng.STREAM_RESIDUAL_SUB)
SUBTILE = tl.constexpr(rng.SUBTILE)
UNIFORM_SCALE = tl.constexpr(rng.UNIFORM_SCALE)
NT_CHUNK = tl.constexpr(128)
LOG2E = tl.constexpr(1.4426950408889634)

# NaN or +inf (logits), or NaN / inf / negative (draft probs)
FLAG_BAD = tl.constexpr(1)
FLAG_FINITE = tl.constexpr(2)  # at least one finite value
# Rows processed with bans / logit_bias / penalties inside the kernels (``penalties``):
# FLAG_BAD and FLAG_FINITE then describe the processed values (the finish reads the raw row
# again only when they are bad: ``_raw_row_flags``, which sets FLAG_BANS_EMPTY for a raw row
# with a finite value whose bans leave none).
FLAG_PROCESSED = tl.constexpr(4)
FLAG_BANS_EMPTY = tl.constexpr(8)

ERR_LOGITS_NAN = tl.constexpr(1)
ERR_LOGITS_NO_FINITE = tl.constexpr(2)
ERR_DRAFT_ID = tl.constexpr(4)
ERR_DRAFT_ROW = tl.constexpr(8)
ERR_PROCESSED_OVERFLOW = tl.constexpr(16)
ERR_BANS = tl.constexpr(32)

# Integer arguments that vary per call and say nothing about alignment are not specialised
# (no recompilation when they change). Row strides and vocabulary sizes stay specialised: their
# divisibility by 16 is what lets Triton issue 16-byte vector loads (warmup covers the
# deployment's sizes; the compile guard reports any other).
_NOSPEC = dict(do_not_specialize=["S", "CPS", "NT", "R", "K", "DS", "DCPS", "SB",
                                   "filtered", "lp0", "draft_kind", "BW", "KP",
                                   "AV"])
J_BLOCK = tl.constexpr(8)  # positions per step of finish_kernel's output loop


@triton.jit
def _philox_words01(c0, c1, c2, c3, k0, k1):
    """Words 0 and 1 of Philox4x32-10 (uint32 tensors), as ``rng.philox``."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c2, 0xCD9E8D57)
        lo0 = c2 * 0xCD9E8D57
        hi1 = tl.umulhi(c0, 0xD2511F53)
        lo1 = c0 * 0xD2511F53
        c0 = hi0 ^ c1 ^ k0
        c1 = lo0
        c2 = hi1 ^ c3 ^ k1
        c3 = lo1
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1


@triton.jit
def _words(seed_lo, seed_hi, pos, counter, stream: tl.constexpr):
    """The two 26-bit halves (w0 >> 6, w1 >> 6) of the 52-bit uniform of ``rng.uniform``.

    ``seed_lo`` / ``seed_hi`` / ``pos``: int64 scalars; ``counter``: int32/int64 tensor.
    """
    c0 = (counter + tl.zeros((), tl.int64)).to(tl.uint32)  # counters are >= 0: low 32 bits
    zero = c0 * 0
    pos = pos + tl.zeros((), tl.int64)
    c1 = zero + pos.to(tl.uint32)
    c2 = zero + (pos >> 32).to(tl.uint32)
    c3 = zero + stream
    k0 = zero + seed_lo.to(tl.uint32)
    k1 = zero + seed_hi.to(tl.uint32)
    w0, w1 = _philox_words01(c0, c1, c2, c3, k0, k1)
    return w0 >> 6, w1 >> 6


@triton.jit
def _uniform(seed_lo, seed_hi, pos, counter, stream: tl.constexpr):
    """Float64 52-bit uniform in (0, 1), exactly ``rng.uniform``."""
    hi, lo = _words(seed_lo, seed_hi, pos, counter, stream)
    return (hi.to(tl.float64) * 67108864.0 + lo.to(tl.float64) + 0.5) * UNIFORM_SCALE


@triton.jit
def _gumbel(seed_lo, seed_hi, pos, counter, stream: tl.constexpr):
    """Float32 Gumbel noise -log(-log(u)) of the 52-bit uniform u of ``rng.uniform``, to within
    a few float32 ulps (``rng.gumbel`` computes it in float64).

    E = -log(u) is formed without cancellation: from u itself when u < 1/2, else from
    v = 1 - u (computed exactly in integers, so E down to 2**-53 keeps its relative precision)
    as -log1p(-v) by Goldberg's log1p(x) = log(1 + x) * x / ((1 + x) - 1). So the noise keeps
    the full 52-bit tail (up to GUMBEL_MAX ~ 36.7) at float32 cost, no float64 transcendental.
    """
    hi, lo = _words(seed_lo, seed_hi, pos, counter, stream)
    upper = hi >= 33554432  # u >= 1/2: bit 25 of the high half
    # v = 1 - u = (2**52 - 1 - k + 0.5) * 2**-52 with k = hi * 2**26 + lo
    hi_c = tl.where(upper, 67108863 - hi, hi)
    lo_c = tl.where(upper, 67108863 - lo, lo)
    x = hi_c.to(tl.float32) * 1.4901161193847656e-08 + (lo_c.to(tl.float32) + 0.5) * (
        2.220446049250313e-16)  # u (lower half) or v = 1 - u (upper half)
    one_minus = 1.0 - x
    log1p_neg = tl.where(one_minus == 1.0, -x,
                         tl.log(one_minus) * (-x) / tl.where(one_minus == 1.0, -1.0,
                                                             one_minus - 1.0))
    e = tl.where(upper, -log1p_neg, -tl.log(x))
    return -tl.log(e)


@triton.jit
def _any(cond, bit):
    """``bit`` (int32) if any lane of ``cond`` is set, else 0."""
    return tl.where(tl.max(cond.to(tl.int32), axis=0) != 0, bit, 0)


@triton.jit
def _lane(v, lane):
    """The value of vector ``v`` at ``lane`` (exact: the other lanes add zeros)."""
    return tl.sum(tl.where(tl.arange(0, v.shape[0]) == lane, v, 0), axis=0)


@triton.jit
def _k_eff(draft_ids_ptr, draft_start_ptr, k_given_ptr, req, LANES: tl.constexpr):
    """Drafts of request ``req`` before its first placeholder (-1), else its k_i.

    LANES reads J_BLOCK draft ids per load (one load's latency instead of k): for
    ``finish_kernel`` and ``stats_draw_kernel``'s drawing programs (a few programs,
    latency-bound) and the statistics of probability rows.
    The statistics of logits keep the scalar loop: with LANES they were slower at B = 128
    (one-hot 85 -> 92 us), while probability rows became much faster (BENCHMARKS.md)."""
    return _k_eff_of(draft_ids_ptr, tl.load(draft_start_ptr + req),
                     tl.load(k_given_ptr + req), LANES)


@triton.jit
def _k_eff_of(draft_ids_ptr, ds, kg, LANES: tl.constexpr):
    """:func:`_k_eff` of the request whose drafts start at ``ds``, with k_given ``kg``."""
    keff = kg
    if LANES:
        for c in range(0, kg, J_BLOCK):
            j = c + tl.arange(0, J_BLOCK)
            d = tl.load(draft_ids_ptr + ds + j, mask=j < kg, other=0)
            keff = tl.minimum(keff, tl.min(tl.where(d == -1, j, kg), axis=0))
    else:
        for j in range(0, kg):
            d = tl.load(draft_ids_ptr + ds + j)
            keff = tl.where((d == -1) & (keff == kg), j, keff)
    return keff


@triton.jit(**_NOSPEC)
def stats_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr,
                 k_given_ptr, temp_ptr, part_m_ptr, part_s_ptr, part_f_ptr, tilemax_ptr,
                 tilesum_ptr, tiletop_ptr, S, CPS, NT, R, d_ptr, dstride, DV, draft_req_ptr,
                 draft_j_ptr, req_temp_ptr, dpart_m_ptr, dpart_s_ptr, dpart_f_ptr, DS, DCPS,
                 rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
                 bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV, WRITE_TOP: tl.constexpr,
                 DRAFT: tl.constexpr, PEN: tl.constexpr,
                 TPC: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Per (row, split): max and sum exp((x - max) / T) (the plain sum and the argmax for
    probabilities) and flags; for the target rows also, per tile, a reference ``ref`` (the
    max of its chunk of TPC tiles) and sum exp((x - ref) / T), so the tile's log-mass is
    (ref - max) / T + log(sum), and with WRITE_TOP the tile's own maximum (the filter
    kernels' search bounds, the top-n logprobs' tile ranking; the chunk's maximum is then
    taken from the tiles', but the per-tile reduction still costs about 10% more shuffles
    than one of the whole chunk). A split covers CPS chunks: one load of TPC * BLOCK elements per
    iteration, about five instructions per element (convert, max, FMA, exp2, add). Errors need
    no per-element test for logits: a NaN or +inf makes the sum NaN, and a row with no finite
    value has max -inf. Rows past the request's live range (target ``j > k_eff``, draft
    ``j >= k_eff``) are not read.

    DRAFT 1 (draft logits) or 2 (draft probabilities): the first R programs of the grid's
    first axis do the same for the R draft rows (``d_ptr`` [R, DV], DS splits of DCPS chunks,
    at the request temperature ``req_temp``; no tiles), the programs after them the target
    rows, so target and draft rows take one launch (grid (R + target rows, max(S, DS)); a
    program past its row's split count does nothing). The draft rows first: at B = 128 with
    draft logits that was 6 us faster than after the target rows (H200, BENCHMARKS.md).
    A grid of R rows alone is a launch of draft rows only.

    PEN 1 (logit_bias) or 2 (penalties too): the target rows are processed as they are loaded
    (``penalties.process``; the ``rep_ptr`` .. ``bval_ptr`` arguments), and their flags
    describe the processed values (with FLAG_PROCESSED)."""
    wait_for_prior_grid(GDC)
    r = tl.program_id(0)
    s = tl.program_id(1)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV)
    if DRAFT != 0:
        if r < R:
            dr = r
            req = tl.load(draft_req_ptr + dr)
            j = tl.load(draft_j_ptr + dr)
            live = (s < DS) & (j < _k_eff(draft_ids_ptr, draft_start_ptr, k_given_ptr, req,
                                          DRAFT == 2))
            _split_stats(d_ptr, dstride, DV, dr, s, live, tl.load(req_temp_ptr + req),
                         dpart_m_ptr, dpart_s_ptr, dpart_f_ptr, tilemax_ptr, tilesum_ptr,
                         tiletop_ptr, DS, DCPS, NT, req, j, pen, DRAFT == 2, False, False,
                         False, TPC, BLOCK)
        else:
            _target_split_stats(x_ptr, stride, V, r - R, s, row_req_ptr, row_j_ptr, draft_ids_ptr,
                                draft_start_ptr, k_given_ptr, temp_ptr, part_m_ptr,
                                part_s_ptr, part_f_ptr, tilemax_ptr, tilesum_ptr,
                                tiletop_ptr, S, CPS, NT, pen, WRITE_TOP, PEN, TPC, BLOCK)
    else:
        _target_split_stats(x_ptr, stride, V, r, s, row_req_ptr, row_j_ptr, draft_ids_ptr,
                            draft_start_ptr, k_given_ptr, temp_ptr, part_m_ptr, part_s_ptr,
                            part_f_ptr, tilemax_ptr, tilesum_ptr, tiletop_ptr, S, CPS, NT,
                            pen, WRITE_TOP, PEN, TPC, BLOCK)


@triton.jit
def _target_split_stats(x_ptr, stride, V, r, s, row_req_ptr, row_j_ptr, draft_ids_ptr,
                        draft_start_ptr, k_given_ptr, temp_ptr, part_m_ptr, part_s_ptr,
                        part_f_ptr, tilemax_ptr, tilesum_ptr, tiletop_ptr, S, CPS, NT, pen,
                        WRITE_TOP: tl.constexpr, PEN: tl.constexpr, TPC: tl.constexpr,
                        BLOCK: tl.constexpr):
    """:func:`stats_kernel`'s work for split ``s`` of target row ``r``."""
    req = tl.load(row_req_ptr + r)
    j = tl.load(row_j_ptr + r)
    live = (s < S) & (j <= _k_eff(draft_ids_ptr, draft_start_ptr, k_given_ptr, req, False))
    _split_stats(x_ptr, stride, V, r, s, live, tl.load(temp_ptr + req), part_m_ptr,
                 part_s_ptr, part_f_ptr, tilemax_ptr, tilesum_ptr, tiletop_ptr, S, CPS, NT,
                 req, j, pen, False, True, WRITE_TOP, PEN, TPC, BLOCK)


@triton.jit
def _split_stats(x_ptr, stride, V, r, s, live, t, part_m_ptr, part_s_ptr, part_f_ptr,
                 tilemax_ptr, tilesum_ptr, tiletop_ptr, S, CPS, NT, req, j, pen,
                 IS_PROBS: tl.constexpr, WRITE_TILES: tl.constexpr, WRITE_TOP: tl.constexpr,
                 PEN: tl.constexpr, TPC: tl.constexpr, BLOCK: tl.constexpr):
    """The statistics of split ``s`` of row ``r`` (:func:`stats_kernel`); ``t`` the row's
    temperature (0 for greedy rows: then 1); with PEN the values of row ``j`` of request
    ``req`` processed by ``penalties.process`` (``pen``)."""
    inv_t = 1.0 / tl.where(t > 0, t, 1.0)
    scale = inv_t * LOG2E  # exp(y / T) = exp2(y * scale)
    CHUNK: tl.constexpr = TPC * BLOCK
    offs0 = tl.arange(0, CHUNK)
    tiles0 = tl.arange(0, TPC)
    flag_v = tl.zeros([CHUNK], tl.int32)  # probabilities only: per-lane flags
    sum_v = tl.zeros([CHUNK], tl.float32)
    m = -float("inf")
    acc = 0.0
    if live:
        base = x_ptr + r.to(tl.int64) * stride
        if PEN:
            st = setup(s * CPS * CHUNK, req, j, pen)
        for c in range(s * CPS, s * CPS + CPS):  # chunks past the row end are fully masked
            offs = c * CHUNK + offs0
            mask = offs < V
            x = tl.load(base + offs, mask=mask, other=-float("inf")).to(tl.float32)
            if PEN:
                x, st = process(x, offs, c * CHUNK, c * CHUNK + CHUNK, req, j, st, pen, PEN == 2)
            if IS_PROBS:
                cmax = tl.max(x, axis=0)
                fin = (x > -float("inf")) & (x < float("inf"))
                bad = mask & ((x != x) | ~fin | (x < 0))
                flag_v |= bad.to(tl.int32) * FLAG_BAD | fin.to(tl.int32) * FLAG_FINITE
                sum_v += tl.where(fin, x, 0.0)
                m = tl.maximum(m, cmax)
            else:
                x2 = tl.reshape(x, (TPC, BLOCK))
                if WRITE_TOP:
                    tmax = tl.max(x2, axis=1)
                    cmax = tl.max(tmax, axis=0)
                else:
                    cmax = tl.max(x, axis=0)
                ref = tl.where(cmax == -float("inf"), 0.0, cmax)
                tsum = tl.sum(tl.exp2((x2 - ref) * scale), axis=1)
                m_new = tl.maximum(m, cmax)
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                # (a chunk whose max is -inf adds its sum unscaled: 0 when every value is
                # -inf, since its factor exp2((0 - m) / T) overflows to inf when the row's
                # values so far are below about -88 T, and 0 * inf is NaN; NaN when the
                # chunk's NaNs are all it holds besides -inf, which the GPU's max skips)
                csum = tl.sum(tsum, axis=0)
                acc = acc * tl.exp2((m - m_safe) * scale) + tl.where(
                    cmax == -float("inf"), csum, csum * tl.exp2((ref - m_safe) * scale))
                m = m_new
                if WRITE_TILES:
                    tile = c * TPC + tiles0
                    o_t = r.to(tl.int64) * NT + tile
                    tl.store(tilemax_ptr + o_t, tl.zeros([TPC], tl.float32) + cmax,
                             mask=tile < NT)
                    tl.store(tilesum_ptr + o_t, tsum, mask=tile < NT)
                    if WRITE_TOP:
                        tl.store(tiletop_ptr + o_t, tmax, mask=tile < NT)
    if IS_PROBS:
        flags = tl.max(flag_v & FLAG_BAD, axis=0) | tl.max(flag_v & FLAG_FINITE, axis=0)
        acc = tl.sum(sum_v, axis=0)
    else:
        bad = (acc != acc) | (m == float("inf"))
        flags = tl.where(bad, FLAG_BAD, 0) | tl.where(m > -float("inf"), FLAG_FINITE, 0)
        if PEN:
            flags |= FLAG_PROCESSED
    o = r.to(tl.int64) * S + s
    ok = s < S  # (stats_kernel's grid may have more splits than this row)
    tl.store(part_m_ptr + o, m, mask=ok)
    tl.store(part_s_ptr + o, acc, mask=ok)
    tl.store(part_f_ptr + o, flags, mask=ok)


@triton.jit
def _row_stats(part_m_ptr, part_s_ptr, part_f_ptr, r, S, t, IS_PROBS, S_MAX: tl.constexpr):
    """Combine row ``r``'s splits: (max, log-normaliser, flags).

    For logits the normaliser is log sum exp((x - max) / t); for probabilities (``IS_PROBS``,
    a constant or a runtime flag) log sum x.
    """
    pm, ps, pf = _load_parts(part_m_ptr, part_s_ptr, part_f_ptr, r, S, S_MAX)
    return _combine_parts(pm, ps, pf, t, IS_PROBS)


@triton.jit
def _load_parts(part_m_ptr, part_s_ptr, part_f_ptr, r, S, S_MAX: tl.constexpr):
    """Row ``r``'s split statistics [S_MAX] (max, sum, flags), neutral past S."""
    offs = tl.arange(0, S_MAX)
    o = r.to(tl.int64) * S + offs
    ok = offs < S
    pm = tl.load(part_m_ptr + o, mask=ok, other=-float("inf"))
    ps = tl.load(part_s_ptr + o, mask=ok, other=0.0)
    pf = tl.load(part_f_ptr + o, mask=ok, other=0)
    return pm, ps, pf


@triton.jit
def _combine_parts(pm, ps, pf, t, IS_PROBS):
    """:func:`_row_stats` of loaded split statistics."""
    m = tl.max(pm, axis=0)
    if IS_PROBS:
        total = tl.sum(ps, axis=0)
    else:
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        total = tl.sum(tl.where(pm == -float("inf"), 0.0, ps * tl.exp((pm - m_safe) / t)),
                       axis=0)
    flags = tl.reduce(pf, 0, _bit_or)
    return m, tl.log(total), flags


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _draft_stats(dstats_ptr, dr, live):
    """(max, log-normaliser, flags) of draft rows ``dr`` (a scalar or a vector, read where
    ``live``) from ``sample_kernel``'s dstats [drafts, 3]."""
    o = dr.to(tl.int64) * 3
    dm = tl.load(dstats_ptr + o, mask=live, other=-float("inf"))
    dlogz = tl.load(dstats_ptr + o + 1, mask=live, other=-float("inf"))
    dflags = tl.load(dstats_ptr + o + 2, mask=live, other=0.0).to(tl.int32)
    return dm, dlogz, dflags


@triton.jit
def _load_tiles(tilemax_ptr, tilesum_ptr, r, NT, offs):
    """Row ``r``'s tile references and sums at tile ids ``offs`` (statistics pass), and which
    tiles hold mass: (ref, sum, has)."""
    ok = offs < NT
    o = r.to(tl.int64) * NT + offs
    tm = tl.load(tilemax_ptr + o, mask=ok, other=-float("inf"))
    ts = tl.load(tilesum_ptr + o, mask=ok, other=0.0)
    return tm, ts, ok & (ts > 0) & (tm > -float("inf"))


@triton.jit
def _best_sub(key, tile, seed_lo, seed_hi, pos, stream: tl.constexpr, BLOCK: tl.constexpr):
    """The middle level of the draw: global index of the sub-tile of tile ``tile`` drawn with
    keys logsumexp(sub-tile) + G(stream), from the tile's keys ``key`` [BLOCK] (log-weights,
    -inf where excluded); lowest index on ties."""
    k2 = tl.reshape(key, (BLOCK // SUBTILE, SUBTILE))
    smax = tl.max(k2, axis=1)
    ref = tl.where(smax > -float("inf"), smax, 0.0)
    lse = ref + tl.log(tl.sum(tl.exp(k2 - ref[:, None]), axis=1))
    sub = tile * (BLOCK // SUBTILE) + tl.arange(0, BLOCK // SUBTILE)
    skey = tl.where(smax > -float("inf"), lse + _gumbel(seed_lo, seed_hi, pos, sub, stream),
                    -float("inf"))
    return tl.argmax(skey, axis=0) + tile * (BLOCK // SUBTILE)


@triton.jit
def _tiled_sample(x_ptr, stride, V, r, m, t, tilemax_ptr, tilesum_ptr, NT, seed_lo, seed_hi,
                  pos, first, cut_v, cut_i, req, j, pen, PEN: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Exact draw from softmax((x - m) / t) of row ``r``, restricted to the survivors of the
    cut (cut_v, cut_i), by three-level Gumbel-max: a tile with keys log-mass + G
    (STREAM_SAMPLE_TILE), a sub-tile of it (STREAM_SAMPLE_SUB), then a token of that sub-tile
    with keys (x - m) / t + G (STREAM_SAMPLE); lowest index on ties, as the torch backend.
    With PEN, x is row ``j`` of request ``req`` processed (``penalties.process``). ``first``:
    :func:`_tiles_and_noise` of the first NT_CHUNK tiles."""
    best = tl.full((), -float("inf"), tl.float32)
    bt = 0
    for c in range(0, NT, NT_CHUNK):
        offs = c + tl.arange(0, NT_CHUNK)
        if c == 0:
            tm, ts, has, g = first
        else:
            tm, ts, has, g = _tiles_and_noise(tilemax_ptr, tilesum_ptr, r, NT, offs, seed_lo,
                                              seed_hi, pos, True)
        lm = (tl.where(has, tm, m) - m) / t + tl.log(tl.where(has, ts, 1.0))
        key = lm + g
        key = tl.where(has, key, -float("inf"))
        kmax = tl.max(key, axis=0)
        kidx = tl.argmax(key, axis=0) + c
        bt = tl.where(kmax > best, kidx, bt)
        best = tl.maximum(best, kmax)
    row = x_ptr + r.to(tl.int64) * stride
    offs = bt * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    if PEN:
        x, _ = process(x, offs, bt * BLOCK, bt * BLOCK + BLOCK, req, j,
                       setup(bt * BLOCK, req, j, pen), pen, PEN == 2)
    fin = (x > -float("inf")) & (x < float("inf")) & _survives(x, offs, cut_v, cut_i)
    sb = _best_sub(tl.where(fin, (x - m) / t, -float("inf")), bt, seed_lo, seed_hi, pos,
                   STREAM_SAMPLE_SUB, BLOCK)
    # The chosen sub-tile only (re-read from cache): noise for SUBTILE tokens, not BLOCK.
    offs = sb * SUBTILE + tl.arange(0, SUBTILE)
    x = tl.load(row + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
    if PEN:
        x, _ = process(x, offs, sb * SUBTILE, sb * SUBTILE + SUBTILE, req, j,
                       setup(sb * SUBTILE, req, j, pen), pen, PEN == 2)
    fin = (x > -float("inf")) & (x < float("inf")) & _survives(x, offs, cut_v, cut_i)
    key = tl.where(fin, (x - m) / t, -float("inf"))
    key = key + _gumbel(seed_lo, seed_hi, pos, offs, STREAM_SAMPLE)
    key = tl.where(fin, key, -float("inf"))
    return (tl.argmax(key, axis=0) + sb * SUBTILE).to(tl.int32)


@triton.jit
def _tiles_and_noise(tilemax_ptr, tilesum_ptr, r, NT, offs, seed_lo, seed_hi, pos, sampled):
    """Row ``r``'s tiles at ``offs`` (:func:`_load_tiles`) and, when ``sampled``, their
    tile-level noise: for :func:`_tiled_sample`, whose first NT_CHUNK tiles :func:`_draw_row`
    takes this way with the row's statistics (neither needs them; the noise is made before
    they are combined: one dependent load fewer in a row's latency, about 0.5 us of an H100
    launch at B = 1)."""
    tm, ts, has = _load_tiles(tilemax_ptr, tilesum_ptr, r, NT, offs)
    g = tl.zeros([NT_CHUNK], tl.float32)
    if sampled:
        g = _gumbel(seed_lo, seed_hi, pos, offs, STREAM_SAMPLE_TILE)
    return tm, ts, has, g


@triton.jit
def _tiles_logz(tilemax_ptr, tilesum_ptr, r, NT, m, t):
    """log sum_t exp((ref_t - m) / t) sum_t: the row's log-normaliser from its tile sums."""
    total = 0.0
    for c in range(0, NT, NT_CHUNK):
        offs = c + tl.arange(0, NT_CHUNK)
        tm, ts, has = _load_tiles(tilemax_ptr, tilesum_ptr, r, NT, offs)
        total += tl.sum(tl.where(has, tl.exp((tl.where(has, tm, m) - m) / t) * ts, 0.0), axis=0)
    return tl.log(total)


@triton.jit
def _first_max(x_ptr, stride, V, r, m, tilemax_ptr, NT, req, j, pen, PEN: tl.constexpr,
               TPC: tl.constexpr, BLOCK: tl.constexpr):
    """Lowest token id of row ``r`` whose value is the row max ``m`` (greedy argmax): the max
    lies in the first chunk whose reference (its max) equals ``m``; scan that chunk's tiles
    (with PEN, processed as :func:`_tiled_sample`'s)."""
    first = 2147483647
    for c in range(0, NT, NT_CHUNK):
        offs = c + tl.arange(0, NT_CHUNK)
        tm = tl.load(tilemax_ptr + r.to(tl.int64) * NT + offs, mask=offs < NT,
                     other=-float("inf"))
        first = tl.minimum(first, tl.min(tl.where(tm == m, offs, 2147483647), axis=0))
    first = tl.minimum(first, NT - 1)
    best = 2147483647
    for tile in range(first, first + TPC):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + r.to(tl.int64) * stride + offs, mask=offs < V,
                    other=-float("inf")).to(tl.float32)
        if PEN:
            x, _ = process(x, offs, tile * BLOCK, tile * BLOCK + BLOCK, req, j,
                           setup(tile * BLOCK, req, j, pen), pen, PEN == 2)
        best = tl.minimum(best, tl.min(tl.where(x == m, offs, 2147483647), axis=0))
    return tl.where(best < V, best, 0)


@triton.jit(**_NOSPEC)
def sample_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr,
                  k_given_ptr, temp_ptr, req_temp_ptr,
                  seed_lo_ptr, seed_hi_ptr, pos_ptr, part_m_ptr, part_s_ptr,
                  part_f_ptr, tilemax_ptr, tilesum_ptr, S, NT, out_y_ptr, out_stats_ptr,
                  cut_v_ptr, cut_i_ptr, tiletop_ptr, lp_n_ptr, rank_ptr, count_ptr,
                  dpart_m_ptr, dpart_s_ptr, dpart_f_ptr, DS, dstats_ptr, draft_kind,
                  rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr,
                  bids_ptr, bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                  FILTERED: tl.constexpr, RANK: tl.constexpr,
                  NT_SORT: tl.constexpr, NPAD: tl.constexpr, PEN: tl.constexpr,
                  S_MAX: tl.constexpr, TPC: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """One program per live row: combine the row's splits into (max, log-normaliser, flags),
    and draw the row's token: argmax for greedy requests, else the exact three-level Gumbel-max
    draw (``_tiled_sample``). Writes y [T] and stats [T, 3] = (max, log-normaliser, flags).
    FILTERED: the filter kernels (``filters``) ran first; a filtered row's tile sums are the
    survivors', its log-normaliser is taken from them, and its draw is restricted to the cut.
    RANK: rows of requests that ask for top-n logprobs also rank their tiles
    (``logprobs.rank_tiles``; RANK 2: by z', with logit_bias or penalties).
    ``draft_kind`` 1 (draft logits) or 2 (draft probabilities): the statistics pass of the
    draft rows ran first; the program of target row j of a request also combines the splits of
    its draft row j (j < k_given) into dstats [drafts, 3] = (max, log-normaliser, flags) at the
    request's temperature (probabilities: log of the plain sum), which the finish and the
    residual kernels read: one combine per draft row instead of one in every kernel that
    reads the row. A runtime flag, not a constant: no sampling-kernel variants of its own.
    With it, a sampled request's rows are not drawn (y 0): the residual kernels draw the one
    target sample such a request can emit (the bonus token, or a zero residual's row).
    PEN: as :func:`stats_kernel`'s (the draw reads the processed values)."""
    wait_for_prior_grid(GDC)
    r = tl.program_id(0)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV)
    req = tl.load(row_req_ptr + r)
    j = tl.load(row_j_ptr + r)
    live = j <= _k_eff(draft_ids_ptr, draft_start_ptr, k_given_ptr, req, False)
    if draft_kind != 0:
        if j < tl.load(k_given_ptr + req):
            dr = tl.load(draft_start_ptr + req) + j
            dt = tl.load(req_temp_ptr + req)
            dm, dlogz, dflags = _row_stats(dpart_m_ptr, dpart_s_ptr, dpart_f_ptr, dr, DS,
                                           tl.where(dt > 0, dt, 1.0), draft_kind == 2, S_MAX)
            o = dr.to(tl.int64) * 3
            tl.store(dstats_ptr + o, dm)
            tl.store(dstats_ptr + o + 1, dlogz)
            tl.store(dstats_ptr + o + 2, dflags.to(tl.float32))
    _draw_row(x_ptr, stride, V, r, req, j, live, draft_kind, tl.load(temp_ptr + req),
              req_temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr, part_m_ptr, part_s_ptr, part_f_ptr,
              tilemax_ptr, tilesum_ptr, S, NT, out_y_ptr, out_stats_ptr, cut_v_ptr, cut_i_ptr,
              tiletop_ptr, lp_n_ptr, rank_ptr, count_ptr, pen, FILTERED, RANK, NT_SORT, NPAD,
              PEN, S_MAX, TPC, BLOCK)


@triton.jit(**_NOSPEC)
def stats_draw_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, draft_ids_ptr, draft_start_ptr,
                      k_given_ptr, temp_ptr, req_temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr,
                      part_m_ptr, part_s_ptr, part_f_ptr, tilemax_ptr, tilesum_ptr, S, CPS, NT,
                      out_y_ptr, out_stats_ptr, done_ptr, row_start_ptr, out_tok_ptr,
                      out_nacc_ptr, out_err_ptr, out_invalid_ptr, res_row_ptr, K,
                      lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, rep_ptr, freq_ptr, pres_ptr,
                      counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr, ban_ptr, BW, KP,
                      aslot_ptr, amask_ptr,
                      AV, PEN: tl.constexpr, S_MAX: tl.constexpr, TPC: tl.constexpr,
                      BLOCK: tl.constexpr, GDC: tl.constexpr):
    """:func:`stats_kernel` (logits, with tiles), :func:`sample_kernel` (unfiltered, no tile
    ranking) and :func:`finish_kernel` (no draft distributions) in one launch: the last of a
    row's S split programs to finish draws the row's token, and the last of a request's
    k_eff + 1 live rows to be drawn finishes the request.

    Each program writes its split's statistics and tiles, then, after a barrier of its own
    threads, adds 1 to the row's counter ``done_ptr[r]`` with an acquire-release atomic at GPU
    scope: the program that reads S - 1 follows every other split's writes (their release, its
    acquire), sets the counter back to 0 for the next launch and draws the row. A live row's
    drawing program then does the same on its request's counter
    ``done_ptr[num rows + request]``, after the row's token and statistics: the program that
    reads k_eff finishes the request. ``done_ptr`` [rows + requests] int32 is all zeros before
    the launch and after it. So the draw starts as soon as its row has been read, while other
    rows are still being read, and nothing waits for a second or third launch (the
    single-pass "last block" pattern of CUDA's threadFenceReduction sample). PEN: as
    :func:`stats_kernel`'s.

    A program reads its split unless its row is past the request's k_given or its draft
    j - 1 is a placeholder (-1): one load of that id before the row's first logit, not the k
    dependent loads of ids that finding k_eff one id at a time took (a row after a
    placeholder that drafts follow is read and never used). Only a drawing program finds
    k_eff, from one load of up to J_BLOCK ids (ceil(k_given / J_BLOCK) loads past that); the
    finishing program reuses it, and takes the
    request's first row as r - j (a request's rows are contiguous) and its first draft row
    from the same look-up as the ids."""
    wait_for_prior_grid(GDC)
    r = tl.program_id(0)
    s = tl.program_id(1)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV)
    req = tl.load(row_req_ptr + r)
    j = tl.load(row_j_ptr + r)
    t = tl.load(temp_ptr + req)
    kg = tl.load(k_given_ptr + req)
    dstart = tl.load(draft_start_ptr + req)
    # Read the split unless the row is past k_given or follows a placeholder directly (a
    # row after a placeholder followed by drafts is read, never used): one load, not k_eff
    prev = tl.load(draft_ids_ptr + dstart + j - 1, mask=(j >= 1) & (j <= kg), other=0)
    _split_stats(x_ptr, stride, V, r, s, (j <= kg) & (prev != -1), t, part_m_ptr,
                 part_s_ptr, part_f_ptr, tilemax_ptr, tilesum_ptr, tilemax_ptr, S, CPS, NT,
                 req, j, pen, False, True, False, PEN, TPC, BLOCK)
    tl.debug_barrier()
    done = tl.atomic_add(done_ptr + r, 1, sem="acq_rel", scope="gpu")
    if done == S - 1:
        tl.store(done_ptr + r, 0)
        k_eff = _k_eff_of(draft_ids_ptr, dstart, kg, True)
        live = j <= k_eff
        # (the cut and the ranking's pointers are never read: unfiltered, no ranking)
        _draw_row(x_ptr, stride, V, r, req, j, live, 0, t, req_temp_ptr, seed_lo_ptr,
                  seed_hi_ptr, pos_ptr, part_m_ptr, part_s_ptr, part_f_ptr, tilemax_ptr,
                  tilesum_ptr, S, NT, out_y_ptr, out_stats_ptr, part_m_ptr, part_f_ptr,
                  tilemax_ptr, part_f_ptr, part_f_ptr, part_f_ptr, pen, False, False, 1, 1, PEN,
                  S_MAX, TPC, BLOCK)
        if live:
            tl.debug_barrier()
            req_done = done_ptr + tl.num_programs(0) + req
            rows_done = tl.atomic_add(req_done, 1, sem="acq_rel", scope="gpu")
            if rows_done == k_eff:
                tl.store(req_done, 0)
                # (no draft distribution: the draft and block arguments are never read)
                _finish_request(req, (k_eff, r - j, dstart), x_ptr, stride, V, temp_ptr,
                                req_temp_ptr, seed_lo_ptr,
                                seed_hi_ptr, pos_ptr, row_start_ptr, draft_start_ptr,
                                k_given_ptr, draft_ids_ptr, out_y_ptr, out_stats_ptr,
                                part_m_ptr, 0, 1, part_m_ptr,
                                out_tok_ptr, out_nacc_ptr, out_err_ptr, out_invalid_ptr,
                                res_row_ptr, K, part_m_ptr, part_f_ptr,
                                part_m_ptr, part_m_ptr, 1, 0, lp_proc_ptr, lp_v_ptr, lp_i_ptr,
                                lp0, pen, False, False, False, False, 0, S_MAX, True)


@triton.jit
def _draw_row(x_ptr, stride, V, r, req, j, live, lazy, t, req_temp_ptr, seed_lo_ptr, seed_hi_ptr,
              pos_ptr, part_m_ptr, part_s_ptr, part_f_ptr, tilemax_ptr, tilesum_ptr, S, NT,
              out_y_ptr, out_stats_ptr, cut_v_ptr, cut_i_ptr, tiletop_ptr, lp_n_ptr, rank_ptr,
              count_ptr, pen, FILTERED: tl.constexpr, RANK: tl.constexpr,
              NT_SORT: tl.constexpr, NPAD: tl.constexpr, PEN: tl.constexpr,
              S_MAX: tl.constexpr, TPC: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r``'s statistics and token (:func:`sample_kernel`); ``t`` the temperature of
    the row's pass (0 for greedy rows). ``lazy`` != 0 (the call has a draft distribution): a
    sampled request's rows are not drawn (y = 0 is written): its acceptance test reads
    p(d_j) from the statistics, and a target sample is needed only for the bonus token or a
    zero residual, which the residual kernels draw (:func:`_target_draw`, the same draw)."""
    t = tl.where(t > 0, t, 1.0)
    parts = _load_parts(part_m_ptr, part_s_ptr, part_f_ptr, r, S, S_MAX)
    sampled = tl.load(req_temp_ptr + req) > 0
    draws = sampled & (lazy == 0)
    seed_lo = tl.load(seed_lo_ptr + req)
    seed_hi = tl.load(seed_hi_ptr + req)
    pos = tl.load(pos_ptr + req) + j
    first = _tiles_and_noise(tilemax_ptr, tilesum_ptr, r, NT, tl.arange(0, NT_CHUNK), seed_lo,
                             seed_hi, pos, draws)
    m, logz, flags = _combine_parts(parts[0], parts[1], parts[2], t, False)
    y = 0
    ok = live & (m > -float("inf")) & (m < float("inf")) & (logz == logz)
    cut_v = -float("inf")
    cut_i = 2147483647
    if FILTERED:
        cut_v = tl.load(cut_v_ptr + r)
        cut_i = tl.load(cut_i_ptr + r)
        if cut_v > -float("inf"):
            logz = _tiles_logz(tilemax_ptr, tilesum_ptr, r, NT, m, t)
    if ok & draws:
        y = _tiled_sample(x_ptr, stride, V, r, m, t, tilemax_ptr, tilesum_ptr, NT, seed_lo,
                          seed_hi, pos, first, cut_v, cut_i, req, j, pen, PEN, BLOCK)
    elif ok & ~sampled:
        y = _first_max(x_ptr, stride, V, r, m, tilemax_ptr, NT, req, j, pen, PEN, TPC, BLOCK)
    tl.store(out_y_ptr + r, y)
    if RANK:
        n_top = tl.load(lp_n_ptr + req)
        if live & (n_top > 0):
            rank_tiles(tiletop_ptr, r, NT, rank_ptr, count_ptr, m, t, cut_v, cut_i, NT_SORT,
                       NPAD, RANK == 2)
    o = r.to(tl.int64) * 3
    tl.store(out_stats_ptr + o, m)
    tl.store(out_stats_ptr + o + 1, logz)
    tl.store(out_stats_ptr + o + 2, flags.to(tl.float32))


@triton.jit
def _cut(cut_v_ptr, cut_i_ptr, row, filtered):
    """The filters' cut (cut_v, cut_i) of target row ``row`` when ``filtered`` (a runtime
    flag or a constexpr); (-inf, INT_MAX) otherwise (then ``cut_i_ptr`` still points to int32,
    so that one compiled variant serves both). ``row``: a scalar or a vector of rows."""
    cut_v = (row * 0).to(tl.float32) - float("inf")
    cut_i = (row * 0).to(tl.int32) + 2147483647
    if filtered:
        cut_v = tl.load(cut_v_ptr + row)
        cut_i = tl.load(cut_i_ptr + row)
    return cut_v, cut_i


@triton.jit
def _prob_at(x_ptr, stride, row, tok, m, logz, t, V, IS_PROBS: tl.constexpr, cut_v, cut_i,
             live, req, j, pen, PEN: tl.constexpr):
    """p(tok) of rows from their stats: exp((x - m) / t - logz) (0 outside the filters' cut),
    or x for probabilities; 0 for tok >= V (a draft vocabulary shorter than the target's) and
    where not ``live`` (nothing read there). PEN: the target rows j of request ``req`` are
    processed with its logit_bias and penalties (``penalties.process_at``; ``pen``)."""
    ok = (tok < V) & live
    safe = tl.where(ok, tok, 0)
    x = tl.load(x_ptr + row.to(tl.int64) * stride + safe, mask=ok, other=0.0).to(tl.float32)
    if PEN:
        x = process_at(x, safe, req, j, ok, pen, PEN == 2)
    if IS_PROBS:
        p = x
    else:
        p = tl.where(_survives(x, safe, cut_v, cut_i), tl.exp((x - m) / t - logz), 0.0)
    return tl.where(ok, p, 0.0)


@triton.jit
def _residual_weights(x_ptr, stride, V, xr, m, logz, t, d_ptr, dstride, DV, dr, dm, dlogz, dt,
                      rho, offs, lo, cut_v, cut_i, req, j, pen, DRAFT_PROBS: tl.constexpr,
                      PEN: tl.constexpr):
    """w = max(rho p - q, 0) at token ids ``offs`` (lo .. lo + len(offs) - 1) of target row
    ``xr`` / draft row ``dr`` (p = 0 outside the filters' cut). PEN: the target row, row j of
    request ``req``, is processed with its logit_bias and penalties (``penalties.process``)."""
    x = tl.load(x_ptr + xr.to(tl.int64) * stride + offs, mask=offs < V,
                other=-float("inf")).to(tl.float32)
    if PEN:
        x, _st = process(x, offs, lo, lo + offs.shape[0], req, j, setup(lo, req, j, pen), pen,
                         PEN == 2)
    fin = (x > -float("inf")) & (x < float("inf")) & _survives(x, offs, cut_v, cut_i)
    # exp((x - m) / t - logz) as exp2((x - m) * (log2 e / t) - logz * log2 e): a product per
    # element instead of a division (a reciprocal on the special-function units), fewer
    # registers; values below 2**-126 flush to 0 (BENCHMARKS.md, "The residual weights
    # without a division per element")
    p = tl.where(fin, tl.exp2((x - m) * (LOG2E / t) - logz * LOG2E), 0.0)
    dmask = offs < DV
    y = tl.load(d_ptr + dr.to(tl.int64) * dstride + offs, mask=dmask, other=0.0).to(tl.float32)
    if DRAFT_PROBS:
        q = tl.where(dmask, y, 0.0)
    else:
        dfin = dmask & (y > -float("inf")) & (y < float("inf"))
        q = tl.where(dfin, tl.exp2((y - dm) * (LOG2E / dt) - dlogz * LOG2E), 0.0)
    return tl.maximum(rho * p - q, 0.0)


@triton.jit
def _draft_prob(d_ptr, dstride, DV, dr, tok, dm, dlogz, dt, DRAFT_PROBS: tl.constexpr, live):
    """q(tok) of draft rows ``dr`` (:func:`_prob_at` with no filter cut)."""
    return _prob_at(d_ptr, dstride, dr, tok, dm, dlogz, dt, DV, DRAFT_PROBS, -float("inf"),
                    2147483647, live, 0, 0, 0, 0)


@triton.jit(**_NOSPEC)
def finish_kernel(x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr,
                  row_start_ptr, draft_start_ptr, k_given_ptr, draft_ids_ptr, y_ptr, stats_ptr,
                  d_ptr, dstride, DV, dstats_ptr, out_tok_ptr,
                  out_nacc_ptr, out_err_ptr, out_invalid_ptr, res_row_ptr, K,
                  cut_v_ptr, cut_i_ptr, rho_row_ptr, bmass_ptr, SB, filtered, lp_proc_ptr,
                  lp_v_ptr, lp_i_ptr, lp0, rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr,
                  CV, bstart_ptr, bids_ptr, bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                  HAS_DRAFT: tl.constexpr,
                  DRAFT_PROBS: tl.constexpr, BLOCK_METHOD: tl.constexpr,
                  RHO_ONLY: tl.constexpr, PEN: tl.constexpr, S_MAX: tl.constexpr,
                  GDC: tl.constexpr):
    """One program per request: decide acceptance from the rows' samples and statistics (from
    ``sample_kernel`` or ``stats_draw_kernel``), draw the correction from the residual where a
    draft distribution was rejected, and write token ids [K+1], num_accepted and the error
    bitmask (with the bans, logit_bias and penalties of processed rows: a suspect row's raw
    values read again tell a bad raw logit, bans that leave no token and an overflow apart).

    Block verification runs this twice: with RHO_ONLY it only writes each draft row's running
    ratio rho_j (j < k) to ``rho_row``, or -1 where Z_j cannot change the accepted length
    tau = max{j : eta_j <= min(h_j, rho_j)} (eta_j > rho_j, or eta_k <= rho_k) and the row
    cannot be the residual's (row 0, rho_0 = 1, is kept unless eta_k <= rho_k);
    ``block_mass_kernel`` then sums Z_j = sum_x max(rho_j p_j(x) - q_j(x), 0) for the others
    in parallel over (draft row, split) into ``bmass`` [drafts, SB], which the second run
    reads, and their tile masses, from which ``residual_draw_kernel`` draws at row tau.

    With ``lp0`` it also writes logprobs = 0 (``_emitted_logprob``) into lp_v / lp_i [N, K+1].
    PEN (with a draft distribution): p_j(d_j) is read from the target rows processed with the
    batch's logit_bias and penalties (``penalties.process_at``), as the statistics were."""
    wait_for_prior_grid(GDC)
    i = tl.program_id(0)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV)
    _finish_request(i, (0, 0, 0), x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr,
                    seed_hi_ptr, pos_ptr, row_start_ptr, draft_start_ptr, k_given_ptr,
                    draft_ids_ptr, y_ptr, stats_ptr, d_ptr, dstride, DV, dstats_ptr,
                    out_tok_ptr, out_nacc_ptr, out_err_ptr, out_invalid_ptr, res_row_ptr,
                    K, cut_v_ptr, cut_i_ptr, rho_row_ptr, bmass_ptr, SB, filtered,
                    lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, pen, HAS_DRAFT, DRAFT_PROBS,
                    BLOCK_METHOD, RHO_ONLY, PEN, S_MAX, False)


@triton.jit
def _finish_request(i, known, x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr, seed_hi_ptr,
                    pos_ptr, row_start_ptr, draft_start_ptr, k_given_ptr, draft_ids_ptr, y_ptr,
                    stats_ptr, d_ptr, dstride, DV, dstats_ptr,
                    out_tok_ptr, out_nacc_ptr, out_err_ptr, out_invalid_ptr, res_row_ptr,
                    K, cut_v_ptr, cut_i_ptr, rho_row_ptr, bmass_ptr, SB, filtered,
                    lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, pen, HAS_DRAFT: tl.constexpr,
                    DRAFT_PROBS: tl.constexpr, BLOCK_METHOD: tl.constexpr,
                    RHO_ONLY: tl.constexpr, PEN: tl.constexpr, S_MAX: tl.constexpr,
                    K_KNOWN: tl.constexpr):
    """The work of :func:`finish_kernel` for request ``i``; with K_KNOWN, ``known`` is its
    (k_eff, first row, first draft row), which ``stats_draw_kernel``'s finishing program
    already has (two dependent loads fewer before the walk's)."""
    if K_KNOWN:
        k, start, dstart = known
    else:
        k = _k_eff(draft_ids_ptr, draft_start_ptr, k_given_ptr, i, True)
        start = tl.load(row_start_ptr + i)
        dstart = tl.load(draft_start_ptr + i)
    seed_lo = tl.load(seed_lo_ptr + i)
    seed_hi = tl.load(seed_hi_ptr + i)
    pos0 = tl.load(pos_ptr + i)
    t = tl.load(temp_ptr + i)
    t = tl.where(t > 0, t, 1.0)
    req_t = tl.load(req_temp_ptr + i)
    dt = tl.where(req_t > 0, req_t, 1.0)
    use_dist = (req_t > 0).to(tl.int32) * HAS_DRAFT

    err = k.to(tl.int32) * 0
    proc_bad = err
    bans_bad = err
    n_acc = k * 0  # accepted drafts
    matching = err + 1  # still accepting (token level / one-hot)
    rho = 1.0  # block: rho_j before draft j
    tau = k * 0
    emit = err
    res_row = k * 0
    lanes = tl.arange(0, J_BLOCK)
    # J_BLOCK positions at a time: every load of a step is issued at once (a walk one position
    # at a time waited for two dependent loads per position); the walk itself runs on
    # registers (a position's value picked from its lane).
    for c in range(0, k + 1, J_BLOCK):
        j = c + lanes
        row = j <= k
        is_draft = j < k
        r = start + tl.where(row, j, 0)
        ro = r.to(tl.int64) * 3
        m = tl.load(stats_ptr + ro, mask=row, other=0.0)
        logz = tl.load(stats_ptr + ro + 1, mask=row, other=0.0)
        flags = tl.load(stats_ptr + ro + 2, mask=row, other=0.0).to(tl.int32)
        # Rows processed in the kernels: flags of the processed values. Processed values
        # that are all fine mean raw ones that are (a raw NaN / +inf stays one, a finite
        # processed value was finite raw); else the raw row is read again to tell a bad raw
        # logit from ERR_PROCESSED_OVERFLOW (below).
        proc = (flags & FLAG_PROCESSED) != 0
        suspect = row & proc & (((flags & FLAG_BAD) != 0) | ((flags & FLAG_FINITE) == 0))
        raw = tl.where(proc, FLAG_FINITE, flags)
        if tl.max(suspect.to(tl.int32), axis=0) != 0:
            for q in range(0, J_BLOCK):
                if _lane(suspect.to(tl.int32), q) != 0:
                    raw = tl.where(lanes == q, _raw_row_flags(x_ptr, stride, V, start + c + q,
                                                              i, c + q, pen), raw)
        raw_bad = (raw & FLAG_BAD) != 0
        err |= _any(row & raw_bad, ERR_LOGITS_NAN)
        err |= _any(row & ~raw_bad & ((raw & FLAG_FINITE) == 0), ERR_LOGITS_NO_FINITE)
        emptied = (raw & FLAG_BANS_EMPTY) != 0
        bans_bad |= _any(suspect & emptied, ERR_BANS)
        proc_bad |= _any(suspect & ~emptied, ERR_PROCESSED_OVERFLOW)
        y = tl.load(y_ptr + r, mask=row, other=0)
        d = tl.load(draft_ids_ptr + dstart + j, mask=is_draft, other=0)
        bad_id = is_draft & ((d < 0) | (d >= V))
        err |= _any(bad_id, ERR_DRAFT_ID)
        d = tl.where(bad_id, 0, d)
        dr = dstart + j
        dm = tl.zeros([J_BLOCK], tl.float32)
        dlogz = dm
        if HAS_DRAFT:
            dm, dlogz, dflags = _draft_stats(dstats_ptr, dr, is_draft)
            dbad = ((dflags & FLAG_BAD) != 0) | ((dflags & FLAG_FINITE) == 0)
            if DRAFT_PROBS:
                dbad = dbad | ~(dlogz > -float("inf"))
            err |= _any(is_draft & dbad, ERR_DRAFT_ROW)
        has_k = k < c + J_BLOCK  # the bonus row j == k is in this step
        lk = (k - c).to(tl.int32)  # its lane
        if use_dist != 0:
            cut_v, cut_i = _cut(cut_v_ptr, cut_i_ptr, r, filtered)
            p_x = _prob_at(x_ptr, stride, r, d, m, logz, t, V, False, cut_v, cut_i, is_draft, i,
                           j, pen, PEN)
            q_x = _draft_prob(d_ptr, dstride, DV, dr, d, dm, dlogz, dt, DRAFT_PROBS, is_draft)
            if BLOCK_METHOD:
                u = _uniform(seed_lo, seed_hi, pos0 + j - 1, j, STREAM_BLOCK_ACCEPT)
                ratio = tl.where(q_x > 0, p_x / tl.where(q_x > 0, q_x, 1.0),
                                 tl.where(p_x > 0, float("inf"), 0.0))
                rho_j = tl.zeros([J_BLOCK], tl.float32)  # rho_j before the draft of each lane
                for lane in tl.static_range(J_BLOCK):
                    rho_j = tl.where(lanes == lane, rho, rho_j)
                    nxt = tl.where(rho > 0, tl.minimum(rho * _lane(ratio, lane), 1.0), 0.0)
                    rho = tl.where(c + lane < k, nxt, rho)
                if RHO_ONLY:
                    # Z_j matters only if eta_j <= rho_j, since h_j <= rho_j (Z_j <= rho_j);
                    # row 0 (rho_0 = 1) is the residual's row when tau ends at 0, so its mass
                    # is summed with the others (no residual_kernel launch)
                    tl.store(rho_row_ptr + dr, tl.where((j == 0) | (u <= rho_j), rho_j, -1.0),
                             mask=is_draft)
                else:
                    # h_j = Z_j / (Z_j + 1 - rho_j), Z_j = sum max(rho_j p_j - q_j, 0).
                    so = tl.arange(0, S_MAX)[None, :]
                    mass = tl.sum(tl.load(bmass_ptr + dr.to(tl.int64)[:, None] * SB + so,
                                          mask=(is_draft & (j > 0))[:, None] & (so < SB),
                                          other=0.0), axis=1)
                    denom = mass + (1.0 - rho_j)
                    h = tl.where(mass > 0, mass / tl.where(denom > 0, denom, 1.0), 0.0)
                    # min(h_j, rho_j): the same in real numbers
                    acc = is_draft & (j > 0) & (u <= h) & (u <= rho_j)
                    last = tl.max(tl.where(acc, lanes, -1), axis=0)
                    tau = tl.where(last >= 0, c + last, tau)
                if has_k:  # h_k = rho_k
                    tau = tl.where((k > 0) & (_lane(u, lk) <= rho), k, tau)
                    n_acc = tau
                    res_row = tau
                    matching = tl.where(tau == k, 1, 0)
            else:
                # Leviathan et al. Alg. 1: accept x_j iff u_j * q_j(x_j) < p_j(x_j).
                u = _uniform(seed_lo, seed_hi, pos0 + j, j * 0, STREAM_ACCEPT)
                first = tl.min(tl.where(is_draft & ~(u * q_x < p_x), lanes, J_BLOCK), axis=0)
                n_acc += tl.where(matching != 0, tl.minimum(first, (k - c).to(tl.int32)), 0)
                rejected_here = (matching != 0) & (first < J_BLOCK)
                res_row = tl.where(rejected_here, c + first, res_row)
                matching = tl.where(rejected_here, 0, matching)
            # (emit stays 0: the residual kernels draw this request's token, bonus or
            # correction, and overwrite it)
        else:  # greedy, or one-hot drafts: sample-and-match
            first = tl.min(tl.where(row & ~(is_draft & (d == y)), lanes, J_BLOCK), axis=0)
            stops = (matching != 0) & (first < J_BLOCK)  # (the bonus row always stops)
            emit = tl.where(stops, _lane(y, first), emit)
            n_acc += tl.where(matching != 0, first, 0)
            matching = tl.where(stops, 0, matching)
    # (as the PyTorch backend: bans only for a request whose raw logits and drafts are
    # valid, then bias / penalties only for one whose bans leave a token)
    err |= tl.where(err == 0, bans_bad, 0)
    err |= tl.where(err == 0, proc_bad, 0)
    if RHO_ONLY:
        # Every draft row of the request gets its final rho_row: -1 (block_mass_kernel skips
        # it) where Z_j cannot change tau: eta_k <= rho_k already gives tau = k, the largest;
        # rows at or past a placeholder, and requests that do not sample from distributions.
        tl.debug_barrier()
        settled = (tau == k) & (k > 0)
        for j in range(0, tl.load(k_given_ptr + i)):
            tl.store(rho_row_ptr + dstart + j, -1.0, mask=settled | (j >= k) | (use_dist == 0))
    else:
        _finish_outputs(i, k, start, dstart, err, n_acc, matching, use_dist, emit, res_row,
                        draft_ids_ptr, out_tok_ptr, out_nacc_ptr, out_err_ptr,
                        out_invalid_ptr, res_row_ptr, V, K, x_ptr, stride, t, stats_ptr,
                        cut_v_ptr, cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0,
                        HAS_DRAFT)


@triton.jit
def _raw_row_flags(x_ptr, stride, V, r, req, j, pen):
    """FLAG_BAD (a NaN or +inf) | FLAG_FINITE (a finite value) of raw row ``r``, row ``j`` of
    request ``req``, read whole (an invalid request's row only), and FLAG_BANS_EMPTY when it
    has a finite value but its bans (``penalties.ban``; none with placeholder ``pen``
    arguments) leave none."""
    bad = 0
    fin = 0
    kept = 0
    bans = ban_setup(0, req, j, pen)
    for c in range(0, V, 1024):
        offs = c + tl.arange(0, 1024)
        x = tl.load(x_ptr + r.to(tl.int64) * stride + offs, mask=offs < V,
                    other=-float("inf")).to(tl.float32)
        bad |= _any((x != x) | (x == float("inf")), FLAG_BAD)
        fin |= _any((x > -float("inf")) & (x < float("inf")), FLAG_FINITE)
        x, bans = ban(x, offs, c + 1024, req, j, bans, pen)
        kept |= _any((x > -float("inf")) & (x < float("inf")), 1)
    return bad | fin | tl.where((fin != 0) & (kept == 0), FLAG_BANS_EMPTY, 0)


@triton.jit
def _emitted_logprob(x_ptr, stride, r, tok, live, t, stats_ptr, cut_v_ptr, cut_i_ptr, filtered,
                     processed):
    """The logprob of token ``tok`` at row ``r`` (scalars or vectors; -inf where not
    ``live``) from the row's statistics: (x - max) / T - log-normaliser, the filters' dropped
    tokens at -inf. Raw mode is the same with T = 1: the fused path only serves it here when
    the statistics are the raw row's (temperature 0 or 1, no filter cut)."""
    m = tl.load(stats_ptr + r.to(tl.int64) * 3, mask=live, other=0.0)
    logz = tl.load(stats_ptr + r.to(tl.int64) * 3 + 1, mask=live, other=0.0)
    x = tl.load(x_ptr + r.to(tl.int64) * stride + tok, mask=live, other=0.0).to(tl.float32)
    if filtered:
        cut_v = tl.load(cut_v_ptr + r, mask=live, other=-float("inf"))
        cut_i = tl.load(cut_i_ptr + r, mask=live, other=2147483647)
        x = tl.where(_survives(x, tok, cut_v, cut_i), x, -float("inf"))
    v = (x - m) / tl.where(processed, t, 1.0) - logz
    return tl.where(live, v, -float("inf"))


@triton.jit
def _finish_outputs(i, k, start, dstart, err, n_acc, matching, use_dist, emit, res_row,
                    draft_ids_ptr, out_tok_ptr, out_nacc_ptr, out_err_ptr,
                    out_invalid_ptr, res_row_ptr, V, K, x_ptr, stride, t, stats_ptr,
                    cut_v_ptr, cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0,
                    HAS_DRAFT: tl.constexpr):
    """The outputs of ``finish_kernel`` for request ``i``, J_BLOCK positions at a time."""
    invalid = err != 0
    n_acc = tl.where(invalid, 0, n_acc)
    # A rejected draft distribution: residual_kernel draws the correction from
    # max(rho_tau p - q, 0) at row res_row (rho_tau = 1 at token level) from the tile masses
    # it sums (block verification: residual_draw_kernel from block_mass_kernel's, and
    # rho_tau from rho_row), and overwrites the token written here. Every draft accepted:
    # the same kernels draw the bonus token from target row start + k (res_row
    # -2 - that row), which sample_kernel did not draw (_draw_row's ``lazy``).
    rejected = (use_dist != 0) & (matching == 0) & ~invalid
    if HAS_DRAFT:
        bonus = (use_dist != 0) & (matching != 0) & ~invalid
        tl.store(res_row_ptr + i, tl.where(rejected, start + res_row,
                                           tl.where(bonus, -2 - (start + k), -1)))
    emit = tl.minimum(tl.maximum(emit, 0), V - 1)
    processed = tl.load(lp_proc_ptr + i) != 0
    for j0 in range(0, K + 1, J_BLOCK):
        j = j0 + tl.arange(0, J_BLOCK)
        inb = j <= K
        dj = dstart + tl.minimum(j, tl.maximum(k - 1, 0))
        d = tl.load(draft_ids_ptr + dj, mask=inb & (j < n_acc), other=-1)
        tok = tl.where(j < n_acc, d, tl.where(j == n_acc, emit, -1))
        tok = tl.where(invalid, -1, tok)
        o = i.to(tl.int64) * (K + 1) + j
        tl.store(out_tok_ptr + o, tok.to(tl.int64), mask=inb)
        if lp0 != 0:  # (tok >= 0 exactly at the emitted positions)
            lp = _emitted_logprob(x_ptr, stride, start + j, tok, inb & (tok >= 0), t,
                                  stats_ptr, cut_v_ptr, cut_i_ptr, filtered, processed)
            tl.store(lp_v_ptr + o, lp, mask=inb)
            tl.store(lp_i_ptr + o, tok.to(tl.int64), mask=inb)
    tl.store(out_nacc_ptr + i, n_acc.to(tl.int64))
    tl.store(out_err_ptr + i, err.to(tl.int64))
    tl.store(out_invalid_ptr + i, invalid)


@triton.jit
def _pair_stats(temp_ptr, req_temp_ptr, stats_ptr, row_start_ptr, draft_start_ptr,
                dstats_ptr, i, r, cut_v_ptr, cut_i_ptr, filtered):
    """What the residual weights of request ``i``'s target row ``r`` and its draft row need:
    (t, max, log-normaliser, draft row, draft t, draft max, draft log-normaliser, cut value,
    cut id). Read once per row pair, outside the loops over its tiles."""
    t = tl.load(temp_ptr + i)
    t = tl.where(t > 0, t, 1.0)
    dt = tl.load(req_temp_ptr + i)
    dt = tl.where(dt > 0, dt, 1.0)
    m = tl.load(stats_ptr + r * 3)
    logz = tl.load(stats_ptr + r * 3 + 1)
    dr = tl.load(draft_start_ptr + i) + (r - tl.load(row_start_ptr + i))
    dm, dlogz, _ = _draft_stats(dstats_ptr, dr, True)
    cut_v, cut_i = _cut(cut_v_ptr, cut_i_ptr, r, filtered)
    return t, m, logz, dr, dt, dm, dlogz, cut_v, cut_i


@triton.jit
def _mass_chunks(x_ptr, stride, V, d_ptr, dstride, DV, r, rho, t, m, logz, dr, dt, dm, dlogz,
                 cut_v, cut_i, c0, c1, tmass_ptr, trow, NT, req, j, pen,
                 DRAFT_PROBS: tl.constexpr, PEN: tl.constexpr, TPC: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Chunks [c0, c1) (TPC tiles each) of the residual w = max(rho p - q, 0) of target row
    ``r`` and draft row ``dr``: writes each tile's mass at tmass [trow, tile] and returns
    their sum. A chunk is one load of TPC * BLOCK elements per row."""
    CHUNK: tl.constexpr = TPC * BLOCK
    total = 0.0
    for c in range(c0, c1):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        w = _residual_weights(x_ptr, stride, V, r, m, logz, t, d_ptr, dstride, DV, dr, dm,
                              dlogz, dt, rho, offs, c * CHUNK, cut_v, cut_i, req, j, pen,
                              DRAFT_PROBS, PEN)
        tile_mass = tl.sum(tl.reshape(w, (TPC, BLOCK)), axis=1)
        tile = c * TPC + tl.arange(0, TPC)
        tl.store(tmass_ptr + trow.to(tl.int64) * NT + tile, tile_mass, mask=tile < NT)
        total += tl.sum(tile_mass, axis=0)
    return total


@triton.jit(**_NOSPEC)
def block_mass_kernel(x_ptr, stride, V, temp_ptr, req_temp_ptr, stats_ptr, row_start_ptr,
                      draft_start_ptr, draft_req_ptr, draft_j_ptr, k_given_ptr, d_ptr, dstride,
                      DV, dstats_ptr, rho_row_ptr, bmass_ptr,
                      tmass_ptr, NT, CPS, cut_v_ptr, cut_i_ptr, draft_ids_ptr, rep_ptr,
                      freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
                      bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                      DRAFT_PROBS: tl.constexpr, FILTERED: tl.constexpr,
                      PEN: tl.constexpr, TPC: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Per (draft row, split of CPS chunks): the split's part of block verification's
    Z_j = sum_x max(rho_j p_j(x) - q_j(x), 0) (Sun et al. 2024, Alg. 2), for the draft rows
    whose Z_j can still change the accepted length, and row 0 (rho_0 = 1) of every request
    whose tau is not yet k (the first finish pass wrote their rho_j; others have rho_row -1
    and get 0; rows no request owns are not read). Writes bmass [drafts, splits]: every Z_j
    of the batch at once instead of one request's rows in series; and the tile masses
    tmass [drafts, NT] of the rows it reads, from which ``residual_draw_kernel`` draws the
    correction at row tau (it is one of them: eta_tau <= rho_tau, or tau = 0). PEN: as
    :func:`residual_kernel`'s."""
    wait_for_prior_grid(GDC)
    dr = tl.program_id(0)
    s = tl.program_id(1)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV)
    i = tl.load(draft_req_ptr + dr)
    j = tl.load(draft_j_ptr + dr)
    rho = tl.load(rho_row_ptr + dr, mask=j < tl.load(k_given_ptr + i), other=-1.0)
    total = 0.0
    if rho >= 0:
        r = tl.load(row_start_ptr + i) + j
        t, m, logz, d_row, dt, dm, dlogz, cut_v, cut_i = _pair_stats(
            temp_ptr, req_temp_ptr, stats_ptr, row_start_ptr, draft_start_ptr, dstats_ptr, i,
            r, cut_v_ptr, cut_i_ptr, FILTERED)
        nc = tl.cdiv(NT, TPC)
        total = _mass_chunks(x_ptr, stride, V, d_ptr, dstride, DV, r, rho, t, m, logz, d_row, dt,
                             dm, dlogz, cut_v, cut_i, s * CPS, tl.minimum(s * CPS + CPS, nc),
                             tmass_ptr, dr, NT, i, j, pen, DRAFT_PROBS, PEN, TPC, BLOCK)
    tl.store(bmass_ptr + dr.to(tl.int64) * tl.num_programs(1) + s, total)


@triton.jit(**_NOSPEC)
def residual_draw_kernel(x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr, seed_hi_ptr,
                         pos_ptr, stats_ptr, tilemax_ptr, tilesum_ptr, row_start_ptr,
                         draft_start_ptr, d_ptr, dstride, DV, dstats_ptr, res_row_ptr, rho_row_ptr,
                         mass_ptr, NT, out_tok_ptr, K, cut_v_ptr, cut_i_ptr,
                         filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, draft_ids_ptr, rep_ptr,
                         freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
                         bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                         DRAFT_PROBS: tl.constexpr, PEN: tl.constexpr,
                         BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Block verification with a second draft: per request whose draft was rejected,
    :func:`_residual_draw` from ``block_mass_kernel``'s tile masses (mass [drafts, NT] and
    rho_row [drafts], read at the draft row of the rejected position). Token level (and block
    verification without a second draft) draws in :func:`residual_kernel` instead, in the
    launch that sums the masses. A request that accepted every draft gets its bonus token
    here (:func:`_target_draw`; res_row -2 - its row)."""
    wait_for_prior_grid(GDC)
    i = tl.program_id(0)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV)
    r = tl.load(res_row_ptr + i)
    if r >= 0:
        _residual_draw(i, r, x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr,
                       seed_hi_ptr, pos_ptr, stats_ptr, tilemax_ptr, tilesum_ptr, row_start_ptr,
                       draft_start_ptr, d_ptr, dstride, DV, dstats_ptr, rho_row_ptr, mass_ptr, NT,
                       True, out_tok_ptr, K, cut_v_ptr, cut_i_ptr, filtered, lp_proc_ptr,
                       lp_v_ptr, lp_i_ptr, lp0, pen, DRAFT_PROBS, PEN, BLOCK)
    elif r <= -2:
        _bonus_draw(i, -2 - r, x_ptr, stride, V, temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr,
                    stats_ptr, tilemax_ptr, tilesum_ptr, row_start_ptr, NT, out_tok_ptr, K,
                    cut_v_ptr, cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, pen,
                    PEN, BLOCK)


@triton.jit(**_NOSPEC)
def residual_kernel(x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr, seed_hi_ptr,
                    pos_ptr, stats_ptr, tilemax_ptr, tilesum_ptr, row_start_ptr, draft_start_ptr,
                    d_ptr, dstride, DV, dstats_ptr, res_row_ptr, mass_ptr, NT, CPS, done_ptr,
                    out_tok_ptr, K,
                    cut_v_ptr, cut_i_ptr, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, draft_ids_ptr,
                    rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr,
                    bids_ptr, bval_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV,
                    DRAFT_PROBS: tl.constexpr, FILTERED: tl.constexpr,
                    PEN: tl.constexpr, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """The residual of every request whose draft was rejected (res_row >= 0), rho_tau 1
    (token level, and block verification when no request has two drafts, where a rejected
    block has tau = 0), in one launch of grid (N, S): program (i, s) writes the masses of
    w = max(p - q, 0) in the tiles of its CPS chunks of the rejected target / draft row pair
    (mass [N, NT]), then adds 1 to the request's counter ``done_ptr[i]`` with an
    acquire-release atomic at GPU scope (after a barrier of its own threads); the program
    that reads S - 1 follows every other split's writes, sets the counter back to 0 and
    draws the correction (:func:`_residual_draw`), while other requests' masses are still
    being summed: no second launch (the pattern of :func:`stats_draw_kernel`). ``done_ptr``
    [N] int32 is all zeros before the launch and after it. A request that accepted every
    draft (res_row -2 - its bonus row) gets its bonus token from program (i, 0)
    (:func:`_target_draw`). PEN: the target rows are processed with the batch's logit_bias
    and penalties (``stats_kernel``)."""
    wait_for_prior_grid(GDC)
    i = tl.program_id(0)
    s = tl.program_id(1)
    pen = (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr,
           bval_ptr, draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP,
           aslot_ptr, amask_ptr, AV)
    r = tl.load(res_row_ptr + i)
    if r >= 0:
        t, m, logz, dr, dt, dm, dlogz, cut_v, cut_i = _pair_stats(
            temp_ptr, req_temp_ptr, stats_ptr, row_start_ptr, draft_start_ptr, dstats_ptr, i,
            r, cut_v_ptr, cut_i_ptr, FILTERED)
        _mass_chunks(x_ptr, stride, V, d_ptr, dstride, DV, r, tl.full((), 1.0, tl.float32), t,
                     m, logz, dr, dt, dm, dlogz, cut_v, cut_i, s * CPS,
                     tl.minimum(s * CPS + CPS, NT), mass_ptr, i, NT, i,
                     r - tl.load(row_start_ptr + i), pen, DRAFT_PROBS, PEN, 1, BLOCK)
        tl.debug_barrier()
        done = tl.atomic_add(done_ptr + i, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) - 1:
            tl.store(done_ptr + i, 0)
            # (rho_row is never read without BY_DRAFT_ROW)
            _residual_draw(i, r, x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr,
                           seed_hi_ptr, pos_ptr, stats_ptr, tilemax_ptr, tilesum_ptr,
                           row_start_ptr, draft_start_ptr, d_ptr, dstride, DV, dstats_ptr,
                           mass_ptr, mass_ptr, NT, False, out_tok_ptr, K, cut_v_ptr, cut_i_ptr,
                           FILTERED, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, pen, DRAFT_PROBS, PEN,
                           BLOCK)
    elif (r <= -2) & (s == 0):
        _bonus_draw(i, -2 - r, x_ptr, stride, V, temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr,
                    stats_ptr, tilemax_ptr, tilesum_ptr, row_start_ptr, NT, out_tok_ptr, K,
                    cut_v_ptr, cut_i_ptr, FILTERED, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, pen,
                    PEN, BLOCK)


@triton.jit(noinline=True)  # (a body of its own: the residual kernels stay quicker to compile)
def _target_draw(r, j, m, t, tilemax_ptr, tilesum_ptr, NT, seed_lo, seed_hi, pos, cut_v, cut_i,
                 x_ptr, stride, V, i, pen, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """Target row ``r`` (row ``j`` of request ``i``)'s sample, as ``sample_kernel`` draws it
    (:func:`_tiled_sample` from the statistics pass's tiles, the same noise at ``pos``), for
    a request that verified against a draft distribution: ``sample_kernel`` left its rows
    undrawn (``_draw_row``'s ``lazy``). 0 where the row has no finite maximum (an invalid
    request's row, whose token is never emitted)."""
    first = _tiles_and_noise(tilemax_ptr, tilesum_ptr, r, NT, tl.arange(0, NT_CHUNK), seed_lo,
                             seed_hi, pos, True)
    tok = 0
    if (m > -float("inf")) & (m < float("inf")):
        tok = _tiled_sample(x_ptr, stride, V, r, m, t, tilemax_ptr, tilesum_ptr, NT, seed_lo,
                            seed_hi, pos, first, cut_v, cut_i, i, j, pen, PEN, BLOCK)
    return tok


@triton.jit
def _bonus_draw(i, r, x_ptr, stride, V, temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr, stats_ptr,
                tilemax_ptr, tilesum_ptr, row_start_ptr, NT, out_tok_ptr, K, cut_v_ptr,
                cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0, pen,
                PEN: tl.constexpr, BLOCK: tl.constexpr):
    """Request ``i``'s bonus token, every draft accepted: target row ``r``'s sample
    (:func:`_target_draw`), written at its position with, with ``lp0``, its logprob (the
    finish wrote a placeholder there)."""
    j = r - tl.load(row_start_ptr + i)
    t = tl.load(temp_ptr + i)
    t = tl.where(t > 0, t, 1.0)
    m = tl.load(stats_ptr + r * 3)
    cut_v, cut_i = _cut(cut_v_ptr, cut_i_ptr, r, filtered)
    tok = _target_draw(r, j, m, t, tilemax_ptr, tilesum_ptr, NT, tl.load(seed_lo_ptr + i),
                       tl.load(seed_hi_ptr + i), tl.load(pos_ptr + i) + j, cut_v, cut_i, x_ptr,
                       stride, V, i, pen, PEN, BLOCK)
    _write_token(i, j, r, tok, x_ptr, stride, t, stats_ptr, out_tok_ptr, K, cut_v_ptr,
                 cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0)


@triton.jit
def _write_token(i, j, r, tok, x_ptr, stride, t, stats_ptr, out_tok_ptr, K, cut_v_ptr,
                 cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0):
    """Token ``tok`` at position ``j`` of request ``i`` (target row ``r``) into the outputs
    the finish wrote, and with ``lp0`` its logprob."""
    o = i.to(tl.int64) * (K + 1) + j
    tl.store(out_tok_ptr + o, tok.to(tl.int64))
    if lp0 != 0:
        lp = _emitted_logprob(x_ptr, stride, r, tok, r >= 0, t, stats_ptr, cut_v_ptr,
                              cut_i_ptr, filtered, tl.load(lp_proc_ptr + i) != 0)
        tl.store(lp_v_ptr + o, lp)
        tl.store(lp_i_ptr + o, tok.to(tl.int64))


@triton.jit
def _residual_draw(i, r, x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr, seed_hi_ptr,
                   pos_ptr, stats_ptr, tilemax_ptr, tilesum_ptr, row_start_ptr, draft_start_ptr,
                   d_ptr, dstride, DV, dstats_ptr, rho_row_ptr, mass_ptr, NT,
                   BY_DRAFT_ROW: tl.constexpr,
                   out_tok_ptr, K, cut_v_ptr, cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr,
                   lp_i_ptr, lp0, pen,
                   DRAFT_PROBS: tl.constexpr, PEN: tl.constexpr, BLOCK: tl.constexpr):
    """Request ``i``'s correction at its rejected row ``r``: the exact three-level Gumbel-max
    draw from the residual (a tile from the tile masses, STREAM_RESIDUAL_TILE; a sub-tile of
    it, STREAM_RESIDUAL_SUB; then a token of that, STREAM_RESIDUAL), or the row's target
    sample (:func:`_target_draw`) when the residual mass is 0 (p == q to rounding). The tile
    masses are mass [N, NT] with rho_tau 1, or with BY_DRAFT_ROW mass [drafts, NT] and
    rho_row [drafts] at the draft row of the rejected position (``block_mass_kernel``'s
    masses and the ratios they were summed with). Overwrites the correction token (and,
    with ``lp0``, its logprob: ``finish_kernel``). PEN: as :func:`residual_kernel`'s."""
    start = tl.load(row_start_ptr + i)
    j = r - start
    mrow = i
    if BY_DRAFT_ROW:
        mrow = tl.load(draft_start_ptr + i) + j
    # the row pair's statistics, loaded while the tile masses are
    t, m, logz, dr, dt, dm, dlogz, cut_v, cut_i = _pair_stats(
        temp_ptr, req_temp_ptr, stats_ptr, row_start_ptr, draft_start_ptr, dstats_ptr, i,
        r, cut_v_ptr, cut_i_ptr, filtered)
    rho = 1.0
    if BY_DRAFT_ROW:
        rho = tl.load(rho_row_ptr + mrow)
    seed_lo = tl.load(seed_lo_ptr + i)
    seed_hi = tl.load(seed_hi_ptr + i)
    pos = tl.load(pos_ptr + i) + j
    best = tl.full((), -float("inf"), tl.float32)
    bt = 0
    for c in range(0, NT, NT_CHUNK):
        offs = c + tl.arange(0, NT_CHUNK)
        ok = offs < NT
        mass = tl.load(mass_ptr + mrow.to(tl.int64) * NT + offs, mask=ok, other=0.0)
        has = ok & (mass > 0)
        key = tl.log(tl.where(has, mass, 1.0)) + _gumbel(
            seed_lo, seed_hi, pos, offs, STREAM_RESIDUAL_TILE)
        key = tl.where(has, key, -float("inf"))
        kmax = tl.max(key, axis=0)
        kidx = tl.argmax(key, axis=0) + c
        bt = tl.where(kmax > best, kidx, bt)
        best = tl.maximum(best, kmax)
    tok = 0
    if best == -float("inf"):
        tok = _target_draw(r, j, m, t, tilemax_ptr, tilesum_ptr, NT, seed_lo, seed_hi, pos,
                           cut_v, cut_i, x_ptr, stride, V, i, pen, PEN, BLOCK)
    else:
        offs = bt * BLOCK + tl.arange(0, BLOCK)
        w = _residual_weights(x_ptr, stride, V, r, m, logz, t, d_ptr, dstride, DV, dr, dm,
                              dlogz, dt, rho, offs, bt * BLOCK, cut_v, cut_i, i, j, pen,
                              DRAFT_PROBS, PEN)
        logw = tl.where(w > 0, tl.log(tl.where(w > 0, w, 1.0)), -float("inf"))
        sb = _best_sub(logw, bt, seed_lo, seed_hi, pos, STREAM_RESIDUAL_SUB, BLOCK)
        # The chosen sub-tile only (weights recomputed from cached rows): noise for
        # SUBTILE tokens, not BLOCK (a sixteenth of the Philox code to compile and run)
        offs = sb * SUBTILE + tl.arange(0, SUBTILE)
        w = _residual_weights(x_ptr, stride, V, r, m, logz, t, d_ptr, dstride, DV, dr, dm,
                              dlogz, dt, rho, offs, sb * SUBTILE, cut_v, cut_i, i, j, pen,
                              DRAFT_PROBS, PEN)
        logw = tl.where(w > 0, tl.log(tl.where(w > 0, w, 1.0)), -float("inf"))
        key = logw + _gumbel(seed_lo, seed_hi, pos, offs, STREAM_RESIDUAL)
        key = tl.where(w > 0, key, -float("inf"))
        tok = (tl.argmax(key, axis=0) + sb * SUBTILE).to(tl.int32)
    _write_token(i, j, r, tok, x_ptr, stride, t, stats_ptr, out_tok_ptr, K, cut_v_ptr,
                 cut_i_ptr, filtered, lp_proc_ptr, lp_v_ptr, lp_i_ptr, lp0)
