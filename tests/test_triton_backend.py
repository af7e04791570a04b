"""The Triton kernels compute the torch backend's function (docs/semantics.md), bit for bit on
the random numbers.

On CPU these run in Triton's interpreter at small sizes (V <= 4096); on a CUDA machine the same
tests run the compiled kernels. Tokens must be identical: the inputs are continuous random
logits, where two Gumbel keys within float rounding of each other are far rarer than one in the
number of draws made here (the fixed seeds make that a checked fact, not a hope).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specsample
from specsample import SamplingBatch, SamplingParams, paths, reference, torch_backend
from specsample.plan import build_plan

triton_backend = pytest.importorskip("specsample.triton_backend")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from specsample import rng  # noqa: E402
from specsample.triton_backend import kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


FILTERS = [dict(top_k=7, top_p=0.9, min_p=0.01), dict(top_k=1), dict(top_p=1e-6),
           dict(top_p=0.5), dict(min_p=0.3), dict(top_k=3, top_p=0.999999), dict(top_k=10**6),
           dict(top_k=40, min_p=0.001)]


def _params(gen: torch.Generator, n: int, *, processors: bool | str) -> list[SamplingParams]:
    """Mixed temperatures; with ``processors`` every other request sets bias, penalties and
    filters (the fused path, with any draft kind; ``processors="bans"`` adds a bad word), with
    ``processors="filters"`` only filters (the fused path)."""
    out = []
    for i in range(n):
        t = [0.0, 0.7, 1.0, 1e-5, 1.5][int(torch.randint(0, 5, (), generator=gen))]
        kw = {}
        if processors == "filters":
            kw = FILTERS[(i + int(torch.randint(0, 8, (), generator=gen))) % len(FILTERS)]
        elif processors and i % 2:
            kw = dict(top_k=7, top_p=0.9, min_p=0.01, presence_penalty=0.4,
                      repetition_penalty=1.2, logit_bias={3 % 2: 1.5})
            if processors == "bans":
                kw |= dict(bad_words_token_ids=[[5]])
        out.append(SamplingParams(temperature=t, seed=1000 + i, **kw))
    return out


def _case(seed: int, n: int, vocab: int, dtype, kind: str, *, draft_vocab: int | None = None,
          processors: bool | str = False, placeholders: bool = False):
    gen = torch.Generator().manual_seed(seed)
    ks = [int(torch.randint(0, 5, (), generator=gen)) for _ in range(n)]
    rows = n + sum(ks)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    # Drafts: the row's argmax half the time (accepted often), else random.
    drafts = []
    r = 0
    for k in ks:
        for j in range(k):
            top = int(logits[r + j].float().argmax())
            drafts.append(top if torch.rand((), generator=gen) < 0.6 else
                          int(torch.randint(0, draft_vocab or vocab, (), generator=gen)))
        r += k + 1
    d = torch.tensor(drafts, dtype=torch.int64)
    if placeholders and d.numel() > 2:
        d[1] = -1
    dv = draft_vocab or vocab
    extra = {}
    if kind == "draft_logits":
        extra["draft_logits"] = (torch.randn(d.numel(), dv, generator=gen) * 3).to(dtype).to(DEVICE)
    elif kind == "draft_probs":
        extra["draft_probs"] = torch.softmax(torch.randn(d.numel(), dv, generator=gen) * 2,
                                             -1).to(DEVICE)
    params = _params(gen, n, processors=processors)
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE,
                                      prompt_token_ids=[[1 % vocab, 2 % vocab]] * n,
                                      output_token_ids=[[2 % vocab, 5 % vocab]] * n)
    pos = torch.randint(0, 2**33, (n,), generator=gen).to(DEVICE)
    return logits.to(DEVICE), d.to(DEVICE), ks, batch, pos, extra


def run_both(logits, d, ks, batch, pos, extra, method):
    """(Triton output through the public API with the backend forced, the torch backend's
    output and error bits on the same plan); ``specsample.paths`` counts the Triton call
    only."""
    plan = build_plan(logits, batch, draft_token_ids=d, num_draft_tokens=ks,
                      draft_logits=extra.get("draft_logits"),
                      draft_probs=extra.get("draft_probs"), positions=pos, method=method)
    ref, ref_err = torch_backend.verify(plan)
    paths.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECSAMPLE_BACKEND", "triton")
        out = specsample.verify(logits, d, ks, batch, positions=pos, method=method,
                                strict=False, **extra)
    return out, ref, ref_err


def _compare(logits, d, ks, batch, pos, extra, method):
    """Triton (through the public API, backend forced) against the torch backend; returns the
    output and the Triton path that ran (from specsample.paths)."""
    out, ref, ref_err = run_both(logits, d, ks, batch, pos, extra, method)
    path = next(p for p in paths.counts() if p.startswith("triton.verify"))
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu()), (out.token_ids, ref.token_ids)
    assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())
    assert torch.equal(out.invalid.cpu(), (ref_err != 0).cpu())
    return out, path


@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_backend(kind, method, dtype):
    case = _case(7, 6, 300, dtype, kind, draft_vocab=260)
    out, path = _compare(*case, method)
    assert path == "triton.verify.fused"


@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_multi_tile_vocabulary(kind, method):
    """V spans three sampling tiles (rng.TILE = 2048): tile draw, then token draw."""
    case = _case(13, 3, 2 * 2048 + 37, torch.bfloat16, kind, draft_vocab=2 * 2048 + 1)
    _compare(*case, method)


@pytest.mark.parametrize("kind", ["onehot", "draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_filtered_path_matches(kind, method):
    # min_p / top_k / top_p fused: no general path, the same tokens as the torch backend.
    dtype = DTYPES[(len(kind) + len(method)) % 3]
    case = _case(21, 6, 2500, dtype, kind, processors="filters")
    _, path = _compare(*case, method)
    assert path == "triton.verify.filtered"


def _long_drafts_case(seed: int, ks: list[int], v: int, kind: str, temps: list[float],
                      placeholders: tuple[int, ...] = (), agree: float = 0.9,
                      noise: float = 0.7):
    """Requests with up to 17 drafts (finish_kernel walks 8 positions per step): draft
    logits q the target's plus N(0, noise^2), each draft the target row's argmax with
    probability ``agree``, else q's argmax (the defaults make some requests accept 8 or
    more); ``placeholders``: flat draft indices set to -1."""
    gen = torch.Generator().manual_seed(seed)
    n = len(ks)
    logits = torch.randn(n + sum(ks), v, generator=gen)
    starts = torch.tensor([0] + ks[:-1]).cumsum(0) + torch.arange(n)
    rows = torch.cat([s + torch.arange(k) for s, k in zip(starts.tolist(), ks)]).long()
    q = logits[rows] + noise * torch.randn(len(rows), v, generator=gen)
    agrees = torch.rand(len(rows), generator=gen) < agree
    d = torch.where(agrees, logits[rows].argmax(-1), q.argmax(-1))
    d[list(placeholders)] = -1
    extra = ({"draft_logits": q.to(DEVICE)} if kind == "draft_logits" else
             {"draft_probs": torch.softmax(q, -1).to(DEVICE)} if kind == "draft_probs" else {})
    params = [SamplingParams(temperature=temps[i % len(temps)], seed=77 + i) for i in range(n)]
    batch = SamplingBatch.from_params(params, vocab_size=v, device=DEVICE)
    pos = torch.randint(0, 2**33, (n,), generator=gen).to(DEVICE)
    return logits.to(DEVICE), d.to(DEVICE), ks, batch, pos, extra


@pytest.mark.parametrize("kind,method", [("onehot", "token"), ("draft_logits", "token"),
                                         ("draft_probs", "token"), ("draft_logits", "block"),
                                         ("draft_probs", "block")])
def test_more_drafts_than_one_finish_step(kind, method):
    """k + 1 > 8: the finish walk's later steps, the running state (acceptance, rho) carried
    between them, the bonus row alone in a step; greedy and sampled requests, placeholders
    (one at j = 10 of a greedy request with 12 drafts: the single launch finds k_eff from
    more ids than the eight it loads up front).
    (One-hot drafts verify the same way with either method.)"""
    ks = [9, 12, 8, 7, 16, 10, 0, 17]
    case = _long_drafts_case(3, ks, 48, kind, [1.0, 0.0, 1.0, 0.7], placeholders=(32, 19))
    out, _ = _compare(*case, method)
    assert (out.num_accepted.cpu() >= 8).any()


def test_single_launch_never_uses_rows_after_a_placeholder():
    """The single launch skips a row whose draft j - 1 is a placeholder and reads (without
    using) a row after the first placeholder that a draft follows: a NaN in rows after
    placeholders, of both kinds, leaves the requests valid, with the torch backend's tokens;
    the rows' statistics show which were read (a read row's flags are set, an unread row's
    are 0)."""
    from specsample import workspace
    v = 300
    ks = [3, 3, 3, 0]
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(sum(ks) + 4, v, generator=gen) * 2
    d = logits[[0, 1, 2, 4, 5, 6, 8, 9, 10]].argmax(-1)
    d[0] = -1  # request 0: [-1, d, d]: row 1 skipped, rows 2 and 3 read
    d[4] = d[5] = -1  # request 1: [d, -1, -1]: rows 2 and 3 skipped
    logits[[2, 3, 6, 7], 5] = float("nan")
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=2)]
    batch = SamplingBatch.from_params(params, vocab_size=v, device=DEVICE)
    paths.reset()
    out, path = _compare(logits.to(DEVICE), d.to(DEVICE), ks, batch,
                         torch.arange(4).to(DEVICE), {}, "token")
    assert path == "triton.verify.fused" and "triton.one_launch" in paths.counts()
    assert not out.invalid.any() and out.num_accepted.tolist()[0] == 0
    assert out.num_accepted.tolist()[2] == 3  # (greedy drafts that are the argmax)
    stats = workspace.scratch("stats", (logits.shape[0], 3), torch.float32,
                              torch.device(DEVICE)).cpu()
    assert (stats[[2, 3], 2] != 0).all() and (stats[[6, 7], 2] == 0).all()


@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
def test_block_masses_only_where_they_can_change_tau(kind):
    """Block verification sums Z_j only for the draft rows whose h_j can still decide tau:
    0 < j < k_eff, a request that samples from distributions, u_j <= rho_j, and not
    u_k <= rho_k (tau = k whatever the masses); and row 0 (rho_0 = 1) of such a request, the
    residual's row if tau ends at 0 (the residual draw reads its tile masses). The others
    are -1 in the ``block.rho`` scratch. Checked row by row against rho_j and u_j recomputed
    here, and the tokens against the torch backend (which sums every Z_j) on a batch where
    some tau were decided by a summed Z_j (0 < tau < k) and some corrections drawn at row 0,
    so skipping a row that mattered would change tokens."""
    from specsample import workspace
    ks = [4, 10, 3, 1, 0, 9, 5, 4, 2, 4, 4, 4] * 3
    temps = [1.0, 1.0, 0.0, 0.7]
    logits, d, ks, batch, pos, extra = case = _long_drafts_case(
        11, ks, 40, kind, temps, placeholders=(20,), agree=0.0, noise=2.0)
    out, _ = _compare(*case, "block")
    rho_row = workspace.scratch("block.rho", (d.numel(),), torch.float32,
                                torch.device(DEVICE)).cpu()
    expect = torch.full((d.numel(),), -1.0, dtype=torch.float64)
    logits, d = logits.cpu().double(), d.cpu()
    r = ds = 0
    keffs = []
    for i, k in enumerate(ks):
        t = float(batch.temperature[i])
        dd = d[ds:ds + k].tolist()
        keff = dd.index(-1) if -1 in dd else k
        keffs.append(keff)
        if t > 0:
            rho = [1.0]
            for j in range(keff):
                p = torch.softmax(logits[r + j] / t, -1)[dd[j]]
                q = (extra["draft_probs"].cpu().double()[ds + j] if "draft_probs" in extra else
                     torch.softmax(extra["draft_logits"].cpu().double()[ds + j] / t, -1))[dd[j]]
                rho.append(min(1.0, rho[-1] * float(p / q)))
            u = [float(rng.uniform(batch.seed_lo[i:i + 1].cpu(), batch.seed_hi[i:i + 1].cpu(),
                                   pos[i:i + 1].cpu() + j - 1, torch.tensor([j]),
                                   rng.STREAM_BLOCK_ACCEPT)) for j in range(keff + 1)]
            if keff > 0 and not u[keff] <= rho[keff]:
                expect[ds] = 1.0
                for j in range(1, keff):
                    if u[j] <= rho[j]:
                        expect[ds + j] = rho[j]
        r += k + 1
        ds += k
    kept = expect >= 0
    assert torch.equal(rho_row >= 0, kept), (rho_row, expect)
    assert torch.allclose(rho_row[kept].double(), expect[kept], rtol=1e-4)
    assert kept.any() and (~kept).any()
    n_acc, k_t = out.num_accepted.cpu(), torch.tensor(keffs)
    sampled = batch.temperature.cpu() > 0
    assert ((n_acc > 0) & (n_acc < k_t) & sampled).any()
    assert ((n_acc == 0) & (k_t > 0) & sampled).any()


@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
def test_block_corrections_at_later_rows_over_tiles(kind, monkeypatch):
    """Block verification's corrections at 0 < tau < k (rho_tau < 1) come from row tau's
    tile masses, which ``block_mass_kernel`` sums in several splits: rows of three tiles,
    a drafter that under-weights tiles 1 and 2 (so the residual's tile masses depend on
    rho), 64 programs per launch (two splits per row). Tokens identical to the torch
    backend; fails if the draw uses rho = 1, ignores the tile masses, or a split does not
    write its tiles."""
    monkeypatch.setattr(triton_backend, "_num_programs_target", lambda device: 64)
    n, k, v = 24, 4, 2 * 2048 + 37
    late = 0
    for seed in range(1):  # (one batch gives 8 late corrections with either kind)
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(n * (k + 1), v, generator=gen) * 1.5
        logits[:, 2048:4096] -= 0.3
        rows = torch.cat([torch.arange(i * (k + 1), i * (k + 1) + k) for i in range(n)])
        q = logits[rows] + 0.8 * torch.randn(len(rows), v, generator=gen)
        q[:, 2048:] -= 1.5
        qp = torch.softmax(q, -1)
        d = torch.multinomial(qp, 1, generator=gen)[:, 0]
        extra = {"draft_logits": q} if kind == "draft_logits" else {"draft_probs": qp}
        batch = SamplingBatch.from_params(
            [SamplingParams(temperature=1.0, seed=500 + i) for i in range(n)], vocab_size=v,
            device=DEVICE)
        pos = torch.randint(0, 2**33, (n,), generator=gen)
        case = (logits.to(DEVICE), d.to(DEVICE), [k] * n, batch, pos.to(DEVICE),
                {key: t.to(DEVICE) for key, t in extra.items()})
        out, _ = _compare(*case, "block")
        late += int(((out.num_accepted > 0) & (out.num_accepted < k)).sum())
    assert late >= 4


def test_filtered_path_serial_search_fallback():
    # Rows with more candidates than the select kernel sorts (flat rows, top_k above the tile
    # count) take the serial search: counted, and the same tokens.
    before = triton_backend.filter_serial_rows(DEVICE)
    gen = torch.Generator().manual_seed(4)
    v = 2 * 2048 + 100
    logits = (torch.randn(4, v, generator=gen) * 0.1).to(DEVICE)  # flat: a huge nucleus
    params = [SamplingParams(seed=i, **f) for i, f in enumerate(
        [dict(top_p=0.9), dict(top_k=3000), dict(top_k=2, top_p=0.5), dict(min_p=0.5)])]
    batch = SamplingBatch.from_params(params, vocab_size=v, device=DEVICE)
    pos = torch.arange(4, device=DEVICE)
    _, path = _compare(logits, torch.zeros(0, dtype=torch.int64, device=DEVICE), [0] * 4, batch,
                       pos, {}, "token")
    assert path == "triton.verify.filtered"
    assert triton_backend.filter_serial_rows(DEVICE) - before == 2


def _kept_sets(logits: torch.Tensor, params: list[SamplingParams]):
    """Each row's kept set under the Triton filters and the torch backend's (processed
    logprobs of every token, which read the filters' cut), and under the float64 reference
    (None for the rows it calls fragile: a decision within rounding, such as a tie at the
    cut, which the two backends settle by the documented rule)."""
    v = logits.shape[1]
    lp = [SamplingParams(**{**p.__dict__, "logprobs": v, "logprobs_mode": "processed"})
          for p in params]
    batch = SamplingBatch.from_params(lp, vocab_size=v, device=DEVICE)
    sets = {}
    for backend in ("triton", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPECSAMPLE_BACKEND", backend)
            out = specsample.sample(logits, batch,
                                    positions=torch.arange(len(params), device=DEVICE))
        ids, vals = out.logprob_token_ids[:, 1:].cpu(), out.logprobs[:, 1:].cpu()
        sets[backend] = [{int(i) for i, x in zip(ids[r], vals[r]) if x > -float("inf")
                          and i >= 0} for r in range(len(params))]
    want = []
    for r, p in enumerate(params):
        trace = reference.RequestTrace()
        row = reference.process_row(logits[r].cpu(), p, trace=trace)
        want.append(None if trace.fragile else {int(i) for i in np.flatnonzero(np.isfinite(
            row.z))})
    return sets["triton"], sets["torch"], want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_filtered_path_histogram_search(dtype):
    # Rows whose candidates overflow the select kernel's buffer (flat rows with a large
    # nucleus, top_k above the tile count, ties at the cut) take the exact-key histogram
    # search, not the serial one: the reference's kept sets, counted as histogram rows.
    gen = torch.Generator().manual_seed(6)
    v = 2 * 2048 + 100
    flat = torch.randn(6, v, generator=gen) * 0.3
    ints = torch.randint(0, 5, (2, v), generator=gen).float()  # exact ties at every cut
    logits = torch.cat([flat, ints]).to(dtype).to(DEVICE)
    params = [SamplingParams(seed=i, **f) for i, f in enumerate(
        [dict(top_p=0.9), dict(top_k=3000), dict(top_k=700, top_p=0.8),
         dict(temperature=0.8, min_p=0.2, top_p=0.95), dict(temperature=3.0, top_p=0.99),
         dict(top_k=2, top_p=0.5), dict(top_p=0.5), dict(top_k=1500, top_p=0.9)])]
    serial = triton_backend.filter_serial_rows(DEVICE)
    hist = triton_backend.filter_histogram_rows(DEVICE)
    got, torch_sets, want = _kept_sets(logits, params)
    for r in range(len(params)):
        assert got[r] == torch_sets[r], (r, len(got[r]), len(torch_sets[r]))
        assert want[r] is None or got[r] == want[r], r
    assert sum(w is not None for w in want) >= 4
    assert triton_backend.filter_serial_rows(DEVICE) == serial
    # row 5 (top_k 2: a two-token cut from the tile maxima) fits the buffer
    assert triton_backend.filter_histogram_rows(DEVICE) - hist == len(params) - 1


def test_filtered_path_histogram_search_skips_empty_keys_and_falls_back():
    # fp16 keys keep float32's exponent range: values on both sides of zero leave hundreds of
    # thousands of keys no token has between them, which the histogram chunks skip. A row
    # whose tokens need more chunks than the search has (values 16 binades apart, one chunk
    # each) takes the serial search, counted, with the same kept set.
    gen = torch.Generator().manual_seed(2)
    v = 4000
    x = torch.rand(3, v, generator=gen) * 2000 - 1000
    spread = torch.tensor([s * 2.0 ** (12 - 4 * i) for i in range(12) for s in (1, -1)])
    x[2] = spread[torch.randint(0, 24, (v,), generator=gen)]
    x = x.to(torch.float16).to(DEVICE)
    serial = triton_backend.filter_serial_rows(DEVICE)
    hist = triton_backend.filter_histogram_rows(DEVICE)
    params = [SamplingParams(seed=0, temperature=5000.0, top_p=0.99),
              SamplingParams(seed=1, temperature=2000.0, top_k=3500),
              SamplingParams(seed=2, temperature=1e6, top_p=0.99)]
    got, torch_sets, _ = _kept_sets(x, params)
    assert got == torch_sets
    assert len(got[0]) > 3000 and len(got[1]) == 3500 and len(got[2]) > 3000
    assert triton_backend.filter_histogram_rows(DEVICE) - hist == 2
    assert triton_backend.filter_serial_rows(DEVICE) - serial == 1


@pytest.mark.parametrize("top_p", [0.9, 0.9999, 0.999999])
def test_filtered_top_p_near_one_needs_no_serial_search(top_p):
    # The top_p bound once had margins on the whole mass, so any top_p above ~0.9998 sent
    # every row to the serial search even with a one-token nucleus.
    v = 2 * 2048
    logits = torch.randn(2, v, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[:, 7] = 40.0
    batch = SamplingBatch.from_params([SamplingParams(seed=i, top_p=top_p) for i in range(2)],
                                      vocab_size=v, device=DEVICE)
    before = triton_backend.filter_serial_rows(DEVICE)
    _compare(logits, torch.zeros(0, dtype=torch.int64, device=DEVICE), [0, 0], batch,
             torch.arange(2, device=DEVICE), {}, "token")
    assert triton_backend.filter_serial_rows(DEVICE) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_filter_serial_rows_without_cuda_names_the_device():
    with pytest.raises(ValueError, match="CUDA is not available"):
        triton_backend.filter_serial_rows()
    assert triton_backend.filter_serial_rows("cpu") >= 0


@pytest.mark.parametrize("rows", ["ties", "neg_inf", "equal"])
def test_filtered_path_edge_rows(rows):
    # Ties at the cut, rows mostly -inf, all-equal rows: the kept set and the tokens match.
    logits, d, ks, batch, pos, extra = _case(5, 6, 300, torch.bfloat16, "onehot",
                                             processors="filters")
    if rows == "ties":
        logits = (logits.float() / 2).round().to(torch.bfloat16)  # many exact ties
    elif rows == "neg_inf":
        logits[:, 7:] = float("-inf")
    else:
        logits[:] = 1.0
    _compare(logits, d, ks, batch, pos, extra, "token")


@pytest.mark.parametrize("kind,processors,path", [
    # (bans, bias, penalties and filters in the kernels, with one-hot drafts or draft logits)
    ("onehot", "bans", "triton.verify.filtered"),
    ("draft_logits", "bans", "triton.verify.filtered"),
    ("draft_logits", True, "triton.verify.filtered"),
    ("onehot", True, "triton.verify.filtered")])
def test_processors_in_kernels_match(kind, processors, path):
    case = _case(11, 5, 200, torch.bfloat16, kind, processors=processors)
    _, ran = _compare(*case, "token")
    assert ran == path


def test_processing_with_draft_distributions_placeholders_and_narrow_drafts():
    # bias, penalties and filters in the kernels with draft logits over a narrower
    # vocabulary, placeholders (-1) among the drafts and mixed temperatures, block
    # verification: the torch backend's outputs, on the filtered path (draft probabilities
    # and token level: tests/test_triton_penalties.py and test_random_cases)
    case = _case(12, 5, 2600, torch.float16, "draft_logits", draft_vocab=2100,
                 placeholders=True, processors=True)
    _, ran = _compare(*case, "block")
    assert ran == "triton.verify.filtered"


def test_placeholders_and_invalid_rows():
    logits, d, ks, batch, pos, extra = _case(3, 6, 150, torch.float16, "onehot",
                                             placeholders=True)
    logits[0, 5] = float("nan")
    logits[-1] = float("-inf")
    _compare(logits, d, ks, batch, pos, extra, "token")


def _poison_scratch(monkeypatch) -> None:
    """Every ``workspace.scratch`` intermediate starts as garbage (NaN, -1), so that a kernel
    that reads one before it is written shows."""
    from specsample import workspace

    scratch = workspace.scratch

    def poisoned(*args):
        t = scratch(*args)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(workspace, "scratch", poisoned)


@pytest.mark.parametrize("kind,method,lps,one_launch", [
    ("onehot", "token", None, True), ("onehot", "block", [(0, "processed"), (0, "raw")], True),
    ("onehot", "token", [(0, "processed"), (5, "raw")], False),
    ("onehot", "token", [(40, "processed")], False),  # (top-n past the kernels': PyTorch)
    ("draft_logits", "block", None, False), ("draft_probs", "token", None, False)])
def test_one_launch_matches_separate_launches(monkeypatch, kind, method, lps, one_launch):
    # An eager call without filters, draft distributions or top-n logprobs is one launch
    # (kernels.stats_draw_kernel: the last of a row's split programs draws the row, the last
    # live row of a request finishes it, through counters that must end at zero); graph
    # capture takes the statistics, sampling and finish launches, and so do the other calls.
    # Same outputs, with several splits per row (more programs wanted than rows),
    # placeholders, a NaN row, an empty row and a greedy request; and each is the path that
    # ran (specsample.paths). Every intermediate starts as garbage (NaN, -1), so a draw or a
    # finish that ran before the writes it needs would show.
    from specsample import workspace
    from test_triton_logprobs import _with_logprobs

    _poison_scratch(monkeypatch)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    monkeypatch.setattr(triton_backend, "_num_programs_target", lambda device: 64)
    vocab = 8197  # 5 tiles: 3 splits of a row
    logits, d, ks, batch, pos, extra = _case(21, 5, vocab, torch.bfloat16, kind,
                                             placeholders=True)
    logits[1, 7] = float("nan")
    logits[-1] = float("-inf")
    params = [dataclasses.replace(p, temperature=0.0) if i == 2 else p
              for i, p in enumerate(batch.params)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    if lps is not None:
        batch = _with_logprobs(batch, lps, vocab)
    assert not batch.needs_filter and not batch.needs_general_path
    assert triton_backend._splits(logits.shape[0], vocab, 2, logits.device)[0] == 3

    def call():
        paths.reset()
        out = specsample.verify(logits, d, ks, batch, positions=pos, method=method,
                                strict=False, **extra)
        return out, paths.counts()

    one, counts = call()
    if not one_launch:
        assert "triton.one_launch" not in counts
        return
    assert counts["triton.one_launch"]["rows"] == logits.shape[0]
    assert not workspace.counters("draw", (logits.shape[0] + 5,), logits.device).any()
    again, _ = call()  # (the counters were left at zero: the next launch works as well)
    with triton_backend.separate_launches():
        sep, counts = call()
    assert "triton.one_launch" not in counts
    assert one.invalid.any() and not one.invalid.all()
    for out in (again, sep):
        for name in ("token_ids", "num_accepted", "invalid", "logprobs", "logprob_token_ids"):
            a, b = getattr(one, name), getattr(out, name)
            assert (a is None and b is None) or torch.equal(a.cpu(), b.cpu()), name
    # sample(): one row per request
    paths.reset()
    one = specsample.sample(logits[:5], batch, positions=pos, strict=False)
    assert paths.counts()["triton.one_launch"]["rows"] == 5
    with triton_backend.separate_launches():
        sep = specsample.sample(logits[:5], batch, positions=pos, strict=False)
    for name in ("token_ids", "invalid", "logprobs", "logprob_token_ids"):
        a, b = getattr(one, name), getattr(sep, name)
        assert (a is None and b is None) or torch.equal(a.cpu(), b.cpu()), name


@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
def test_residual_masses_and_draw_in_one_launch(monkeypatch, kind, method):
    # A rejected draft distribution's correction (token level, and block verification with
    # k_i <= 1): kernels.residual_kernel sums the residual's tile masses over several split
    # programs per request and the last of them draws, through counters that must end at
    # zero. The masses start as NaN, so a draw made before every split had written its
    # masses, and not made again after, would show; the torch backend's tokens, a second
    # call alike. (The interpreter runs the programs one after another: the GPU test
    # test_residual_in_one_launch_under_load covers them running at once.)
    from specsample import workspace

    _poison_scratch(monkeypatch)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    monkeypatch.setattr(triton_backend, "_num_programs_target", lambda device: 64)
    vocab, n = 10240, 12  # 5 whole tiles: 5 residual splits per request
    assert triton_backend._splits(n, vocab, 1, torch.device(DEVICE))[0] == 5
    logits, d, ks, batch, pos, extra = _case(31, n, vocab, torch.bfloat16, kind)
    if method == "block":  # (k_i <= 1: the residual of token level; k_i >= 2 elsewhere)
        keep = [sum(ks[:i]) for i in range(n) if ks[i]]
        rows = [r for i in range(n) for r in range(sum(ks[:i]) + i,
                                                   sum(ks[:i]) + i + min(ks[i], 1) + 1)]
        ks = [min(k, 1) for k in ks]
        logits, d = logits[rows], d[keep]
        extra = {key: v[keep] for key, v in extra.items()}
    for _ in range(2):
        out, ref, _ = run_both(logits, d, ks, batch, pos, extra, method)
        assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
        assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())
        assert not workspace.counters("residual", (n,), logits.device).any()
    rejected = [i for i in range(n) if ref.num_accepted[i] < ks[i]
                and batch.params[i].temperature > 0]
    assert rejected  # (the case it means to be: corrections drawn)


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("scale", [2.0, 0.5])
def test_target_sample_drawn_only_where_emitted(monkeypatch, method, scale):
    # With a draft distribution, sample_kernel leaves a sampled request's rows undrawn; the
    # residual kernels draw the one target sample such a request emits. Draft probabilities
    # q = scale * p (used as given, not renormalised) reach both cases: scale 0.5 accepts
    # every draft (u q < p always), so the bonus token is row k's sample; scale 2 rejects
    # about half the drafts with a residual max(rho p - q, 0) that is 0 everywhere, so the
    # correction is the rejected row's sample. Either way the emitted token is what sample()
    # draws from that row at that position, and the torch backend's; and sample_kernel drew
    # none of the rows (its y scratch, poisoned with -1, holds 0 in every row).
    from specsample import workspace

    scratch = workspace.scratch  # (unpoisoned: to read y after the call)
    _poison_scratch(monkeypatch)
    vocab, n, k = 2048, 8, 3
    gen = torch.Generator().manual_seed(77)
    logits = (torch.randn(n * (k + 1), vocab, generator=gen) * 3).to(torch.bfloat16)
    temps = [1.0, 0.7, 1.0, 1.5] * (n // 4)
    params = [SamplingParams(temperature=t, seed=500 + i) for i, t in enumerate(temps)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    pos = torch.randint(0, 2**33, (n,), generator=gen)
    draft_rows = [i * (k + 1) + j for i in range(n) for j in range(k)]
    t_rows = torch.tensor(temps).repeat_interleave(k)[:, None]
    q = scale * torch.softmax(logits[draft_rows].float() / t_rows, -1)
    d = torch.stack([torch.multinomial(q[r], 1, generator=gen)[0] for r in range(n * k)])
    extra = {"draft_probs": q.to(DEVICE)}
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    out, ref, _ = run_both(logits.to(DEVICE), d.to(DEVICE), [k] * n, batch, pos.to(DEVICE),
                           extra, method)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())
    y = scratch("y", (n * (k + 1),), torch.int32, torch.device(DEVICE))
    assert (y == 0).all(), y
    acc = out.num_accepted.cpu()
    assert (acc == k).all() if scale < 1 else (acc < k).sum() >= n // 2
    for i in range(n):
        a = int(acc[i])
        one = SamplingBatch.from_params([params[i]], vocab_size=vocab, device=DEVICE)
        y = specsample.sample(logits[i * (k + 1) + a:i * (k + 1) + a + 1].to(DEVICE), one,
                              positions=pos[i:i + 1].to(DEVICE) + a)
        assert int(out.token_ids[i, a]) == int(y.token_ids[0]), (i, a)


@pytest.mark.parametrize("method", ["token", "block"])
def test_all_greedy_batch_launches_no_residual(monkeypatch, method):
    # Greedy requests verify against the argmax even with a draft distribution: a batch with
    # no sampled request skips the residual kernels (the finish decides everything).
    launched = []
    launch = triton_backend.launch

    def recording(kernel):
        launched.append(kernel.fn.__name__)
        return launch(kernel)

    monkeypatch.setattr(triton_backend, "launch", recording)
    logits, d, ks, batch, pos, extra = _case(41, 6, 1024, torch.float32, "draft_logits")
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 6, vocab_size=1024,
                                      device=DEVICE)
    assert sum(ks) and not batch.any_sampled
    out, ref, _ = run_both(logits, d, ks, batch, pos, extra, method)
    assert torch.equal(out.token_ids.cpu(), ref.token_ids.cpu())
    assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())
    assert "finish_kernel" in launched, launched  # (the hook sees the launches)
    assert not {"residual_kernel", "residual_draw_kernel", "block_mass_kernel"} & set(
        launched), launched


@pytest.mark.parametrize("method, processors", [("token", False), ("block", "filters")])
def test_draft_probs_statistics_apart(monkeypatch, method, processors):
    """Draft probabilities of more than ``MERGED_PROBS_MAX_ROWS`` rows take a statistics
    launch of their own, fewer share the target rows' launch (draft rows first); both give
    the torch backend's outputs (fails if either launch is skipped or reads the wrong rows),
    with a draft vocabulary narrower than the target's and split counts that differ, so the
    shared grid has programs past the draft rows' splits (which must not store)."""
    monkeypatch.setattr(triton_backend, "_num_programs_target", lambda device: 64)
    # (two chunks of tiles for the target rows, one for the draft rows: 2 tiles per chunk)
    vocab, dvocab = 4100, 2048
    logits, d, ks, batch, pos, extra = _case(8, 9, vocab, torch.bfloat16, "draft_probs",
                                             draft_vocab=dvocab, processors=processors)
    drows = extra["draft_probs"].shape[0]
    assert drows > 8
    tpc = triton_backend.TILES_PER_CHUNK
    s = triton_backend._splits(logits.shape[0], vocab, tpc, logits.device)[0]
    ds = triton_backend._splits(drows, dvocab, tpc, logits.device)[0]
    assert s != ds and min(s, ds) >= 1, (s, ds)
    for limit, apart in ((drows - 1, True), (drows, False)):
        monkeypatch.setattr(triton_backend, "MERGED_PROBS_MAX_ROWS", limit)
        _compare(logits, d, ks, batch, pos, extra, method)
        counts = paths.counts()
        assert ("triton.stats.draft_probs_apart" in counts) == apart
        if apart:
            assert counts["triton.stats.draft_probs_apart"]["rows"] == drows



@pytest.mark.parametrize("counts", ["ok", "request_error", "batch_error", "negative"])
def test_one_launch_with_device_layouts(monkeypatch, counts):
    # Device num_draft_tokens: rows laid out on the device, with a request whose count
    # exceeds max_num_draft_tokens (its k_given 0), counts that do not add up to the drafts
    # (rows no request owns, mapped to the last request past its k_given: never live), or a
    # negative count. Every request is still finished exactly once and every row drawn once:
    # the same outputs and error bits as the separate launches, the counters back at zero.
    from specsample import workspace
    from specsample.triton_backend import layout

    monkeypatch.setattr(triton_backend, "_num_programs_target", lambda device: 64)
    vocab = 8197
    logits, d, ks, batch, pos, extra = _case(21, 5, vocab, torch.bfloat16, "onehot",
                                             placeholders=True)
    k, max_k = list(ks), max(ks)
    if counts == "request_error":
        max_k -= 1
    elif counts == "batch_error":
        k[0] += 1
    elif counts == "negative":
        k[0] = -1
    plan = build_plan(logits, batch, draft_token_ids=d, num_draft_tokens=ks, draft_logits=None,
                      draft_probs=None, positions=pos, method="token")
    lay = layout.device_layout(torch.tensor(k, device=DEVICE), max_k, logits.shape[0],
                               d.numel())
    names = ("row_start", "draft_start", "row_req", "row_j", "draft_req", "draft_j", "k_given")
    plan = dataclasses.replace(plan, **dict(zip(names, lay[:7])), layout_err=lay[7],
                               num_draft=None, max_k=max_k)
    paths.reset()
    one, err_one = triton_backend.run(plan, "verify")
    err_one = err_one.clone()  # (a workspace tensor: the next call rewrites it)
    assert "triton.one_launch" in paths.counts()
    with triton_backend.separate_launches():
        sep, err_sep = triton_backend.run(plan, "verify")
    assert torch.equal(err_one, err_sep)
    assert bool((plan.layout_err != 0).any()) == (counts != "ok")  # (the case it means to be)
    for name in ("token_ids", "num_accepted", "invalid"):
        assert torch.equal(getattr(one, name), getattr(sep, name)), name
    assert not workspace.counters("draw", (logits.shape[0] + 5,), logits.device).any()


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31), n=st.integers(1, 4), vocab=st.integers(2, 700),
       dtype=st.sampled_from(DTYPES), kind=st.sampled_from(["onehot", "draft_logits",
                                                              "draft_probs"]),
       method=st.sampled_from(["token", "block"]),
       processors=st.sampled_from([False, True, "filters"]))
def test_random_cases(seed, n, vocab, dtype, kind, method, processors):
    case = _case(seed, n, vocab, dtype, kind, draft_vocab=max(1, vocab - seed % 3),
                 processors=processors)
    _compare(*case, method)


def test_public_sample_uses_triton(monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    logits, _, _, batch, pos, _ = _case(5, 4, 257, torch.bfloat16, "onehot")
    logits = logits[:4]
    paths.reset()
    with paths.forbid("torch.*", "triton.*.general"):
        out = specsample.sample(logits, batch, positions=pos)
    assert paths.counts()["triton.sample.fused"]["rows"] == 4
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    ref = specsample.sample(logits, batch, positions=pos)
    assert torch.equal(out.token_ids, ref.token_ids)


def test_compile_guard_modes():
    with pytest.raises(ValueError, match="on_compile"):
        triton_backend.install_compile_guard("explode")


@triton.jit
def _noise_kernel(out_ptr, key_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    g = kernels._gumbel(tl.load(key_ptr), tl.load(key_ptr + 1), tl.load(key_ptr + 2), offs,
                        kernels.STREAM_SAMPLE)
    tl.store(out_ptr + offs, g, mask=offs < n)


def test_kernel_gumbel_noise_matches_rng():
    """The kernels' float32 Gumbel noise equals rng.gumbel (float64) to float32 precision."""
    n = 8192
    for key in [(12345, 678, 99), (2**32 - 1, 5, 2**40 + 3)]:
        out = torch.empty(n, device=DEVICE)
        _noise_kernel[(1,)](out, torch.tensor(key, device=DEVICE), n, BLOCK=n)
        ref = rng.gumbel(torch.tensor(key[0]), torch.tensor(key[1]), torch.tensor(key[2]),
                         torch.arange(n), rng.STREAM_SAMPLE)
        err = (out.cpu().double() - ref).abs() / (1 + ref.abs())
        assert err.max() < 2e-6


def test_compile_guard_watches_every_kernel_of_the_package(monkeypatch):
    # The guard once matched three kernel names only: the residual, block-mass and filter
    # kernels could compile after warmup unnoticed (and it once watched only
    # specsample.triton_backend, not the distributed kernels); and it once read the kernel from the
    # wrong attribute of what Triton passes, matching nothing. (The hook is called directly,
    # with what Triton 3.6's _call_hook passes: Triton's interpreter compiles nothing.)
    from triton.runtime.jit import JitFunctionInfo

    from specsample import _distributed_kernels
    from specsample.triton_backend import filters

    monkeypatch.setitem(triton_backend._state, "warmed", True)
    monkeypatch.setitem(triton_backend._state, "mode", "ignore")
    monkeypatch.setitem(triton_backend._state, "compiles_after_warmup", [])
    for kernel in (filters.gather_kernel, kernels.block_mass_kernel,
                   kernels.residual_draw_kernel, _distributed_kernels._tile_mass_kernel,
                   _noise_kernel):
        info = JitFunctionInfo(kernel.fn.__module__, kernel.fn.__qualname__, kernel)
        triton_backend._post_compile_hook(fn=info, repr=kernel.__name__)
    assert triton_backend.compilations_after_warmup() == [
        "gather_kernel", "block_mass_kernel", "residual_draw_kernel", "_tile_mass_kernel"]


def test_warmup_calls_cover_every_draft_kind_method_and_dtype(monkeypatch):
    # warmup() once ran the draft_logits / draft_probs calls for one method and one target
    # dtype only (a mis-indented block): verify() with draft distributions compiled after
    # warmup, which a GPU test only showed when run on its own. The calls are recorded here.
    from specsample import api

    seen = set()

    def verify(target, drafts, k, batch, *, draft_logits=None, draft_probs=None,
               method="token", max_num_draft_tokens=None, **kw):
        d = draft_logits if draft_logits is not None else draft_probs
        kind = "logits" if draft_logits is not None else "probs" if d is not None else "onehot"
        seen.add((target.dtype, kind, None if d is None else d.dtype, method,
                  isinstance(k, torch.Tensor), batch.needs_filter, batch.needs_general_path,
                  triton_backend.one_launch()))

    monkeypatch.setattr(api, "verify", verify)
    monkeypatch.setattr(api, "sample", lambda *a, **kw: None)
    monkeypatch.setattr(api, "select_backend", lambda device: "triton")  # (the interpreter)
    warmed = []
    monkeypatch.setattr(triton_backend.layout, "warm", warmed.append)
    monkeypatch.setitem(triton_backend._state, "compiles_after_warmup", [])
    try:
        triton_backend.warmup(DEVICE, vocab_size=64, workers=0, on_compile="ignore")
    finally:
        triton_backend.disarm_compile_guard()
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    for dtype in dtypes:
        for filt, general in ((False, False), (True, False), (True, True)):
            for method in ("token", "block"):
                assert (dtype, "onehot", None, method, False, filt, general, True) in seen
                for ddtype in dtypes:
                    for kind in ("logits", "probs"):
                        assert (dtype, kind, ddtype, method, False, filt, general,
                                True) in seen, (dtype, kind, ddtype, method, filt, general)
        # the calls that take the single launch when eager, again with the separate launches
        # of graph capture (triton_backend.one_launch): unfiltered, the general path
        for filt, general in ((False, False), (True, True)):
            assert (dtype, "onehot", None, "token", False, filt, general, False) in seen
    assert warmed == [torch.device(DEVICE)]  # the layout kernels (device num_draft_tokens)


def test_block_only_warmup_covers_block_calls_of_one_draft(monkeypatch):
    # A block batch whose k_i are all <= 1 draws its corrections from residual_kernel, as
    # token level does (block_mass_kernel serves max k >= 2): a warmup for block
    # verification alone must make such calls too, for every draft kind and dtype.
    from specsample import api

    seen = set()

    def verify(target, drafts, k, batch, *, draft_logits=None, draft_probs=None,
               method="token", **kw):
        d = draft_logits if draft_logits is not None else draft_probs
        kind = "logits" if draft_logits is not None else "probs" if d is not None else "onehot"
        seen.add((target.dtype, kind, None if d is None else d.dtype, method, max(k)))

    monkeypatch.setattr(api, "verify", verify)
    monkeypatch.setattr(api, "sample", lambda *a, **kw: None)
    monkeypatch.setattr(api, "select_backend", lambda device: "triton")
    monkeypatch.setattr(triton_backend.layout, "warm", lambda device: None)
    monkeypatch.setitem(triton_backend._state, "compiles_after_warmup", [])
    try:
        triton_backend.warmup(DEVICE, vocab_size=64, workers=0, on_compile="ignore",
                              methods=("block",))
    finally:
        triton_backend.disarm_compile_guard()
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    for dtype in dtypes:
        for ddtype in dtypes:
            for kind in ("logits", "probs"):
                assert (dtype, kind, ddtype, "block", 1) in seen, (dtype, kind, ddtype)
                assert (dtype, kind, ddtype, "block", 2) in seen, (dtype, kind, ddtype)


def test_layout_warm_launches_every_layout_kernel_variant(monkeypatch):
    # A device num_draft_tokens call always launches layout_kernel and mark_kernel, with
    # HAS_LP as the batch asks: warmup once compiled only the variant without logprobs. A call
    # with positions=None launches fresh_positions_kernel.
    from triton.runtime import interpreter

    seen = set()
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        seen.add((self.fn.__name__, kwargs.get("HAS_LP")))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    triton_backend.layout.warm(torch.device("cpu"))
    assert seen == {("layout_kernel", None), ("mark_kernel", False), ("mark_kernel", True),
                    ("fresh_positions_kernel", None)}


@pytest.mark.parametrize("processors", [False, True])
def test_low_rows_before_an_all_neg_inf_tile_stay_valid(monkeypatch, processors):
    # A row whose values are all below about -88 T, then a vocabulary tile that is all -inf
    # (a grammar mask) in the same split: the statistics pass once added 0 * inf = NaN for
    # that tile and reported the row invalid (found by an adversarial test). One tile a chunk
    # (the fused processing's setting, and the plain pass's when patched) puts both tiles in
    # one split of the interpreter's grid.
    monkeypatch.setattr(triton_backend, "TILES_PER_CHUNK", 1)
    vocab = 4096
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, vocab, generator=gen) - 5.0
    logits[:, 2048:] = float("-inf")
    extra = {"logit_bias": {7: 1.0}} if processors else {}
    params = [SamplingParams(temperature=[0.01, 0.0][i % 2], seed=i, **extra) for i in range(4)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=DEVICE)
    logits = logits.to(DEVICE)
    pos = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    outs = {}
    for backend in ("triton", "torch"):
        paths.reset()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPECSAMPLE_BACKEND", backend)
            outs[backend] = specsample.sample(logits, batch, positions=pos, strict=False)
        if backend == "triton":
            assert ("triton.processing.fused" in paths.counts()) == processors
    assert not outs["triton"].invalid.any()
    assert torch.equal(outs["triton"].token_ids.cpu(), outs["torch"].token_ids.cpu())
