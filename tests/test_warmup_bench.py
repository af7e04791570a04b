"""``python -m specsample.warmup_bench``: the timing itself needs a CUDA device (its figures are
in BENCHMARKS.md); here, without one it refuses with a clear message, and a run that fails
reports the child's error instead of a number."""

from __future__ import annotations

import pytest
import torch

from specsample import warmup_bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_says_so(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        warmup_bench.main(["--vocab", "64", "--repeats", "0", "--out", str(tmp_path / "o.json")])
    assert exc.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_a_failed_run_raises_with_the_childs_error(monkeypatch):
    # (the child process is a plain Python that fails: its error comes back in the exception)
    monkeypatch.setattr(warmup_bench, "_CHILD", "raise SystemExit('child failed: no device')")
    with pytest.raises(RuntimeError, match="(?s)warmup run failed.*child failed: no device"):
        warmup_bench._run(64, "/nonexistent-cache", "default")
