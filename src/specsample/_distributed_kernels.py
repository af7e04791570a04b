"""Triton kernels of specsample.distributed on CUDA: the shard's tile masses in one pass
over the logits (no float32 copy), and rng's 52-bit uniforms in one launch (the torch version
of Philox is some hundred small kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rng
from .triton_backend.kernels import (
    ERR_DRAFT_ID,
    ERR_LOGITS_NAN,
    ERR_LOGITS_NO_FINITE,
    STREAM_SAMPLE,
    STREAM_SAMPLE_SUB,
    STREAM_SAMPLE_TILE,
    _gumbel,
    _k_eff_of,
    _uniform,
)

_BLOCK = 512


@triton.jit(do_not_specialize=["w", "head", "nb"])
def _tile_mass_kernel(x_ptr, stride, w, head, m_ptr, t_ptr, out_ptr, nb,
                      HAS_MT: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, j] = sum of exp((x - m_r) / t_r) over the local columns of global tile j."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    start = j * TILE - head
    row = x_ptr + r.to(tl.int64) * stride
    if HAS_MT:
        m = tl.load(m_ptr + r)
        t = tl.load(t_ptr + r)
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(0, TILE, BLOCK):
        cols = start + c + tl.arange(0, BLOCK)
        ok = (cols >= 0) & (cols < w)
        x = tl.load(row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if HAS_MT:
            x = (x - m) / t
        acc += tl.where(ok, tl.exp(x), 0.0)
    tl.store(out_ptr + r * nb + j, tl.sum(acc, axis=0))


def tile_mass(src: torch.Tensor, m: torch.Tensor | None, t: torch.Tensor | None,
              off: int) -> torch.Tensor:
    """[R, nb] float64 partial masses of exp((src - m) / t) (exp(src) with m None) over the
    global ``rng.TILE`` tiles meeting columns off .. off + w - 1 (``src`` [R, w], any float
    dtype, unit column stride)."""
    r, w = src.shape
    if src.stride(1) != 1:
        src = src.contiguous()
    head = off % rng.TILE
    nb = (off + w - 1) // rng.TILE - off // rng.TILE + 1
    out = torch.empty((r, nb), dtype=torch.float32, device=src.device)
    if r:
        has = m is not None
        _tile_mass_kernel[(r, nb)](src, src.stride(0), w, head, m if has else out,
                                   t if has else out, out, nb, HAS_MT=has, TILE=rng.TILE,
                                   BLOCK=_BLOCK)
    return out.to(torch.float64)


@triton.jit(do_not_specialize=["ncol"])
def _uniform_kernel(lo_ptr, hi_ptr, pos_ptr, c_ptr, out_ptr, ncol, STREAM: tl.constexpr,
                    BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < ncol
    counter = tl.load(c_ptr + r * ncol + cols, mask=ok, other=0)
    u = _uniform(tl.load(lo_ptr + r), tl.load(hi_ptr + r), tl.load(pos_ptr + r), counter,
                 STREAM)
    tl.store(out_ptr + r * ncol + cols, u, mask=ok)


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, pos: torch.Tensor,
            counter: torch.Tensor, stream: int) -> torch.Tensor:
    """``rng.uniform`` (the same float64 values) for keys [R] and counters [R, c] int64."""
    r, c = counter.shape
    counter = counter.contiguous()
    out = torch.empty((r, c), dtype=torch.float64, device=counter.device)
    block = 128
    _uniform_kernel[(r, triton.cdiv(c, block))](
        seed_lo.contiguous(), seed_hi.contiguous(), pos.contiguous(), counter, out, c,
        STREAM=stream, BLOCK=block)
    return out


# ------------------------------------------------------------- the fast path's four kernels
#
# Calls without processors (temperature only), one-hot drafts and no logprobs run as four
# launches and three all_gathers of per-row payloads (distributed.py, ``_run_fast``):
#
# 1. ``shard_stats_kernel``: per row and local tile (``rng.TILE`` columns of the global grid,
#    partial at the shard's ends) the tile's max, its sum of exp((x - max) / T) and the sums of
#    its ``rng.SUBTILE`` sub-tiles; per row the payload A: the shard's max (NaN skipped), its
#    lowest argmax (global id), a NaN / +inf flag, and the first and last tile's partials
#    (other ranks need them for the tiles that straddle shards);
# 2. ``shard_keys_kernel`` (after A is gathered): the global max M, then the tile level of the
#    draw over the tiles that start in this shard (keys log-mass + G, the straddling tile's
#    other parts from A) and the sub-tile masses of the best one: payload B;
# 3. ``shard_token_kernel`` (after B is gathered): the winning tile (largest key, lowest id),
#    its sub-tile by log-mass + G, then this shard's best (key, id) inside that sub-tile:
#    payload C;
# 4. ``shard_finish_kernel`` (after C is gathered, one program per request): every row's
#    token (largest key, lowest id; the lowest argmax for greedy requests), the error bits,
#    one-hot prefix matching and the outputs.
#
# The noise is keyed as on one device (tile, sub-tile and token ids are global), so the
# tokens are those of specsample.sample / verify on the whole rows up to float32 rounding of
# the masses (which only decides near-ties).

NSUB = rng.TILE // rng.SUBTILE
PAYLOAD_A = 8 + 2 * NSUB  # max, argmax, flags, (unused), first (max, sum), last (max, sum), subs
PAYLOAD_B = 2 + NSUB  # key, tile, sub-tile masses of that tile (relative to M)
PAYLOAD_C = 2  # key, id
_NONE = tl.constexpr(16777216.0)  # "no id" in a payload (ids are exact in float32 below 2**24)
_LOG2E = tl.constexpr(1.4426950408889634)
_FAST_NOSPEC = dict(do_not_specialize=["R", "N", "K", "nt"])


@triton.jit
def _row_temperature(row_req_ptr, temp_ptr, r):
    """(1 / T of row ``r``'s request, 1 for greedy, and whether it is sampled)."""
    t = tl.load(temp_ptr + tl.load(row_req_ptr + r))
    return 1.0 / tl.where(t > 0, t, 1.0), t > 0


@triton.jit(**_FAST_NOSPEC)
def shard_stats_kernel(x_ptr, stride, w, off, nt, row_req_ptr, temp_ptr, tm_ptr, ts_ptr,
                       sub_ptr, a_ptr, R, TILE: tl.constexpr, SUB: tl.constexpr,
                       PA: tl.constexpr):
    r = tl.program_id(0)
    inv_t, _ = _row_temperature(row_req_ptr, temp_ptr, r)
    scale = inv_t * _LOG2E
    g0 = off // TILE
    head = off - g0 * TILE
    row = x_ptr + r.to(tl.int64) * stride
    lane = tl.arange(0, TILE)
    bad = 0
    rmax = -float("inf")
    rarg = 0
    o_a = a_ptr + r.to(tl.int64) * PA
    for j in range(0, nt):
        cols = j * TILE - head + lane
        ok = (cols >= 0) & (cols < w)
        x = tl.load(row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        nan = x != x
        bad |= tl.max((ok & (nan | (x == float("inf")))).to(tl.int32), axis=0)
        x = tl.where(nan, -float("inf"), x)
        tm = tl.max(x, axis=0)
        gid = (g0 + j) * TILE + lane
        first = tl.min(tl.where(x == tm, gid, 2147483647), axis=0)
        rarg = tl.where(tm > rmax, first, rarg)
        rmax = tl.maximum(rmax, tm)
        fin = (x > -float("inf")) & (x < float("inf"))
        ref = tl.where((tm > -float("inf")) & (tm < float("inf")), tm, 0.0)
        e = tl.where(fin, tl.exp2((x - ref) * scale), 0.0)
        sub = tl.sum(tl.reshape(e, (TILE // SUB, SUB)), axis=1)
        ts = tl.sum(sub, axis=0)
        o_t = r.to(tl.int64) * nt + j
        tl.store(tm_ptr + o_t, tm)
        tl.store(ts_ptr + o_t, ts)
        so = tl.arange(0, TILE // SUB)
        tl.store(sub_ptr + o_t * (TILE // SUB) + so, sub)
        if j == 0:
            tl.store(o_a + 4, tm)
            tl.store(o_a + 5, ts)
            tl.store(o_a + 8 + so, sub)
        if j == nt - 1:
            tl.store(o_a + 6, tm)
            tl.store(o_a + 7, ts)
            tl.store(o_a + 8 + TILE // SUB + so, sub)
    if nt == 0:
        tl.store(o_a + 4, -float("inf"))
        tl.store(o_a + 5, 0.0)
        tl.store(o_a + 6, -float("inf"))
        tl.store(o_a + 7, 0.0)
        so = tl.arange(0, 2 * (TILE // SUB))
        tl.store(o_a + 8 + so, tl.zeros([2 * (TILE // SUB)], tl.float32))
    tl.store(o_a, rmax)
    tl.store(o_a + 1, rarg.to(tl.float32))
    tl.store(o_a + 2, bad.to(tl.float32))
    tl.store(o_a + 3, 0.0)


@triton.jit
def _global_max(a_ptr, r, R, W, PA: tl.constexpr, WB: tl.constexpr):
    """Row ``r``'s max over the ranks of the gathered payload A [W, R, PA] (-inf if none),
    the lowest global id attaining it, and whether any rank saw a NaN / +inf."""
    q = tl.arange(0, WB)
    o = (q.to(tl.int64) * R + r) * PA
    okq = q < W
    m = tl.load(a_ptr + o, mask=okq, other=-float("inf"))
    mx = tl.max(m, axis=0)
    arg = tl.load(a_ptr + o + 1, mask=okq, other=_NONE)
    first = tl.min(tl.where(m == mx, arg, _NONE), axis=0)
    bad = tl.max(tl.load(a_ptr + o + 2, mask=okq, other=0.0), axis=0) > 0
    return mx, first, bad


@triton.jit(**_FAST_NOSPEC)
def shard_keys_kernel(a_ptr, tm_ptr, ts_ptr, sub_ptr, b_ptr, row_req_ptr, row_j_ptr, temp_ptr,
                      seed_lo_ptr, seed_hi_ptr, pos_ptr, R, W, rank, S, V, off, w, nt,
                      TILE: tl.constexpr, SUB: tl.constexpr, PA: tl.constexpr,
                      PB: tl.constexpr, WB: tl.constexpr, CH: tl.constexpr):
    r = tl.program_id(0)
    NS: tl.constexpr = TILE // SUB
    inv_t, sampled = _row_temperature(row_req_ptr, temp_ptr, r)
    mx, _, _ = _global_max(a_ptr, r, R, W, PA, WB)
    m = tl.where((mx > -float("inf")) & (mx < float("inf")), mx, 0.0)
    req = tl.load(row_req_ptr + r)
    seed_lo = tl.load(seed_lo_ptr + req)
    seed_hi = tl.load(seed_hi_ptr + req)
    pos = tl.load(pos_ptr + req) + tl.load(row_j_ptr + r)
    g0 = off // TILE
    own0 = (off % TILE != 0).to(tl.int32)  # the first tile starts on an earlier rank
    glast = g0 + nt - 1
    # The parts of this shard's last tile held by later ranks (their first tile).
    extra = 0.0
    extra_sub = tl.zeros([NS], tl.float32)
    so = tl.arange(0, NS)
    if sampled & (nt > 0):
        for q in range(rank + 1, W):
            q_off = q * S
            q_first = q_off // TILE
            if (q_off < V) & (q_first == glast):
                o_q = (r.to(tl.int64) + q * R) * PA
                f = tl.exp2((tl.load(a_ptr + o_q + 4) - m) * inv_t * _LOG2E)
                extra += f * tl.load(a_ptr + o_q + 5)
                extra_sub += f * tl.load(a_ptr + o_q + 8 + so)
    best = -float("inf")
    bj = -1
    if sampled:
        for c in range(own0, nt, CH):
            j = c + tl.arange(0, CH)
            ok = j < nt
            o_t = r.to(tl.int64) * nt + j
            tm = tl.load(tm_ptr + o_t, mask=ok, other=-float("inf"))
            ts = tl.load(ts_ptr + o_t, mask=ok, other=0.0)
            mass = tl.where(tm > -float("inf"), tl.exp2((tm - m) * inv_t * _LOG2E) * ts, 0.0)
            mass += tl.where(j == nt - 1, extra, 0.0)
            g = g0 + j
            key = tl.log(mass) + _gumbel(seed_lo, seed_hi, pos, g, STREAM_SAMPLE_TILE)
            key = tl.where(ok & (mass > 0), key, -float("inf"))
            kmax = tl.max(key, axis=0)
            kidx = tl.argmax(key, axis=0) + c
            bj = tl.where(kmax > best, kidx, bj)
            best = tl.maximum(best, kmax)
    o_b = b_ptr + r.to(tl.int64) * PB
    if bj >= 0:
        o_t = r.to(tl.int64) * nt + bj
        f = tl.exp2((tl.load(tm_ptr + o_t) - m) * inv_t * _LOG2E)
        subs = f * tl.load(sub_ptr + o_t * NS + so)
        subs += tl.where(bj == nt - 1, extra_sub, 0.0)
        tl.store(o_b, best)
        tl.store(o_b + 1, (g0 + bj).to(tl.float32))
        tl.store(o_b + 2 + so, subs)
    else:
        tl.store(o_b, -float("inf"))
        tl.store(o_b + 1, _NONE)
        tl.store(o_b + 2 + so, tl.zeros([NS], tl.float32))


@triton.jit(**_FAST_NOSPEC)
def shard_token_kernel(x_ptr, stride, a_ptr, b_ptr, c_ptr, row_req_ptr, row_j_ptr, temp_ptr,
                       seed_lo_ptr, seed_hi_ptr, pos_ptr, R, W, off, w, TILE: tl.constexpr,
                       SUB: tl.constexpr, PA: tl.constexpr, PB: tl.constexpr,
                       WB: tl.constexpr):
    r = tl.program_id(0)
    NS: tl.constexpr = TILE // SUB
    inv_t, sampled = _row_temperature(row_req_ptr, temp_ptr, r)
    o_c = c_ptr + r.to(tl.int64) * 2
    bk = tl.full((), -float("inf"), tl.float32)
    bid = tl.full((), _NONE, tl.float32)
    if sampled:
        mx, _, _ = _global_max(a_ptr, r, R, W, PA, WB)
        m = tl.where((mx > -float("inf")) & (mx < float("inf")), mx, 0.0)
        req = tl.load(row_req_ptr + r)
        seed_lo = tl.load(seed_lo_ptr + req)
        seed_hi = tl.load(seed_hi_ptr + req)
        pos = tl.load(pos_ptr + req) + tl.load(row_j_ptr + r)
        # the winning tile: largest key, lowest tile id on equal keys
        q = tl.arange(0, WB)
        o_q = (q.to(tl.int64) * R + r) * PB
        kq = tl.load(b_ptr + o_q, mask=q < W, other=-float("inf"))
        kq = tl.where(kq == kq, kq, -float("inf"))
        gq = tl.load(b_ptr + o_q + 1, mask=q < W, other=_NONE)
        kbest = tl.max(kq, axis=0)
        tile = tl.min(tl.where(kq == kbest, gq, _NONE), axis=0)
        win = tl.min(tl.where((kq == kbest) & (gq == tile), q, WB), axis=0)
        win = tl.minimum(win, W - 1)
        so = tl.arange(0, NS)
        subs = tl.load(b_ptr + (win.to(tl.int64) * R + r) * PB + 2 + so)
        t_id = tl.minimum(tile, _NONE - 1).to(tl.int32)
        sid = t_id * NS + so
        skey = tl.log(subs) + _gumbel(seed_lo, seed_hi, pos, sid, STREAM_SAMPLE_SUB)
        skey = tl.where(subs > 0, skey, -float("inf"))
        sb = tl.argmax(skey, axis=0) + t_id * NS
        # this shard's best token of sub-tile sb
        ids = sb * SUB + tl.arange(0, SUB)
        cols = ids - off
        ok = (cols >= 0) & (cols < w)
        x = tl.load(x_ptr + r.to(tl.int64) * stride + cols, mask=ok,
                    other=-float("inf")).to(tl.float32)
        fin = ok & (x > -float("inf")) & (x < float("inf"))
        key = (x - m) * inv_t + _gumbel(seed_lo, seed_hi, pos, ids, STREAM_SAMPLE)
        key = tl.where(fin, key, -float("inf"))
        bk = tl.max(key, axis=0)
        arg = tl.argmax(key, axis=0) + sb * SUB
        lowest = tl.min(tl.where(ok, ids, 2147483647), axis=0)
        held = lowest < 2147483647
        bid = tl.where(bk > -float("inf"), arg.to(tl.float32),
                       tl.where(held, lowest.to(tl.float32), _NONE))
    tl.store(o_c, bk)
    tl.store(o_c + 1, bid)


@triton.jit
def _row_token(a_ptr, c_ptr, r, R, W, V, greedy, PA: tl.constexpr, WB: tl.constexpr):
    """Row ``r``'s token: its lowest argmax when ``greedy``, else the drawn one (largest key
    of the gathered payload C, lowest id on equal keys); clamped into [0, V)."""
    if greedy:
        _, tok, _ = _global_max(a_ptr, r, R, W, PA, WB)
    else:
        q = tl.arange(0, WB)
        o_q = (q.to(tl.int64) * R + r) * 2
        kq = tl.load(c_ptr + o_q, mask=q < W, other=-float("inf"))
        iq = tl.load(c_ptr + o_q + 1, mask=q < W, other=_NONE)
        kbest = tl.max(kq, axis=0)
        tok = tl.min(tl.where(kq == kbest, iq, _NONE), axis=0)
    return tl.minimum(tl.maximum(tok, 0.0), V - 1).to(tl.int64)


@triton.jit(**_FAST_NOSPEC)
def shard_finish_kernel(a_ptr, c_ptr, temp_ptr, row_start_ptr, draft_start_ptr, k_given_ptr,
                        draft_ids_ptr, tok_ptr, nacc_ptr, err_ptr, inv_ptr, R, N, K, W, V,
                        PA: tl.constexpr, WB: tl.constexpr):
    i = tl.program_id(0)
    rs = tl.load(row_start_ptr + i)
    ds = tl.load(draft_start_ptr + i)
    kg = tl.load(k_given_ptr + i)
    keff = _k_eff_of(draft_ids_ptr, ds, kg, False)
    greedy = tl.load(temp_ptr + i) <= 0
    err = 0
    for j in range(0, keff + 1):
        mx, _, bad = _global_max(a_ptr, rs + j, R, W, PA, WB)
        err |= tl.where(bad, ERR_LOGITS_NAN, tl.where(mx == -float("inf"),
                                                      ERR_LOGITS_NO_FINITE, 0))
    for j in range(0, keff):
        d = tl.load(draft_ids_ptr + ds + j)
        err |= tl.where((d < 0) | (d >= V), ERR_DRAFT_ID, 0)
    # one-hot prefix matching: accept d_j while it equals row j's token
    nacc = 0
    going = err == 0
    emit = tl.zeros((), tl.int64) - 1
    for j in range(0, keff + 1):
        if going:
            y = _row_token(a_ptr, c_ptr, rs + j, R, W, V, greedy, PA, WB)
            d = tl.load(draft_ids_ptr + ds + j, mask=j < keff, other=-1)
            if (j < keff) & (d == y):
                nacc += 1
            else:
                emit = y
                going = going & False
    valid = err == 0
    for j in range(0, K + 1):
        d = tl.load(draft_ids_ptr + ds + j, mask=j < nacc, other=-1)
        v = tl.where(j < nacc, d, tl.where(j == nacc, emit, -1))
        tl.store(tok_ptr + i.to(tl.int64) * (K + 1) + j, tl.where(valid, v, -1))
    tl.store(nacc_ptr + i, tl.where(valid, nacc, 0).to(tl.int64))
    tl.store(err_ptr + i, err.to(tl.int64))
    tl.store(inv_ptr + i, (err != 0).to(tl.int8))
