"""Warm means warm (GPU): on a fresh Triton cache, ``warmup()`` then a sweep of batch shapes
and options compiles nothing.

The sweep runs in a subprocess of its own (a fresh ``TRITON_CACHE_DIR`` and no kernel compiled
earlier in the process, which would hide a missing variant): batch sizes 1..300 (primes and
powers of two and their neighbours), 0..8 draft tokens with the count varying by request,
every dtype, draft kind (one-hot, draft_logits, draft_probs) and method, trees, and option
mixes (greedy / seeded / unseeded, min_p / top_k / top_p, penalties, logit bias, bans,
logprobs raw and processed), all with ``on_compile="raise"``. It prints one JSON line: the
warmup's seconds and report, the calls made and any compile after warmup.

Run by hand: ``PYTHONPATH=src python tests/test_warmup_sweep.py [vocab [device [batches]]]``
(batches comma-separated).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest
import torch

BATCHES = (1, 2, 3, 5, 7, 11, 13, 16, 17, 31, 32, 33, 61, 64, 97, 127, 128, 131, 199, 256,
           257, 293, 300)


def _option_mixes(gen: torch.Generator, vocab: int):
    """Per-request SamplingParams keyword sets, one list per mix (cycled over requests)."""
    from specsample import SamplingParams as P

    def t():
        return float(torch.rand((), generator=gen)) + 0.3

    plain = [dict(temperature=0.0), dict(temperature=t(), seed=3), dict(temperature=t())]
    filters = [dict(temperature=0.0), dict(temperature=t(), seed=4, top_k=20, top_p=0.8),
               dict(temperature=t(), min_p=0.05), dict(temperature=t(), seed=5, top_p=0.9)]
    general = [dict(temperature=t(), seed=6, presence_penalty=0.5, frequency_penalty=0.2),
               dict(temperature=0.0, repetition_penalty=1.2),
               dict(temperature=t(), logit_bias={1: 2.0, vocab - 1: -1.0}, top_k=50),
               dict(temperature=t(), seed=7, allowed_token_ids=list(range(0, vocab, 7))),
               dict(temperature=t(), bad_words_token_ids=[[5, 9], [11]], min_tokens=3,
                    stop_token_ids=[2])]
    # (bans alone: processed in the kernels as logit_bias alone is)
    bans = [dict(temperature=t(), seed=13, allowed_token_ids=list(range(3, vocab, 5))),
            dict(temperature=0.0, bad_words_token_ids=[[5, 9], [11]], min_tokens=3,
                 stop_token_ids=[2], top_p=0.9),
            dict(temperature=t())]
    logprobs = [dict(temperature=t(), seed=8, logprobs=5),
                dict(temperature=0.0, logprobs=0, logprobs_mode="processed"),
                dict(temperature=t(), logprobs=20, logprobs_mode="processed", top_p=0.9),
                dict(temperature=t(), seed=9, logprobs=1, logprobs_mode="raw", min_p=0.02),
                dict(temperature=t(), seed=10)]
    # (raw top-n with the processing in the kernels: the raw tiles ranked apart)
    raw_topn = [dict(temperature=t(), seed=11, logprobs=3, presence_penalty=0.3),
                dict(temperature=t(), logprobs=0, logprobs_mode="processed",
                     logit_bias={4: 1.0}),
                dict(temperature=0.0, logprobs=2, logprobs_mode="raw",
                     repetition_penalty=1.1)]
    # (processed top-n and logprobs = 0 with the processing in the kernels: ranked by z' with
    # logit_bias / penalties, by z with bans alone)
    processed_topn = [dict(temperature=t(), seed=12, logprobs=2, logprobs_mode="processed",
                           presence_penalty=0.3),
                      dict(temperature=0.0, logprobs=4, logprobs_mode="processed",
                           logit_bias={4: 1.0}),
                      dict(temperature=t(), logprobs=0, top_k=30)]
    bans_lp = [dict(temperature=t(), seed=14, logprobs=3, logprobs_mode="processed",
                    bad_words_token_ids=[[5, 9], [11]], top_p=0.9),
               dict(temperature=t(), logprobs=0, allowed_token_ids=list(range(3, vocab, 5)))]
    return {name: [P(**kw) for kw in mix] for name, mix in
            (("plain", plain), ("filters", filters), ("general", general), ("bans", bans),
             ("logprobs", logprobs), ("raw_topn", raw_topn),
             ("processed_topn", processed_topn), ("bans_lp", bans_lp))}


def sweep(vocab: int, dev: str = "cuda", batches=BATCHES, on_compile: str = "raise") -> dict:
    import specsample
    from specsample import SamplingBatch, triton_backend

    t0 = time.perf_counter()
    specsample.warmup(dev, vocab_size=vocab, on_compile=on_compile)
    if dev == "cuda":
        torch.cuda.synchronize()
    result = {"vocab": vocab, "warmup_s": round(time.perf_counter() - t0, 2),
              "report": triton_backend.warmup_report()}
    gen = torch.Generator().manual_seed(0)
    dgen = torch.Generator(device=dev).manual_seed(1)  # (the large tensors, made on dev)

    def rows(n_rows, dtype):
        return (torch.randn(n_rows, vocab, generator=dgen, device=dev) * 3).to(dtype)

    mixes = _option_mixes(gen, vocab)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    kinds = ("onehot", "draft_logits", "draft_probs")
    calls, errors = 0, []

    def call(desc, fn, *args, **kwargs):
        nonlocal calls
        calls += 1
        try:
            fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (every failure is reported with its call)
            errors.append(f"{desc}: {e!r}"[:300])

    for i, n in enumerate(batches):
        for j, (name, mix) in enumerate(mixes.items()):
            c = i * len(mixes) + j
            k_max, dtype = c % 9, dtypes[c % 3]
            kind, method = kinds[(c // 3) % 3], ("token", "block")[(c // 9) % 2]
            params = [mix[r % len(mix)] for r in range(n)]
            if c % 5 == 0:  # unseeded requests keyed by the batch's counter (positions=None)
                params = [dataclasses.replace(p, seed=None) for p in params]
            ks = torch.randint(0, k_max + 1, (n,), generator=gen)
            if c % 4 == 0:
                ks[:] = k_max  # every request at K as well as varying counts
            m = int(ks.sum())
            history = [torch.randint(0, vocab, (r % 5,), generator=gen).tolist()
                       for r in range(n)]
            batch = SamplingBatch.from_params(params, vocab_size=vocab, device=dev,
                                              prompt_token_ids=history,
                                              output_token_ids=history)
            logits = rows(n + m, dtype)
            drafts = torch.randint(0, vocab, (m,), generator=gen).to(dev)
            pos = None if c % 5 == 0 else torch.randint(0, 1000, (n,), generator=gen).to(dev)
            extra = {}
            if kind != "onehot":
                dl = rows(m, dtypes[(c + 1) % 3])
                extra = ({"draft_logits": dl} if kind == "draft_logits"
                         else {"draft_probs": torch.softmax(dl.float(), -1).to(dl.dtype)})
            desc = f"B={n} K<={k_max} {name} {dtype} {kind} {method}"
            call(f"verify {desc}", specsample.verify, logits, drafts, ks, batch, positions=pos,
                 method=method, strict=False, **extra)
            call(f"sample {desc}", specsample.sample, logits[:n], batch, positions=pos,
                 strict=False)
            if c % 3 == 0:  # trees: a root with two children, one of which starts a chain
                nodes = [min(int(x), 8) for x in ks]
                par, tok = [], []
                for q in nodes:
                    par += ([0, 0, 1] + list(range(3, q)))[:q]
                    tok += torch.randperm(vocab, generator=gen)[:q].tolist()
                call(f"verify_tree {desc}", specsample.verify_tree, rows(n + sum(nodes), dtype),
                     tok, par, nodes, batch,
                     positions=pos, strict=False)
    if dev == "cuda":
        torch.cuda.synchronize()
    result.update(calls=calls, errors=errors,
                  compiles_after_warmup=triton_backend.compilations_after_warmup())
    return result


# integer arguments a kernel may be specialised on (Triton compiles a variant for a value of 1
# and one for a multiple of 16): the vocabulary and the row strides, fixed in a deployment,
# and the penalty counts' row stride CV (V, or 0 without penalties: warmup runs both); for
# specsample.distributed, the world size W, the shard width S and this rank's columns (off, w)
FIXED_PER_DEPLOYMENT = {"V", "DV", "stride", "dstride", "raw_stride", "proc_stride", "CV",
                        "W", "S", "off", "w"}


def _kernels():
    """(name, arguments a launch may specialise on) of every launched kernel of the package,
    as jitted or as Triton's interpreter wraps them."""
    import inspect

    from specsample import _distributed_kernels  # noqa: F401 (imports the kernels)
    from specsample.triton_backend import filters, kernels, logprobs, tree  # noqa: F401

    for name, mod in list(sys.modules.items()):
        if not name.startswith("specsample") or mod is None:
            continue
        for obj in vars(mod).values():
            fn = getattr(obj, "fn", None)
            if not callable(fn) or not getattr(fn, "__name__", "").endswith("_kernel"):
                continue
            nospec = set(getattr(obj, "kwargs", {}).get("do_not_specialize", ())) | {
                p.name for p in getattr(obj, "params", ()) if p.do_not_specialize}
            ints = {n for n, p in inspect.signature(fn).parameters.items()
                    if "constexpr" not in str(p.annotation) and not n.endswith("_ptr")}
            yield fn.__name__, ints - nospec


def test_no_kernel_is_specialised_on_a_value_that_varies_by_step():
    pytest.importorskip("triton")
    found = dict(_kernels())
    assert {"stats_kernel", "select_kernel", "logprob_merge_kernel",
            "_uniform_kernel"} <= set(found)
    for name, specialised in found.items():
        assert specialised <= FIXED_PER_DEPLOYMENT, (name, specialised)


@pytest.mark.gpu
def test_fresh_cache_warmup_then_the_sweep_compiles_nothing(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton_cache"))
    src = os.path.join(os.path.dirname(__file__), "..", "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, __file__, "151936"], env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["errors"] == [], result["errors"]
    assert result["compiles_after_warmup"] == []
    report = result["report"]
    assert "error" not in report and report["failed"] == [], report
    assert report["variants"] > 150 and report["manifest"] == "written", report
    assert report["launcher_errors"] == [], report  # (the workers built every launcher)
    assert report["compiled"] + report["cached"] == report["variants"]
    # the calls then loaded every variant from the cache: the workers compiled them all
    assert report["compiled_serially"] == [] and report["loaded"] >= report["variants"]
    assert result["calls"] >= 2 * len(BATCHES) * 5


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(sweep(int(args[0]) if args else 151936, *args[1:2],
                           *([tuple(int(b) for b in args[2].split(","))] if args[2:] else []))))
