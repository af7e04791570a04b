"""Triton kernels of specsample.distributed (CUDA, or Triton's interpreter on CPU tensors).

For the PyTorch path: the shard's tile masses in one pass over the logits (no float32 copy),
and rng's 52-bit uniforms in one launch (the torch version of Philox is some hundred small
kernels). For temperature-only calls: the two launches of ``distributed._run_kernels``
(``shard_pass_kernel``, then one all_gather, then ``shard_final_kernel``), described below.
"""

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


# ------------------------------------------------------- temperature-only calls: two launches
#
# Calls without processors (temperature only), with one-hot drafts and no logprobs run as
# ``shard_pass_kernel`` on every rank, one all_gather of its per-row payload, then
# ``shard_final_kernel`` on every rank (``distributed._run_kernels``). The draw is the
# single-device three-level Gumbel-max (``rng``: a tile with keys log-mass + G, a sub-tile
# of it, a token of that sub-tile; tile, sub-tile and token ids global, ties to the lowest
# id), split so that one exchange suffices:
#
# * ``shard_pass_kernel`` (one program per row) reads the shard's columns once, in their
#   dtype: per local tile its max, and the sums of exp((x - max) / T) of its sub-tiles
#   (scratch); per row the shard's max m_r (NaN skipped), lowest argmax (global id) and a
#   NaN / +inf flag. For a sampled row it then keys the tiles that lie in this shard alone
#   and keeps the best one; for that tile, and for the shard's first and last tile where
#   another rank holds part of them, it writes the tile's (partial) sub-tile masses and,
#   per sub-tile, its best token key (x - m_r) / T + G and id. Everything relative to m_r.
# * ``shard_final_kernel`` (one program per request, every rank alike) takes M = max m_r,
#   rescales each rank's values by exp((m_r - M) / T), keys the tiles shared by ranks from
#   their parts, picks the tile (largest key; lowest id on equal keys), its sub-tile from
#   the summed sub-tile masses, and the token from the parts' per-sub-tile bests. Greedy
#   requests take the lowest global argmax. Then the error bits, one-hot prefix matching
#   (drawing a row only when the walk reaches it) and the outputs.
#
# The tokens are those of specsample.sample / verify on the whole rows up to float32
# rounding of the keys and masses (which decides only near-ties).

NSUB = rng.TILE // rng.SUBTILE
SLOT = 2 + 3 * NSUB  # head (key or mass), tile id, sub-tile masses, per-sub-tile key, id
PAYLOAD = 3 + 3 * SLOT  # m_r, argmax, flags; slots: best own tile, first tile, last tile
_NONE = tl.constexpr(16777216.0)  # "no id" in a payload (ids are exact in float32 < 2**24)
_LOG2E = tl.constexpr(1.4426950408889634)
_FAST_NOSPEC = dict(do_not_specialize=["R", "K", "nt"])  # (vary per call)


@triton.jit
def _inv_temperature(t):
    """1 / T (1 for a greedy request, T = 0)."""
    return 1.0 / tl.where(t > 0, t, 1.0)


@triton.jit
def _tile_slot(x_ptr, stride, off, w, r, j, g, head, mref, inv_t, seed_lo, seed_hi, pos,
               tm_ptr, sub_ptr, nt, slot_ptr, TILE: tl.constexpr, SUB: tl.constexpr):
    """Write local tile ``j`` (global ``g``) of row ``r`` into a payload slot: ``head``, g,
    its sub-tile masses relative to ``mref`` (this shard's columns), and per sub-tile the
    best token key (x - mref) / T + G (STREAM_SAMPLE) and its id (lowest on ties)."""
    NS: tl.constexpr = TILE // SUB
    so = tl.arange(0, NS)
    o_t = r.to(tl.int64) * nt + j
    tm = tl.load(tm_ptr + o_t)
    f = tl.where(tm > -float("inf"), tl.exp2((tm - mref) * inv_t * _LOG2E), 0.0)
    tl.store(slot_ptr, head)
    tl.store(slot_ptr + 1, g.to(tl.float32))
    tl.store(slot_ptr + 2 + so, f * tl.load(sub_ptr + o_t * NS + so))
    ids = g * TILE + tl.arange(0, TILE)
    cols = ids - off
    ok = (cols >= 0) & (cols < w)
    x = tl.load(x_ptr + r.to(tl.int64) * stride + cols, mask=ok,
                other=-float("inf")).to(tl.float32)
    fin = ok & (x > -float("inf")) & (x < float("inf"))
    key = tl.where(fin, (x - mref) * inv_t + _gumbel(seed_lo, seed_hi, pos, ids, STREAM_SAMPLE),
                   -float("inf"))
    k2 = tl.reshape(key, (NS, SUB))
    best = tl.argmax(k2, axis=1)
    tl.store(slot_ptr + 2 + NS + so, tl.max(k2, axis=1))
    tl.store(slot_ptr + 2 + 2 * NS + so, ((g * NS + so) * SUB + best).to(tl.float32))


@triton.jit
def _mass(tm, ts, mref, scale):
    """exp((tm - mref) / T) ts: a tile's mass relative to mref from its max tm and its sum
    ts relative to tm (0 for a tile of -inf)."""
    return tl.where(tm > -float("inf"), tl.exp2((tm - mref) * scale) * ts, 0.0)


@triton.jit(**_FAST_NOSPEC)
def shard_pass_kernel(x_ptr, stride, w, off, nt, V, row_req_ptr, row_j_ptr, temp_ptr,
                      seed_lo_ptr, seed_hi_ptr, pos_ptr, scratch_ptr, p_ptr, R,
                      TILE: tl.constexpr, SUB: tl.constexpr, P: tl.constexpr,
                      SLOT_W: tl.constexpr, CH: tl.constexpr):
    r = tl.program_id(0)
    NS: tl.constexpr = TILE // SUB
    # scratch: per local tile its max [R, nt], its sum [R, nt], its sub-tile sums [R, nt, NS]
    tm_ptr = scratch_ptr
    ts_ptr = scratch_ptr + R.to(tl.int64) * nt
    sub_ptr = scratch_ptr + 2 * R.to(tl.int64) * nt
    req = tl.load(row_req_ptr + r)
    t = tl.load(temp_ptr + req)
    inv_t = _inv_temperature(t)
    scale = inv_t * _LOG2E
    g0 = off // TILE
    head = off - g0 * TILE
    row = x_ptr + r.to(tl.int64) * stride
    lane = tl.arange(0, TILE)
    so = tl.arange(0, NS)
    bad = 0
    rmax = -float("inf")
    rarg = 0
    for j in range(0, nt):
        cols = j * TILE - head + lane
        ok = (cols >= 0) & (cols < w)
        x = tl.load(row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        nan = x != x
        bad |= tl.max((ok & (nan | (x == float("inf")))).to(tl.int32), axis=0)
        x = tl.where(nan, -float("inf"), x)
        tm = tl.max(x, axis=0)
        first = tl.min(tl.where(x == tm, (g0 + j) * TILE + lane, 2147483647), axis=0)
        rarg = tl.where(tm > rmax, first, rarg)
        rmax = tl.maximum(rmax, tm)
        fin = (x > -float("inf")) & (x < float("inf"))
        ref = tl.where((tm > -float("inf")) & (tm < float("inf")), tm, 0.0)
        e = tl.where(fin, tl.exp2((x - ref) * scale), 0.0)
        sub = tl.sum(tl.reshape(e, (NS, SUB)), axis=1)
        o_t = r.to(tl.int64) * nt + j
        tl.store(tm_ptr + o_t, tm)
        tl.store(ts_ptr + o_t, tl.sum(sub, axis=0))
        tl.store(sub_ptr + o_t * NS + so, sub)
    o_p = p_ptr + r.to(tl.int64) * P
    tl.store(o_p, rmax)
    tl.store(o_p + 1, rarg.to(tl.float32))
    tl.store(o_p + 2, bad.to(tl.float32))
    # Slot 0, the best tile held by this shard alone (none: key -inf).
    best = -float("inf")
    bj = -1
    if (t > 0) & (nt > 0):
        mref = tl.where((rmax > -float("inf")) & (rmax < float("inf")), rmax, 0.0)
        seed_lo = tl.load(seed_lo_ptr + req)
        seed_hi = tl.load(seed_hi_ptr + req)
        pos = tl.load(pos_ptr + req) + tl.load(row_j_ptr + r)
        end = off + w
        shared_first = tl.where(off % TILE != 0, 1, 0)  # an earlier rank holds its start
        shared_last = tl.where((end < V) & (end % TILE != 0), 1, 0)  # a later rank, its end
        for c in range(shared_first, nt - shared_last, CH):
            jv = c + tl.arange(0, CH)
            ok = jv < nt - shared_last
            o_t = r.to(tl.int64) * nt + jv
            tm = tl.load(tm_ptr + o_t, mask=ok, other=-float("inf"))
            ts = tl.load(ts_ptr + o_t, mask=ok, other=0.0)
            mass = _mass(tm, ts, mref, scale)
            key = tl.log(mass) + _gumbel(seed_lo, seed_hi, pos, g0 + jv, STREAM_SAMPLE_TILE)
            key = tl.where(ok & (mass > 0), key, -float("inf"))
            kmax = tl.max(key, axis=0)
            kidx = tl.argmax(key, axis=0) + c
            bj = tl.where(kmax > best, kidx, bj)
            best = tl.maximum(best, kmax)
        if bj >= 0:
            _tile_slot(x_ptr, stride, off, w, r, bj, g0 + bj, best, mref, inv_t, seed_lo,
                       seed_hi, pos, tm_ptr, sub_ptr, nt, o_p + 3, TILE, SUB)
        # Slots 1 and 2: the first and the last tile where other ranks hold part of them.
        if (shared_first == 1) | ((nt == 1) & (shared_last == 1)):
            o_t = r.to(tl.int64) * nt
            mass = _mass(tl.load(tm_ptr + o_t), tl.load(ts_ptr + o_t), mref, scale)
            _tile_slot(x_ptr, stride, off, w, r, 0, g0, mass, mref, inv_t, seed_lo, seed_hi,
                       pos, tm_ptr, sub_ptr, nt, o_p + 3 + SLOT_W, TILE, SUB)
        if (nt > 1) & (shared_last == 1):
            o_t = r.to(tl.int64) * nt + nt - 1
            mass = _mass(tl.load(tm_ptr + o_t), tl.load(ts_ptr + o_t), mref, scale)
            _tile_slot(x_ptr, stride, off, w, r, nt - 1, g0 + nt - 1, mass, mref, inv_t,
                       seed_lo, seed_hi, pos, tm_ptr, sub_ptr, nt, o_p + 3 + 2 * SLOT_W,
                       TILE, SUB)
    if bj < 0:
        tl.store(o_p + 3, -float("inf"))
        tl.store(o_p + 4, _NONE)


@triton.jit
def _global_max(p_ptr, r, R, W, P: tl.constexpr, WB: tl.constexpr):
    """Row ``r``'s max over the ranks of the gathered payload [W, R, P] (-inf if none),
    the lowest global id attaining it, and whether any rank saw a NaN / +inf."""
    q = tl.arange(0, WB)
    o = (q.to(tl.int64) * R + r) * P
    okq = q < W
    m = tl.load(p_ptr + o, mask=okq, other=-float("inf"))
    mx = tl.max(m, axis=0)
    arg = tl.load(p_ptr + o + 1, mask=okq, other=_NONE)
    first = tl.min(tl.where(m == mx, arg, _NONE), axis=0)
    bad = tl.max(tl.load(p_ptr + o + 2, mask=okq, other=0.0), axis=0) > 0
    return mx, first, bad


@triton.jit
def _rank_offset(p_ptr, q, r, R, W, mref, inv_t, P: tl.constexpr):
    """(key offset (m_q - M) / T, mass factor exp of it) of rank ``q``'s values of row
    ``r`` (-inf and 0 where the rank holds no finite value, or q >= W: a vector's lanes
    past the ranks are not read); q a scalar or a vector."""
    m = tl.load(p_ptr + (q * R + r).to(tl.int64) * P, mask=q < W, other=-float("inf"))
    fin = (m > -float("inf")) & (m < float("inf"))
    off = tl.where(fin, (m - mref) * inv_t, -float("inf"))
    return off, tl.where(fin, tl.exp2(off * _LOG2E), 0.0)


@triton.jit
def _slot_of(q, g, interior, S, TILE: tl.constexpr):
    """Payload slot of rank ``q``'s part of tile ``g``: 0 for a tile one rank holds alone,
    else 1 when it is q's first tile, 2 when it is q's last."""
    return tl.where(interior, 0, tl.where((q * S) // TILE == g, 1, 2))


@triton.jit
def _draw_row(p_ptr, r, R, W, S, V, inv_t, seed_lo, seed_hi, pos, TILE: tl.constexpr,
              SUB: tl.constexpr, P: tl.constexpr, SLOT_W: tl.constexpr, WB: tl.constexpr):
    """Row ``r``'s sampled token (int64 in [0, V)) from the gathered payloads."""
    NS: tl.constexpr = TILE // SUB
    so = tl.arange(0, NS)
    mx, _arg, _bad = _global_max(p_ptr, r, R, W, P, WB)
    mref = tl.where((mx > -float("inf")) & (mx < float("inf")), mx, 0.0)
    # The tile: every rank's best own tile, then the tiles that ranks share.
    q = tl.arange(0, WB)
    koff, _scale = _rank_offset(p_ptr, q, r, R, W, mref, inv_t, P)
    o_q = (q.to(tl.int64) * R + r) * P + 3
    kq = tl.load(p_ptr + o_q, mask=q < W, other=-float("inf")) + koff
    kq = tl.where((q < W) & (kq == kq), kq, -float("inf"))
    gq = tl.load(p_ptr + o_q + 1, mask=q < W, other=_NONE)
    best = tl.max(kq, axis=0)
    tile = tl.min(tl.where(kq == best, gq, _NONE), axis=0)
    q_lo = tl.min(tl.where((kq == best) & (gq == tile), q, WB - 1), axis=0)
    q_hi = q_lo
    interior = tl.full((), 1, tl.int1)
    for b in range(1, W):
        g = (b * S) // TILE
        first = (b == 1) | ((b - 1) * S <= g * TILE)  # the first boundary inside tile g
        if (b * S < V) & (b * S % TILE != 0) & first:
            lo = (g * TILE) // S
            hi = tl.minimum(tl.minimum(((g + 1) * TILE - 1) // S, W - 1), (V - 1) // S)
            mass = 0.0
            for qq in range(lo, hi + 1):
                _off_t, f = _rank_offset(p_ptr, qq, r, R, W, mref, inv_t, P)
                o = (qq * R + r).to(tl.int64) * P + 3 + _slot_of(qq, g, False, S, TILE) * SLOT_W
                mass += f * tl.load(p_ptr + o)
            key = tl.log(mass) + _gumbel(seed_lo, seed_hi, pos, g, STREAM_SAMPLE_TILE)
            key = tl.where(mass > 0, key, -float("inf"))
            gf = g.to(tl.float32)
            better = (key > best) | ((key == best) & (gf < tile))
            best = tl.where(better, key, best)
            tile = tl.where(better, gf, tile)
            q_lo = tl.where(better, lo, q_lo)
            q_hi = tl.where(better, hi, q_hi)
            interior = interior & ~better
    tid = tl.where(best > -float("inf"), tile, 0.0).to(tl.int32)
    # Its sub-tile, from the parts' sub-tile masses.
    subs = tl.zeros([NS], tl.float32)
    for qq in range(q_lo, q_hi + 1):
        _off_s, f = _rank_offset(p_ptr, qq, r, R, W, mref, inv_t, P)
        o = (qq * R + r).to(tl.int64) * P + 3 + _slot_of(qq, tid, interior, S, TILE) * SLOT_W
        subs += f * tl.load(p_ptr + o + 2 + so)
    skey = tl.log(subs) + _gumbel(seed_lo, seed_hi, pos, tid * NS + so, STREAM_SAMPLE_SUB)
    sb = tl.argmax(tl.where(subs > 0, skey, -float("inf")), axis=0)
    # Its token: the best of the parts' bests in that sub-tile.
    bk = tl.full((), -float("inf"), tl.float32)
    bid = tl.full((), _NONE, tl.float32)
    for qq in range(q_lo, q_hi + 1):
        ko, _f_k = _rank_offset(p_ptr, qq, r, R, W, mref, inv_t, P)
        o = (qq * R + r).to(tl.int64) * P + 3 + _slot_of(qq, tid, interior, S, TILE) * SLOT_W
        k = tl.load(p_ptr + o + 2 + NS + sb) + ko
        k = tl.where(k == k, k, -float("inf"))
        i = tl.load(p_ptr + o + 2 + 2 * NS + sb)
        better = (k > bk) | ((k == bk) & (i < bid))
        bk = tl.where(better, k, bk)
        bid = tl.where(better, i, bid)
    return tl.minimum(tl.maximum(bid, 0.0), V - 1).to(tl.int64)


@triton.jit(**_FAST_NOSPEC)
def shard_final_kernel(p_ptr, temp_ptr, seed_lo_ptr, seed_hi_ptr, pos_ptr, row_start_ptr,
                       draft_start_ptr, k_given_ptr, draft_ids_ptr, tok_ptr, nacc_ptr, err_ptr,
                       inv_ptr, R, K, W, S, V, TILE: tl.constexpr, SUB: tl.constexpr,
                       P: tl.constexpr, SLOT_W: tl.constexpr, WB: tl.constexpr):
    i = tl.program_id(0)
    rs = tl.load(row_start_ptr + i)
    ds = tl.load(draft_start_ptr + i)
    kg = tl.load(k_given_ptr + i)
    keff = _k_eff_of(draft_ids_ptr, ds, kg, False)
    t = tl.load(temp_ptr + i)
    inv_t = _inv_temperature(t)
    err = 0
    for j in range(0, keff + 1):
        mx, _arg, bad = _global_max(p_ptr, rs + j, R, W, P, WB)
        err |= tl.where(bad, ERR_LOGITS_NAN, tl.where(mx == -float("inf"),
                                                      ERR_LOGITS_NO_FINITE, 0))
    for j in range(0, keff):
        d = tl.load(draft_ids_ptr + ds + j)
        err |= tl.where((d < 0) | (d >= V), ERR_DRAFT_ID, 0)
    # One-hot prefix matching: accept d_j while it equals row j's token (drawn when reached).
    seed_lo = tl.load(seed_lo_ptr + i)
    seed_hi = tl.load(seed_hi_ptr + i)
    pos = tl.load(pos_ptr + i)
    nacc = 0
    going = err == 0
    emit = tl.zeros((), tl.int64) - 1
    for j in range(0, keff + 1):
        if going:
            if t > 0:
                y = _draw_row(p_ptr, rs + j, R, W, S, V, inv_t, seed_lo, seed_hi, pos + j,
                              TILE, SUB, P, SLOT_W, WB)
            else:
                _mx, yf, _bad = _global_max(p_ptr, rs + j, R, W, P, WB)
                y = tl.minimum(tl.maximum(yf, 0.0), V - 1).to(tl.int64)
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
