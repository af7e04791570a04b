"""Triton kernels of specsample.distributed on CUDA: the shard's tile masses in one pass
over the logits (no float32 copy), and rng's 52-bit uniforms in one launch (the torch version
of Philox is some hundred small kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import rng
from .triton_backend.kernels import _uniform

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
