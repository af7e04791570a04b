"""``python -m specsample.warmup_bench``: the timing itself needs a CUDA device (its figures are
in BENCHMARKS.md); here, a run that fails reports the child's error instead of a number."""

from __future__ import annotations

import pytest
import torch

from specsample import warmup_bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without CUDA")
def test_a_failed_run_raises_with_the_childs_error(tmp_path):
    with pytest.raises(RuntimeError, match="(?s)warmup run failed.*(CUDA|cuda|Torch not compiled)"):
        warmup_bench.main(["--vocab", "64", "--repeats", "0", "--out", str(tmp_path / "o.json")])
    assert not (tmp_path / "o.json").exists()
