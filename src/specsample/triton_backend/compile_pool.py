"""Parallel compilation for :func:`specsample.warmup`.

Triton compiles one kernel variant at a time, on the thread that launches it (about a second
each, most of it in LLVM and ptxas), and a deployment needs about a hundred variants. So
``warmup()`` runs its calls three times over:

1. :func:`collect`: with every compile skipped (Triton's ``jit_cache_hook`` returning True; no
   kernel runs), recording the variants the calls would compile as Triton serialises them
   (``specialization_data``, what ``JITFunction.preload`` reads).
2. :func:`compile_variants`: the variants missing from Triton's on-disk cache are compiled in
   worker processes (``python -m specsample.triton_backend.compile_pool``), each writing to
   that cache. Processes, not threads: the compiler holds the GIL for most of its work.
3. The calls for real: every compile is then a load from the cache.

A variant that fails in a worker is compiled again in step 3, on the calling thread, where a
real error surfaces as usual; :func:`last_report` says what each step did.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel variant: the kernel's module and name, and Triton's serialised
    specialisation (signature, constexprs, attributes, options) as a JSON string."""

    module: str
    name: str
    data: str


_report: dict = {}


def last_report() -> dict:
    """What the last parallel warmup did: ``variants`` (collected), ``cached`` (already on
    disk), ``compiled`` (by workers), ``failed`` (worker errors, compiled again serially),
    ``workers``, and the seconds of each step (``collect_s``, ``compile_s``); or ``error``
    when the parallel steps failed as a whole. Empty before the first one."""
    return dict(_report)


def _package_kernels() -> list:
    """Every Triton kernel of this package that is imported (JITFunction objects)."""
    from triton.runtime.jit import JITFunction

    return [v for name, mod in list(sys.modules.items())
            if name.startswith("specsample") and mod is not None
            for v in vars(mod).values() if isinstance(v, JITFunction)]


def collect(calls: Callable[[], object]) -> list[Variant]:
    """Run ``calls()`` with no specsample kernel launched and return the variants the launches
    would have compiled, each once (already compiled ones too: their in-process caches are
    set aside meanwhile, so that no kernel reads another's unwritten output). The outputs of
    the calls are garbage."""
    seen: dict[tuple, Variant] = {}
    previous = knobs.runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        if not str(fn.module).startswith("specsample"):
            return None
        seen.setdefault((fn.module, fn.name, str(key)),
                        Variant(fn.module, fn.name, compile["specialization_data"]))
        return True  # skip the compile and the launch

    caches = [entry[0] for k in _package_kernels() for entry in k.device_caches.values()]
    saved = [dict(c) for c in caches]
    knobs.runtime.jit_cache_hook = hook
    try:
        for c in caches:
            c.clear()
        calls()
    finally:
        knobs.runtime.jit_cache_hook = previous
        for c, old in zip(caches, saved):
            c.clear()
            c.update(old)
    return list(seen.values())


def _source(variant: Variant, target: GPUTarget):
    """(ASTSource, backend, options) of a variant, as ``JITFunction.preload`` builds them."""
    import triton.language as tl
    from triton.compiler.compiler import ASTSource, make_backend

    fn = getattr(importlib.import_module(variant.module), variant.name)
    obj = json.loads(variant.data)
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
        tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(obj["constant_keys"], obj["constant_vals"])}
    attrs = dict(zip(map(tuple, obj["attrs_keys"]), obj["attrs_vals"]))
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in obj["signature"].items()}
    backend = make_backend(target)
    options = backend.parse_options(
        {k: tuple(v) if isinstance(v, list) else v for k, v in obj["options"].items()})
    return ASTSource(fn, signature, constexprs, attrs), backend, options


def is_cached(variant: Variant, target: GPUTarget) -> bool:
    """Whether Triton's on-disk cache holds the compiled variant (the lookup of
    ``triton.compile``)."""
    # (the names triton.compile uses)
    from triton.compiler.compiler import (
        get_cache_invalidating_env_vars,
        get_cache_key,
        get_cache_manager,
    )

    src, backend, options = _source(variant, target)
    options = backend.parse_options(dict(options.__dict__, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    name = f"{src.name[:150]}.json"
    return name in (manager.get_group(name) or {})


def compile_one(variant: Variant, target: GPUTarget) -> None:
    """Compile one variant for ``target`` into Triton's on-disk cache (no device needed)."""
    src, _, options = _source(variant, target)
    triton.compile(src, target=target, options=options.__dict__)


def compile_variants(variants: Sequence[Variant], target: GPUTarget,
                     workers: int) -> dict:
    """Compile the variants missing from the on-disk cache in up to ``workers`` processes.

    Returns {"cached": n, "compiled": n, "failed": [error text, ...], "workers": n}. Never
    raises for a variant that fails to compile (its launch compiles it again, serially)."""
    missing = [v for v in variants if not _cached_or_false(v, target)]
    workers = max(1, min(workers, len(missing)))
    result = {"cached": len(variants) - len(missing), "compiled": 0, "failed": [],
              "workers": workers if missing else 0}
    if not missing:
        return result
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"target": [target.backend, target.arch, target.warp_size],
                   "variants": [dataclasses.asdict(v) for v in missing]}, f)
        job = f.name
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the workers import this package from where the caller did (after the caller's own
    # path, so that a Triton the caller put first is the workers' too)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
    try:
        procs = [subprocess.Popen(
            [sys.executable, "-m", "specsample.triton_backend.compile_pool", job, str(i),
             str(workers)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for i in range(workers)]
        for p in procs:
            out, err = p.communicate()
            done = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            result["compiled"] += sum(1 for d in done if d["ok"])
            result["failed"] += [d["error"] for d in done if not d["ok"]]
            if p.returncode != 0:
                result["failed"].append(f"worker exited with {p.returncode}: {err[-2000:]}")
    finally:
        os.unlink(job)
    return result


def _cached_or_false(variant: Variant, target: GPUTarget) -> bool:
    try:
        return is_cached(variant, target)
    except Exception:  # (an unreadable entry: let a worker compile it)
        return False


def parallel_warmup(calls: Callable[[], object], target: GPUTarget, workers: int) -> None:
    """Steps 1 and 2 of the module docstring for ``calls`` (the caller then runs them for
    real); fills :func:`last_report`."""
    t0 = time.perf_counter()
    variants = collect(calls)
    t1 = time.perf_counter()
    result = compile_variants(variants, target, workers)
    _report.clear()
    _report.update(variants=len(variants), collect_s=t1 - t0,
                   compile_s=time.perf_counter() - t1, **result)


def record_failure(error: Exception) -> None:
    """Report that the parallel steps failed as a whole (warmup then compiles serially)."""
    _report.clear()
    _report.update(error=repr(error))


def main(argv: Sequence[str] | None = None) -> int:
    """Worker: ``python -m specsample.triton_backend.compile_pool JOB INDEX COUNT`` compiles
    the job's variants INDEX, INDEX + COUNT, ... and prints one JSON line per variant."""
    job, index, count = (argv if argv is not None else sys.argv[1:])
    spec = json.load(open(job))
    target = GPUTarget(*spec["target"])
    for v in spec["variants"][int(index)::int(count)]:
        variant = Variant(**v)
        try:
            compile_one(variant, target)
            print(json.dumps({"ok": True}), flush=True)
        except Exception as e:  # reported to the parent, which compiles it again serially
            print(json.dumps({"ok": False, "error": f"{variant.name}: {e!r}"[:2000]}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
