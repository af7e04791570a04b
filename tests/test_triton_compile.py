"""The Triton kernels compile for a GPU (sm_90), checked on a machine without one.

On CPU the test suite runs the kernels in Triton's interpreter, which executes their Python
with NumPy and so misses errors that only the compiler raises: a variable assigned tensors of
different shapes in the two branches of an ``if``, or a placeholder tensor of another dtype
passed where the kernel does pointer arithmetic or atomics on an int32 pointer. Two such
errors were only found on a rented GPU.

This test records the launches that a representative set of public calls makes in the
interpreter (``sample()``; ``verify()`` with one-hot drafts, draft_logits and draft_probs,
token and block methods; plain temperature, min_p / top_k / top_p, the general path;
logprobs None / 0 / 5 / 20 raw and processed; bf16, fp16 and fp32 logits; ``verify_tree()``):
each kernel with its arguments' Triton types and its constexpr values, as Triton's JIT types
them (without its alignment and value-1 specialisations, which only tune the code). A
subprocess without ``TRITON_INTERPRET`` then compiles the distinct variants for sm_90 with
num_warps=4, in parallel over the machine's cores (no GPU is needed): the first variant of
each kernel all the way to a cubin with ``triton.compile`` (front end, LLVM and the wheel's
ptxas), the others, which differ in their constexpr values or their arguments' types, through
the front end (``ASTSource.make_ir``, where type and shape errors are raised: both faults
found on a GPU were of that kind). Every variant to a cubin took 68 s on two cores instead of
25 s (85 cubins instead of 21), most of it in LLVM; the GPU's own warmup compiles them all.

The constexprs that the launchers choose differently when interpreting (``GPU_VALUES``: the
filters' candidate capacity) are compiled with their CUDA values,
the ones a GPU compiles. The test skips when triton has no nvidia backend or no ptxas.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams

triton_backend = pytest.importorskip("specsample.triton_backend")

from triton.runtime import interpreter  # noqa: E402
from triton.runtime.jit import mangle_type  # noqa: E402

from test_tree_triton import _case as _tree_case  # noqa: E402
from test_triton_backend import _case  # noqa: E402
from test_triton_logprobs import _with_logprobs  # noqa: E402

KERNEL_MODULES = ["kernels", "filters", "logprobs", "tree", "layout"]
# constexpr name -> the value the CUDA launcher passes where the interpreted one differs
# (WB: specsample.distributed's rank lanes, 1 in the one-rank group the test runs; GDC:
# programmatic dependent launch, which the interpreter never asks for)
GPU_VALUES = {"CAP": triton_backend.FILTER_CAP, "WB": 2, "GDC": True}
SRC = Path(specsample.__file__).resolve().parents[1]  # the subprocess compiles this copy

# Logprob requests cycled over a batch's requests: (n, mode).
RAW_AND_PROCESSED = [(None, "raw"), (0, "raw"), (5, "raw"), (20, "processed"),
                     (0, "processed"), (5, "processed")]
PROCESSED_ONLY = [(None, "raw"), (0, "raw"), (5, "processed"), (20, "processed")]
GENERAL = dict(logit_bias={3: 1.5}, presence_penalty=0.4)

_HELPER = r"""
import concurrent.futures, importlib, json, multiprocessing, sys
import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

TARGET = GPUTarget("cuda", 90, 32)
OPTIONS = {"num_warps": 4}


def compile_one(v):
    fn = getattr(importlib.import_module(v["module"]), v["name"])
    try:
        src = ASTSource(fn=fn, signature=v["signature"], constexprs=v["constexprs"])
        if v["full"]:
            compiled = triton.compile(src, target=TARGET, options=OPTIONS)
            # (programmatic dependent launch: the wait must be in the code, before any load)
            if v["constexprs"].get("GDC") is True:
                ptx = compiled.asm["ptx"]
                wait = ptx.find("griddepcontrol.wait")
                load = min([i for i in (ptx.find("ld.global"), ptx.find("atom.global"))
                            if i >= 0] or [len(ptx)])
                if not 0 <= wait < load:
                    return dict(v, error="griddepcontrol.wait missing or after a load")
        else:  # the front end only, as triton.compile starts
            backend = make_backend(TARGET)
            options = backend.parse_options(OPTIONS)
            context = ir.context()
            ir.load_dialects(context)
            backend.load_dialects(context)
            src.make_ir(TARGET, options, backend.get_codegen_implementation(options),
                        backend.get_module_map(), context)
    except Exception as e:
        return dict(v, error=f"{type(e).__name__}: {e}")
    return None


def main(path, workers):
    try:
        if "nvidia" not in triton.backends.backends:
            raise RuntimeError("triton has no nvidia backend")
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90).version  # runs ptxas --version
    except Exception as e:
        print(json.dumps({"unavailable": f"{type(e).__name__}: {e}"}))
        return
    variants = json.load(open(path))
    for module in {v["module"] for v in variants}:  # once, before the workers fork
        importlib.import_module(module)
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("fork")) as pool:
        failures = [f for f in pool.map(compile_one, variants) if f is not None]
    print(json.dumps({"compiled": len(variants), "failures": failures}))


main(sys.argv[1], int(sys.argv[2]))
"""


def _variant(fn, args, kwargs) -> dict:
    """A launch as Triton's JIT types it: {module, name, signature, constexprs}; launch
    options (num_warps, ...) are not parameters and are left out."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args))
    bound.update((k, v) for k, v in kwargs.items() if k in params)
    signature, constexprs = {}, {}
    for name, p in params.items():
        value = bound.get(name, p.default)
        assert value is not inspect.Parameter.empty, f"{fn.__name__}: {name} not passed"
        if "constexpr" in str(p.annotation) or value is None:
            value = getattr(value, "value", value)
            constexprs[name] = GPU_VALUES.get(name, value)
            signature[name] = "constexpr"
        else:
            signature[name] = mangle_type(value)
    return dict(module=fn.__module__, name=fn.__name__, signature=signature,
                constexprs=constexprs)


def _verify(seed, vocab, dtype, kind, method, processors, lps):
    """verify() of 4 requests of ``test_triton_backend._case`` with logprobs ``lps``."""
    logits, d, ks, batch, pos, extra = _case(seed, 4, vocab, dtype, kind, processors=processors)
    if lps is not None:
        batch = _with_logprobs(batch, lps, vocab)
    specsample.verify(logits, d, ks, batch, positions=pos, method=method, strict=False, **extra)


def _penalised_verify(dtype, separate: bool = False, filters: dict | None = None):
    """verify() of one-hot drafts with logit_bias and penalties applied in the kernels (and
    ``filters``, cut on the processed rows)."""
    from test_triton_penalties import CASES
    from test_triton_penalties import _case as _pen_case

    logits, d, ks, batch, pos = _pen_case(2, 4, 300, dtype, CASES[3][1] | (filters or {}))
    with triton_backend.separate_launches() if separate else contextlib.nullcontext():
        specsample.verify(logits, d, ks, batch, positions=pos, strict=False)


def _verify_tree(logits, tokens, parents, num_nodes, batch, pos):
    specsample.verify_tree(logits, tokens, parents, num_nodes, batch, positions=pos, strict=False)


def _sample(dtype, vocab, cases):
    """sample() of one request per (temperature, logprobs, mode, extra params)."""
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(len(cases), vocab, generator=gen) * 2).to(dtype)
    params = [SamplingParams(temperature=t, seed=i, logprobs=n, logprobs_mode=mode, **kw)
              for i, (t, n, mode, kw) in enumerate(cases)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device="cpu",
                                      prompt_token_ids=[[1, 2]] * len(cases),
                                      output_token_ids=[[2, 5]] * len(cases))
    specsample.sample(logits, batch, positions=torch.arange(len(cases)), strict=False)


def _fake_output(n, width, n_lp):
    lp = None if n_lp is None else torch.zeros(n, width, n_lp)
    return specsample.VerifyOutput(
        token_ids=torch.zeros(n, width, dtype=torch.int64),
        num_accepted=torch.zeros(n, dtype=torch.int64), logprobs=lp,
        logprob_token_ids=None if lp is None else torch.zeros(n, width, n_lp, dtype=torch.int64),
        invalid=torch.zeros(n, dtype=torch.bool))


def _calls():
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    rp, po = RAW_AND_PROCESSED, PROCESSED_ONLY
    yield lambda: _sample(bf16, 300, [(0.0, None, "raw", {}), (1.0, None, "raw", {})])
    yield lambda: _sample(bf16, 4000, [(0.0, 0, "raw", dict(top_p=0.9)),
                                       (0.8, 4, "processed", dict(top_k=5)),
                                       (1.0, None, "raw", dict(min_p=0.1))])
    yield lambda: _sample(fp16, 300, [(0.7, 3, "processed", GENERAL), (1.0, 0, "raw", {})])
    # raw logprobs=0 at T = 0.7: the raw normaliser's own pass, no top-n
    yield lambda: _sample(fp32, 300, [(0.7, 0, "raw", {})])
    # logit_bias / penalties in the kernels (triton_backend.penalties): the single launch,
    # and the separate launches
    yield lambda: _sample(fp16, 300, [(0.7, None, "raw", GENERAL), (0.0, None, "raw", GENERAL)])
    yield lambda: _penalised_verify(bf16)
    yield lambda: _penalised_verify(fp32, separate=True)
    # ... with the filters (PEN 2), and logit_bias alone with them (PEN 1)
    yield lambda: _penalised_verify(bf16, filters=dict(top_k=5, top_p=0.9, min_p=0.01))
    yield lambda: _sample(fp16, 300, [(0.7, None, "raw", dict(logit_bias={3: 1.5}, top_p=0.9)),
                                      (1.0, None, "raw", dict(logit_bias={4: 1.0}, min_p=0.1))])
    # bans alone with processed top-n (ranked by z: the logprob kernels' PEN 1, ZRANK off) and
    # a raw logprobs = 0 (the raw normaliser)
    yield lambda: _sample(bf16, 300, [(0.7, 3, "processed", dict(bad_words_token_ids=[[5]])),
                                      (0.0, 0, "raw", dict(min_tokens=9, stop_token_ids=[4]))])
    # raw top-n with penalties: the raw tiles' maxima and raw_topn_kernel
    yield lambda: _sample(fp16, 300, [(0.7, 3, "raw", GENERAL), (1.0, 2, "processed", GENERAL)])
    for i, (kind, method, processors, dtype, lps) in enumerate([
            ("onehot", "token", False, bf16, None),
            ("onehot", "token", False, fp16, rp),
            ("onehot", "block", False, fp32, rp),
            ("onehot", "token", "filters", bf16, rp),
            ("onehot", "block", True, fp16, po),
            ("onehot", "token", True, fp32, rp),  # raw top-n on the general path: PyTorch
            ("draft_logits", "token", False, bf16, rp),
            ("draft_logits", "block", "filters", fp16, rp),
            ("draft_logits", "block", True, fp32, po),
            ("draft_probs", "token", "filters", fp32, rp),
            ("draft_probs", "block", False, bf16, po),
            ("draft_probs", "block", True, bf16, [(0, "processed"), (None, "raw")])]):
        vocab = 2500 if i % 4 == 1 else 300  # two sampling tiles now and then
        yield lambda a=(7 + i, vocab, dtype, kind, method, processors, lps): _verify(*a)
    layout = importlib.import_module("specsample.triton_backend.layout")
    yield lambda: layout.device_layout(torch.tensor([1, 0, 2]), 2, 6, 3)
    yield lambda: layout.fresh_positions(SamplingBatch.from_params(
        [SamplingParams()] * 2, vocab_size=8, device="cpu"))  # (positions=None)
    for n_lp in (None, 2):
        yield lambda n_lp=n_lp: layout.mark_layout_errors(_fake_output(3, 3, n_lp),
                                                          torch.zeros(3, dtype=torch.int64),
                                                          torch.tensor([0, 256, 0]))
    for mode, kw in [("mixed", {}), ("sampled", dict(top_k=5, min_p=0.05)),
                     ("mixed", GENERAL)]:
        for lp in (2, None):  # (None: the walk kernel, its two variants)
            yield lambda m=mode, kw=kw, lp=lp: _verify_tree(
                *_tree_case(3, 3, 300, bf16, m, logprobs=lp, **kw))
    yield _captured_tree  # (the walk's third variant: the sibling check)
    yield _distributed_calls


def _distributed_calls():
    """specsample.distributed's launches (temperature-only calls: shard_pass_kernel and
    shard_final_kernel) in a one-rank gloo group, for bf16 and fp32 shards."""
    import tempfile

    import torch.distributed as dist

    import specsample.distributed as sd

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1)
        try:
            batch = SamplingBatch.from_params(
                [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)],
                vocab_size=300, device="cpu")
            pos = torch.arange(2)
            for dtype in (torch.bfloat16, torch.float32):
                logits = torch.randn(5, 300).to(dtype)
                sd.sample(logits[:2], batch, positions=pos, strict=False)
                sd.verify(logits, torch.tensor([1, 2, 3]), [2, 1], batch, positions=pos,
                          strict=False)
        finally:
            dist.destroy_process_group()


def _captured_tree():
    """verify_tree's CUDA-graph capture form, the capture state forced on (the structure laid
    out first by an eager call)."""
    from unittest import mock

    from specsample import api

    logits, tok, par, ms, batch, pos = _tree_case(4, 3, 300, torch.bfloat16, "mixed")
    _verify_tree(logits, tok, par, ms, batch, pos)
    with mock.patch.object(api, "_capturing", lambda: True):
        _verify_tree(logits, torch.tensor(tok), par, ms, batch, pos)


def _launch_form_errors(fn, args, kwargs) -> list[str]:
    """What keeps a launch off ``triton_backend.launch``'s direct path, or would make its key
    ambiguous: a constexpr given by position, a runtime parameter given by keyword."""
    params = list(inspect.signature(fn).parameters.values())
    is_const = ["constexpr" in str(p.annotation) for p in params]
    errors = [f"{fn.__name__}: constexpr {p.name} by position"
              for p, c in zip(params[:len(args)], is_const) if c]
    errors += [f"{fn.__name__}: runtime parameter {p.name} not by position"
               for p, c in zip(params[len(args):], is_const[len(args):]) if not c]
    return errors


_FORM_ERRORS: set[str] = set()


def _record(monkeypatch) -> list[dict]:
    """Run the calls with the Triton backend in the interpreter; the distinct launches (and
    each launch's form, ``_FORM_ERRORS``)."""
    seen = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        v = _variant(self.fn, args, kwargs)
        seen.setdefault(json.dumps(v, sort_keys=True), v)
        _FORM_ERRORS.update(_launch_form_errors(self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    for call in _calls():
        call()
    return list(seen.values())


def _kernels_of_the_backend() -> set[str]:
    out = set()
    for m in KERNEL_MODULES:
        mod = importlib.import_module(f"specsample.triton_backend.{m}")
        out |= {f"{mod.__name__}.{k}" for k, v in vars(mod).items()
                if isinstance(v, interpreter.InterpretedFunction) and k.endswith("_kernel")}
    return out


def test_kernels_compile_for_sm90(monkeypatch, tmp_path):
    if not isinstance(triton_backend.kernels.stats_kernel, interpreter.InterpretedFunction):
        pytest.skip("the kernels are compiled for real here (TRITON_INTERPRET is off)")
    variants = _record(monkeypatch)
    launched = {f"{v['module']}.{v['name']}" for v in variants}
    assert _kernels_of_the_backend() <= launched, (
        f"kernels no call launched (extend _calls): {_kernels_of_the_backend() - launched}")
    # Every launch in the form the direct launcher keys (runtime arguments by position,
    # constexprs by keyword; triton_backend.launch): otherwise it would take Triton's path.
    assert not _FORM_ERRORS, sorted(_FORM_ERRORS)

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    # the first variant of each kernel compiles to a cubin, the others (other constexprs or
    # argument types) through the front end; the cubins first (the longest)
    firsts = {}
    for v in variants:
        v["full"] = firsts.setdefault((v["module"], v["name"]), v) is v
    path = tmp_path / "variants.json"
    path.write_text(json.dumps(sorted(variants, key=lambda v: not v["full"])))
    workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    proc = subprocess.run([sys.executable, "-c", _HELPER, str(path), str(workers)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the compile subprocess failed:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in report:
        pytest.skip(f"cannot compile for sm_90 here: {report['unavailable']}")
    failures = report["failures"]
    print(f"compiled {report['compiled']} kernel variants for sm_90 ({len(firsts)} to a cubin), "
          f"{len(failures)} failed")
    by_error: dict[tuple[str, str], list[dict]] = {}
    for f in failures:
        by_error.setdefault((f"{f['module']}.{f['name']}", f["error"]), []).append(f)
    if by_error:
        pytest.fail(f"{len(failures)} of {report['compiled']} kernel variants do not compile "
                    "for sm_90 (the interpreter runs them; a GPU would not):\n\n" + "\n\n".join(
                        f"{kernel} in {len(fs)} variant(s), e.g. constexprs={fs[0]['constexprs']}"
                        f"\nsignature={fs[0]['signature']}\n{error}"
                        for (kernel, error), fs in by_error.items()), pytrace=False)
