"""Review of warmup()'s parallel compilation (``triton_backend.compile_pool``): regression
tests for the robustness holes found.

Tests named ``test_bug_*`` (comments "BUG") failed on the code as reviewed and pass since
the fixes; the others pin behaviour checked and found right. All run on CPU: the Pool tests
start one or two real workers (about a second each) and feed them a variant whose module does
not exist, which a worker answers at once with an error.
"""

from __future__ import annotations

import os
import threading

import pytest

pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from specsample.triton_backend import compile_pool  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BOGUS = compile_pool.Variant("specsample.no_such_module", "k", "{}")


# -- Pool ------------------------------------------------------------------------------------


def test_bug_worker_stdout_noise_does_not_abort_the_pool(tmp_path, monkeypatch):
    # BUG (failed before the fix). Anything a worker writes to its stdout before main()
    # swaps sys.stdout (a sitecustomize or .pth hook, an import-time print) or at the C level
    # (fd 1: ptxas and other subprocesses inherit it) reaches the answer pipe. Pool.compile
    # then json.loads it and raises JSONDecodeError: the whole parallel step fails and
    # warmup() compiles every variant serially (148 s instead of 20 s on the H200).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('a startup banner')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    pool = compile_pool.Pool(1)
    try:
        result = pool.compile([BOGUS], TARGET)
    finally:
        pool.close()
    assert result["compiled"] == 0
    assert len(result["failed"]) == 1 and "no_such_module" in result["failed"][0], result


def test_bug_an_idle_worker_that_dies_is_not_a_failed_variant():
    # BUG (failed before the fix). A worker that was given nothing (more workers than
    # variants) and dies is reported as a failure ("?: worker 1 exited"), so a warmup whose
    # variants all compiled writes no manifest and reports a failure.
    pool = compile_pool.Pool(2)
    try:
        pool._procs[1].kill()
        pool._procs[1].wait()
        result = pool.compile([BOGUS], TARGET)
    finally:
        pool.close()
    assert [f for f in result["failed"] if "no_such_module" not in f] == [], result


def test_bug_pool_close_closes_the_workers_pipes():
    # BUG (failed before the fix, low). close() closes stdin but never the stdout pipes:
    # one file descriptor per worker stays open until garbage collection, which then warns
    # (ResourceWarning: unclosed file).
    pool = compile_pool.Pool(1)
    procs = list(pool._procs)
    pool.close()
    assert all(p.returncode is not None for p in procs)
    assert all(p.stdout.closed for p in procs)


def test_pool_reaps_every_worker():
    # every worker, fed or not, is killed and reaped (none is left a zombie)
    pool = compile_pool.Pool(2)
    procs = list(pool._procs)
    try:
        pool.compile([BOGUS], TARGET)
    finally:
        pool.close()
    assert all(p.returncode is not None for p in procs)


# -- manifest ----------------------------------------------------------------------------------


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    if "dir" in vars(knobs.cache):
        pytest.skip("triton.knobs.cache.dir is set in code")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_bug_manifest_name_depends_on_cache_invalidating_env_vars(cache_dir, monkeypatch):
    # BUG (failed before the fix). Triton's cache key of every variant includes the
    # cache-invalidating environment (TRITON_DISABLE_LINE_INFO, DISABLE_LLVM_OPT,
    # MLIR_ENABLE_DUMP, ...), the manifest's name does not: after such a variable changes,
    # the old manifest is a "hit" (its entries exist), collect and the workers are skipped,
    # and the calls compile every variant serially. (Also missing from the name: Triton's
    # build key, the ptxas version in the backend's hash, torch's version.)
    monkeypatch.delenv("TRITON_DISABLE_LINE_INFO", raising=False)
    before = compile_pool._manifest_path({"v": 1}, TARGET)
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")
    after = compile_pool._manifest_path({"v": 1}, TARGET)
    assert before != after


@pytest.mark.parametrize("content", ["[1]", "{}", '[["only-a-digest"]]'])
def test_bug_a_malformed_manifest_is_ignored(cache_dir, content):
    # BUG (failed before the fix, low). Valid JSON of the wrong shape is either a "hit"
    # with no entries ({}: collect skipped) or raises TypeError / ValueError out of
    # parallel_warmup (outside its try): warmup then warns and compiles serially, every time,
    # since the manifest is never rewritten.
    config = {"malformed": content}
    path = compile_pool._manifest_path(config, TARGET)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    ran = []
    compile_pool.parallel_warmup(lambda: ran.append(1), TARGET, 1, config)
    assert ran, compile_pool.last_report()


def test_bug_a_run_that_launched_no_kernel_writes_no_hit_for_later_runs(cache_dir):
    # BUG (failed before the fix). warmup() with SPECSAMPLE_BACKEND=torch on CUDA runs its
    # calls on the torch backend: collect finds no variant and writes the manifest "[]" under
    # the same name as a Triton run (the backend is not part of the name). The next warmup
    # without the variable is then a "hit" with nothing in it and compiles every variant
    # serially in its calls. Here: the first run launches nothing, the second would.
    config = {"backend-agnostic": True}
    compile_pool.parallel_warmup(lambda: None, TARGET, 1, config)
    ran = []
    compile_pool.parallel_warmup(lambda: ran.append(1), TARGET, 1, config)
    assert ran, compile_pool.last_report()


# -- hooks, listeners, threads ---------------------------------------------------------------


def _interleave(run):
    """Two threads each call ``run(block)``, which installs something process-wide around
    ``block()``: A enters, B enters, A leaves, then B leaves (not last in, first out)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def a():
        try:
            run(lambda: (a_in.set(), b_in.wait(2)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            a_out.set()

    def b():
        try:
            a_in.wait(10)
            run(lambda: (b_in.set(), a_out.wait(10)))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors


def _counting(block):
    with compile_pool.count_compiles():
        block()


def test_bug_collect_in_two_threads_leaves_no_cache_hook_installed():
    # BUG (failed before the fix, serious when it happens). collect() swaps a process-wide
    # jit_cache_hook that skips every specsample launch, and restores "the previous one" at
    # its end. Two warmups that overlap (one thread per GPU, or a re-warmup while serving)
    # restore out of order: the first warmup's hook stays installed for good, and every later
    # launch of a variant not in the in-process cache is silently skipped (garbage outputs).
    # The same hook also skips launches of other threads while one collect runs.
    before = knobs.runtime.jit_cache_hook
    try:
        _interleave(compile_pool.collect)
        assert knobs.runtime.jit_cache_hook is before
    finally:
        knobs.runtime.jit_cache_hook = before


def test_bug_count_compiles_in_two_threads_leaves_no_listener_installed():
    # BUG (failed before the fix, low): the same out-of-order restore for the compilation
    # listener of count_compiles (a counting listener stays installed).
    before = knobs.compilation.listener
    try:
        _interleave(_counting)
        assert knobs.compilation.listener is before
    finally:
        knobs.compilation.listener = before


def test_collect_restores_the_hook_when_the_calls_raise():
    # (checked fine)
    before = knobs.runtime.jit_cache_hook

    def calls():
        raise ValueError("boom")

    with pytest.raises(ValueError):
        compile_pool.collect(calls)
    assert knobs.runtime.jit_cache_hook is before


def test_count_compiles_chains_and_restores_the_listener():
    # (checked fine)
    seen = []

    def mine(**kwargs):
        seen.append(kwargs["cache_hit"])

    before = knobs.compilation.listener
    knobs.compilation.listener = mine
    try:
        with compile_pool.count_compiles() as counts:
            knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=None,
                                       cache_hit=True)
        assert seen == [True] and counts == {"loaded": 0, "compiled": []}
        assert knobs.compilation.listener is mine
    finally:
        knobs.compilation.listener = before


def test_settle_cache_keys_under_the_interpreter():
    # (checked fine) interpreted kernels are no JITCallables: nothing to settle, no error
    assert compile_pool.settle_cache_keys() >= 1


def test_last_report_is_a_copy():
    # (checked fine)
    report = compile_pool.last_report()
    report["x"] = 1
    assert "x" not in compile_pool.last_report()



# -- launchers (second review) ---------------------------------------------------------------


def _variant(name: str, signature: dict) -> compile_pool.Variant:
    import json

    return compile_pool.Variant("specsample.triton_backend.kernels", name,
                                json.dumps({"signature": signature}))


def test_one_launcher_per_key_and_a_failed_one_passes_on():
    # Each launcher key (argument types, pointers alike) is built by one job, the first of its
    # key in the (slowest first) queue; when that job's variant fails, the next queued
    # variant of the key builds it, and with none left the report says so.
    a = _variant("finish_kernel", {"x_ptr": "*bf16", "n": "i32"})
    b = _variant("finish_kernel", {"x_ptr": "*fp32", "n": "i32"})  # (a's key)
    c = _variant("select_kernel", {"x_ptr": "*bf16", "n": "i64"})
    queue = compile_pool.jobs([a, b, c])
    assert [job[0].name for job in queue] == ["select_kernel", "finish_kernel", "finish_kernel"]
    assert [job[1] for job in queue] == [True, True, False]
    first = queue.popleft(), queue.popleft()
    assert compile_pool.pass_launcher(queue, first[1][0]) is True and queue[0][1] is True
    assert compile_pool.pass_launcher(queue, first[0][0]) is False


def test_a_dead_launcher_job_is_reported_when_no_variant_of_its_key_is_left():
    pool = compile_pool.Pool(1)
    try:
        result = pool.compile([BOGUS], TARGET)
    finally:
        pool.close()
    assert len(result["failed"]) == 1
    assert len(result["launcher_errors"]) == 1 and "no other" in result["launcher_errors"][0]


def test_a_manifest_hit_reports_the_same_keys(cache_dir, monkeypatch):
    # (BUG, found by review) the hit's report lacked launcher_errors, which a fresh one has
    monkeypatch.setattr(compile_pool, "_read_manifest", lambda path: [["0" * 64, "k.json"]])
    monkeypatch.setattr(compile_pool, "_entry_exists", lambda entry: True)
    compile_pool.parallel_warmup(lambda: None, TARGET, 1, {"v": 1})
    report = compile_pool.last_report()
    assert report["manifest"] == "hit"
    assert {"variants", "cached", "compiled", "failed", "launcher_errors", "workers",
            "collect_s", "compile_s"} <= set(report)
