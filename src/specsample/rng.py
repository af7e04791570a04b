"""Counter-based random numbers shared by every backend.

Every random number specsample draws is a pure function of
``(seed, position, counter, stream)``:

* ``seed``: the request's 64-bit seed (``SamplingParams.seed`` mod 2**64), split into the
  two 32-bit Philox key words ``k0 = seed & 0xffffffff`` and ``k1 = seed >> 32``.
* ``position``: the absolute position in the sequence of the token the draw decides, split
  into counter words ``c1 = position & 0xffffffff`` and ``c2 = position >> 32``.
* ``counter``: counter word ``c0``: the token id for per-token noise (Gumbel keys), or a
  per-stream scalar index for per-row uniforms (see the streams below).
* ``stream``: counter word ``c3``, one of the ``STREAM_*`` constants.

The generator is Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
3", SC 2011), the generator behind Triton's ``tl.rand``; word 0 of its output is used. It is
stateless, so results never depend on batch order, batch size, vocabulary tiling, chunking or
replay, and it is safe under CUDA graphs. The Triton backend evaluates the same function
bit for bit (integer arithmetic is exact; only the final ``log`` of the Gumbel transform may
differ by float rounding between backends).

Streams and why they are separate (DESIGN.md):

* ``STREAM_SAMPLE`` (0): Gumbel noise of the target distribution at a position. Used by
  ``sample()``, by one-hot draft verification (sample-and-match), and by the bonus token.
  Because one-hot verification uses exactly the noise ``sample()`` uses at the same position,
  speculation cannot change a seeded request's tokens (API.md guarantee 4).
* ``STREAM_ACCEPT`` (1): token-level acceptance uniform ``u_j`` of the draft at a position
  (``c0 = 0``).
* ``STREAM_RESIDUAL`` (2): Gumbel noise for the residual distribution at a rejected position.
* ``STREAM_BLOCK_ACCEPT`` (3): block-verification uniforms. Block verification observes every
  ``u_j`` of its window, including those after the accepted prefix, so a key must never be
  reused by the next step; the key uses ``c0 = j + 1`` (j = draft index in the window) with
  ``position = window start + j``. The pair determines the window start, so no uniform is
  ever observed twice across speculative steps.
* ``STREAM_SAMPLE_TILE`` (5) / ``STREAM_SAMPLE_SUB`` (8), ``STREAM_RESIDUAL_TILE`` (6) /
  ``STREAM_RESIDUAL_SUB`` (9): the tile and sub-tile levels of the draws above (below).
* ``STREAM_DRAFT`` (4) / ``STREAM_DRAFT_TILE`` (7) / ``STREAM_DRAFT_SUB`` (10): a drafter's
  own sampling (the engine's model drafter), through :func:`draft_streams`. Reusing the
  target's residual stream for the drafter would correlate q's draw with the residual draw and
  bias the output. The stream word also carries the draft's index j in its window
  (``stream | (j + 1) << 8``): block verification's decision depends on drafts past the
  accepted prefix, so a drafter keyed by position alone would reuse, in the next step, noise
  an earlier decision already observed.

Key reuse across steps for the other streams is unbiased: a decision at a position is only
made once a token is emitted there, and later steps start after the last emitted position; noise
drawn at positions past the first rejection was never used by any decision.

Uniforms have 52 bits, from output words 0 and 1:
``u = ((w0 >> 6) * 2**26 + (w1 >> 6) + 0.5) * 2**-52`` in float64 (exact), strictly inside
(0, 1), and Gumbel noise is ``-log(-log(u))`` in float64. The largest u is 1 - 2**-53, so the
noise is the continuous Gumbel law truncated above ``GUMBEL_MAX`` (about 36.7): the chance
that any of a row's draws would have been cut there is below 1e-12, far under anything
measurable.

Sampling a row uses three levels of Gumbel-max (see ``docs/semantics.md``): the vocabulary is
cut into tiles of ``TILE`` tokens and each tile into sub-tiles of ``SUBTILE`` tokens; a tile is
drawn with keys ``logsumexp(tile) + G`` on the ``*_TILE`` stream (counter = tile index), then a
sub-tile of it with keys ``logsumexp(sub-tile) + G`` on the ``*_SUB`` stream (counter = global
sub-tile index, ``token id // SUBTILE``), then a token of that sub-tile with keys ``z + G`` on
the token stream (counter = token id). Because
``P(tile) * P(sub-tile | tile) * P(token | sub-tile) = p(token)`` the draw is exact, and it
needs noise for V / TILE + TILE / SUBTILE + SUBTILE values per row (235 at V = 151,936)
instead of the whole vocabulary. ``sub_stream(tile_stream)`` names the sub-tile stream of a
tile stream (``STREAM_SAMPLE_SUB`` 8, ``STREAM_RESIDUAL_SUB`` 9, ``STREAM_DRAFT_SUB`` 10, with
the tile stream's high bits: a drafter's index j).
"""

from __future__ import annotations

import math

import numpy as np
import torch

STREAM_SAMPLE = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2
STREAM_BLOCK_ACCEPT = 3
STREAM_DRAFT = 4
STREAM_SAMPLE_TILE = 5
STREAM_RESIDUAL_TILE = 6
STREAM_DRAFT_TILE = 7
STREAM_SAMPLE_SUB = 8
STREAM_RESIDUAL_SUB = 9
STREAM_DRAFT_SUB = 10
_SUB_OF_TILE = {STREAM_SAMPLE_TILE: STREAM_SAMPLE_SUB, STREAM_RESIDUAL_TILE: STREAM_RESIDUAL_SUB,
                STREAM_DRAFT_TILE: STREAM_DRAFT_SUB}

#: Tokens per sampling tile (part of the random-number definition: never tied to a kernel's
#: block size, so every backend draws the same tokens).
TILE = 2048
#: Tokens per sub-tile, the middle sampling level (divides TILE; also part of the definition).
SUBTILE = 128

PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
MASK32 = 0xFFFFFFFF

UNIFORM_SCALE = 2.0**-52
#: Largest Gumbel value the 52-bit uniform can produce, rounded up: -log(-log(1 - 2**-53)).
GUMBEL_MAX = 36.75
#: Smallest Gumbel value: -log(-log(2**-53)), rounded down.
GUMBEL_MIN = -3.61


def draft_streams(j: int) -> tuple[int, int]:
    """(token stream, tile stream) for a drafter's draw of draft ``j`` (0-based) of a window.

    Use them with position = the drafted token's absolute position: (position, j) determine
    the window's start, so no drafter noise is ever reused by a later speculative step.
    """
    if j < 0 or j >= 2**20:
        raise ValueError(f"draft index must be in [0, 2**20), got {j}")
    return STREAM_DRAFT | (j + 1) << 8, STREAM_DRAFT_TILE | (j + 1) << 8


def sub_stream(tile_stream: int) -> int:
    """The sub-tile stream that goes with ``tile_stream`` (a ``*_TILE`` stream, possibly with
    a drafter's index in its high bits, as :func:`draft_streams` returns it).

    Raises:
        ValueError: ``tile_stream`` is not a tile stream.
    """
    low = tile_stream & 0xFF
    if low not in _SUB_OF_TILE:
        raise ValueError(f"{tile_stream} is not a tile stream (STREAM_*_TILE)")
    return (tile_stream & ~0xFF) | _SUB_OF_TILE[low]


def split_seed(seed: int) -> tuple[int, int]:
    """Return the Philox key words ``(k0, k1)`` of ``seed mod 2**64``."""
    seed %= 2**64
    return seed & MASK32, seed >> 32


def philox_scalar(c0: int, c1: int, c2: int, c3: int, k0: int, k1: int) -> tuple[int, ...]:
    """Philox4x32-10 on Python ints (the specification the tensor versions are tested against)."""
    for _ in range(PHILOX_ROUNDS):
        p0 = PHILOX_ROUND_B * c2
        p1 = PHILOX_ROUND_A * c0
        c0, c1, c2, c3 = (
            (p0 >> 32) ^ c1 ^ k0,
            p0 & MASK32,
            (p1 >> 32) ^ c3 ^ k1,
            p1 & MASK32,
        )
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1, c2, c3


def uniform_scalar(seed: int, position: int, counter: int, stream: int) -> float:
    """The uniform in (0, 1) for one key, on Python numbers (the exact float64 value)."""
    k0, k1 = split_seed(seed)
    w = philox_scalar(counter & MASK32, position & MASK32, (position >> 32) & MASK32, stream,
                      k0, k1)
    return ((w[0] >> 6) * 2**26 + (w[1] >> 6) + 0.5) * UNIFORM_SCALE


def gumbel_scalar(seed: int, position: int, counter: int, stream: int) -> float:
    """The Gumbel(0, 1) value ``-log(-log(u))`` for one key, in float64."""
    return -math.log(-math.log(uniform_scalar(seed, position, counter, stream)))


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # b holds uint32 values in int64; split b in 16-bit halves so no product overflows int64.
    b_lo = b & 0xFFFF
    b_hi = b >> 16
    lo_part = a * b_lo  # < 2**48
    hi_part = a * b_hi  # < 2**48
    total_lo = lo_part + ((hi_part & 0xFFFF) << 16)  # < 2**49
    lo = total_lo & MASK32
    hi = ((hi_part >> 16) + (total_lo >> 32)) & MASK32
    return hi, lo


def philox(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor,
           k0: torch.Tensor, k1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Words 0 and 1 of Philox4x32-10 on broadcastable int64 tensors holding uint32 values.

    Returns two int64 tensors of uint32 values with the broadcast shape of the inputs.
    """
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape, k0.shape, k1.shape)
    c0, c1, c2, c3 = (t.expand(shape) for t in (c0, c1, c2, c3))
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo(PHILOX_ROUND_B, c2)
        hi1, lo1 = _mulhilo(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi0 ^ c1 ^ k0, lo0, hi1 ^ c3 ^ k1, lo1
        k0 = (k0 + PHILOX_KEY_A) & MASK32
        k1 = (k1 + PHILOX_KEY_B) & MASK32
    return c0, c1


def _philox_numpy(c0: np.ndarray, c1: np.ndarray, c2: np.ndarray, c3: np.ndarray,
                  k0: np.ndarray, k1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`philox` on broadcastable uint64 numpy arrays holding uint32 values: a product of
    two uint32 values is exact in uint64. The CPU path: the two multiplications of a round
    run as one operation on the stacked words (c0, c2), and the round keys are computed up
    front, so a round is five whole-array numpy operations (on the small arrays a row's
    sampling needs, the per-operation cost dominates)."""
    shape = np.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape, k0.shape, k1.shape)
    even = np.empty((2, *shape), dtype=np.uint64)
    odd = np.empty((2, *shape), dtype=np.uint64)
    even[0], even[1], odd[0], odd[1] = c0, c2, c1, c3
    # the round keys keep the keys' own (usually per-row) shape; the XOR broadcasts them
    kshape = (1,) * (len(shape) - max(k0.ndim, k1.ndim)) + np.broadcast_shapes(k0.shape,
                                                                                k1.shape)
    key = np.empty((2, *kshape), dtype=np.uint64)
    key[0], key[1] = k0, k1
    trail = (1,) * len(shape)
    mul = np.array([PHILOX_ROUND_A, PHILOX_ROUND_B], dtype=np.uint64).reshape(2, *trail)
    step = np.array([PHILOX_KEY_A, PHILOX_KEY_B], dtype=np.uint64).reshape(2, *trail)
    rounds = np.arange(PHILOX_ROUNDS, dtype=np.uint64).reshape(-1, 1, *trail)
    keys = (key[None] + rounds * step[None]) & np.uint64(MASK32)  # [rounds, 2, ...]
    sh, mask = np.uint64(32), np.uint64(MASK32)
    for r in range(PHILOX_ROUNDS):
        p = even * mul  # (c0 A, c2 B)
        # c0' = hi(c2 B) ^ c1 ^ k0, c2' = hi(c0 A) ^ c3 ^ k1; c1' = lo(c2 B), c3' = lo(c0 A)
        even, odd = ((p >> sh)[::-1] ^ odd) ^ keys[r], (p & mask)[::-1]
    return even[0], odd[0]


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor,
            counter: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """Float64 53-bit uniforms in (0, 1) for broadcastable keys (all int64 tensors).

    ``seed_lo`` / ``seed_hi``: the key words; ``position``: absolute positions (int64 >= 0);
    ``counter``: token ids or scalar indices (int64 >= 0); ``stream``: a ``STREAM_*`` constant
    (or a 0-d int64 tensor holding one, on the keys' device). CPU tensors are evaluated with
    numpy (:func:`_philox_numpy`), others, and every call inside ``torch.compile``
    (``specsample.cpu_compile``), with tensor ops (:func:`philox`); both are this module's
    function bit for bit.
    """
    if (position.device.type == "cpu" and counter.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        u64, mask = np.uint64, np.uint64(MASK32)
        # (int64 -> uint64 keeps the bits; the words are masked on the numpy side)
        cnt, pos, lo, hi = (t.numpy().astype(u64) for t in (counter, position, seed_lo, seed_hi))
        w0, w1 = _philox_numpy(cnt & mask, pos & mask, pos >> u64(32), u64(int(stream)), lo,
                               hi)
        u = np.asarray((((w0 >> u64(6)) << u64(26)) + (w1 >> u64(6))), dtype=np.float64)
        u += 0.5  # (in place: 0-d keys keep a 0-d array, which torch.from_numpy takes)
        u *= UNIFORM_SCALE
        return torch.from_numpy(u)
    c3 = stream if isinstance(stream, torch.Tensor) else torch.full(
        (), stream, dtype=torch.int64, device=position.device)
    w0, w1 = philox(counter & MASK32, position & MASK32, (position >> 32) & MASK32, c3,
                    seed_lo, seed_hi)
    # (2.0**-52 is UNIFORM_SCALE: torch.compile would make the module's float an input of
    # the graph, a tensor made at every call)
    return (((w0 >> 6) << 26) + (w1 >> 6)).to(torch.float64).add_(0.5).mul_(2.0**-52)


def gumbel(seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor,
           counter: torch.Tensor, stream: int | torch.Tensor) -> torch.Tensor:
    """Float64 Gumbel(0, 1) noise ``-log(-log(u))`` for broadcastable keys (see ``uniform``)."""
    return -torch.log(-torch.log(uniform(seed_lo, seed_hi, position, counter, stream)))
