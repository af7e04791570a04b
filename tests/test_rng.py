"""specsample.rng: Philox4x32-10 known answers, tensor == scalar, uniform range, Gumbel bounds."""

from __future__ import annotations

import math

import pytest
import torch

from specsample import rng

M = 0xFFFFFFFF

# Random123 kat_vectors, philox4x32_10: (counter c0..c3, key k0 k1) -> output words.
KAT = [
    ((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M, M, M, M, M, M), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("inputs,expected", KAT)
def test_philox_scalar_known_answers(inputs, expected):
    assert rng.philox_scalar(*inputs) == expected


@pytest.mark.parametrize("inputs,expected", KAT)
def test_philox_tensor_known_answers(inputs, expected):
    t = [torch.tensor([v], dtype=torch.int64) for v in inputs]
    assert int(rng.philox(*t)[0]) == expected[0]


def _keys(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**62, (n,), generator=g) * 4 + torch.randint(0, 4, (n,), generator=g)
    seeds[:3] = torch.tensor([0, 2**32 - 1, 2**62 + 12345])
    pos = torch.randint(0, 2**45, (n,), generator=g)
    pos[:2] = torch.tensor([0, 2**32])
    counter = torch.randint(0, 2**20, (n,), generator=g)
    return seeds, pos, counter


STREAMS = [rng.STREAM_SAMPLE, rng.STREAM_ACCEPT, rng.STREAM_RESIDUAL, rng.STREAM_BLOCK_ACCEPT,
           rng.STREAM_DRAFT, rng.STREAM_SAMPLE_TILE, rng.STREAM_RESIDUAL_TILE,
           rng.STREAM_DRAFT_TILE, rng.STREAM_SAMPLE_SUB, rng.STREAM_RESIDUAL_SUB,
           rng.STREAM_DRAFT_SUB]


def test_streams_distinct():
    assert len(set(STREAMS)) == len(STREAMS)


@pytest.mark.parametrize("stream", STREAMS)
def test_tensor_matches_scalar(stream):
    seeds, pos, counter = _keys(300, stream)
    split = [rng.split_seed(int(s)) for s in seeds]
    lo = torch.tensor([s[0] for s in split])
    hi = torch.tensor([s[1] for s in split])
    u = rng.uniform(lo, hi, pos, counter, stream)
    g = rng.gumbel(lo, hi, pos, counter, stream)
    assert u.dtype == torch.float64 and g.dtype == torch.float64
    for i in range(len(seeds)):
        us = rng.uniform_scalar(int(seeds[i]), int(pos[i]), int(counter[i]), stream)
        assert float(u[i]) == us  # bit exact: the 52-bit uniform is float64-exact
        gs = rng.gumbel_scalar(int(seeds[i]), int(pos[i]), int(counter[i]), stream)
        assert abs(float(g[i]) - gs) <= 1e-12 * (1 + abs(gs))


def test_seed_taken_mod_2_64():
    assert rng.split_seed(-1) == (M, M)
    assert rng.split_seed(2**64 + 5) == (5, 0)
    assert rng.uniform_scalar(-1, 3, 4, 0) == rng.uniform_scalar(2**64 - 1, 3, 4, 0)


def test_keys_are_distinct_per_word():
    base = rng.uniform_scalar(7, 100, 3, rng.STREAM_SAMPLE)
    others = [rng.uniform_scalar(8, 100, 3, 0), rng.uniform_scalar(7 + 2**32, 100, 3, 0),
              rng.uniform_scalar(7, 101, 3, 0), rng.uniform_scalar(7, 100 + 2**32, 3, 0),
              rng.uniform_scalar(7, 100, 4, 0), rng.uniform_scalar(7, 100, 3, 1)]
    assert all(o != base for o in others)


def test_uniform_strictly_inside_unit_interval_and_uniform():
    n = 200_000
    lo = torch.tensor([123])
    hi = torch.tensor([456])
    u = rng.uniform(lo, hi, torch.arange(n), torch.zeros(n, dtype=torch.int64), 0)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    # extreme words (0, 0) and (2**32 - 1, 2**32 - 1) map to 2**-53 and 1 - 2**-53
    assert ((0 >> 6) * 2**26 + (0 >> 6) + 0.5) * rng.UNIFORM_SCALE == 2.0**-53
    assert ((M >> 6) * 2**26 + (M >> 6) + 0.5) * rng.UNIFORM_SCALE == 1 - 2.0**-53
    assert 0 < 2.0**-53 and 1 - 2.0**-53 < 1
    assert abs(float(u.mean()) - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1)
    assert torch.all((hist - n / 10).abs() < 5 * math.sqrt(n / 10))


def test_gumbel_bounds():
    umin, umax = 2.0**-53, 1 - 2.0**-53
    assert -math.log(-math.log(umax)) <= rng.GUMBEL_MAX
    assert rng.GUMBEL_MAX - (-math.log(-math.log(umax))) < 0.05
    assert -math.log(-math.log(umin)) >= rng.GUMBEL_MIN
    assert -math.log(-math.log(umin)) - rng.GUMBEL_MIN < 0.05
    # the tensor evaluation at the extremes stays inside the bounds too
    ext = torch.tensor([umin, umax], dtype=torch.float64)
    g = -torch.log(-torch.log(ext))
    assert float(g[1]) <= rng.GUMBEL_MAX and float(g[0]) >= rng.GUMBEL_MIN
    n = 100_000
    g = rng.gumbel(torch.tensor([9]), torch.tensor([0]), torch.arange(n),
                   torch.zeros(n, dtype=torch.int64), rng.STREAM_SAMPLE)
    assert float(g.max()) <= rng.GUMBEL_MAX and float(g.min()) >= rng.GUMBEL_MIN
    assert abs(float(g.mean()) - 0.5772156649) < 0.02  # Euler-Mascheroni


def test_numpy_and_tensor_philox_agree():
    """CPU tensors take the numpy evaluation; other devices the tensor ops: same words."""
    g = torch.Generator().manual_seed(5)
    c = [torch.randint(0, 2**32, (64,), generator=g) for _ in range(6)]
    w_t = rng.philox(*c)
    w_n = rng._philox_numpy(*(t.numpy().astype("uint64") for t in c))
    for a, b in zip(w_t, w_n):
        assert a.tolist() == b.astype("int64").tolist()


def test_sub_stream():
    assert rng.sub_stream(rng.STREAM_SAMPLE_TILE) == rng.STREAM_SAMPLE_SUB
    assert rng.sub_stream(rng.STREAM_RESIDUAL_TILE) == rng.STREAM_RESIDUAL_SUB
    tok, tile = rng.draft_streams(3)
    assert rng.sub_stream(tile) == rng.STREAM_DRAFT_SUB | 4 << 8
    with pytest.raises(ValueError, match="tile stream"):
        rng.sub_stream(rng.STREAM_SAMPLE)


try:  # the Triton kernels' Philox: the code the GPU compiles (conftest swaps the interpreter's)
    import triton
    import triton.language as tl

    from specsample.triton_backend import kernels
except ImportError:
    triton = None
else:
    PHILOX_JIT = getattr(kernels._philox_words01, "jit", kernels._philox_words01)

    @triton.jit
    def _words_kernel(c_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        w0, w1 = PHILOX_JIT(tl.load(c_ptr + i).to(tl.uint32),
                            tl.load(c_ptr + N + i).to(tl.uint32),
                            tl.load(c_ptr + 2 * N + i).to(tl.uint32),
                            tl.load(c_ptr + 3 * N + i).to(tl.uint32),
                            tl.load(c_ptr + 4 * N + i).to(tl.uint32),
                            tl.load(c_ptr + 5 * N + i).to(tl.uint32))
        tl.store(out_ptr + i, w0.to(tl.int64))
        tl.store(out_ptr + N + i, w1.to(tl.int64))


@pytest.mark.skipif(triton is None, reason="needs triton")
def test_the_kernels_philox_gives_the_known_answers_and_rngs_words():
    """``kernels._philox_words01`` (Triton code, as the GPU compiles it) against the known
    answers and :func:`rng.philox` on random words. In the interpreter the rest of the suite
    draws with numpy instead (``conftest._philox_in_numpy``); this runs the Triton code."""
    g = torch.Generator().manual_seed(11)
    n = 64
    c = torch.randint(0, 2**32, (6, n), generator=g)
    for j, (inputs, _) in enumerate(KAT):
        c[:, j] = torch.tensor(inputs)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(2, n, dtype=torch.int64, device=device)
    _words_kernel[(1,)](c.to(device), out, N=n)
    want = rng.philox(*c)
    assert out[0].cpu().tolist() == want[0].tolist()
    assert out[1].cpu().tolist() == want[1].tolist()
    assert out[:, :len(KAT)].T.cpu().tolist() == [[e[0], e[1]] for _, e in KAT]
