"""Review of the top-n logprobs from the best-ranked tiles (``triton_backend/logprobs.py``):
the grid of ``topn_partial_kernel`` and the general path's ranking, against the torch backend
(ids exactly, values within 1e-5) and the float64 reference.

The grid's size comes from the host's program target (4 on CPU); the tests pin it, so a CUDA
machine launches the same grid as the interpreter.
"""

from __future__ import annotations

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, paths, reference

triton_backend = pytest.importorskip("specsample.triton_backend")

from test_triton_backend import DEVICE  # noqa: E402
from test_triton_logprobs import _assert_same, _both  # noqa: E402

TILE = 2048


def _four_tiles(rows: int) -> torch.Tensor:
    """[rows, 8192] rows whose top 4 come from four tiles, ranked in tile order: 10 @ 0,
    9 @ 2048, 8 @ 4096 (and 7.5 @ 4097, the tile's second best), 7.75 @ 6144; -30 elsewhere.
    L (the maximum of the tile of rank 3) is 7.75, so each rank gives exactly its maximum."""
    x = torch.full((rows, 4 * TILE), -30.0)
    x[:, 0], x[:, TILE], x[:, 2 * TILE], x[:, 2 * TILE + 1] = 10.0, 9.0, 8.0, 7.5
    x[:, 3 * TILE] = 7.75
    return x


def _verify_chain(monkeypatch, temperature: float, mode: str = "raw", programs: int = 4,
                  beside: SamplingParams | None = None, **filters):
    """One request with 7 one-hot drafts (the argmax, id 0) over ``_four_tiles`` rows, top-4
    logprobs, optionally ``beside`` a request without drafts; with ``programs`` per device
    (4, or 8 for two requests): 4 normaliser splits (S) and 8 positions per request, so two
    ranks per program (G = 2: program q takes ranks q and q + 2)."""
    monkeypatch.setattr(triton_backend, "_num_programs_target", lambda dev: programs)
    k = 7
    params = [SamplingParams(temperature=temperature, seed=3, logprobs=4, logprobs_mode=mode,
                             **filters)] + ([beside] if beside else [])
    logits = _four_tiles(k + len(params)).to(DEVICE)
    d = torch.zeros(k, dtype=torch.int64, device=DEVICE)
    batch = SamplingBatch.from_params(params, vocab_size=logits.shape[1], device=DEVICE)
    pos = torch.zeros(len(params), dtype=torch.int64, device=DEVICE)
    out, ref, path = _both(logits, d, [k] + [0] * (len(params) - 1), batch, pos)
    assert path == ["triton.logprobs.fused"]
    return out, ref


def test_two_ranks_per_program(monkeypatch):
    # Greedy (the sampling statistics give the raw normaliser: only G programs per position):
    # every draft accepted, 8 emitted positions, each needing ranks 0..3 from two programs.
    out, ref = _verify_chain(monkeypatch, 0.0)
    assert out.num_accepted.tolist() == [7]
    _assert_same(out, ref)
    assert out.logprob_token_ids[0, :, 1:].tolist() == [[0, TILE, 2 * TILE, 3 * TILE]] * 8


@pytest.mark.parametrize("case", ["raw T=0.5", "raw T=1 top_k=2", "processed beside raw T=0.7"])
def test_ranks_are_extracted_once_when_splits_outnumber_programs(monkeypatch, case):
    # The partial kernel's grid is max(G, S) programs per position when a raw normaliser is
    # needed: only programs q < G extract ranks (found by review: programs q >= G repeated
    # ranks, giving duplicate ids and candidate counts past CAND).
    if case == "raw T=0.5":
        out, ref = _verify_chain(monkeypatch, 0.5)
    elif case == "raw T=1 top_k=2":
        out, ref = _verify_chain(monkeypatch, 1.0, top_k=2)
    else:  # the raw request (no top-n) asks for the raw normaliser's splits
        out, ref = _verify_chain(monkeypatch, 0.7, "processed", programs=8,
                                 beside=SamplingParams(temperature=0.7, seed=4, logprobs=0))
    assert ref.logprob_token_ids[0, 0, 1:].tolist() == [0, TILE, 2 * TILE, 3 * TILE]
    _assert_same(out, ref)


def _general_rows(params):
    """Two requests without drafts (``params``: bans, bias or penalties, which took the general
    path when these tests were written; the kernels process them now) over rows where z' rounds
    two logits together: 1000 @ 0, 0.1 @ 3 and the next float above it @ 5, -5 elsewhere
    (V = 40): (Triton output, torch backend output, the logprob path, the float64 reference's)."""
    x = torch.full((2, 40), -5.0)
    x[:, 0], x[:, 3] = 1000.0, 0.1
    x[:, 5] = torch.nextafter(torch.tensor(0.1), torch.tensor(1.0))
    logits, d = x.to(DEVICE), torch.empty(0, dtype=torch.int64, device=DEVICE)
    batch = SamplingBatch.from_params(params, vocab_size=40, device=DEVICE)
    assert batch.needs_general_path
    pos = torch.arange(2, device=DEVICE)
    out, ref, path = _both(logits, d, [0, 0], batch, pos)
    return out, ref, path, reference.verify(logits, d, [0, 0], batch, positions=pos)


@pytest.mark.parametrize("n_top", [3, 33])  # the kernels; the PyTorch path past 32
def test_general_path_with_bans_ranks_processed_top_n_by_the_exact_value(n_top):
    # bad words only: no logit_bias / penalties, so the exact order holds (found by review:
    # the Triton general path ranked by z'; its top-n now take the PyTorch path, which
    # ranks by the raw logits)
    out, ref, _, want = _general_rows([
        SamplingParams(temperature=1.0, seed=1, logprobs=n_top, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, seed=2, logprobs=3, logprobs_mode="processed",
                       bad_words_token_ids=[[7]])])
    assert want.logprob_token_ids[:, 0, 1:4].tolist() == [[0, 5, 3]] * 2
    assert torch.equal(ref.logprob_token_ids.cpu(), want.logprob_token_ids.cpu())
    _assert_same(out, ref)  # (on either logprob path: a fix may change it)


def test_general_path_with_bias_ranks_by_z_prime():
    # With logit_bias the backends rank by z' (semantics.md), so the same pair goes by id;
    # the kernels process the rows and serve processed and raw top-n (the raw tiles ranked
    # apart, raw_topn_kernel); past 32 top-n the general path's PyTorch code.
    for second, n2, want_path in (("processed", 2, "triton.logprobs.fused"),
                                  ("raw", 2, "triton.logprobs.fused"),
                                  ("raw", 33, "triton.logprobs.torch")):
        out, ref, path, _ = _general_rows([
            SamplingParams(temperature=1.0, seed=1, logprobs=3, logprobs_mode="processed"),
            SamplingParams(temperature=0.5, seed=2, logprobs=n2, logprobs_mode=second,
                           logit_bias={7: -1.0})])
        assert path == [want_path]
        _assert_same(out, ref)
        assert out.logprob_token_ids[0, 0, 1:4].tolist() == [0, 3, 5]


def test_sample_with_one_token_tiles_and_ties(monkeypatch):
    # sample() over 6145 tokens (a last tile of one token): the last token alone at the
    # maximum, a constant row (ties: lowest ids), and a row of {0, 1} with n = 1 and 32.
    vocab = 3 * TILE + 1
    gen = torch.Generator().manual_seed(11)
    x = torch.randint(0, 2, (4, vocab), generator=gen).float()
    x[0, :] = -1.0
    x[0, vocab - 1] = 2.0
    x[1, :] = 0.0
    logits = x.to(torch.float16).to(DEVICE)
    cases = [(1.0, "raw", 32, {}), (0.5, "processed", 32, dict(top_k=1)),
             (2.0, "raw", 1, {}), (0.7, "processed", 32, dict(min_p=1.0))]
    params = [SamplingParams(temperature=t, seed=i, logprobs=n, logprobs_mode=mode, **kw)
              for i, (t, mode, n, kw) in enumerate(cases)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    pos = torch.arange(4, device=DEVICE)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    ref = specsample.sample(logits, batch, positions=pos, strict=False)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    paths.reset()
    out = specsample.sample(logits, batch, positions=pos, strict=False)
    assert [p for p in paths.counts() if p.startswith("triton.logprobs")] == [
        "triton.logprobs.fused"]
    _assert_same(out, ref)
    ids = out.logprob_token_ids.cpu()
    assert ids[0, 1:].tolist() == [vocab - 1] + list(range(31))
    assert ids[1, 1:].tolist() == list(range(32))
    assert torch.isinf(out.logprobs[1, 2:]).all()  # top_k=1: one survivor, then -inf
