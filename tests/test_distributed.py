"""specsample.distributed: vocabulary-parallel sample() / verify() equal the single-device
functions on the whole rows (gloo on CPU with 2 and 3 processes; NCCL on 2 GPUs when there
are two).

One process group per world size runs every case (spawning costs seconds); each rank compares
its outputs with single-process sample() / verify() (torch backend, CPU) on the full rows and
with rank 0's batch, and writes its failures to a file the test reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import tempfile
import traceback

import pytest
import torch
import torch.multiprocessing as mp

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams, paths

JOIN_TIMEOUT_S = 150


def _run_spawned(world: int, target: str, backend: str = "gloo") -> list[dict]:
    """Spawn ``world`` ranks running ``target`` (a function name in this module); returns
    each rank's report. A rank that does not finish within JOIN_TIMEOUT_S fails the test."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world, tmp, target, backend), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=JOIN_TIMEOUT_S)
        while not ctx.join(timeout=5):
            if datetime.datetime.now() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"{target} with {world} ranks did not finish in {JOIN_TIMEOUT_S} s")
        reports = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                reports.append(json.load(f))
    return reports


def _passing_reports(world: int, target: str, backend: str = "gloo") -> list[dict]:
    """:func:`_run_spawned`, failing the test on any rank's reported failure."""
    reports = _run_spawned(world, target, backend)
    fails = [f for r in reports for f in r["failures"]]
    assert not fails, "\n".join(fails[:5])
    return reports


def _worker(rank: int, world: int, tmp: str, target: str, backend: str) -> None:
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ.setdefault("SPECSAMPLE_BACKEND", "torch")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # (a file in the test's own directory: no port that another test process could take)
    dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    report = {"failures": [], "cases": 0}
    try:
        globals()[target](rank, world, report)
    except Exception:  # noqa: BLE001 - reported to the parent
        report["failures"].append(traceback.format_exc())
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
    # No interpreter teardown once the report is written: about one run in 20 of the error
    # cases on a loaded 2-core machine, a rank's exit aborted ("terminate called without an
    # active exception", SIGABRT) after its report and the group were done.
    os._exit(0)


# ------------------------------------------------------------------------- case builder


def _shard(full: torch.Tensor, rank: int, world: int, vocab: int, gen: torch.Generator,
           trim: bool = False) -> torch.Tensor:
    """This rank's columns [r S, (r + 1) S) of ``full`` [R, V]; columns past ``vocab`` are
    padding filled with garbage (NaN, +inf, huge) unless ``trim`` (then they are left out)."""
    s = -(-vocab // world)
    lo, hi = rank * s, (rank + 1) * s
    part = full[:, min(lo, full.shape[1]):min(hi, full.shape[1])]
    if trim:
        return part.clone()
    pad = hi - max(lo, min(hi, full.shape[1]))
    if pad:
        garbage = torch.randn(full.shape[0], pad, generator=gen) * 1e30
        garbage[:, ::3] = math.nan
        garbage[:, 1::3] = math.inf
        part = torch.cat([part, garbage.to(full.dtype)], dim=1)
    return part.contiguous()


def _params(gen: torch.Generator, kind: str, vocab: int, seeded: bool) -> SamplingParams:
    def ri(hi: int) -> int:
        return int(torch.randint(hi, (1,), generator=gen))

    seed = ri(2**31) if seeded else None
    lp = [None, 0, 3][ri(3)]
    mode = ["raw", "processed"][ri(2)]
    common = dict(seed=seed, logprobs=lp, logprobs_mode=mode)
    if kind == "greedy":
        return SamplingParams(temperature=0.0, **common)
    if kind == "plain":
        return SamplingParams(temperature=[0.5, 1.0, 1.7][ri(3)], **common)
    if kind == "top_k":
        return SamplingParams(temperature=0.8, top_k=[1, 3, 40, 700][ri(4)], **common)
    if kind == "top_p":
        return SamplingParams(temperature=1.0, top_p=[0.3, 0.9, 0.999][ri(3)], **common)
    if kind == "min_p":
        return SamplingParams(temperature=1.2, min_p=[0.01, 0.2][ri(2)], **common)
    if kind == "all_filters":
        return SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02, **common)
    if kind == "penalties":
        return SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3,
                              repetition_penalty=1.3, top_p=0.95, **common)
    if kind == "bias":
        return SamplingParams(temperature=0.7, logit_bias={0: 5.0, vocab - 1: 3.0,
                                                           vocab // 2: -100.0}, **common)
    if kind == "bans":
        return SamplingParams(temperature=1.0, bad_words_token_ids=[[1], [2, 3]],
                              min_tokens=3, stop_token_ids=[vocab - 1], top_k=20, **common)
    if kind == "allowed":
        return SamplingParams(temperature=[0.0, 1.0][ri(2)],
                              allowed_token_ids=sorted({ri(vocab) for _ in range(30)}), **common)
    raise AssertionError(kind)


KINDS = ["greedy", "plain", "top_k", "top_p", "min_p", "all_filters", "penalties", "bias",
         "bans", "allowed"]


def _close(a, b, what: str, fails: list, tol: float = 1e-5) -> None:
    if (a is None) != (b is None):
        fails.append(f"{what}: one is None")
        return
    if a is None:
        return
    if a.dtype.is_floating_point:
        same_inf = torch.equal(torch.isneginf(a), torch.isneginf(b))
        fin = torch.isfinite(a) & torch.isfinite(b)
        if not same_inf or not torch.allclose(a[fin], b[fin], atol=tol, rtol=0):
            fails.append(f"{what}: {a.tolist()} != {b.tolist()}")
    elif not torch.equal(a, b):
        fails.append(f"{what}: {a.tolist()} != {b.tolist()}")


def _case(rank: int, world: int, case: int, report: dict, *, vocab: int, op: str,
          draft: str = "onehot", method: str = "token", kinds=None, dtype=torch.float32,
          nan_shard: int | None = None, trim_draft: bool = False, draft_vocab=None,
          ties: bool = False, fresh: bool = False, device: str = "cpu",
          logprobs: bool = True, dist_backend: str | None = None) -> None:
    import specsample.distributed as sd

    gen = torch.Generator().manual_seed(1000 + case)
    n = 1 + int(torch.randint(4, (1,), generator=gen))
    kinds = kinds or KINDS
    params = [_params(gen, kinds[int(torch.randint(len(kinds), (1,), generator=gen))], vocab,
                      seeded=not fresh and bool(torch.randint(2, (1,), generator=gen)))
              for _ in range(n)]
    if not logprobs:
        params = [dataclasses.replace(p, logprobs=None) for p in params]
    k = [0] * n if op == "sample" else [int(torch.randint(4, (1,), generator=gen))
                                        for _ in range(n)]
    rows = n + sum(k)
    scale = 4.0
    logits = torch.randn(rows, vocab, generator=gen) * scale
    if ties:
        logits = (logits * 2).round() / 2
    vd = draft_vocab or vocab
    drafts = torch.randint(vd, (sum(k),), generator=gen)
    if draft == "onehot" and sum(k):
        # make acceptance likely: draft the target's argmax half of the time
        rstart = torch.cumsum(torch.tensor([0] + [x + 1 for x in k[:-1]]), 0)
        at = 0
        for i in range(n):
            for j in range(k[i]):
                if torch.rand((), generator=gen) < 0.5:
                    drafts[at] = logits[rstart[i] + j].argmax()
                at += 1
    dl = dp = None
    if draft == "logits":
        dl = logits[[r for i in range(n) for r in range(int(sum(k[:i])) + i,
                                                        int(sum(k[:i])) + i + k[i])], :vd]
        dl = dl + torch.randn(dl.shape, generator=gen)
    elif draft == "probs":
        dp = torch.softmax(torch.randn(sum(k), vd, generator=gen) * 3, dim=-1)
    if nan_shard is not None and rows:
        s = -(-vocab // world)
        col = min(vocab - 1, nan_shard * s + 1)
        logits[0, col] = math.nan
    outputs = [[int(torch.randint(vocab, (1,), generator=gen)) for _ in range(3)]
               for _ in range(n)]
    prompts = [[int(torch.randint(vocab, (1,), generator=gen)) for _ in range(4)] + [2]
               for _ in range(n)]
    positions = None if fresh else torch.randint(10**6, (n,), generator=gen)

    def batch_for(r: int) -> SamplingBatch:
        torch.manual_seed(77 * case + r)
        return SamplingBatch.from_params(params, vocab_size=vocab, prompt_token_ids=prompts,
                                         output_token_ids=outputs, eos_token_ids=[vocab - 2],
                                         device=device)

    ref_batch, my_batch = batch_for(0), batch_for(rank)
    logits = logits.to(dtype)
    fails = report["failures"]
    tag = f"case {case} (V={vocab}, W={world}, {op}, {draft}, {method}, {[p for p in params]})"
    local = _shard(logits, rank, world, vocab, gen).to(device)
    logits, drafts = logits.to(device), drafts.to(device)
    dl = None if dl is None else dl.to(device)
    dp = None if dp is None else dp.to(device)
    try:
        if op == "sample":
            ref = specsample.sample(logits, ref_batch, positions=positions, strict=False)
            with _backend(dist_backend):
                got = sd.sample(local, my_batch, positions=positions, strict=False)
            pairs = [("token_ids", ref.token_ids, got.token_ids)]
        else:
            kw = {}
            if dl is not None:
                kw["local_draft_logits"] = _shard(dl.cpu(), rank, world, vocab, gen,
                                                  trim=trim_draft).to(device)
            if dp is not None:
                kw["local_draft_probs"] = _shard(dp.cpu(), rank, world, vocab, gen,
                                                 trim=trim_draft).to(device)
            ref = specsample.verify(logits, drafts, k, ref_batch, draft_logits=dl,
                                    draft_probs=dp, positions=positions, method=method,
                                    strict=False)
            with _backend(dist_backend):
                got = sd.verify(local, drafts, k, my_batch, positions=positions,
                                method=method, strict=False, **kw)
            pairs = [("token_ids", ref.token_ids, got.token_ids),
                     ("num_accepted", ref.num_accepted, got.num_accepted)]
        pairs += [("invalid", ref.invalid, got.invalid),
                  ("logprob ids", ref.logprob_token_ids, got.logprob_token_ids),
                  ("logprobs", ref.logprobs, got.logprobs)]
        for what, a, b in pairs:
            _close(None if a is None else a.cpu(), None if b is None else b.cpu(),
                   f"{tag}: {what}", fails)
    except Exception:  # noqa: BLE001
        fails.append(f"{tag}: {traceback.format_exc()}")
    report["cases"] += 1


@contextlib.contextmanager
def _backend(name: str | None):
    """``$SPECSAMPLE_BACKEND`` set to ``name`` (None: left as it is) inside the block."""
    before = os.environ.get("SPECSAMPLE_BACKEND")
    if name is not None:
        os.environ["SPECSAMPLE_BACKEND"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("SPECSAMPLE_BACKEND", None)
        else:
            os.environ["SPECSAMPLE_BACKEND"] = before


def _equivalence_cases(rank: int, world: int, report: dict) -> None:
    case = 0
    v_small = 3000 if world == 3 else 5003  # world 3: S = 1000 < TILE, tiles straddle ranks
    for vocab in (v_small, 4099):
        for op in ("sample", "verify"):
            for kind in KINDS:
                case += 1
                _case(rank, world, case, report, vocab=vocab, op=op, kinds=[kind])
    for draft in ("logits", "probs"):
        for method in ("token", "block"):
            for kinds in (["plain"], ["greedy", "plain"], ["top_k", "top_p", "penalties"]):
                case += 1
                _case(rank, world, case, report, vocab=v_small, op="verify", draft=draft,
                      method=method, kinds=kinds)
            case += 1
            _case(rank, world, case, report, vocab=v_small, op="verify", draft=draft,
                  method=method, kinds=["plain", "min_p"], draft_vocab=v_small - 700,
                  trim_draft=True)
    case += 1
    _case(rank, world, case, report, vocab=v_small, op="verify", method="block",
          kinds=["plain"])
    for dtype in (torch.bfloat16, torch.float16):
        case += 1
        _case(rank, world, case, report, vocab=v_small, op="verify", dtype=dtype)
    for shard in range(world):
        case += 1
        _case(rank, world, case, report, vocab=v_small, op="verify", nan_shard=shard)
    case += 1
    _case(rank, world, case, report, vocab=v_small, op="sample", ties=True,
          kinds=["top_k", "top_p", "all_filters", "greedy"])
    case += 1
    _case(rank, world, case, report, vocab=v_small, op="verify", fresh=True)
    case += 1
    _case(rank, world, case, report, vocab=4 if world == 3 else 3, op="verify",
          kinds=["plain", "greedy", "top_k"])  # world 3, V = 4: the last rank holds nothing
    case += 1
    _case(rank, world, case, report, vocab=9000, op="verify", draft="logits",
          kinds=["plain", "top_p"])


@pytest.mark.parametrize("world", [2, 3])
def test_equivalence_gloo(world):
    reports = _passing_reports(world, "_equivalence_cases")
    assert all(r["cases"] == reports[0]["cases"] > 40 for r in reports)


def _kernel_cases(rank: int, world: int, report: dict, device: str = "cpu") -> None:
    """The Triton launches of the temperature-only path (Triton's interpreter on CPU
    tensors) against single-device sample() / verify() (the torch backend) on the whole
    rows; every call must have taken that path."""
    paths.reset()
    case = 800
    v_small = 3000 if world == 3 else 5003  # world 3: S = 1000 < TILE, tiles straddle ranks
    common = dict(logprobs=False, dist_backend="triton", device=device)
    vocabs = (v_small, 20000) + ((151936,) if device != "cpu" else ())
    for vocab in vocabs:
        for op in ("sample", "verify"):
            for kinds in (["plain"], ["greedy", "plain"]):
                case += 1
                _case(rank, world, case, report, vocab=vocab, op=op, kinds=kinds, **common)
    for method in ("token", "block"):
        for dtype in (torch.bfloat16, torch.float16):
            case += 1
            _case(rank, world, case, report, vocab=v_small, op="verify", dtype=dtype,
                  method=method, kinds=["greedy", "plain"], **common)
    for shard in range(world):
        case += 1
        _case(rank, world, case, report, vocab=v_small, op="verify", nan_shard=shard,
              kinds=["greedy", "plain"], **common)
    case += 1
    _case(rank, world, case, report, vocab=v_small, op="sample", ties=True,
          kinds=["greedy", "plain"], **common)
    case += 1
    _case(rank, world, case, report, vocab=v_small, op="verify", fresh=True,
          kinds=["greedy", "plain"], **common)
    case += 1
    _case(rank, world, case, report, vocab=4 if world == 3 else 3, op="verify",
          kinds=["plain", "greedy"], **common)  # world 3, V = 4: the last rank holds nothing
    taken = paths.counts()
    other = sorted(p for p in taken if p.startswith("distributed.") and
                   not p.endswith(".kernels"))
    if other or sum(v["calls"] for p, v in taken.items() if p.endswith(".kernels")) != (
            report["cases"]):
        report["failures"].append(f"paths taken: {taken}")


@pytest.mark.parametrize("world", [2, 3])
def test_kernels_equal_single_device_gloo(world):
    reports = _passing_reports(world, "_kernel_cases")
    assert all(r["cases"] == reports[0]["cases"] > 12 for r in reports)


def _kernel_cases_cuda(rank: int, world: int, report: dict) -> None:
    _kernel_cases(rank, world, report, device="cuda:0")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_kernels_equal_single_device_gloo_one_gpu(world):
    # (gloo ranks sharing one GPU: the kernels run compiled; NCCL needs a GPU per rank)
    reports = _passing_reports(world, "_kernel_cases_cuda")
    assert all(r["cases"] == reports[0]["cases"] > 12 for r in reports)


# --------------------------------------------------------------------------- errors


def _expect(report: dict, what: str, exc: type, fn) -> None:
    try:
        fn()
    except exc as e:
        report.setdefault("messages", []).append(f"{what}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        report["failures"].append(f"{what}: raised {type(e).__name__}: {e}")
        return
    report["failures"].append(f"{what}: did not raise {exc.__name__}")


def _error_cases(rank: int, world: int, report: dict, dist_backend: str | None = None
                 ) -> None:
    import specsample.distributed as sd

    if dist_backend is not None:  # (the references below run the torch backend)
        os.environ["SPECSAMPLE_BACKEND"] = dist_backend

    vocab = 3001
    s = -(-vocab // world)
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.0, seed=2)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab)
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2 + 3, vocab, generator=gen)
    local = _shard(full, rank, world, vocab, gen)
    drafts, k, pos = torch.tensor([1, 2, 3]), [3, 0], torch.tensor([10, 20])

    def good(d=drafts):
        with _backend("torch"):
            ref = specsample.verify(full, d, k, batch, positions=pos)
        got = sd.verify(local, d, k, batch, positions=pos)
        if not (torch.equal(ref.token_ids, got.token_ids) and
                torch.equal(ref.num_accepted, got.num_accepted)):
            report["failures"].append(f"out of step after an error, or wrong: {ref} {got}")

    last = rank == world - 1
    # rows differ between ranks (the last rank's call is locally invalid)
    _expect(report, "rows", ValueError, lambda: sd.verify(
        local[:4] if last else local, drafts, k, batch, positions=pos))
    good()
    # a shard of the wrong width on one rank
    _expect(report, "width", ValueError, lambda: sd.verify(
        local[:, :-1] if last else local, drafts, k, batch, positions=pos))
    good()
    # a different vocabulary on one rank (its shard width then also disagrees)
    other = SamplingBatch.from_params(params, vocab_size=vocab + world)
    _expect(report, "vocab", ValueError, lambda: sd.verify(
        _shard(torch.randn(5, vocab + world), rank, world, vocab + world, gen) if last
        else local, drafts, k, other if last else batch, positions=pos))
    good()
    # locally valid, globally inconsistent: one rank verifies with method "block"
    _expect(report, "method", ValueError, lambda: sd.verify(
        local, drafts, k, batch, positions=pos, method="block" if last else "token"))
    good()
    # a ValueError on one rank only (bad positions shape)
    _expect(report, "positions", ValueError, lambda: sd.verify(
        local, drafts, k, batch, positions=torch.tensor([1]) if last else pos))
    good()
    # draft probs on one rank only
    probs = torch.full((3, s), 1.0 / vocab)
    _expect(report, "draft kind", ValueError, lambda: sd.verify(
        local, drafts, k, batch, positions=pos, local_draft_probs=probs if last else None))
    good()
    # positions=None with user seeds: every rank fails locally
    _expect(report, "seeded without positions", ValueError,
            lambda: sd.verify(local, drafts, k, batch))
    good()
    # NaN on one shard: SamplingError on every rank with strict=True, invalid with False
    bad = local.clone()
    if last:
        bad[0, 0] = math.nan
    _expect(report, "strict NaN", SamplingError, lambda: sd.verify(
        bad, drafts, k, batch, positions=pos))
    out = sd.verify(bad, drafts, k, batch, positions=pos, strict=False)
    if out.invalid.tolist() != [True, False] or out.token_ids[0].tolist() != [-1] * 4:
        report["failures"].append(f"NaN on one shard: {out}")
    good()
    # a draft id outside [0, V): that request is invalid
    wrong = torch.tensor([1, vocab, 3])
    _expect(report, "strict draft id", SamplingError, lambda: sd.verify(
        local, wrong, k, batch, positions=pos))
    out = sd.verify(local, wrong, k, batch, positions=pos, strict=False)
    if out.invalid.tolist() != [True, False]:
        report["failures"].append(f"draft id V: {out}")
    # a -1 placeholder ends the request's drafts
    good(torch.tensor([full[0].argmax().item(), -1, 3]))
    # ranks whose backends would take different paths (different collectives), and a
    # backend setting that fails on one rank only
    with _backend("torch" if last else "triton"):
        _expect(report, "path", ValueError, lambda: sd.verify(
            local, drafts, k, batch, positions=pos))
    with _backend("tirton" if last else None):
        _expect(report, "backend", ValueError, lambda: sd.verify(
            local, drafts, k, batch, positions=pos))
    good()
    report["cases"] += 1
    report["paths"] = sorted(paths.counts())


def _error_cases_kernels(rank: int, world: int, report: dict) -> None:
    _error_cases(rank, world, report, dist_backend="triton")


@pytest.mark.parametrize("world, path", [(2, "torch"), (3, "torch"), (2, "kernels")])
def test_errors_raise_on_every_rank(world, path):
    reports = _passing_reports(world, "_error_cases" + ("_kernels" if path == "kernels" else ""))
    for r in reports:
        assert r["cases"] == 1 and len(r["messages"]) == 11, r.get("messages")
        assert "distributed.verify." + path in r["paths"], r["paths"]
    # every rank names the problem
    assert any("positions must have shape" in m for m in reports[0]["messages"])
    assert any("disagree on path" in m for m in reports[0]["messages"])
    assert any("SPECSAMPLE_BACKEND must be" in m for m in reports[0]["messages"])


# ----------------------------------------------------------------------- statistics


def _chi_square_cases(rank: int, world: int, report: dict) -> None:
    """Distributed sample() against the exact softmax (a G-test on the top tokens + rest),
    and the same test on a deliberately wrong sampler (temperature 1.15 for 1.0), which it
    must reject."""
    import numpy as np
    from scipy import stats

    import specsample.distributed as sd

    vocab, n = 4500, 4000
    gen = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=gen) * 2.5
    p = torch.softmax(row.double(), -1)
    order = torch.argsort(p, descending=True)
    top = order[:30]
    local = _shard(row[None].expand(n, vocab), rank, world, vocab, gen)

    def counts(temperature: float) -> np.ndarray:
        batch = SamplingBatch.from_params(
            [SamplingParams(temperature=temperature, seed=i) for i in range(n)],
            vocab_size=vocab)
        tok = sd.sample(local, batch, positions=torch.full((n,), 7)).token_ids
        hit = (tok[:, None] == top[None, :])
        c = hit.sum(0).numpy()
        return np.append(c, n - c.sum())

    expected = np.append(p[top].numpy(), 1 - p[top].sum().item()) * n
    for temperature, should_pass in ((1.0, True), (1.15, False)):
        pv = stats.power_divergence(counts(temperature), expected,
                                    lambda_="log-likelihood").pvalue
        report.setdefault("pvalues", []).append(float(pv))
        if should_pass != (pv > 1e-4):
            report["failures"].append(f"T={temperature}: p = {pv}")
    report["cases"] += 1


def test_chi_square_against_softmax():
    reports = _run_spawned(2, "_chi_square_cases")
    fails = [f for r in reports for f in r["failures"]]
    assert not fails, fails
    assert reports[0]["pvalues"] == reports[1]["pvalues"]


# --------------------------------------------------------------------------- warmup


def _warmup_cases(rank: int, world: int, report: dict) -> None:
    from specsample import distributed

    for kw in (dict(draft_vocab_size=2000), {}):  # a shorter drafter's vocabulary, the same
        report["calls"] = distributed.warmup(3001, dtypes=(torch.bfloat16, torch.float32),
                                             **kw)
        report["cases"] += 1
    for bad, what in ((dict(on_compile="loud"), "on_compile"), (dict(vocab_size=0), "vocab"),
                      (dict(dtypes=(torch.int32,)), "dtype")):
        try:
            distributed.warmup(**dict(dict(vocab_size=64), **bad))
            report["failures"].append(f"no error for {bad}")
        except ValueError as e:
            if what not in str(e):
                report["failures"].append(f"{bad}: {e}")


def test_warmup_runs_on_every_rank_gloo():
    # (on CPU tensors it compiles nothing: the calls run and the same count comes back)
    reports = _passing_reports(2, "_warmup_cases")
    assert [r["calls"] for r in reports] == [2 * 3 * (4 + 2 * 3)] * 2


# ----------------------------------------------------------------------------- NCCL


def _gpu_cases(rank: int, world: int, report: dict) -> None:
    case = 500
    for backend in ("torch", "triton"):
        os.environ["SPECSAMPLE_BACKEND"] = backend
        for vocab, dtype in ((151936, torch.bfloat16), (5003, torch.float32)):
            for op, draft, method, kinds in (
                    ("sample", "onehot", "token", None),
                    ("verify", "onehot", "token", ["plain", "greedy"]),
                    ("verify", "onehot", "token", ["top_k", "top_p", "min_p", "all_filters"]),
                    ("verify", "logits", "token", ["plain", "top_p"]),
                    ("verify", "probs", "block", ["plain", "greedy"]),
                    ("verify", "onehot", "block", ["penalties", "bans", "bias"])):
                case += 1
                _case(rank, world, case, report, vocab=vocab, op=op, draft=draft,
                      method=method, kinds=kinds, dtype=dtype, device=f"cuda:{rank}")


def _gpu_warmup_cases(rank: int, world: int, report: dict) -> None:
    # warmup, then calls of other shapes and options: nothing compiles (on_compile="raise")
    from specsample import distributed, triton_backend

    os.environ["SPECSAMPLE_BACKEND"] = "triton"
    distributed.warmup(151936, on_compile="raise")
    try:
        case = 600
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for op, draft, method, kinds in (
                    ("sample", "onehot", "token", None),
                    ("verify", "onehot", "token", ["plain", "greedy", "top_p"]),
                    ("verify", "logits", "block", ["plain", "top_k", "bias"]),
                    ("verify", "probs", "token", ["min_p", "penalties"])):
                case += 1
                _case(rank, world, case, report, vocab=151936, op=op, draft=draft,
                      method=method, kinds=kinds, dtype=dtype, device=f"cuda:{rank}")
        report["compiles"] = triton_backend.compilations_after_warmup()
    finally:
        triton_backend.disarm_compile_guard()


def _two_gpu_reports(target: str) -> list[dict]:
    """``target`` on two NCCL ranks (skipped without two GPUs); fails on any rank's failure."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    return _passing_reports(2, target, backend="nccl")


@pytest.mark.gpu
def test_warmup_then_nothing_compiles_nccl_two_gpus():
    reports = _two_gpu_reports("_gpu_warmup_cases")
    assert [r["compiles"] for r in reports] == [[], []]


@pytest.mark.gpu
def test_equivalence_nccl_two_gpus():
    assert _two_gpu_reports("_gpu_cases")[0]["cases"] == 24
