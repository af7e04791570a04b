"""Logprobs on the Triton path (``triton_backend/logprobs.py``) compute the torch backend's
values and ids (docs/semantics.md, Outputs): raw and processed modes mixed in one batch, the
fused, filtered and general paths, ties (lower id first), -inf entries, more logprobs than the
vocabulary, invalid requests, sample(), and the PyTorch path past 32. Values also against the
float64 reference.

On CPU the kernels run in Triton's interpreter (V <= 4096; 4000 gives two vocabulary splits).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import specsample
from specsample import SamplingBatch, SamplingParams, paths, reference

pytest.importorskip("specsample.triton_backend")

from test_triton_backend import DEVICE, _case, run_both  # noqa: E402

MIXED = [(None, "raw"), (0, "raw"), (3, "processed"), (5, "raw"), (0, "processed"),
         (2, "raw"), (1, "processed")]


def _with_logprobs(batch: SamplingBatch, lps, vocab: int) -> SamplingBatch:
    params = [SamplingParams(**{**p.__dict__, "logprobs": lps[i % len(lps)][0],
                                "logprobs_mode": lps[i % len(lps)][1]})
              for i, p in enumerate(batch.params)]
    n = len(params)
    return SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                     prompt_token_ids=[[1 % vocab, 2 % vocab]] * n,
                                     output_token_ids=[[2 % vocab, 5 % vocab]] * n)


def _both(logits, d, ks, batch, pos, extra=None, method="token"):
    """(Triton output, torch backend output, the Triton logprob path that ran)."""
    out, ref, _ = run_both(logits, d, ks, batch, pos, extra or {}, method)
    path = [p for p in paths.counts() if p.startswith("triton.logprobs")]
    return out, ref, path


def _sample_both(logits, batch, pos):
    """sample() on the Triton and the torch backend: (Triton output, torch output, the Triton
    call's path counts)."""
    outs = {}
    for backend in ("torch", "triton"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPECSAMPLE_BACKEND", backend)
            paths.reset()
            outs[backend] = specsample.sample(logits, batch, positions=pos, strict=False)
    return outs["triton"], outs["torch"], paths.counts()


def _assert_same(out, ref):
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    assert torch.equal(out.logprob_token_ids.cpu(), ref.logprob_token_ids.cpu()), (
        out.logprob_token_ids, ref.logprob_token_ids)
    a, b = out.logprobs.cpu(), ref.logprobs.cpu()
    assert torch.equal(torch.isinf(a), torch.isinf(b)), (a, b)
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("kind,method,processors,dtype,vocab", [
    ("onehot", "token", False, torch.bfloat16, 4000),
    ("onehot", "block", "filters", torch.float16, 150),
    ("onehot", "token", True, torch.float32, 4000),
    ("draft_logits", "block", False, torch.float32, 150),
    ("draft_logits", "token", "filters", torch.bfloat16, 4000),
    ("draft_probs", "token", True, torch.bfloat16, 150),
    ("draft_probs", "block", "filters", torch.float32, 4000),
])
def test_matches_torch_backend(kind, method, processors, dtype, vocab):
    logits, d, ks, batch0, pos, extra = _case(7, 7, vocab, dtype, kind, processors=processors)
    batch = _with_logprobs(batch0, MIXED, vocab)
    out, ref, path = _both(logits, d, ks, batch, pos, extra, method)
    assert path == ["triton.logprobs.fused"]
    _assert_same(out, ref)
    if processors is True:  # (raw top-n with the processing in the kernels: raw_topn_kernel)
        assert "triton.processing.fused" in paths.counts()


@pytest.mark.parametrize("kind,method,processors,dtype,vocab", [
    ("onehot", "token", False, torch.bfloat16, 4000),
    ("onehot", "block", "filters", torch.float16, 150),
    ("draft_logits", "token", "filters", torch.bfloat16, 300),
    ("draft_probs", "block", False, torch.float32, 300),
])
def test_logprobs_zero_written_with_the_tokens(kind, method, processors, dtype, vocab):
    # logprobs = 0 for every request that asks: the requests' finish (and the residual draw at a
    # redrawn correction) write column 0 from the statistics, unless a request in raw mode
    # (the default, also of requests not asking) needs a normaliser those do not give
    # (temperature other than 0 / 1, or a filtered batch: the fused kernels' path, tested
    # above).
    logits, d, ks, batch0, pos, extra = _case(11, 12, vocab, dtype, kind, processors=processors)
    mixes = [[(0, "processed"), (None, "processed")]]
    if not processors:
        mixes += [[(0, "raw"), (0, "processed")], [(0, "processed"), (None, "raw")]]
    for lps in mixes:
        batch = _with_logprobs(batch0, lps, vocab)
        raw_t = {p.temperature for p in batch.params if p.logprobs_mode == "raw"}
        in_finish = not raw_t or (not processors and raw_t <= {0.0, 1.0})
        out, ref, path = _both(logits, d, ks, batch, pos, extra, method)
        assert path == ["triton.logprobs.finish" if in_finish else "triton.logprobs.fused"]
        _assert_same(out, ref)
        # (a case that can fail: the columns 0 must be the emitted tokens with finite values)
        emitted = out.token_ids >= 0
        assert torch.equal(out.logprob_token_ids[..., 0], out.token_ids)
        assert torch.isfinite(out.logprobs[..., 0][emitted]).any()
        assert torch.isinf(out.logprobs[..., 0][~emitted]).all()
    # raw requests at temperatures 0 and 1 only, no filters: still written with the tokens
    params = [SamplingParams(**{**p.__dict__, "temperature": [0.0, 1.0][i % 2], "logprobs": 0,
                                "logprobs_mode": "raw", "top_k": 0, "top_p": 1.0,
                                "min_p": 0.0})
              for i, p in enumerate(batch0.params)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    out, ref, path = _both(logits, d, ks, batch, pos, extra, method)
    assert path == ["triton.logprobs.finish"]
    _assert_same(out, ref)


@pytest.mark.parametrize("n_top", [5, 20])
def test_ties_go_to_the_lower_id(n_top):
    # Logits from {0, 1, 2}: every top-n boundary falls inside a tie group, across splits.
    gen = torch.Generator().manual_seed(3)
    vocab = 4000
    logits = torch.randint(0, 3, (4, vocab), generator=gen).to(torch.bfloat16).to(DEVICE)
    params = [SamplingParams(temperature=t, seed=i, logprobs=n_top, logprobs_mode=mode, **kw)
              for i, (t, mode, kw) in enumerate([(1.0, "raw", {}), (0.7, "processed", {}),
                                                   (0.0, "raw", {}),
                                                   (0.9, "processed", dict(top_k=7))])]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    d = torch.empty(0, dtype=torch.int64, device=DEVICE)
    pos = torch.arange(4, device=DEVICE)
    out, ref, _ = _both(logits, d, [0] * 4, batch, pos)
    _assert_same(out, ref)
    x = logits.float().cpu()
    for i in range(3):  # unfiltered rows: the n largest by (value desc, id asc)
        want = sorted(range(vocab), key=lambda t: (-float(x[i, t]), t))[:n_top]
        assert out.logprob_token_ids[i, 0, 1:].tolist() == want
    # the top-k=7 row in processed mode: its 7 survivors, then dropped ids at -inf
    assert torch.isinf(out.logprobs[3, 0, 8:]).all()
    assert torch.isfinite(out.logprobs[3, 0, 1:8]).all()


def test_neg_inf_entries_and_more_logprobs_than_vocabulary():
    vocab = 3
    logits = torch.tensor([[0.5, -math.inf, 0.5], [-math.inf, 2.0, -math.inf]],
                          device=DEVICE)
    params = [SamplingParams(temperature=1.0, seed=1, logprobs=5),
              SamplingParams(temperature=0.5, seed=2, logprobs=2, logprobs_mode="processed")]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    d = torch.empty(0, dtype=torch.int64, device=DEVICE)
    out, ref, _ = _both(logits, d, [0, 0], batch, torch.arange(2, device=DEVICE))
    _assert_same(out, ref)
    assert out.logprob_token_ids[0, 0, 1:].tolist() == [0, 2, 1, -1, -1]
    assert out.logprob_token_ids[1, 0, 1:3].tolist() == [1, 0]
    assert out.logprobs[1, 0, 2].item() == -math.inf


@pytest.mark.parametrize("lps", [[(3, "raw"), (2, "processed")], [(0, "processed")]])
def test_invalid_requests_get_padding(lps):
    logits, d, ks, batch, pos, extra = _case(3, 5, 300, torch.float16, "onehot")
    batch = _with_logprobs(batch, lps, 300)
    logits[0, 5] = float("nan")
    logits[-1] = float("-inf")
    out, ref, _ = _both(logits, d, ks, batch, pos)
    _assert_same(out, ref)
    assert out.invalid.any()
    bad = out.invalid.nonzero().flatten()
    assert (out.logprob_token_ids[bad] == -1).all() and torch.isinf(out.logprobs[bad]).all()


@pytest.mark.parametrize("lps,modes,want", [
    ([0, 4, None], ["raw", "processed"], "triton.logprobs.fused"),
    ([0, None, 0], ["processed"], "triton.logprobs.finish"),  # logprobs = 0 with the tokens
])
def test_sample_matches_torch_backend(lps, modes, want):
    gen = torch.Generator().manual_seed(5)
    vocab = 4000
    logits = (torch.randn(6, vocab, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    params = [SamplingParams(temperature=[0.0, 0.8, 1.0][i % 3], seed=i,
                             logprobs=lps[i % 3], logprobs_mode=modes[i % len(modes)],
                             **([dict(top_p=0.9)] * 2 + [{}])[i % 3]) for i in range(6)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    out, ref, counts = _sample_both(logits, batch, torch.arange(6, device=DEVICE))
    assert want in counts
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    assert torch.equal(out.logprob_token_ids.cpu(), ref.logprob_token_ids.cpu())
    torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs.cpu(), atol=1e-5, rtol=1e-6)


def test_more_than_32_take_the_torch_path():
    logits, d, ks, batch, pos, extra = _case(4, 3, 200, torch.float32, "onehot")
    batch = _with_logprobs(batch, [(40, "raw"), (33, "processed")], 200)
    out, ref, path = _both(logits, d, ks, batch, pos)
    assert path == ["triton.logprobs.torch"]
    _assert_same(out, ref)


def test_values_match_the_float64_reference():
    logits, d, ks, batch, pos, extra = _case(11, 4, 4000, torch.float32, "draft_logits",
                                             processors="filters")
    batch = _with_logprobs(batch, [(4, "raw"), (3, "processed"), (0, "raw")], 4000)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMPLE_BACKEND", "triton")
        out = specsample.verify(logits, d, ks, batch, positions=pos, strict=False, **extra)
    ref = reference.verify(logits, d, ks, batch, positions=pos, **extra)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    assert torch.equal(out.logprob_token_ids.cpu(), ref.logprob_token_ids.cpu())
    a, b = out.logprobs.cpu().double(), ref.logprobs.cpu()
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a))
    assert float((a[fin] - b[fin]).abs().max()) <= 1e-5


def _rows_on_the_kernels(logits, params):
    """verify() without drafts of ``logits``' rows (one per request) on both backends: the Triton
    logprob kernels must serve them and agree with the torch backend. Returns the Triton
    output."""
    n, vocab = logits.shape
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    d = torch.empty(0, dtype=torch.int64, device=DEVICE)
    out, ref, path = _both(logits, d, [0] * n, batch, torch.arange(n, device=DEVICE))
    assert path == ["triton.logprobs.fused"]
    _assert_same(out, ref)
    return out


@pytest.mark.parametrize("n_top", [2, 3])
def test_tile_threshold_skips_no_candidate(n_top):
    # Four tiles; values from {0..9} so tile maxima tie with each other and with the n-th
    # value; filtered processed rows keep fewer tokens than n (the -inf tail, lowest ids).
    gen = torch.Generator().manual_seed(9)
    vocab = 8192
    logits = torch.randint(0, 10, (6, vocab), generator=gen).float()
    logits[1, 5000] = 30.0  # one dominant tile
    logits[2, :4096] -= 20.0  # the best values in the last two tiles only
    logits = logits.to(torch.bfloat16).to(DEVICE)
    cases = [(1.0, "raw", {}), (0.7, "raw", {}), (1.0, "processed", dict(top_k=1)),
             (0.8, "processed", dict(top_p=1e-6)), (0.0, "processed", dict(top_k=2)),
             (1.3, "processed", {})]
    params = [SamplingParams(temperature=t, seed=i, logprobs=n_top, logprobs_mode=mode, **kw)
              for i, (t, mode, kw) in enumerate(cases)]
    out = _rows_on_the_kernels(logits, params)
    assert torch.isinf(out.logprobs[2, 0, 2:]).all()  # top_k=1: one survivor, then -inf


@pytest.mark.parametrize("n_top", [3, 4, 32])
def test_top_n_from_the_best_ranked_tiles(n_top):
    # The kernels read only the n best tiles by (maximum, tile), tile of rank q for its best
    # n - q entries. Rows where that bound is tight: all of the top n in one tile, the tile
    # of rank 1 holding n - 1 of them, tile maxima tied (the lower tile ranks first), and
    # -0.0 tying +0.0 (the lower id first). With n = 32 the tied rows give more than 64
    # candidates (the merge then takes their best n one maximum at a time).
    vocab, tile = 8192, 2048
    x = torch.full((6, vocab), -5.0)
    x[0, 2 * tile + torch.arange(n_top) * 97] = 10.0 - 0.25 * torch.arange(n_top).float()
    x[1, 3 * tile + 5] = 20.0
    x[1, tile + torch.arange(n_top) * 31] = 19.0 - 0.25 * torch.arange(n_top).float()
    x[2] = torch.arange(vocab).remainder(7).float()  # max 6 in every tile, many times
    x[3, :] = -1.0
    x[3, 3 * tile + 1], x[3, tile + 7], x[3, 100] = 0.0, -0.0, -0.0
    x[4, tile - 1], x[4, tile] = 3.0, 3.0  # the top pair straddles a tile boundary
    x[5] = -torch.arange(vocab).float()  # descending: everything in tile 0
    logits = x.to(torch.bfloat16).to(DEVICE)
    cases = [(1.0, "raw", {}), (0.7, "raw", {}), (1.0, "processed", dict(top_k=2)),
             (0.8, "processed", {}), (0.0, "processed", {}), (1.0, "raw", dict(top_p=0.5))]
    params = [SamplingParams(temperature=t, seed=i, logprobs=n_top, logprobs_mode=mode, **kw)
              for i, (t, mode, kw) in enumerate(cases)]
    out = _rows_on_the_kernels(logits, params)
    ids = out.logprob_token_ids[:, 0, 1:].cpu()
    assert ids[0].tolist() == (2 * tile + torch.arange(n_top) * 97).tolist()
    assert ids[1].tolist() == [3 * tile + 5] + (tile + torch.arange(n_top - 1) * 31).tolist()
    dropped = [t for t in range(vocab) if t not in (6, 13)]
    assert ids[2].tolist() == ([6, 13] + dropped)[:n_top]  # top_k=2, then the rest by id
    assert ids[3, :3].tolist() == [100, tile + 7, 3 * tile + 1]
    assert ids[5].tolist() == list(range(n_top))


@pytest.mark.parametrize("vocab", [1, 2, 3, 2049])
def test_small_vocabularies_and_split_boundaries(vocab):
    # Constant, integer-valued and nearly all -inf rows: ties everywhere, n below, at and
    # above V (31, 32 with one, two or three tokens), filters keeping one token, the -inf
    # tail of processed rows; 2049 puts a one-token tile past a split.
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(0, 3, (6, vocab), generator=gen).float()
    x[0] = 0.0
    x[1] = -math.inf
    x[1, vocab // 2] = 1.0
    x[2, :vocab - 1] = -math.inf
    logits = x.to(torch.bfloat16).to(DEVICE)
    cases = [(1.0, "raw", 32, {}), (0.7, "processed", 31, {}),
             (0.0, "processed", 1, dict(top_k=2)), (0.9, "processed", 32, dict(top_k=1)),
             (0.5, "raw", 0, dict(min_p=0.999)), (1.3, "processed", 3, dict(top_p=1e-6))]
    params = [SamplingParams(temperature=t, seed=i, logprobs=n, logprobs_mode=mode, **kw)
              for i, (t, mode, n, kw) in enumerate(cases)]
    out = _rows_on_the_kernels(logits, params)
    ids = out.logprob_token_ids[:, 0, 1:].cpu()
    assert (ids[:, vocab:] == -1).all()  # more logprobs than the vocabulary: padding
    assert ids[0, :min(vocab, 32)].tolist() == list(range(min(vocab, 32)))  # constant row


def test_processed_ranks_by_the_exact_value():
    # Two float32 logits one ulp apart whose processed values (x - max) round together: the
    # larger logit ranks first (the float64 reference's order), not the lower id; the
    # PyTorch path past 32 ranks the same.
    vocab = 40
    x = torch.full((2, vocab), -5.0)
    x[:, 0] = 1000.0
    x[:, 3] = 0.1
    x[:, 5] = torch.nextafter(torch.tensor(0.1), torch.tensor(1.0))
    logits = x.to(DEVICE)
    d = torch.empty(0, dtype=torch.int64, device=DEVICE)
    pos = torch.arange(2, device=DEVICE)
    for n_top, want_path in ((3, "triton.logprobs.fused"), (33, "triton.logprobs.torch")):
        params = [SamplingParams(temperature=t, seed=1, logprobs=n_top,
                                 logprobs_mode="processed") for t in (1.0, 0.0)]
        batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
        paths.reset()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPECSAMPLE_BACKEND", "triton")
            out = specsample.verify(logits, d, [0, 0], batch, positions=pos, strict=False)
        assert [p for p in paths.counts() if p.startswith("triton.logprobs")] == [want_path]
        ref = reference.verify(logits, d, [0, 0], batch, positions=pos)
        assert torch.equal(out.logprob_token_ids.cpu(), ref.logprob_token_ids.cpu())
        assert out.logprob_token_ids[:, 0, 1:3].tolist() == [[0, 5], [0, 5]]


def test_many_requests_with_placeholders():
    # 20 requests, 0..4 drafts each with a -1 placeholder, block verification with
    # draft_probs; n of 0, 2 and 32 (and None) mixed with both modes.
    logits, d, ks, batch, pos, extra = _case(21, 20, 300, torch.float32, "draft_probs",
                                             placeholders=True)
    batch = _with_logprobs(batch, [(32, "processed"), (None, "raw"), (2, "raw"),
                                   (0, "processed"), (32, "raw")], 300)
    out, ref, path = _both(logits, d, ks, batch, pos, extra, "block")
    assert path == ["triton.logprobs.fused"]
    _assert_same(out, ref)


# Bans, logit_bias and penalties with logprobs: the kernels process the rows (no general
# path), column 0 in both modes, processed top-n and raw top-n (the raw tiles ranked apart:
# raw_topn_kernel). Each request sets the processors every other one.
PROCESSED_MIX = [(None, "raw"), (0, "raw"), (3, "processed"), (20, "processed"),
                 (4, "raw"), (1, "processed"), (5, "processed")]
PROCESSOR_SETS = {
    "bias": dict(logit_bias={3: 2.5, 7: -1.0, 2099: 4.0}),
    "penalties": dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3),
    "bans": dict(bad_words_token_ids=[[2, 11], [5]], min_tokens=5, stop_token_ids=[9]),
    # fewer tokens allowed than top-n asked: -inf entries, lowest ids first
    "allowed": dict(allowed_token_ids=[4, 40, 400, 2090]),
    "bans+filters": dict(bad_words_token_ids=[[2, 11], [5]], top_k=6, min_p=0.02),
    "all+filters": dict(logit_bias={3: 2.5, 1: 3.0}, presence_penalty=0.4,
                        repetition_penalty=1.2, bad_words_token_ids=[[5]], top_k=9,
                        top_p=0.8, min_p=0.01),
}


def _processed_case(seed, kind, name, vocab=2100, dtype=torch.bfloat16, lps=PROCESSED_MIX):
    logits, d, ks, batch0, pos, extra = _case(seed, 7, vocab, dtype, kind)
    # the tokens the processors touch among the likeliest: in the top-n, often emitted
    logits[:, [1, 2, 3, 5, 7, 11]] += 4.0
    params = [SamplingParams(**{**p.__dict__, **(PROCESSOR_SETS[name] if i % 2 else {}),
                                "logprobs": lps[i % len(lps)][0],
                                "logprobs_mode": lps[i % len(lps)][1]})
              for i, p in enumerate(batch0.params)]
    # outputs that the penalties count and that the bad word (2, 11) follows
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      prompt_token_ids=[[1, 3, 7]] * 7,
                                      output_token_ids=[[7, 3, 3, 2]] * 7)
    return logits, d, ks, batch, pos, extra


@pytest.mark.parametrize("name,kind,method", [
    ("bias", "onehot", "token"), ("penalties", "onehot", "token"), ("bans", "onehot", "token"),
    ("allowed", "onehot", "token"), ("all+filters", "onehot", "block"),
    ("all+filters", "draft_logits", "block"), ("penalties", "draft_probs", "token"),
    ("bans+filters", "draft_logits", "token"),
])
def test_processors_with_logprobs_on_the_kernels(name, kind, method):
    logits, d, ks, batch, pos, extra = _processed_case(21, kind, name)
    out, ref, path = _both(logits, d, ks, batch, pos, extra, method)
    assert path == ["triton.logprobs.fused"]
    assert "triton.processing.fused" in paths.counts()
    _assert_same(out, ref)
    assert torch.isfinite(out.logprobs[..., 1:]).any()
    if name == "allowed":  # 4 tokens allowed, 20 asked: the rest -inf from the lowest ids
        i = 3  # (processed, logprobs 20, allowed_token_ids)
        got = out.logprob_token_ids[i, 0].tolist()
        assert sorted(got[1:5]) == [4, 40, 400, 2090] and got[5:8] == [0, 1, 2]
    if name not in ("bias", "all+filters"):
        return
    # raw top-n alone, and more than 32 top-n (the general path), the same values
    for lps, general in (([(4, "raw"), (None, "raw")], False),
                         ([(33, "raw"), (2, "processed")], True)):
        batch2 = _processed_case(21, kind, name, lps=lps)[3]
        out, ref, path = _both(logits, d, ks, batch2, pos, extra, method)
        assert path == ["triton.logprobs.torch" if general else "triton.logprobs.fused"]
        assert ("triton.processing.fused" in paths.counts()) != general
        _assert_same(out, ref)


@pytest.mark.parametrize("name", ["bias", "bans"])
def test_sample_processors_with_logprobs(name):
    logits, _, _, batch, pos, _ = _processed_case(22, "onehot", name)
    out, ref, counts = _sample_both(logits[:7], batch, pos)
    assert {"triton.logprobs.fused", "triton.processing.fused"} <= set(counts)
    _assert_same(out, ref)


def _z_prime_tie(t: float):
    """Two float32 logits a < b (b one ulp above a) and a row maximum m whose (x - m) / t
    round to the same float32, or None."""
    a = torch.tensor(1.0)
    b = torch.nextafter(a, torch.tensor(2.0))
    for m in torch.linspace(1.5, 9.0, 400):
        za, zb = (a - m) / t, (b - m) / t
        if za == zb:
            return float(a), float(b), float(m)
    return None


@pytest.mark.parametrize("zrank", [True, False])
def test_processed_top_n_ranks_by_z_prime_with_bias(zrank):
    # With logit_bias (or penalties) processed top-n rank by z' = (z - m) / T: two logits one
    # ulp apart that T rounds together tie and go by id (docs/semantics.md). Power: ranking by
    # z (the bans-only rule) puts the larger logit, the higher id, first and fails.
    t = 3.0
    a, b, m = _z_prime_tie(t)
    vocab = 300
    row = torch.full((vocab,), -5.0)
    row[10], row[20], row[0] = a, b, m  # id 20 the larger logit, the same z' as id 10
    logits = row[None, :].to(DEVICE)
    params = [SamplingParams(temperature=t, seed=1, logprobs=3, logprobs_mode="processed",
                             logit_bias={250: 0.0, 251: -1.0})]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    d = torch.empty(0, dtype=torch.int64, device=DEVICE)
    with pytest.MonkeyPatch.context() as mp:
        if not zrank:
            from specsample.triton_backend import logprobs as lpk
            mp.setattr(lpk, "ranks_by_z_prime", lambda batch: False)
        out, ref, path = _both(logits, d, [0], batch, torch.arange(1, device=DEVICE))
    assert path == ["triton.logprobs.fused"]
    assert ref.logprob_token_ids[0, 0, 1:4].tolist() == [0, 10, 20]  # (the tie by id)
    assert (out.logprob_token_ids[0, 0, 1:4].tolist() == [0, 10, 20]) == zrank
    if zrank:
        _assert_same(out, ref)


@triton.jit
def _unprocessed_at(x, tok, req, j, live, pen, PENALTIES: tl.constexpr):
    return x


@triton.jit
def _unprocessed(x, offs, lo, hi, req, j, state, pen, PENALTIES: tl.constexpr):
    return x, state


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces kernel functions (Triton's interpreter)")
@pytest.mark.parametrize("name", ["penalties", "allowed"])
def test_processors_with_logprobs_fail_unprocessed(monkeypatch, name):
    # Power of test_processors_with_logprobs_on_the_kernels: with the logprob kernels reading
    # the raw values (the sampling still processed), column 0 or the top-n differ.
    from specsample.triton_backend import logprobs as lpk

    monkeypatch.setattr(lpk, "process_at", _unprocessed_at)
    monkeypatch.setattr(lpk, "process", _unprocessed)
    logits, d, ks, batch, pos, extra = _processed_case(21, "onehot", name)
    out, ref, _ = _both(logits, d, ks, batch, pos, extra, "token")
    with pytest.raises(AssertionError):
        _assert_same(out, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 262144])
@pytest.mark.parametrize("name,kind,method", [("all+filters", "onehot", "token"),
                                              ("bans", "draft_logits", "block"),
                                              ("penalties", "onehot", "block")])
def test_gpu_processors_with_logprobs(vocab, name, kind, method):
    # Real vocabularies: the torch backend's logprobs with the processing in the kernels, no
    # host synchronisation, and a captured call whose replays with new rows equal eager calls.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from specsample.bench import capture_graph

    logits, d, ks, batch, pos, extra = _processed_case(31, kind, name, vocab=vocab)
    out, ref, path = _both(logits, d, ks, batch, pos, extra, method)
    assert path == ["triton.logprobs.fused"]
    assert "triton.processing.fused" in paths.counts()
    _assert_same(out, ref)

    def call(x, q):
        return specsample.verify(x, d, ks, batch, positions=pos, method=method, strict=False,
                                 **({kind: q} if extra else {}))

    q0 = next(iter(extra.values()), None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call(logits, q0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static = {"x": logits.clone(), "q": None if q0 is None else q0.clone()}
    graph, graph_out = capture_graph(lambda: call(static["x"], static["q"]))
    gen = torch.Generator(device="cuda").manual_seed(32)
    for _ in range(2):
        x = (logits.float() + torch.randn(logits.shape, generator=gen, device="cuda")).to(
            logits.dtype)
        static["x"].copy_(x)
        graph.replay()
        eager = call(x, q0)
        torch.cuda.synchronize()
        for field in ("token_ids", "num_accepted", "logprobs", "logprob_token_ids"):
            assert torch.equal(getattr(graph_out, field), getattr(eager, field)), field


def test_raw_top_n_with_bias_ranks_the_raw_logits():
    # Raw top-n of a biased request rank the raw row, whose best tiles the processed
    # statistics do not rank first: the raw maxima sit in the last tiles, biased far down.
    # The processed top-n of the same rows differ, so ranking the processed tiles would fail.
    vocab = 3 * 2048 + 5
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, vocab, generator=gen)
    top = [6000, 6001, 4100, 4099]  # (ids in the last two tiles)
    x[:, top] = torch.tensor([9.0, 8.5, 8.0, 8.0])
    bias = {t: -30.0 for t in top}
    params = [SamplingParams(temperature=0.8, seed=1, logprobs=6, logit_bias=bias),
              SamplingParams(temperature=1.0, seed=2, logprobs=6, logprobs_mode="processed",
                             logit_bias=bias, top_k=3)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    d = torch.empty(0, dtype=torch.int64, device=DEVICE)
    out, ref, path = _both(x.to(DEVICE), d, [0, 0], batch, torch.arange(2, device=DEVICE))
    assert path == ["triton.logprobs.fused"]
    assert "triton.processing.fused" in paths.counts()
    _assert_same(out, ref)
    want_raw = sorted(range(vocab), key=lambda t: (-float(x[0, t]), t))[:6]
    assert want_raw[:4] == [6000, 6001, 4099, 4100]
    assert out.logprob_token_ids[0, 0, 1:].tolist() == want_raw
    raw_lp = torch.log_softmax(x[0].double(), -1)[want_raw]
    torch.testing.assert_close(out.logprobs[0, 0, 1:].cpu().double(), raw_lp, atol=1e-5,
                               rtol=0)
    assert not set(out.logprob_token_ids[1, 0, 1:4].tolist()) & set(top)


@pytest.mark.parametrize("n_top", [1, 2])
def test_z_prime_ranking_with_a_filter_ranks_the_filtered_tiles(n_top):
    # (found by review) Processed top-n with logit_bias and top_k: a dropped token (id 10,
    # tile 0) whose z rounds to the same z' as a survivor (id 2100, tile 1) must not take the
    # survivor's place: the tiles rank by the filtered row's maxima. Ranking the unfiltered
    # tile maxima gave [4200, 0] at n = 2.
    t = 3.0
    b, a, m = _z_prime_tie(t)  # (a one ulp above b, the same z')
    vocab = 3 * 2048
    row = torch.full((vocab,), -20.0)
    row[4200], row[2100], row[10] = m, a, b  # (top_k 2 keeps 4200 and 2100, the larger)
    params = [SamplingParams(temperature=t, seed=1, logprobs=n_top, logprobs_mode="processed",
                             logit_bias={6000: 0.0}, top_k=2)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    d = torch.empty(0, dtype=torch.int64, device=DEVICE)
    out, ref, path = _both(row[None].to(DEVICE), d, [0], batch, torch.arange(1, device=DEVICE))
    assert path == ["triton.logprobs.fused"]
    assert ref.logprob_token_ids[0, 0, 1:].tolist() == [4200, 2100][:n_top]
    _assert_same(out, ref)
