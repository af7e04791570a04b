"""``triton_backend.compile_pool``: warmup's parallel compilation. Here the workers compile real
kernel variants for sm_90 (the compiler and ptxas need no GPU) into a fresh Triton cache, the
cache lookup then finds them, a variant that cannot compile is reported, not raised, the cache
keys do not depend on the order kernels are hashed, and (with a stand-in for the CUDA driver)
the whole collect -> workers -> launch flow loads what the workers wrote, kernels and their
launchers (against a stand-in libcuda). The checks run in
subprocesses without TRITON_INTERPRET, since the interpreter's kernels cannot be compiled;
tests/test_warmup_sweep.py runs warmup on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
# (one test worker runs the module's compile subprocess once: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("compile_pool")

SRC = str(Path(__file__).resolve().parents[1] / "src")

# The start of every driver below: the sm_90 target, or a skip on a Triton without NVIDIA's.
PREAMBLE = r'''
import json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend

TARGET = GPUTarget("cuda", 90, 32)
try:
    make_backend(TARGET)
except Exception as e:  # (a Triton build without the NVIDIA backend)
    print(json.dumps({"skip": repr(e)}))
    sys.exit(0)
'''


def _run(driver: str, cache: Path | None = None, timeout: int = 600) -> dict:
    """Run ``driver`` in a subprocess without TRITON_INTERPRET (with ``cache`` as Triton's
    cache), skip when it found no NVIDIA backend, and return its last JSON line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cache is not None:
        env["TRITON_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", driver], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(f"no NVIDIA backend in this Triton: {out['skip']}")
    return out

DRIVER = PREAMBLE + r'''
import inspect
from triton.runtime.jit import serialize_specialization_data
from specsample.triton_backend import compile_pool, logprobs

target = TARGET
POINTERS = {"raw_ptr": "*bf16", "proc_ptr": "*bf16", "num_acc_ptr": "*i64",
            "invalid_ptr": "*u8", "row_start_ptr": "*i64", "lp_n_ptr": "*i64",
            "lp_proc_ptr": "*u8", "cut_i_ptr": "*i32", "count_ptr": "*i32", "cand_ptr": "*i64",
            "rank_ptr": "*i64"}


def variant(kernel, constexprs, **pointer_types):
    # as Triton's launcher serialises one: pointers typed (float32 unless named), integers
    # int32, constexprs by value, 4 warps
    names = list(inspect.signature(kernel.fn).parameters)
    types = dict(POINTERS, **pointer_types)
    signature = {n: "constexpr" if n in constexprs else
                 types.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in names}
    constants = {(names.index(k),): v for k, v in constexprs.items()}
    options = make_backend(target).parse_options({"num_warps": 4})
    data = serialize_specialization_data(kernel.fn.__name__, signature, constants, {},
                                         options, "key")
    return compile_pool.Variant(kernel.fn.__module__, kernel.fn.__name__, data)


partial = dict(GENERAL=False, PEN=0, ZRANK=False, RAWTOP=False, NPAD=32, CAND=528, BLOCK=2048)
good = variant(logprobs.topn_partial_kernel, partial)
# the atomic count of a float32 pointer added to an address: the real compiler refuses it
bad = variant(logprobs.topn_partial_kernel, partial, count_ptr="*fp32")
out = {"before": compile_pool.is_cached(good, target)}
out["first"] = compile_pool.compile_variants([good, good], target, workers=2)
out["after"] = compile_pool.is_cached(good, target)
out["again"] = compile_pool.compile_variants([good], target, workers=4)
out["bad"] = compile_pool.compile_variants([bad], target, workers=1)
out["bad_cached"] = compile_pool.is_cached(bad, target)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    cache = tmp_path_factory.mktemp("triton_cache")
    return dict(_run(DRIVER, cache), cache=str(cache))


def test_workers_fill_the_cache_then_find_it(result):
    assert result["before"] is False
    first = result["first"]
    assert first["failed"] == [], first["failed"]
    assert (first["compiled"], first["cached"]) == (2, 0)
    # the seconds each kernel held a worker, for finding what a slow warmup waited on
    assert set(first["kernel_s"]) == {"topn_partial_kernel"} and first["kernel_s"][
        "topn_partial_kernel"] > 0, first
    assert first["longest"][0] == "topn_partial_kernel" and 0 < first["first_answer_s"], first
    assert result["after"] is True
    assert any(Path(result["cache"]).rglob("*.cubin"))
    assert result["again"] == {"cached": 1, "compiled": 0, "failed": [], "launcher_errors": [],
                               "workers": 0}


def test_a_variant_that_cannot_compile_is_reported(result):
    bad = result["bad"]
    assert bad["compiled"] == 0
    assert len(bad["failed"]) == 1 and "topn_partial_kernel" in bad["failed"][0], bad
    assert result["bad_cached"] is False


KEYS = r'''
import json
from triton.runtime.jit import JITCallable
import specsample.triton_backend as tb
from specsample import _distributed_kernels  # noqa: F401 (its kernels too)
from specsample.triton_backend import compile_pool

fns = sorted({id(v): v for m in (tb, tb.kernels, tb.filters, tb.logprobs_kernels,
                                  _distributed_kernels)
              for v in vars(m).values() if isinstance(v, JITCallable)}.values(),
             key=lambda f: (f.fn.__module__, f.fn.__name__))


def keys(order, settle):
    # a process that hashed its kernels in this order (as its first compiles would)
    for f in fns:
        f.hash, f.used_global_vals = None, {}
    for f in (fns if order == "forward" else fns[::-1]):
        f.cache_key
    if settle:
        compile_pool.settle_cache_keys()
    return {f"{f.fn.__module__}.{f.fn.__name__}": f.cache_key for f in fns}


out = {"import": {f"{f.fn.__module__}.{f.fn.__name__}": f.cache_key for f in fns}}
for order in ("forward", "reverse"):
    for settle in (False, True):
        out[f"{order}_{settle}"] = keys(order, settle)
print(json.dumps(out))
'''


def test_cache_keys_do_not_depend_on_the_order_kernels_are_first_compiled():
    # Triton 3.6 hashes a caller before merging in its callees' global constants when the
    # callee is not yet hashed, so the on-disk cache key of a kernel depended on which kernel
    # the process compiled first: warmup's workers wrote entries the launching process never
    # found (every variant compiled twice on the H200). settle_cache_keys fixes every key.
    out = _run(KEYS, timeout=300)
    assert len(out["import"]) >= 40
    assert out["forward_True"] == out["import"] and out["reverse_True"] == out["import"]
    # the power of the check: unsettled, the two orders give different keys (if a Triton
    # release hashes callees first, this fails and settle_cache_keys can go)
    assert out["forward_False"] != out["reverse_False"]


FLOW = PREAMBLE + r'''
import torch, triton
from triton.runtime import driver


class Driver:  # a stand-in for the CUDA driver: Triton asks it for the device and target only
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return TARGET


class Kernel:  # what the launches get instead of a compiled kernel: no launch happens
    function = packed_metadata = None

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        pass


driver.set_active(Driver())
import specsample.api as api
api.select_backend = lambda device: "triton"
import triton.compiler
from specsample import triton_backend
from specsample.triton_backend import compile_pool

def calls():
    triton_backend.warmup("cpu", vocab_size=3000, workers=0, on_compile="ignore",
                          dtypes=(torch.bfloat16,), methods=("token",))

variants = compile_pool.collect(calls)
# every kernel gets its (unused when unfiltered) cut as int32: one variant, not two
out = {"cut_types": sorted({json.loads(v.data)["signature"].get("cut_i_ptr", "*i32")
                            for v in variants})}
try:  # one launcher source per launcher key (Triton's own launcher code, where it has it)
    from triton.backends.nvidia.driver import make_launcher
except ImportError:
    out["sources_per_key"] = None
else:
    sources = {}
    for v in variants:
        sig = json.loads(v.data)["signature"]
        sources.setdefault(compile_pool.launcher_key(v), set()).add(
            make_launcher({}, dict(enumerate(sig.values())), None))
    out["sources_per_key"] = sorted({len(s) for s in sources.values()})
wanted = {"sample_kernel", "finish_kernel", "residual_kernel"}
pick, seen = [], set()
for v in variants:
    if v.name in wanted and v.name not in seen:
        seen.add(v.name)
        pick.append(v)
out.update(variants=len(variants), workers=compile_pool.compile_variants(pick, TARGET, 2))
real = triton.compiler.compile
misses = []


def launch_compile(src, target=None, options=None, _env_vars=None):
    # the launching process's own lookup, for the picked kernels: a hit loads (no compile);
    # a miss (their other variants, which the workers did not compile) is only noted, since
    # compiling it here would cost seconds and tell nothing
    if src.fn.__name__ in seen:
        entry = compile_pool.source_entry(src, make_backend(target or TARGET), options or {})
        if compile_pool._entry_exists(entry):
            real(src, target=target, options=options)
        else:
            misses.append(src.fn.__name__)
    return Kernel()


for k in compile_pool._package_kernels():
    k.compile = launch_compile
    for entry in k.device_caches.values():
        entry[0].clear()
with compile_pool.count_compiles() as counts:
    calls()
out["loaded"], out["compiled"], out["misses"] = counts["loaded"], counts["compiled"], misses
out["picked_variants"] = sum(v.name in seen for v in variants)  # (of the three kernels)
print(json.dumps(out))
'''


def test_the_workers_entries_are_what_the_launches_load(tmp_path):
    # End to end on CPU with a stand-in driver: collect lists the variants of warmup's calls,
    # two workers compile one variant each of three kernels into a fresh cache, then the calls
    # launch again and Triton's own lookup finds those variants (the other variants of the
    # same kernels, not compiled by the workers, are the only misses; they are not compiled).
    # Before compile_pool.settle_cache_keys, the workers wrote entries under other keys.
    out = _run(FLOW, tmp_path / "cache")
    assert out["variants"] >= 20
    assert out["cut_types"] == ["*i32"], out["cut_types"]
    assert out["sources_per_key"] in (None, [1]), out["sources_per_key"]
    assert out["workers"]["compiled"] == 3 and out["workers"]["failed"] == [], out
    assert out["loaded"] == 3 and out["compiled"] == [], out
    assert len(out["misses"]) == out["picked_variants"] - 3 > 0, out


def test_a_dead_worker_passes_its_variants_to_the_live_one():
    # Worker 0 is gone before anything is sent: its variant goes to worker 1, which answers
    # both (a module that does not exist: an error at once), and none is left uncompiled.
    from triton.backends.compiler import GPUTarget

    from specsample.triton_backend import compile_pool

    bogus = [compile_pool.Variant(f"specsample.no_such_module_{i}", "k", "{}") for i in (1, 2)]
    pool = compile_pool.Pool(2)
    try:
        pool._procs[0].kill()
        pool._procs[0].wait()
        result = pool.compile(bogus, GPUTarget("cuda", 90, 32))
    finally:
        pool.close()
    assert result["compiled"] == 0
    assert sorted(f.split(":")[0] for f in result["failed"]) == ["k", "k"], result
    assert all("no_such_module" in f for f in result["failed"]), result


# Every entry point of the CUDA driver that Triton's driver.c and launchers link against: a
# stand-in libcuda.so.1 with these (never called) lets the launchers build and load on CPU.
CUDA_SYMBOLS = (
    "cuCtxGetCurrent cuCtxGetLimit cuCtxSetCurrent cuCtxSetLimit cuDeviceGet "
    "cuDeviceGetAttribute cuDevicePrimaryCtxRetain cuFuncGetAttribute cuFuncSetAttribute "
    "cuFuncSetCacheConfig cuGetErrorString cuGetProcAddress cuLaunchKernelEx "
    "cuModuleGetFunction cuModuleLoadData cuOccupancyMaxActiveClusters cuPointerGetAttribute "
    "cuPointerGetAttributes cuTensorMapEncodeTiled").split()

LAUNCHER = DRIVER.split("out = {")[0] + r'''
from pathlib import Path

import triton
from triton import knobs
from triton.runtime import build


def launcher_needs_a_build(variant):
    # the launching process's step: Triton's CompiledKernel builds the launcher, from the
    # cache when there (a build here raises)
    src, _, options = compile_pool._source(variant, target)
    kernel = triton.compile(src, target=target, options=options.__dict__)
    real, built = build._build, []
    build._build = lambda *a, **k: built.append(1) or real(*a, **k)
    try:
        compile_pool._launcher_cls(target)(kernel.src, kernel.metadata)
    finally:
        build._build = real
    return bool(built)


# two variants of one launcher key (another constexpr), two workers: one builds it
twin = variant(logprobs.topn_partial_kernel, dict(partial, BLOCK=1024))
out = {"worker": compile_pool.compile_variants([good, twin], target, workers=2)}
out["launchers"] = len(list(Path(knobs.cache.dir).rglob("__triton_launcher*")))
out["needs_build"] = [launcher_needs_a_build(v) for v in (good, twin)]
# the power of the check: a variant the workers did not compile (an int64 stride: another
# launcher signature) needs one
other = variant(logprobs.topn_partial_kernel, partial, raw_stride="i64")
out["other_needs_build"] = launcher_needs_a_build(other)
print(json.dumps(out))
'''


def test_the_workers_build_the_launchers_too(tmp_path, monkeypatch):
    # A launcher (the C module through which the host launches a kernel, a third of a second
    # of gcc each) was built by the launching process after warmup's workers: 13 builds,
    # 4.5 s of a fresh-cache warmup on the H200. The workers now build it beside the kernel,
    # once per launcher key (the variants' argument types).
    import shutil

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    stubs = tmp_path / "cuda.c"
    stubs.write_text("".join(f"int {name}(void) {{ return 1; }}\n" for name in CUDA_SYMBOLS))
    libdir = tmp_path / "lib"
    libdir.mkdir()
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(libdir / "libcuda.so.1"), str(stubs)],
                   check=True)
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", str(libdir))  # (where Triton links it from)
    monkeypatch.setenv("LD_LIBRARY_PATH", os.pathsep.join(  # (where the loader finds it)
        p for p in (str(libdir), os.environ.get("LD_LIBRARY_PATH")) if p))
    out = _run(LAUNCHER, tmp_path / "cache")
    assert out["worker"]["compiled"] == 2 and out["worker"]["failed"] == [], out
    assert out["worker"]["launcher_errors"] == [], out
    assert out["launchers"] == 1, out
    assert out["needs_build"] == [False, False]
    assert out["other_needs_build"] is True


def test_collect_sets_the_direct_launchers_cache_aside():
    # The direct launcher (triton_backend.launch) launches a specialisation it has seen
    # without asking Triton, so without collect's hook: collect must empty its cache while
    # the calls run (else kernels would really launch and read unwritten buffers) and put it
    # back afterwards.
    pytest.importorskip("specsample.triton_backend")
    import importlib

    from specsample.triton_backend import compile_pool

    compiled = importlib.import_module("specsample.triton_backend.launch")._COMPILED
    sentinel = ("not a kernel",)
    compiled[sentinel] = "compiled"
    seen = []
    try:
        compile_pool.collect(lambda: seen.append(dict(compiled)))
        assert seen == [{}]
        assert compiled[sentinel] == "compiled"
    finally:
        compiled.pop(sentinel, None)
