"""Triton kernels: one pass over the logits, temperature fused, no FP32 copy.

Three launches per call (docs/triton.md has the picture):

1. ``stats_kernel`` (grid rows x vocabulary splits): reads each live row once in its own dtype
   and writes, per split, the running max, the sum of exp((x - max) / T) (online softmax), the
   argmax (lowest id), validity flags, and the maximum of every vocabulary tile.
2. ``sample_kernel`` (same grid): Gumbel-max sampling of every sampled row. From the global max
   and the noise of the row's argmax it knows a lower bound on the winning key, so a tile whose
   maximum cannot beat it (tile max + GUMBEL_MAX below the bound) is neither read again nor
   given noise: for peaked LLM rows only a few tiles are touched.
3. ``finish_kernel`` (grid requests): combines the per-split results, then greedy / one-hot
   prefix matching, token-level rejection sampling (Leviathan et al. 2023, Alg. 1) or block
   verification (Sun et al. 2024, Alg. 2) with a residual draw over the rejected row pair only,
   and writes the outputs.

The random numbers are ``specsample.rng``'s Philox4x32-10 function bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import rng

STREAM_SAMPLE = tl.constexpr(rng.STREAM_SAMPLE)
STREAM_ACCEPT = tl.constexpr(rng.STREAM_ACCEPT)
STREAM_RESIDUAL = tl.constexpr(rng.STREAM_RESIDUAL)
STREAM_BLOCK_ACCEPT = tl.constexpr(rng.STREAM_BLOCK_ACCEPT)
GUMBEL_MAX = tl.constexpr(rng.GUMBEL_MAX)
UNIFORM_SCALE = tl.constexpr(rng.UNIFORM_SCALE)

# NaN or +inf (logits), or NaN / inf / negative (draft probs)
FLAG_BAD = tl.constexpr(1)
FLAG_FINITE = tl.constexpr(2)  # at least one finite value

ERR_LOGITS_NAN = tl.constexpr(1)
ERR_LOGITS_NO_FINITE = tl.constexpr(2)
ERR_DRAFT_ID = tl.constexpr(4)
ERR_DRAFT_ROW = tl.constexpr(8)

_NOSPEC = dict(do_not_specialize=[
    "stride", "V", "S", "TPS", "NT", "live_extra", "K", "dstride", "DV", "DS", "DTPS",
])


@triton.jit
def _philox_word0(c0, c1, c2, c3, k0, k1):
    """Word 0 of Philox4x32-10 (uint32 tensors), as ``rng.philox``."""
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
    return c0


@triton.jit
def _uniform(seed_lo, seed_hi, pos, counter, stream: tl.constexpr):
    """Float32 uniform in (0, 1) for key (seed, position, counter, stream), as ``rng.uniform``.

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
    x = _philox_word0(c0, c1, c2, c3, k0, k1)
    return ((x >> 9).to(tl.float32) + 0.5) * UNIFORM_SCALE


@triton.jit
def _gumbel(seed_lo, seed_hi, pos, counter, stream: tl.constexpr):
    return -tl.log(-tl.log(_uniform(seed_lo, seed_hi, pos, counter, stream)))


@triton.jit(**_NOSPEC)
def stats_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, keff_ptr, live_extra, temp_ptr,
                 part_m_ptr, part_s_ptr, part_a_ptr, part_f_ptr, tilemax_ptr, S, TPS, NT,
                 IS_PROBS: tl.constexpr, WRITE_TILEMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, split): max, sum exp((x - max) / T) (or the plain sum for probabilities),
    argmax (lowest id), flags, and each tile's max. Rows past the request's live range
    (``j >= k_eff + live_extra``) are not read."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    req = tl.load(row_req_ptr + r)
    j = tl.load(row_j_ptr + r)
    live = j < tl.load(keff_ptr + req) + live_extra
    t = tl.load(temp_ptr + req)
    t = tl.where(t > 0, t, 1.0)
    m = -float("inf")
    acc = 0.0
    amax = 0
    flags = 0
    if live:
        base = x_ptr + r.to(tl.int64) * stride
        offs0 = tl.arange(0, BLOCK)
        t_lo = s * TPS
        for tile in range(t_lo, t_lo + TPS):  # tiles >= NT (last split) are fully masked
            offs = tile * BLOCK + offs0
            mask = offs < V
            x = tl.load(base + offs, mask=mask, other=-float("inf")).to(tl.float32)
            fin = (x > -float("inf")) & (x < float("inf"))
            if IS_PROBS:
                bad = mask & ((x != x) | ~fin | (x < 0))
            else:
                bad = (x != x) | (x == float("inf"))
            flags |= tl.max(bad.to(tl.int32), axis=0) * FLAG_BAD
            flags |= tl.max(fin.to(tl.int32), axis=0) * FLAG_FINITE
            xs = tl.where(fin, x, -float("inf"))
            tmax = tl.max(xs, axis=0)
            if WRITE_TILEMAX:
                tl.store(tilemax_ptr + r.to(tl.int64) * NT + tile, tmax, mask=tile < NT)
            targ = tl.argmax(xs, axis=0).to(tl.int32) + tile * BLOCK
            amax = tl.where(tmax > m, targ, amax)
            m_new = tl.maximum(m, tmax)
            if IS_PROBS:
                acc += tl.sum(tl.where(fin, x, 0.0), axis=0)
            else:
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
                acc = acc * tl.exp((m - m_safe) / t) + tl.sum(tl.exp((xs - m_safe) / t), axis=0)
            m = m_new
    o = r.to(tl.int64) * S + s
    tl.store(part_m_ptr + o, m)
    tl.store(part_s_ptr + o, acc)
    tl.store(part_a_ptr + o, amax)
    tl.store(part_f_ptr + o, flags)


@triton.jit
def _row_max(part_m_ptr, part_a_ptr, r, S, S_MAX: tl.constexpr):
    """Global max and argmax (lowest id) of row ``r`` from its split partials."""
    offs = tl.arange(0, S_MAX)
    pm = tl.load(part_m_ptr + r.to(tl.int64) * S + offs, mask=offs < S, other=-float("inf"))
    m = tl.max(pm, axis=0)
    first = tl.min(tl.where(pm == m, offs, S_MAX), axis=0)
    first = tl.minimum(first, S - 1)
    a = tl.load(part_a_ptr + r.to(tl.int64) * S + first)
    return m, a


@triton.jit
def _row_stats(part_m_ptr, part_s_ptr, part_a_ptr, part_f_ptr, r, S, t,
               IS_PROBS: tl.constexpr, S_MAX: tl.constexpr):
    """Combine row ``r``'s splits: (max, log-normaliser, argmax, flags).

    For logits the normaliser is log sum exp((x - max) / t); for probabilities log sum x.
    """
    offs = tl.arange(0, S_MAX)
    o = r.to(tl.int64) * S + offs
    ok = offs < S
    pm = tl.load(part_m_ptr + o, mask=ok, other=-float("inf"))
    ps = tl.load(part_s_ptr + o, mask=ok, other=0.0)
    pf = tl.load(part_f_ptr + o, mask=ok, other=0)
    m, a = _row_max(part_m_ptr, part_a_ptr, r, S, S_MAX)
    if IS_PROBS:
        total = tl.sum(ps, axis=0)
    else:
        m_safe = tl.where(m == -float("inf"), 0.0, m)
        total = tl.sum(tl.where(pm == -float("inf"), 0.0, ps * tl.exp((pm - m_safe) / t)), axis=0)
    flags = tl.max(pf & FLAG_BAD, axis=0) | tl.max(pf & FLAG_FINITE, axis=0)
    return m, tl.log(total), a, flags


@triton.jit(**_NOSPEC)
def sample_kernel(x_ptr, stride, V, row_req_ptr, row_j_ptr, keff_ptr, temp_ptr, req_temp_ptr,
                  seed_lo_ptr, seed_hi_ptr, pos_ptr, part_m_ptr, part_a_ptr, tilemax_ptr,
                  best_key_ptr, best_idx_ptr, S, TPS, NT,
                  S_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, split) of a live sampled row: the best Gumbel key (x - max) / T + G and its id
    over the split's tiles that can still win. Greedy and dead rows write -inf."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    req = tl.load(row_req_ptr + r)
    j = tl.load(row_j_ptr + r)
    live = j <= tl.load(keff_ptr + req)
    sampled = tl.load(req_temp_ptr + req) > 0
    best = -float("inf")
    bidx = 0
    if live & sampled:
        t = tl.load(temp_ptr + req)
        t = tl.where(t > 0, t, 1.0)
        m, a = _row_max(part_m_ptr, part_a_ptr, r, S, S_MAX)
        seed_lo = tl.load(seed_lo_ptr + req)
        seed_hi = tl.load(seed_hi_ptr + req)
        pos = tl.load(pos_ptr + req) + j
        bound = _gumbel(seed_lo, seed_hi, pos, a, STREAM_SAMPLE)
        base = x_ptr + r.to(tl.int64) * stride
        offs0 = tl.arange(0, BLOCK)
        t_lo = s * TPS
        if m > -float("inf"):
            for tile in range(t_lo, t_lo + TPS):
                tmax = tl.load(tilemax_ptr + r.to(tl.int64) * NT + tile, mask=tile < NT,
                               other=-float("inf"))
                if (tmax - m) / t + GUMBEL_MAX >= bound:
                    offs = tile * BLOCK + offs0
                    x = tl.load(base + offs, mask=offs < V, other=-float("inf")).to(tl.float32)
                    fin = (x > -float("inf")) & (x < float("inf"))
                    key = tl.where(fin, (x - m) / t, -float("inf"))
                    key = key + _gumbel(seed_lo, seed_hi, pos, offs, STREAM_SAMPLE)
                    kmax = tl.max(key, axis=0)
                    kidx = tl.argmax(key, axis=0).to(tl.int32) + tile * BLOCK
                    bidx = tl.where(kmax > best, kidx, bidx)
                    best = tl.maximum(best, kmax)
    o = r.to(tl.int64) * S + s
    tl.store(best_key_ptr + o, best)
    tl.store(best_idx_ptr + o, bidx)


@triton.jit
def _row_sample(best_key_ptr, best_idx_ptr, r, S, S_MAX: tl.constexpr):
    offs = tl.arange(0, S_MAX)
    o = r.to(tl.int64) * S + offs
    ok = offs < S
    bk = tl.load(best_key_ptr + o, mask=ok, other=-float("inf"))
    bi = tl.load(best_idx_ptr + o, mask=ok, other=0)
    kmax = tl.max(bk, axis=0)
    return tl.min(tl.where(ok & (bk == kmax), bi, 2147483647), axis=0)


@triton.jit
def _prob_at(x_ptr, stride, row, tok, m, logz, t, V, IS_PROBS: tl.constexpr):
    """p(tok) of a row from its stats: exp((x - m) / t - logz), or x for probabilities;
    0 for tok >= V (a draft vocabulary shorter than the target's)."""
    ok = tok < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride + tl.where(ok, tok, 0)).to(tl.float32)
    if IS_PROBS:
        p = x
    else:
        p = tl.exp((x - m) / t - logz)
    return tl.where(ok, p, 0.0)


@triton.jit
def _residual_tiles(x_ptr, stride, V, xr, m, logz, t, d_ptr, dstride, DV, dr, dm, dlogz, dt,
                    rho, seed_lo, seed_hi, pos, tilemax_ptr, NT, DRAFT_PROBS: tl.constexpr,
                    SAMPLE: tl.constexpr, BLOCK: tl.constexpr):
    """Over target row ``xr`` and draft row ``dr``: with w = max(rho p - q, 0), either the
    residual mass sum w (SAMPLE False) or the Gumbel-max draw argmax log w + G
    (STREAM_RESIDUAL; SAMPLE True). Returns (mass or best key, best id)."""
    offs0 = tl.arange(0, BLOCK)
    total = 0.0
    best = -float("inf")
    bidx = 0
    log_rho = tl.log(rho)
    for tile in range(0, NT):
        tmax = tl.load(tilemax_ptr + xr.to(tl.int64) * NT + tile)
        go = True
        if SAMPLE:
            go = log_rho + (tmax - m) / t - logz + GUMBEL_MAX >= best
        if go:
            offs = tile * BLOCK + offs0
            x = tl.load(x_ptr + xr.to(tl.int64) * stride + offs, mask=offs < V,
                        other=-float("inf")).to(tl.float32)
            fin = (x > -float("inf")) & (x < float("inf"))
            p = tl.where(fin, tl.exp((x - m) / t - logz), 0.0)
            dmask = offs < DV
            y = tl.load(d_ptr + dr.to(tl.int64) * dstride + offs, mask=dmask,
                        other=0.0).to(tl.float32)
            if DRAFT_PROBS:
                q = tl.where(dmask, y, 0.0)
            else:
                dfin = dmask & (y > -float("inf")) & (y < float("inf"))
                q = tl.where(dfin, tl.exp((y - dm) / dt - dlogz), 0.0)
            w = tl.maximum(rho * p - q, 0.0)
            if SAMPLE:
                key = tl.where(w > 0, tl.log(tl.where(w > 0, w, 1.0)), -float("inf"))
                key = key + _gumbel(seed_lo, seed_hi, pos, offs, STREAM_RESIDUAL)
                kmax = tl.max(key, axis=0)
                kidx = tl.argmax(key, axis=0).to(tl.int32) + tile * BLOCK
                bidx = tl.where(kmax > best, kidx, bidx)
                best = tl.maximum(best, kmax)
            else:
                total += tl.sum(w, axis=0)
    if SAMPLE:
        return best, bidx
    return total, bidx


@triton.jit
def _draft_prob(d_ptr, dstride, DV, dr, tok, dm, dlogz, dt, DRAFT_PROBS: tl.constexpr):
    if DRAFT_PROBS:
        q = _prob_at(d_ptr, dstride, dr, tok, dm, dlogz, dt, DV, True)
    else:
        q = _prob_at(d_ptr, dstride, dr, tok, dm, dlogz, dt, DV, False)
    return q


@triton.jit(**_NOSPEC)
def finish_kernel(x_ptr, stride, V, temp_ptr, req_temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr,
                  row_start_ptr, draft_start_ptr, keff_ptr, draft_ids_ptr,
                  part_m_ptr, part_s_ptr, part_a_ptr, part_f_ptr, tilemax_ptr,
                  best_key_ptr, best_idx_ptr, S, NT,
                  d_ptr, dstride, DV, dpart_m_ptr, dpart_s_ptr, dpart_a_ptr, dpart_f_ptr, DS,
                  out_tok_ptr, out_nacc_ptr, out_err_ptr, out_stats_ptr, K,
                  HAS_DRAFT: tl.constexpr, DRAFT_PROBS: tl.constexpr, BLOCK_METHOD: tl.constexpr,
                  S_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """One program per request: combine row statistics, decide acceptance, draw the
    correction / bonus token, and write token ids [K+1], num_accepted, the error bitmask, and
    per-row (max, log-normaliser) statistics for logprobs."""
    i = tl.program_id(0)
    k = tl.load(keff_ptr + i)
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
    n_acc = k * 0  # accepted drafts
    matching = err + 1  # still accepting (token level / one-hot)
    rho = 1.0  # block: rho_j before draft j
    rho_tau = 1.0
    tau = k * 0
    emit = err
    res_row = k * 0
    for j in range(0, k + 1):
        r = start + j
        m, logz, a, flags = _row_stats(part_m_ptr, part_s_ptr, part_a_ptr, part_f_ptr, r, S, t,
                                       False, S_MAX)
        tl.store(out_stats_ptr + r.to(tl.int64) * 2, m)
        tl.store(out_stats_ptr + r.to(tl.int64) * 2 + 1, logz)
        err |= tl.where((flags & FLAG_BAD) != 0, ERR_LOGITS_NAN, 0)
        err |= tl.where((flags & (FLAG_BAD | FLAG_FINITE)) == 0, ERR_LOGITS_NO_FINITE, 0)
        y = tl.where(req_t == 0, a, _row_sample(best_key_ptr, best_idx_ptr, r, S, S_MAX))
        is_draft = j < k
        d = tl.load(draft_ids_ptr + dstart + tl.where(is_draft, j, 0), mask=is_draft, other=0)
        bad_id = is_draft & ((d < 0) | (d >= V))
        err |= tl.where(bad_id, ERR_DRAFT_ID, 0)
        d = tl.where(bad_id, 0, d)
        dr = dstart + j
        dm = 0.0
        dlogz = 0.0
        if HAS_DRAFT:
            if is_draft:
                dm, dlogz, da, dflags = _row_stats(dpart_m_ptr, dpart_s_ptr, dpart_a_ptr,
                                                   dpart_f_ptr, dr, DS, dt, DRAFT_PROBS, S_MAX)
                dbad = ((dflags & FLAG_BAD) != 0) | ((dflags & FLAG_FINITE) == 0)
                if DRAFT_PROBS:
                    dbad = dbad | ~(dlogz > -float("inf"))
                err |= tl.where(dbad, ERR_DRAFT_ROW, 0)
        if use_dist != 0:
            if is_draft:
                p_x = _prob_at(x_ptr, stride, r, d, m, logz, t, V, False)
                q_x = _draft_prob(d_ptr, dstride, DV, dr, d, dm, dlogz, dt, DRAFT_PROBS)
                if BLOCK_METHOD:
                    if j > 0:
                        # h_j = Z_j / (Z_j + 1 - rho_j), Z_j = sum max(rho_j p_j - q_j, 0).
                        mass, _unused = _residual_tiles(
                            x_ptr, stride, V, r, m, logz, t, d_ptr, dstride, DV, dr, dm, dlogz,
                            dt, rho, seed_lo, seed_hi, pos0 + j, tilemax_ptr, NT, DRAFT_PROBS,
                            False, BLOCK)
                        denom = mass + 1.0 - rho
                        h = tl.where(mass > 0, mass / tl.where(denom > 0, denom, 1.0), 0.0)
                        u = _uniform(seed_lo, seed_hi, pos0 + j - 1, j, STREAM_BLOCK_ACCEPT)
                        tau = tl.where(u <= h, j, tau)
                        rho_tau = tl.where(u <= h, rho, rho_tau)
                    ratio = tl.where(q_x > 0, p_x / tl.where(q_x > 0, q_x, 1.0),
                                     tl.where(p_x > 0, float("inf"), 0.0))
                    rho = tl.where(rho > 0, tl.minimum(rho * ratio, 1.0), 0.0)
                else:
                    u = _uniform(seed_lo, seed_hi, pos0 + j, j * 0, STREAM_ACCEPT)
                    ok = u * q_x < p_x
                    n_acc += tl.where((matching != 0) & ok, 1, 0)
                    res_row = tl.where((matching != 0) & ~ok, j, res_row)
                    matching = tl.where(ok, matching, 0)
            else:  # the bonus row j == k
                if BLOCK_METHOD:
                    if k > 0:
                        u = _uniform(seed_lo, seed_hi, pos0 + k - 1, k, STREAM_BLOCK_ACCEPT)
                        tau = tl.where(u <= rho, k, tau)
                    n_acc = tau
                    res_row = tau
                    matching = tl.where(tau == k, 1, 0)
                emit = tl.where(matching != 0, y, emit)
        else:  # greedy, or one-hot drafts: sample-and-match
            ok = is_draft & (d == y)
            emit = tl.where((matching != 0) & ~ok, y, emit)
            n_acc += tl.where((matching != 0) & ok, 1, 0)
            matching = tl.where(ok, matching, 0)
    if (use_dist != 0) & (matching == 0):
        # Residual draw max(rho_tau p - q, 0) on the rejected row pair (rho_tau = 1: token level).
        r = start + res_row
        m, logz, a, flags = _row_stats(part_m_ptr, part_s_ptr, part_a_ptr, part_f_ptr, r, S, t,
                                       False, S_MAX)
        dr = dstart + res_row
        dm, dlogz, da, dflags = _row_stats(dpart_m_ptr, dpart_s_ptr, dpart_a_ptr, dpart_f_ptr,
                                           dr, DS, dt, DRAFT_PROBS, S_MAX)
        best, bidx = _residual_tiles(x_ptr, stride, V, r, m, logz, t, d_ptr, dstride, DV, dr, dm,
                                     dlogz, dt, rho_tau, seed_lo, seed_hi, pos0 + res_row,
                                     tilemax_ptr, NT, DRAFT_PROBS, True, BLOCK)
        y = _row_sample(best_key_ptr, best_idx_ptr, r, S, S_MAX)
        emit = tl.where(best > -float("inf"), bidx, y)
    invalid = err != 0
    n_acc = tl.where(invalid, 0, n_acc)
    emit = tl.minimum(tl.maximum(emit, 0), V - 1)
    for j in range(0, K + 1):
        dj = dstart + tl.minimum(j, tl.maximum(k - 1, 0))
        d = tl.load(draft_ids_ptr + dj, mask=j < n_acc, other=-1)
        tok = tl.where(j < n_acc, d, tl.where(j == n_acc, emit, -1))
        tok = tl.where(invalid, -1, tok)
        tl.store(out_tok_ptr + i.to(tl.int64) * (K + 1) + j, tok.to(tl.int64))
    tl.store(out_nacc_ptr + i, n_acc.to(tl.int64))
    tl.store(out_err_ptr + i, err.to(tl.int64))
