"""Parallel compilation for :func:`specsample.warmup`.

Triton compiles one kernel variant at a time, on the thread that launches it (up to eight
seconds for the kernels that sort, most of it in LLVM and ptxas), and a deployment needs a few
hundred variants. So ``warmup()`` runs its calls twice over, with compile workers beside them:

0. :class:`Pool` starts the workers (Python processes running :func:`main`), whose imports
   then overlap the next step. Processes, not threads: the compiler holds the GIL for most
   of its work.
1. :func:`collect`: with every compile skipped (Triton's ``jit_cache_hook`` returning True; no
   kernel runs), recording the variants the calls would compile as Triton serialises them
   (``specialization_data``, what ``JITFunction.preload`` reads).
2. :meth:`Pool.compile`: the variants missing from Triton's on-disk cache go to the workers
   one at a time, the slowest kinds first, each worker taking the next when it is done; each
   writes the variant to that cache, and the first variant of each :func:`launcher_key` its
   launcher (a C module built by the system's compiler).
3. The calls for real: every compile is then a load from the cache.

A variant that fails (or takes over ``VARIANT_TIMEOUT_S``) in a worker is compiled again in
step 3, on the calling thread, where a real error surfaces as usual; :func:`last_report` says
what each step did. After a complete warmup a manifest (the cache entries of its variants,
keyed by the package's sources, the kernels' cache keys, the warmup's arguments, the target,
Triton's build and cache-relevant environment, the compiler's version and torch's) is written
beside Triton's cache, so that the next warmup of the same deployment finds every entry
without steps 0-2; a manifest whose calls still compiled is deleted. :func:`settle_cache_keys`
makes the cache keys the same in every process. One warmup runs at a time (:data:`LOCK`); the
workers use pipes and ``selectors``, so the parallel steps need a POSIX system (elsewhere
warmup compiles serially).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget

from .launch import _COMPILED


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel variant: the kernel's module and name, and Triton's serialised
    specialisation (signature, constexprs, attributes, options) as a JSON string."""

    module: str
    name: str
    data: str


# One warmup at a time: collect() and count_compiles() swap process-wide Triton hooks.
LOCK = threading.RLock()
VARIANT_TIMEOUT_S = 600.0  # a worker compiling one variant longer than this is killed
MAX_WORKERS = 32  # default cap (each worker imports torch: about 300 MB)
_TAG = "@specsample-compile "  # prefix of the workers' answers

_report: dict = {}
_manifest: dict = {}  # the path of the last manifest found ("hit"), to delete if stale


def last_report() -> dict:
    """What the last parallel warmup did: ``variants`` (collected), ``cached`` (already on
    disk), ``compiled`` (by workers), ``failed`` (worker errors, compiled again serially),
    ``launcher_errors`` (why workers left launchers, the C modules through which the host
    launches kernels, for the calls to build; each distinct text once), ``workers``,
    ``manifest`` ("hit": every entry found from the last warmup's list, no collect nor
    workers; "written"; or why not), ``loaded`` (variants the calls then loaded from the
    cache) and ``compiled_serially`` (those they compiled: missed), and the seconds of each
    step (``collect_s``, ``compile_s``, ``calls_s``); or ``error`` when the parallel steps failed
    as a whole, or ``skipped`` (why they did not run). Empty before the first warmup."""
    return dict(_report)


def reset_report(skipped: str | None = None) -> None:
    """Start a new report (with ``skipped``: why the parallel steps will not run)."""
    _report.clear()
    _manifest.clear()
    if skipped:
        _report["skipped"] = skipped


def _ours(module_name: str) -> bool:
    return module_name == "specsample" or module_name.startswith("specsample.")


def _package_objects(kind: type) -> list:
    """Every Triton function of type ``kind`` in this package's imported modules, each once,
    in a fixed order (the defining module, then the name)."""
    found = {id(v): v for name, mod in list(sys.modules.items())
             if _ours(name) and mod is not None
             for v in list(vars(mod).values()) if isinstance(v, kind)}
    return sorted(found.values(), key=lambda f: (f.fn.__module__, f.fn.__qualname__))


def _package_kernels() -> list:
    """Every Triton kernel of this package that is imported (JITFunction objects)."""
    from triton.runtime.jit import JITFunction

    return _package_objects(JITFunction)


def settle_cache_keys() -> int:
    """Give every Triton function of this package the cache key it gets when its callees are
    hashed first, whatever order the kernels are first compiled in; returns the rounds taken.
    Run at import (of ``specsample.triton_backend``), before any launch: after launches it
    would rebuild the recorded global values from the current ones.

    Triton 3.6's ``JITFunction.cache_key`` merges a callee's global constants into the
    caller's key before hashing the callee, so a caller hashed before its callees gets a
    different key (``DependenciesFinder._update_hash``). Which kernel a process compiles first
    then changes the on-disk cache keys: the compile workers (and a restarted server) would
    write entries the launching process never finds. Hashing everything again until no key
    changes makes every key the complete one in every process.

    Raises:
        RuntimeError: the keys did not settle in 32 rounds (a call cycle Triton cannot hash).
    """
    from triton.runtime.jit import JITCallable

    functions = _package_objects(JITCallable)
    keys = None
    for rounds in range(1, 33):
        for f in functions:
            f.hash = None
        now = [f.cache_key for f in functions]
        if now == keys:
            return rounds
        keys = now
    raise RuntimeError("specsample: Triton cache keys did not settle")


def collect(calls: Callable[[], object]) -> list[Variant]:
    """Run ``calls()`` with no specsample kernel launched and return the variants the launches
    would have compiled, each once (already compiled ones too: their in-process caches, and
    ``launch._COMPILED``, are set aside meanwhile, so that no kernel reads another's
    unwritten output). The outputs of
    the calls are garbage. Launches of other threads meanwhile run as usual (they may load
    or compile variants the cleared caches held); one collect runs at a time."""
    seen: dict[tuple, Variant] = {}
    owner = threading.get_ident()
    with LOCK:
        previous = knobs.runtime.jit_cache_hook

        def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            if threading.get_ident() != owner or not _ours(str(fn.module)):
                return previous(key=key, repr=repr, fn=fn, compile=compile,
                                is_manual_warmup=is_manual_warmup,
                                already_compiled=already_compiled) if previous else None
            seen.setdefault((fn.module, fn.name, str(key)),
                            Variant(fn.module, fn.name, compile["specialization_data"]))
            return True  # skip the compile and the launch

        # Triton's per-kernel caches, and the direct launcher's (which would launch a known
        # specialisation without asking Triton, so without the hook)
        caches = [entry[0] for k in _package_kernels() for entry in k.device_caches.values()]
        caches.append(_COMPILED)
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


def cache_entry(variant: Variant, target: GPUTarget) -> tuple[str, str]:
    """(hash, file name) under which ``triton.compile`` stores and finds the variant."""
    src, backend, options = _source(variant, target)
    return source_entry(src, backend, options.__dict__)


def source_entry(src, backend, options: dict) -> tuple[str, str]:
    """(hash, file name) under which ``triton.compile(src, options=options)`` stores and finds
    its kernel for ``backend``'s target (``src`` an ASTSource; ``options`` as the launch
    passes them)."""
    # (the names triton.compile uses)
    from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key

    options = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, options, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest(), f"{src.name[:150]}.json"


def _entry_exists(entry: Sequence[str]) -> bool:
    """Whether Triton's on-disk cache holds ``entry`` (:func:`cache_entry`'s or
    :func:`source_entry`'s (hash, file name))."""
    from triton.compiler.compiler import get_cache_manager

    digest, name = entry
    return name in (get_cache_manager(digest).get_group(name) or {})


def is_cached(variant: Variant, target: GPUTarget) -> bool:
    """Whether Triton's on-disk cache holds the compiled variant (the lookup of
    ``triton.compile``)."""
    return _entry_exists(cache_entry(variant, target))


def compile_one(variant: Variant, target: GPUTarget, launcher: bool = True) -> str | None:
    """Compile one variant for ``target`` into Triton's on-disk cache (no device needed), then
    (with ``launcher``) its launcher: the small C module through which the host launches it,
    built with the system's C compiler (a third of a second) and cached beside it. Returns
    None, or why the launcher could not be built (the launch then builds it)."""
    src, _, options = _source(variant, target)
    kernel = triton.compile(src, target=target, options=options.__dict__)
    if not launcher:
        return None
    try:
        _launcher_cls(target)(kernel.src, kernel.metadata)
    except Exception as e:  # (no libcuda here, say)
        return f"{e!r}"[:500]
    return None


def _launcher_cls(target: GPUTarget) -> type:
    """The launcher class of ``target``'s driver, without making that driver the active one
    (which would query the device)."""
    from triton.backends import backends

    for b in backends.values():
        if b.compiler.supports_target(target):
            if b.driver not in _drivers:
                try:
                    _drivers[b.driver] = b.driver()
                except Exception as e:  # (remembered: the next variant fails the same way)
                    _drivers[b.driver] = e
            driver = _drivers[b.driver]
            if isinstance(driver, Exception):
                raise driver
            return driver.launcher_cls
    raise RuntimeError(f"no Triton backend supports {target}")


_drivers: dict = {}  # driver class -> instance (or the error its construction raised)


def launcher_key(variant: Variant) -> tuple:
    """What a variant's launcher depends on: its arguments' types, pointers all alike (the
    192 variants of a default warmup need 12 launchers). Variants with one key share one
    launcher, which one worker builds."""
    signature = json.loads(variant.data).get("signature", {}).values()
    return tuple("*" if isinstance(t, str) and t.startswith("*") else str(t) for t in signature)


def jobs(variants: Sequence[Variant]) -> deque:
    """The workers' queue: [variant, build its launcher] pairs, the slowest kernels first, the
    launcher flag on the first variant of each :func:`launcher_key`."""
    queue, seen = deque(), set()
    for v in sorted(variants, key=lambda v: (
            _SLOW_FIRST.index(v.name) if v.name in _SLOW_FIRST else len(_SLOW_FIRST))):
        key = launcher_key(v)
        queue.append([v, key not in seen])
        seen.add(key)
    return queue


def pass_launcher(queue: deque, variant: Variant) -> bool:
    """Hand the launcher of ``variant`` (whose compile failed) to the next queued variant of
    its key; False when none is left (the launch then builds it)."""
    key = launcher_key(variant)
    for job in queue:
        if launcher_key(job[0]) == key:
            job[1] = True
            return True
    return False


# Kernels whose variants take the longest to compile each, slowest first (the filters' cut
# about 3 s on a CPU host, the single launch about 1.2 s, the three-level draws 0.6-0.9 s):
# sent first, so that no worker starts one of them last.
_SLOW_FIRST = ("select_kernel", "stats_draw_kernel", "sample_kernel", "residual_kernel",
               "residual_draw_kernel", "logprob_merge_kernel")

# The worker: its stdout goes to stderr before anything is imported, so that nothing but its
# answers (on a duplicate of the original stdout) reaches the parent.
_WORKER = ("import os, sys; answer = os.dup(1); os.dup2(2, 1); "
           "from specsample.triton_backend.compile_pool import main; sys.exit(main(answer))")


class Pool:
    """Compile workers: started at construction (their imports take seconds, overlapping
    whatever the caller does next), fed one variant at a time by :meth:`compile`, stopped by
    :meth:`close`. A worker that dies fails its variant and takes no more; one that takes
    over ``VARIANT_TIMEOUT_S`` on a variant is killed."""

    def __init__(self, workers: int) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # the workers import this package from where the caller did (after the caller's own
        # path, so that a Triton the caller put first is the workers' too)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), root) if p)
        # the cache the caller's Triton uses, also when set in code (knobs.cache.dir)
        env["TRITON_CACHE_DIR"] = str(knobs.cache.dir)
        # only the binary and its metadata: what a launch loads (not a cache-key input)
        env["TRITON_STORE_BINARY_ONLY"] = "1"
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []
        try:
            for _ in range(max(1, workers)):
                self._logs.append(tempfile.TemporaryFile("w+b"))
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=self._logs[-1], text=True, env=env,
                    start_new_session=True))  # (its own process group: see _kill)
        except BaseException:
            self.close()
            raise

    @property
    def workers(self) -> int:
        return len(self._procs)

    def _log(self, i: int) -> str:
        self._logs[i].seek(0)
        return self._logs[i].read()[-2000:].decode("utf-8", "replace")

    def _answer(self, i: int) -> str:
        """The worker's next answer line ("" at EOF), skipping anything else it printed."""
        while True:
            line = self._procs[i].stdout.readline()
            if not line or line.startswith(_TAG):
                return line[len(_TAG):]

    def compile(self, variants: Sequence[Variant], target: GPUTarget) -> dict:
        """Compile ``variants`` and their launchers for ``target``; returns {"compiled": n,
        "failed": [error text, ...], "launcher_errors": [each distinct text] (why launchers
        were left for the launches to build), "kernel_s": {kernel name: seconds its variants
        held a worker, the first of each worker's jobs including the worker's start},
        "first_answer_s": seconds until the first worker answered, "longest": [kernel name,
        seconds] of the job that held its worker longest}. Never raises for a variant that
        fails."""
        queue = jobs(variants)
        spec = [target.backend, target.arch, target.warp_size]
        result = {"compiled": 0, "failed": [], "launcher_errors": [], "kernel_s": {},
                  "first_answer_s": None, "longest": None}
        t0 = time.monotonic()
        busy: dict[int, tuple[list, float]] = {}
        killed: set[int] = set()
        sel = selectors.DefaultSelector()

        def feed(i: int) -> None:
            if not queue:
                return
            job = queue.popleft()
            try:
                self._procs[i].stdin.write(_TAG + json.dumps(
                    {"target": spec, "variant": dataclasses.asdict(job[0]),
                     "launcher": job[1]}) + "\n")
                self._procs[i].stdin.flush()
                busy[i] = (job, time.monotonic())
            except OSError:  # (the worker is gone: the variant goes to another)
                queue.appendleft(job)
                sel.unregister(self._procs[i].stdout)

        def failed(job: list, text: str) -> None:  # (its launcher goes to another job)
            result["failed"].append(text)
            if job[1] and not pass_launcher(queue, job[0]):
                result["launcher_errors"].append(
                    f"{job[0].name}: its variant failed, and no other of its launcher key "
                    "was left to build the launcher")

        def dispatch() -> None:  # every live idle worker takes a variant while any is left
            for key in list(sel.get_map().values()):
                if not queue:
                    return
                if key.data not in busy:
                    feed(key.data)

        try:
            for i, p in enumerate(self._procs):
                sel.register(p.stdout, selectors.EVENT_READ, i)
            dispatch()
            while busy:
                events = sel.select(timeout=5.0)
                now = time.monotonic()
                for i, (_job, start) in list(busy.items()):
                    if i not in killed and now - start > VARIANT_TIMEOUT_S:
                        killed.add(i)
                        _kill(self._procs[i])  # (its pipe then reads EOF)
                for key, _ in events:
                    i = key.data
                    line = self._answer(i)
                    job, start = busy.pop(i, (None, now))
                    if job is not None:
                        name = job[0].name
                        result["kernel_s"][name] = round(
                            result["kernel_s"].get(name, 0.0) + now - start, 2)
                        if result["first_answer_s"] is None:
                            result["first_answer_s"] = round(now - t0, 2)
                        if result["longest"] is None or now - start > result["longest"][1]:
                            result["longest"] = [name, round(now - start, 2)]
                    if not line:  # the worker is gone (its variant is compiled at launch)
                        sel.unregister(key.fileobj)
                        if job is not None:
                            failed(job, f"{job[0].name}: " + (
                                f"timed out after {VARIANT_TIMEOUT_S:.0f} s" if i in killed
                                else f"worker {i} exited: {self._log(i)}"))
                        continue
                    done = json.loads(line)
                    if done["ok"]:
                        result["compiled"] += 1
                        error = done.get("launcher_error")
                        if error and error not in result["launcher_errors"]:
                            result["launcher_errors"].append(error)
                    else:
                        failed(job, done["error"])
                dispatch()
        finally:
            sel.close()
        result["failed"] += [f"{job[0].name}: not compiled, no worker left" for job in queue]
        return result

    def close(self) -> None:
        """Stop the workers and close their pipes and logs. They are killed: one that
        answered has written its cache entries (atomically, as Triton writes them), and one
        that did not has nothing worth waiting for (its variant is compiled at launch)."""
        for p in self._procs:
            _kill(p)
        for p in self._procs:
            p.wait()
            for pipe in (p.stdin, p.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass
        for log in self._logs:
            log.close()


def _kill(proc: subprocess.Popen) -> None:
    """Kill a worker and whatever it started (the compiler's ptxas, the launcher's gcc): its
    process group, where the system has them."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (AttributeError, OSError):  # (no process groups here)
        proc.kill()


def compile_variants(variants: Sequence[Variant], target: GPUTarget, workers: int,
                     pool: Pool | None = None) -> dict:
    """Compile the variants missing from the on-disk cache in up to ``workers`` processes
    (those of ``pool`` when given, which the caller closes).

    Returns {"cached": n, "compiled": n, "failed": [error text, ...], "launcher_errors":
    [each distinct text], "workers": n} (see :meth:`Pool.compile`). Never raises for a
    variant that fails to compile (its launch compiles it again, serially)."""
    missing = [v for v in variants if not _cached_or_false(v, target)]
    result = {"cached": len(variants) - len(missing), "compiled": 0, "failed": [],
              "launcher_errors": [], "workers": 0}
    if not missing:
        return result
    own = pool is None
    if own:
        pool = Pool(max(1, min(workers, len(missing))))
    try:
        result.update(pool.compile(missing, target), workers=pool.workers)
    finally:
        if own:
            pool.close()
    return result


def _cached_or_false(variant: Variant, target: GPUTarget) -> bool:
    try:
        return is_cached(variant, target)
    except Exception:  # (an unreadable entry: let a worker compile it)
        return False


def _manifest_path(config: dict, target: GPUTarget) -> Path:
    """Where the manifest of a warmup with ``config`` lives: beside Triton's cache, named by
    a hash of everything the variants and their cache keys depend on: the package's sources
    and kernels' cache keys, ``config``, the target, Triton's build, its cache-invalidating
    environment, the compiler backend's version and torch's (any change gives a new name)."""
    import torch
    from triton.compiler.compiler import get_cache_invalidating_env_vars, make_backend
    from triton.runtime.cache import triton_key
    from triton.runtime.jit import JITCallable

    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(path.read_bytes())
    for f in _package_objects(JITCallable):
        h.update(f"{f.fn.__module__}.{f.fn.__name__}:{f.cache_key}".encode())
    h.update(json.dumps([config, [target.backend, target.arch, target.warp_size],
                         triton_key(), sorted(get_cache_invalidating_env_vars().items()),
                         make_backend(target).hash(), torch.__version__],
                        sort_keys=True, default=str).encode())
    return Path(knobs.cache.dir) / "specsample_warmup" / f"{h.hexdigest()}.json"


def _read_manifest(path: Path) -> list | None:
    """The manifest's entries, or None when missing or not a non-empty list of
    [hash, file name] pairs."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(entries, list) and entries and all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(x, str) for x in e)
        for e in entries)
    return entries if ok else None


def parallel_warmup(calls: Callable[[], object], target: GPUTarget, workers: int,
                    config: dict) -> None:
    """Steps 0-2 of the module docstring for ``calls`` (the caller then runs them for real);
    fills :func:`last_report`. ``config``: what else decides the variants (the warmup's
    arguments and backend), part of the manifest's name."""
    t0 = time.perf_counter()
    reset_report()
    if knobs.compilation.always_compile:  # (the cache is not read: nothing to fill)
        _report.update(skipped="TRITON_ALWAYS_COMPILE is set")
        return
    # On a cache without manifests (a fresh one) the workers start first, their imports
    # overlapping the manifest's name (which hashes Triton's build: half a second)
    fresh = not any((Path(knobs.cache.dir) / "specsample_warmup").glob("*.json"))
    pool = Pool(workers) if fresh else None
    try:
        manifest = _manifest_path(config, target)
        entries = _read_manifest(manifest)
        if entries is not None and all(_entry_exists(e) for e in entries):
            _manifest["path"] = manifest
            _report.update(variants=len(entries), cached=len(entries), compiled=0, failed=[],
                           launcher_errors=[], workers=0, manifest="hit", collect_s=0.0,
                           compile_s=time.perf_counter() - t0)
            return
        pool = pool or Pool(workers)
        t1 = time.perf_counter()
        variants = collect(calls)
        t2 = time.perf_counter()
        result = compile_variants(variants, target, workers, pool)
    finally:
        if pool is not None:
            pool.close()
    _report.update(variants=len(variants), collect_s=t2 - t1,
                   compile_s=time.perf_counter() - t2, **result)
    if not variants:  # (no kernel launched: the torch backend, say)
        _report["manifest"] = "not written: no variant"
    elif not result["failed"]:
        tmp = manifest.with_suffix(f".tmp{os.getpid()}")
        try:
            manifest.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps([cache_entry(v, target) for v in variants]))
            os.replace(tmp, manifest)
            _report["manifest"] = "written"
        except OSError as e:  # (a read-only cache: every warmup collects)
            _report["manifest"] = f"not written: {e!r}"
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def count_compiles():
    """Within the block, record each specsample kernel variant the process gets from
    ``triton.compile``: yields {"loaded": n (from the on-disk cache), "compiled": [names]
    (compiled here, serially)}. Chains any listener already set; one at a time."""
    seen = {"loaded": 0, "compiled": []}
    with LOCK:
        previous = knobs.compilation.listener

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group,
                         times=times, cache_hit=cache_hit)
            fn = getattr(src, "fn", None)
            if _ours(str(getattr(getattr(fn, "fn", None), "__module__", ""))):
                if cache_hit:
                    seen["loaded"] += 1
                else:
                    seen["compiled"].append(src.name)

        knobs.compilation.listener = listener
        try:
            yield seen
        finally:
            knobs.compilation.listener = previous


def record_launches(seen: dict, seconds: float) -> None:
    """Add what step 3 did (:func:`count_compiles`) in ``seconds`` to the report: ``loaded``,
    ``compiled_serially`` (variants the parallel steps missed; empty when they covered all)
    and ``calls_s``. A manifest hit whose calls still compiled is stale: it is deleted, so
    that the next warmup collects again."""
    if not _report:
        return
    _report.update(loaded=seen["loaded"], compiled_serially=list(seen["compiled"]),
                   calls_s=seconds)
    if seen["compiled"] and "path" in _manifest:
        Path(_manifest.pop("path")).unlink(missing_ok=True)
        _report["manifest"] = "hit, stale: deleted"


def record_failure(error: Exception) -> None:
    """Report that the parallel steps failed as a whole (warmup then compiles serially)."""
    _report.clear()
    _report.update(error=repr(error))


def main(answer_fd: int) -> int:
    """Worker (started by :class:`Pool` with its stdout on ``answer_fd`` and fd 1 on stderr):
    reads one tagged JSON job per line on stdin ({"target": [backend, arch, warp size],
    "variant": {...}, "launcher": bool}), compiles it (and its launcher: :func:`compile_one`)
    and answers one tagged JSON line ({"ok": true, "launcher_error": null or text} or
    {"ok": false, "error": text}); exits at EOF."""
    answer = os.fdopen(answer_fd, "w")
    for line in sys.stdin:
        if not line.startswith(_TAG):
            continue
        job = json.loads(line[len(_TAG):])
        variant = Variant(**job["variant"])
        try:
            launcher_error = compile_one(variant, GPUTarget(*job["target"]),
                                         job.get("launcher", True))
            print(_TAG + json.dumps({"ok": True, "launcher_error": launcher_error}),
                  file=answer, flush=True)
        except Exception as e:  # reported to the parent, which compiles it again serially
            print(_TAG + json.dumps({"ok": False, "error": f"{variant.name}: {e!r}"[:2000]}),
                  file=answer, flush=True)
    return 0
