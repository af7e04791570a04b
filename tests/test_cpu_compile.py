"""The torch backend's compiled CPU functions (specsample.cpu_compile) against their eager form.

The rest of the suite runs the same functions uncompiled (conftest.py); here compilation is
on, and every compiled result must be the eager one: the same tokens, accepted counts and
invalid flags for verify() and sample() over the shape classes torch.compile distinguishes
(one row, which is passed twice; a vocabulary below one tile, a multiple of it, with a
remainder), mixed greedy / sampled batches, invalid requests, -inf logits, placeholders,
filters (threshold cuts and cuts inside a tie group), penalties, bias, bans, logprobs, the
residual draws of draft probabilities (the compiled three-level draw), logits dtypes and
autograd / inference modes mixed in one process. Tokens never depend on the other requests
(guarantee 3, at constructed near-ties). A chi-square test checks the compiled draw's law
against the softmax, with a power check; compile failures fall back eagerly, counted and
warned.

All tests share one xdist group: each function variant and shape class compiles once
(20-60 s on 2 cores with an empty Inductor cache), and later tests reuse it; the file compiles
23 graphs (and five small ones of its own). Split over two workers, the halves compiled more
between them than the file does in one process.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specsample import SamplingBatch, SamplingParams, cpu_compile, paths, rng, sample, verify
from specsample import torch_backend as tb

pytestmark = pytest.mark.xdist_group("cpu_compile")


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    monkeypatch.setattr(cpu_compile, "ENABLED", True)
    paths.reset()
    yield
    paths.reset()


def _outputs_equal(a, b) -> None:
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.invalid, b.invalid)


def _case(n: int, k: int, v: int, seed: int, **options):
    g = torch.Generator().manual_seed(seed)
    temps = [0.0 if (i + seed) % 3 == 0 else 0.5 + 0.4 * i for i in range(n)]
    params = [SamplingParams(temperature=t, seed=seed * 100 + i, **options)
              for i, t in enumerate(temps)]
    batch = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=[[1, 2]] * n,
                                      output_token_ids=[[3]] * n)
    logits = torch.randn(n * (k + 1), v, generator=g) * 2
    if seed % 4 == 1:
        logits[0, 5] = float("nan")  # request 0 invalid
    if seed % 4 == 2:
        logits[:, ::2] = -torch.inf
    if seed % 2:  # drafts that match (long accepted runs), else random ones
        drafts = logits.nan_to_num(0).view(n, k + 1, v)[:, :k].argmax(-1).reshape(-1)
    else:
        drafts = torch.randint(0, v, (n * k,), generator=g)
    if seed % 5 == 3 and k:
        drafts[0] = -1  # a placeholder
    return logits, drafts, batch, torch.randint(0, 2**33, (n,), generator=g)


SHAPES = [(1, 4, 49152), (1, 0, 49152), (3, 2, 1000), (2, 3, 6144), (4, 1, 5000),
          (1, 2, 100), (2, 0, 3000)]


@pytest.mark.parametrize("n,k,v", SHAPES)
def test_temperature_only_verify_matches_eager(n, k, v):
    matched = 0  # (batches with drafts and no greedy request draw and match in one call)
    for seed in range(6):
        logits, drafts, batch, pos = _case(n, k, v, seed)
        matched += k > 0 and batch.num_greedy == 0
        a = verify(logits, drafts, [k] * n, batch, positions=pos, strict=False)
        with cpu_compile.disabled():
            b = verify(logits, drafts, [k] * n, batch, positions=pos, strict=False)
        _outputs_equal(a, b)
    counts = paths.counts()
    calls = {f: counts.get(f"cpu.compiled.{f}", {}).get("calls", 0)
             for f in ("matched_rows", "processed_rows")}
    assert sum(calls.values()) >= 3  # (not all-greedy batches)
    assert calls["matched_rows"] == matched
    assert "cpu.compiled.draw" not in counts  # (one compiled function did all the draws)


def test_sample_matches_eager():
    for n, v in [(1, 49152), (5, 3000), (2, 100)]:
        logits, _, batch, pos = _case(n, 0, v, 7)
        a = sample(logits, batch, positions=pos).token_ids
        with cpu_compile.disabled():
            b = sample(logits, batch, positions=pos).token_ids
        assert torch.equal(a, b)
    assert paths.counts()["cpu.compiled.processed_rows"]["calls"] == 3


OPTIONS = [{"top_p": 0.9, "top_k": 40}, {"top_p": 0.5}, {"min_p": 0.05}, {"top_k": 3},
           {"repetition_penalty": 1.3, "presence_penalty": 0.5},
           {"logit_bias": {7: 3.0, 99: -100.0}, "frequency_penalty": 0.4, "top_p": 0.8},
           {"bad_words_token_ids": [[3]], "min_p": 0.2}]


@pytest.mark.parametrize("options", OPTIONS)
def test_processed_rows_match_eager(options):
    """Filters, penalties, bias and bans in the compiled pass (the cut and the processed rows
    from the eager code, applied on the fly), at vocabularies of 3,000 and 5,000: each
    further size class is a compilation of 20-60 s on 2 cores. The other classes are
    covered by test_temperature_only_verify_matches_eager and test_matched_rows_shape_
    classes_in_one_process; the candidates' functions at a real vocabulary (49,152: their
    groups of blocks) by the latter and test_one_row_sample_is_its_row_in_a_batch, at 4,096
    by the two near-tie tests."""
    shapes = [(2, 3, 5000), (3, 2, 3000)]
    for n, k, v in shapes:
        for seed in (0, 1, 2, 3):
            logits, drafts, batch, pos = _case(n, k, v, seed, **options)
            a = verify(logits, drafts, [k] * n, batch, positions=pos, strict=False)
            with cpu_compile.disabled():
                b = verify(logits, drafts, [k] * n, batch, positions=pos, strict=False)
            _outputs_equal(a, b)
    counts = paths.counts()
    assert counts["cpu.compiled.processed_rows"]["calls"] > 0
    assert counts["cpu.eager.processed_rows"]["calls"] > 0  # (the disabled() runs)


def test_tie_split_by_a_filter():
    """A top_k boundary inside a tie group (not a threshold): the cut's id rule applies inside
    the compiled pass too."""
    logits, drafts, batch, pos = _case(2, 2, 3000, 2, top_k=3)
    logits = logits.nan_to_num(0.0).round()  # (many ties)
    logits[:, 10:13] = 9.0
    logits[:, 20:22] = 8.0
    logits[1::3, 10] = 7.0  # (these rows keep 11, 12, then the lower id of the tied 8.0s)
    for seed in range(8):
        p = pos + seed
        a = verify(logits, drafts, [2, 2], batch, positions=p, strict=False)
        with cpu_compile.disabled():
            b = verify(logits, drafts, [2, 2], batch, positions=p, strict=False)
        _outputs_equal(a, b)
        assert 21 not in a.token_ids[:, :1].tolist()  # (request 0's row 0: id 21 dropped)
    # (request 0's rows are drawn from their candidates, greedy request 1's by the pass)
    counts = paths.counts()
    assert counts["cpu.compiled.candidate_rows"]["calls"] == 8
    assert "cpu.candidates_missed" not in counts


def test_tokens_never_depend_on_the_other_requests():
    """Guarantee 3 with compilation on: a seeded request's token is the same whatever the
    other requests ask (logprobs need z' itself; a filter; a gradient). Near-ties make any
    difference between two ways of computing the draw show: 801 requests with one seed and
    position whose rows differ only by tile 1 moved in steps of 2e-8."""
    v, n, seed, position = 4096, 801, 12345, 77
    g = torch.Generator().manual_seed(5)
    row = torch.randn(v, generator=g)
    row[3] = 5.0  # (the row max in tile 0: moving tile 1 moves only its own log-sum-exp)
    lo, hi = torch.tensor([seed]), torch.tensor([0])
    noise = rng.gumbel(lo, hi, torch.tensor([position]), torch.arange(2), rng.STREAM_SAMPLE_TILE)
    lse = tb.tile_logsumexp(row[None] - 5.0)[0].double()
    tie = float(lse[0] + noise[0] - lse[1] - noise[1])  # tile 1's shift that ties the keys
    logits = row.repeat(n, 1)
    # about 30 float32 ulps of tile 1's log-sum-exp around the tie: the drawn tile flips
    logits[:, 2048:] += tie + (torch.arange(n)[:, None] - n // 2) * 2e-8
    plain = [SamplingParams(temperature=1.0, seed=seed)] * n
    pos = torch.full((n,), position)

    def tokens(extra: SamplingParams | None, x: torch.Tensor) -> torch.Tensor:
        params = plain + ([extra] if extra else [])
        rows = torch.cat([x, x[:1]]) if extra else x
        p = torch.cat([pos, pos[:1]]) if extra else pos
        return sample(rows, SamplingBatch.from_params(params, vocab_size=v),
                      positions=p).token_ids[:n]

    alone = tokens(None, logits)
    assert 0 < int((alone >= 2048).sum()) < n  # (both tiles drawn: the sweep crosses the tie)
    assert torch.equal(alone, tokens(SamplingParams(temperature=0.5, seed=1, logprobs=0),
                                     logits))
    assert torch.equal(alone, tokens(SamplingParams(temperature=0.5, seed=1, top_k=2),
                                     logits))
    assert torch.equal(alone, tokens(None, logits.clone().requires_grad_(True)))


def test_matched_tokens_are_the_sampled_ones():
    """One-hot verify of sampled requests draws and matches in one compiled call
    (``matched_rows``); every other batch draws with ``processed_rows``. Both must give each
    row the same token, at constructed near-ties (as above: rows whose tile 1 moves across
    the tie of the tile keys in steps of 2e-8), with and without a filter cut in the batch,
    and the match must be the prefix rule."""
    v, n, seed, position = 4096, 401, 12345, 77
    g = torch.Generator().manual_seed(5)
    row = torch.randn(v, generator=g)
    row[3] = 5.0
    lo, hi = torch.tensor([seed]), torch.tensor([0])
    noise = rng.gumbel(lo, hi, torch.tensor([position]), torch.arange(2), rng.STREAM_SAMPLE_TILE)
    lse = tb.tile_logsumexp(row[None] - 5.0)[0].double()
    tie = float(lse[0] + noise[0] - lse[1] - noise[1])
    x = row.repeat(n, 1)
    x[:, 2048:] += tie + (torch.arange(n)[:, None] - n // 2) * 2e-8
    # request i: its draft row is x[i] at the position, its bonus row x[i] at position + 1
    logits = torch.stack([x, x], 1).reshape(2 * n, v)
    pos = torch.full((n,), position)
    drafted = sample(x, SamplingBatch.from_params([SamplingParams(temperature=1.0, seed=seed)]
                                                  * n, vocab_size=v), positions=pos).token_ids
    assert 0 < int((drafted >= 2048).sum()) < n  # (the sweep crosses the tie)
    drafts = torch.where(torch.arange(n) % 3 == 0, (drafted + 1) % v, drafted)  # some wrong

    def run(extra: SamplingParams | None, **options):
        params = [SamplingParams(temperature=1.0, seed=seed, **options)] * n
        rows, d, p = logits, drafts, pos
        if extra:
            params = params + [extra]
            rows, d, p = torch.cat([logits, logits[:2]]), torch.cat([d, d[:1]]), torch.cat(
                [pos, pos[:1]])
        paths.reset()
        out = verify(rows, d, [1] * len(params), SamplingBatch.from_params(
            params, vocab_size=v), positions=p)
        return out, paths.counts()

    matched, counts = run(None)
    assert counts["cpu.compiled.matched_rows"]["calls"] == 1
    alone = sample(logits, SamplingBatch.from_params(
        [SamplingParams(temperature=1.0, seed=seed)] * (2 * n), vocab_size=v),
        positions=torch.stack([pos, pos + 1], 1).reshape(-1)).token_ids.view(n, 2)
    ok = drafts == alone[:, 0]
    assert torch.equal(matched.num_accepted, ok.long())
    assert torch.equal(matched.token_ids, torch.where(ok[:, None], alone, torch.stack(
        [alone[:, 0], torch.full((n,), -1)], 1)))
    for extra, options in [(SamplingParams(temperature=0.0), {}),  # (a greedy request)
                           (SamplingParams(temperature=0.5, seed=1, logprobs=0), {}),
                           (SamplingParams(temperature=0.5, seed=1, top_k=2), {})]:
        out, counts = run(extra, **options)
        assert "cpu.compiled.matched_rows" not in counts or extra.top_k
        assert torch.equal(out.token_ids[:n], matched.token_ids)
    out, counts = run(None, top_k=4000)  # (a cut that keeps nearly everything: the rows'
    assert counts["cpu.compiled.matched_candidates"]["calls"] == 1  # candidates miss it)
    assert counts["cpu.candidates_missed"]["rows"] == 2 * n


def test_logprobs_keep_the_eager_processing():
    """With logprobs z' itself is built (eagerly); the tokens still come from the compiled
    pass."""
    logits, drafts, batch, pos = _case(2, 2, 5000, 1, top_p=0.9, logprobs=3)
    a = verify(logits, drafts, [2, 2], batch, positions=pos, strict=False)
    with cpu_compile.disabled():
        b = verify(logits, drafts, [2, 2], batch, positions=pos, strict=False)
    _outputs_equal(a, b)
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.logprob_token_ids,
                                                              b.logprob_token_ids)
    assert paths.counts()["cpu.compiled.processed_rows"]["calls"] == 1
    assert "cpu.compiled.draw" not in paths.counts()


def test_residual_draws_compiled():
    """Draft probabilities: the residual distribution's draw runs compiled."""
    n, k, v = 3, 3, 5000
    g = torch.Generator().manual_seed(3)
    for seed in range(4):
        logits, _, batch, pos = _case(n, k, v, seed + 8)
        q = torch.softmax(torch.randn(n * k, v, generator=g) * 2, -1)
        drafts = torch.multinomial(q, 1, generator=g).squeeze(1)
        a = verify(logits, drafts, [k] * n, batch, positions=pos, draft_probs=q, strict=False)
        with cpu_compile.disabled():
            b = verify(logits, drafts, [k] * n, batch, positions=pos, draft_probs=q,
                       strict=False)
        _outputs_equal(a, b)
    assert paths.counts()["cpu.compiled.draw"]["calls"] > 0


def test_draw_edge_rows():
    """Rows with -inf tiles, one finite token, a single tile, and every row -inf."""
    v = 5000
    z = torch.full((4, v), -torch.inf)
    z[0, 4999] = 0.0  # only the last (partial) tile
    z[1, :2048] = torch.linspace(-3, 0, 2048)  # only tile 0
    z[2, 100] = 0.0
    z[2, 4500] = -0.5
    seeds = torch.arange(4) * 977
    for pos in range(20):
        p = torch.full((4,), pos)
        a = tb.tiled_gumbel_argmax(z, None, seeds, seeds + 1, p, 0, 5)
        with cpu_compile.disabled():
            b = tb.tiled_gumbel_argmax(z, None, seeds, seeds + 1, p, 0, 5)
        assert torch.equal(a, b)
        assert a[0] == 4999 and a[1] < 2048 and a[2] in (100, 4500) and 0 <= a[3] < v


def test_law_of_the_compiled_draw():
    """Chi-square of 24,000 compiled draws (sample(), V = 5,000: three tiles, one partial)
    against softmax(z / T); the same test must reject the law at a wrong temperature."""
    v, temperature, n = 5000, 0.7, 4000
    g = torch.Generator().manual_seed(11)
    row = torch.full((v,), -6.0)  # (a tail of about 5% of the mass, over every tile)
    hot = torch.randperm(v, generator=g)[:12]  # spread over the tiles
    row[hot] = torch.randn(12, generator=g)
    logits = row.expand(n, v).contiguous()
    law = torch.softmax(row.double() / temperature, -1).numpy()

    def counts(t: float) -> np.ndarray:
        batch = SamplingBatch.from_params(
            [SamplingParams(temperature=t, seed=5000 + i) for i in range(n)], vocab_size=v)
        out = np.zeros(v, dtype=np.int64)
        for step in range(6):
            tok = sample(logits, batch, positions=torch.full((n,), step * 7)).token_ids
            out += np.bincount(tok.numpy(), minlength=v)
        return out

    def pvalue(observed: np.ndarray) -> float:
        keep = law * observed.sum() >= 5  # the hot tokens; the tail pooled into one bin
        f_obs = np.append(observed[keep], observed[~keep].sum())
        f_exp = np.append(law[keep], law[~keep].sum()) * observed.sum()
        assert f_exp.min() >= 5
        return float(stats.chisquare(f_obs, f_exp).pvalue)

    assert pvalue(counts(temperature)) > 1e-3
    assert pvalue(counts(1.0)) < 1e-6  # power: a sampler that ignored T = 0.7
    assert paths.counts()["cpu.compiled.processed_rows"]["calls"] == 12


def test_switches_and_gradients():
    logits, drafts, batch, pos = _case(2, 2, 3000, 4)
    with cpu_compile.disabled():
        verify(logits, drafts, [2, 2], batch, positions=pos)
    assert "cpu.eager.matched_rows" in paths.counts()  # (sampled requests, one-hot drafts)
    assert not any(k.startswith("cpu.compiled") for k in paths.counts())
    paths.reset()
    # logits that need a gradient: the tokens, integer results of detached values, are
    # still drawn by the compiled function
    leaf = logits.clone().requires_grad_(True)
    a = verify(leaf, drafts, [2, 2], batch, positions=pos)
    _outputs_equal(a, verify(logits, drafts, [2, 2], batch, positions=pos))
    assert paths.counts()["cpu.compiled.matched_rows"]["calls"] == 2


def test_compile_failure_falls_back(monkeypatch):
    monkeypatch.setattr(cpu_compile, "_failed", {})

    def broken(name, fn):
        def run(*args):
            raise RuntimeError("no C++ compiler here")
        return run

    monkeypatch.setattr(cpu_compile, "_compiled_fn", broken)
    logits, drafts, batch, pos = _case(2, 2, 3000, 4)
    with pytest.warns(RuntimeWarning, match="no C.. compiler here"):
        a = verify(logits, drafts, [2, 2], batch, positions=pos)
    with cpu_compile.disabled():
        b = verify(logits, drafts, [2, 2], batch, positions=pos)
    _outputs_equal(a, b)
    assert "matched_rows[float32][nocut]" in cpu_compile.failures()
    assert paths.counts()["cpu.compile_failed.matched_rows"]["calls"] == 1
    # later calls of the same variant run eagerly without trying again
    verify(logits, drafts, [2, 2], batch, positions=pos)
    assert paths.counts()["cpu.compile_failed.matched_rows"]["calls"] == 2


def test_modes_and_dtypes_mixed_in_one_process():
    """Grad mode, no_grad, inference_mode and two logits dtypes in one process: each
    (dtype, inference tensor or not) compiles apart, so no mix exhausts torch.compile's
    limit of 8 recompilations per function (which once made it fail for good), and every
    result is the eager one."""
    base, drafts, batch, pos = _case(3, 2, 3000, 7, min_p=0.05)  # (a threshold cut)
    # (each (dtype, inference tensor or not) is a compilation of 20-45 s on 2 cores: float32
    # in every mode, bfloat16 without gradients; float16 rows take bfloat16's upcast)
    for dtype, modes in ((torch.float32, ("grad", "no_grad", "inference")),
                         (torch.bfloat16, ("no_grad",))):
        for mode in modes:
            logits = base.nan_to_num(0.0).to(dtype)
            ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
                   "inference": torch.inference_mode}[mode]
            with ctx():
                a = verify(logits.clone(), drafts, [2] * 3, batch, positions=pos)
            with cpu_compile.disabled():
                b = verify(logits, drafts, [2] * 3, batch, positions=pos)
            _outputs_equal(a, b)
    assert cpu_compile.failures() == {}
    counts = paths.counts()
    assert counts["cpu.compiled.processed_rows"]["calls"] == 4
    assert not any(k.startswith("cpu.compile_failed") for k in counts)


def test_matched_rows_shape_classes_in_one_process():
    """One-hot verify over the shapes the compiled match distinguishes (one request, one
    draft, with and without a cut, vocabularies with a partial tile and multiples of it), in
    one process: no variant runs out of torch.compile's recompilations, and every result is
    the eager one. (Vocabularies below one tile, 20-45 s of compilation per function on 2
    cores, are covered without a cut by test_temperature_only_verify_matches_eager.)"""
    for n, k, v in [(1, 1, 3000), (1, 4, 49152), (2, 1, 2500), (3, 2, 6144), (4, 3, 5000),
                    (2, 2, 5500), (5, 1, 4096)]:
        for options in ({}, {"top_k": 5}, {"min_p": 0.1}):
            logits, drafts, batch, pos = _case(n, k, v, 1, **options)
            batch = SamplingBatch.from_params(
                [SamplingParams(temperature=0.9, seed=i, **options) for i in range(n)],
                vocab_size=v)
            a = verify(logits, drafts, [k] * n, batch, positions=pos, strict=False)
            with cpu_compile.disabled():
                b = verify(logits, drafts, [k] * n, batch, positions=pos, strict=False)
            _outputs_equal(a, b)
    assert cpu_compile.failures() == {}
    counts = paths.counts()
    assert counts["cpu.compiled.matched_rows"]["calls"] == 14
    # (top_k: every row drawn from its candidates; request 0's NaN row, zeroed, is not read)
    assert counts["cpu.compiled.matched_candidates"]["calls"] == 7
    assert "cpu.compiled.processed_rows" not in counts


def test_one_row_and_one_draft_compile_nothing_new():
    """A single row (one request without drafts under a fixed max_num_draft_tokens) is padded
    like a single request: no graph of its own (torch.compile would specialise the size 1);
    and with one draft the padded grid's tokens come back contiguous."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    v = 3000
    g = torch.Generator().manual_seed(3)

    def call(n, ks, **kw):
        batch = SamplingBatch.from_params([SamplingParams(temperature=0.9, seed=i)
                                           for i in range(n)], vocab_size=v)
        logits = torch.randn(n + sum(ks), v, generator=g)
        drafts = torch.randint(0, v, (sum(ks),), generator=g)
        return verify(logits, drafts, ks, batch, positions=torch.arange(n), **kw)

    call(2, [2, 2])
    fn = cpu_compile._compiled["matched_rows[float32][nocut]"]
    entries = len(_debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__))
    out = call(1, [0], max_num_draft_tokens=2)
    assert out.token_ids.shape == (1, 3) and int(out.token_ids[0, 1]) == -1
    assert len(_debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__)) == entries
    out = call(3, [1, 1, 1])
    assert out.token_ids.is_contiguous() and out.token_ids.shape == (3, 2)


def _scaled_argmax(x: torch.Tensor, a: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """A small row function for the one-row protocol: x [R, V], a [R, 2], streams [3]."""
    return (x * a[:, 0:1] + a[:, 1:2]).argmax(1) + streams[0]


_PADS = []


def _pad_two(args: tuple) -> tuple:
    _PADS.append(args[0].shape[0])
    x, a, *rest = args
    a2 = torch.cat([a, a])
    torch._dynamo.mark_static(a2, 1)
    return (torch.cat([x, x]), a2, *rest)


def _row_call(name: str, r: int, seed: int, v: int = 300) -> tuple[torch.Tensor, tuple]:
    g = torch.Generator().manual_seed(seed)
    x, a = torch.randn(r, v, generator=g), torch.rand(r, 2, generator=g) + 0.5
    streams = torch.tensor([7, 0, 0])
    torch._dynamo.mark_static(a, 1)
    torch._dynamo.mark_static(streams, 0)
    args = (x, a, streams)
    out = cpu_compile.call(name, _scaled_argmax, *args, rows=r, pad=_pad_two)
    return out[:r], args


def test_one_row_runs_the_graph_compiled_for_many(monkeypatch):
    """A function called with ``pad``: its first one-row call goes padded to two rows (and
    compiles a graph for every row count), later one-row calls run that graph unpadded and
    compile nothing. A one-row call that compiles all the same (a setting the guards check
    changed: the number of threads; or, simulated, any compilation during the call) drops the
    function's compiled form, is made again padded, counted, and one row goes padded at that
    vocabulary size from then on."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    name = "one_row_test"
    _PADS.clear()
    for r, seed in ((1, 0), (3, 1), (1, 2), (2, 3), (1, 4)):
        got, args = _row_call(name, r, seed)
        assert torch.equal(got, _scaled_argmax(*args)), (r, seed)
    assert _PADS == [1]  # (the first call only)
    fn = cpu_compile._compiled[name]
    assert len(_debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__)) == 1
    counts = paths.counts()
    assert counts[f"cpu.compiled.{name}"] == {"calls": 5, "rows": 8}
    assert f"cpu.one_row_padded.{name}" not in counts

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        got, args = _row_call(name, 1, 5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, _scaled_argmax(*args))
    assert paths.counts()[f"cpu.one_row_padded.{name}"]["calls"] == 1
    assert cpu_compile._compiled[name] is not fn and (name, 300) in cpu_compile._padded_rows
    got, args = _row_call(name, 1, 6)
    assert torch.equal(got, _scaled_argmax(*args)) and _PADS == [1, 1, 1]

    looks = []

    def moving_count() -> int:
        looks.append(1)
        return len(looks)

    _row_call(name, 2, 9, v=400)  # (a size not refused yet, run with two rows: then one row
    # goes direct)
    monkeypatch.setattr(cpu_compile, "_graphs", moving_count)
    fn = cpu_compile._compiled[name]
    got, args = _row_call(name, 1, 7, v=400)
    assert torch.equal(got, _scaled_argmax(*args))
    assert len(looks) == 2 and paths.counts()[f"cpu.one_row_padded.{name}"]["calls"] == 2
    assert cpu_compile._compiled[name] is not fn and (name, 400) in cpu_compile._padded_rows


def test_one_row_views_and_new_sizes_go_without_refusal():
    """A one-row slice of a strided view is passed with standard strides (torch.compile
    guards on a size-1 dimension's stride too), and a one-row call at a vocabulary size
    that no call of more rows has used goes padded at first (it needs a graph for that size):
    neither counts as a refusal nor drops the compiled function. The token is the row's in a
    batch either way."""
    v = 5000
    g = torch.Generator().manual_seed(21)
    params = [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]
    big = torch.randn(6, v + 37, generator=g) * 3
    rows = big[::2, 5:5 + v]
    many = sample(rows.contiguous(), SamplingBatch.from_params(params, vocab_size=v),
                  positions=torch.tensor([5, 6, 7]))
    one = sample(rows[1:2], SamplingBatch.from_params(params[1:2], vocab_size=v),
                 positions=torch.tensor([6]))
    assert int(one.token_ids[0]) == int(many.token_ids[1])
    small = torch.randn(3, 1000, generator=g) * 3
    one = sample(small[:1], SamplingBatch.from_params(params[:1], vocab_size=1000),
                 positions=torch.tensor([5]))
    many = sample(small, SamplingBatch.from_params(params, vocab_size=1000),
                  positions=torch.tensor([5, 6, 7]))
    assert int(one.token_ids[0]) == int(many.token_ids[0])
    assert not any(k.startswith("cpu.one_row_padded") for k in paths.counts())


def test_one_row_sample_is_its_row_in_a_batch(monkeypatch):
    """sample() of one request runs the pass compiled for many rows, and its token is the one
    the same request gets as row 0 of a batch (the same graph); the candidates' function,
    whose graph guards on two rows or more, gets one row padded to two (counted as one
    row)."""
    g = torch.Generator().manual_seed(11)
    pads = []
    real = tb._two_rows

    def counted(n, args, widths=True):
        pads.append(args[0].shape[0])
        return real(n, args, widths)

    monkeypatch.setattr(tb, "_two_rows", counted)
    for v, options, name, rows in ((5000, {}, "processed_rows", 6),
                                   (49152, {}, "processed_rows", 6),
                                   (4096, {"top_k": 20, "top_p": 0.8}, "candidate_rows", 6),
                                   (49152, {"top_p": 0.9}, "candidate_rows", 6)):
        paths.reset()
        logits = torch.randn(3, v, generator=g) * 3
        params = [SamplingParams(temperature=0.8, seed=40 + i, **options) for i in range(3)]
        pos = torch.tensor([5, 9, 2])
        many = sample(logits, SamplingBatch.from_params(params, vocab_size=v), positions=pos)
        for i in range(3):
            one = sample(logits[i:i + 1], SamplingBatch.from_params([params[i]], vocab_size=v),
                         positions=pos[i:i + 1])
            assert int(one.token_ids[0]) == int(many.token_ids[i]), (v, options, i)
        counts = paths.counts()
        assert counts[f"cpu.compiled.{name}"]["rows"] == rows, (v, options, counts)
        assert not any(k.startswith("cpu.one_row_padded") for k in counts), counts
        assert len(pads) == (0 if name == "processed_rows" else 3), (v, options, pads)
        pads.clear()
