"""Rough edges a new user met on a fresh clone: messages that name what is wrong."""

import numpy as np
import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, sample, select_backend, verify

V = 16


def _batch(n=1, **kw):
    return SamplingBatch.from_params([SamplingParams(seed=i) for i in range(n)], vocab_size=V,
                                     **kw)


def test_sample_dtype_error_names_logits():
    with pytest.raises(ValueError, match=r"^logits must be float32"):
        sample(torch.zeros(1, V, dtype=torch.int64), _batch(), positions=torch.tensor([0]))


def test_from_params_takes_numpy_vocab_size_and_refuses_a_single_params():
    assert SamplingBatch.from_params([SamplingParams()], vocab_size=np.int64(V)).vocab_size == V
    with pytest.raises(ValueError, match="sequence of SamplingParams, one per request"):
        SamplingBatch.from_params(SamplingParams(), vocab_size=V)


def test_flat_prompt_token_ids_get_a_hint():
    with pytest.raises(ValueError, match="one sequence of token ids per request"):
        SamplingBatch.from_params([SamplingParams()] * 2, vocab_size=V,
                                  prompt_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] must be a sequence"):
        SamplingBatch.from_params([SamplingParams()], vocab_size=V, prompt_token_ids=[1])


@pytest.mark.parametrize("strict", ["no", 1, None])
def test_strict_must_be_a_bool(strict):
    batch = _batch()
    x = torch.zeros(1, V)
    with pytest.raises(ValueError, match="strict must be True or False"):
        sample(x, batch, positions=torch.tensor([0]), strict=strict)
    with pytest.raises(ValueError, match="strict must be True or False"):
        verify(x, [], [0], batch, positions=torch.tensor([0]), strict=strict)
    with pytest.raises(ValueError, match="strict must be True or False"):
        specsample.probs(x, batch, strict=strict)


def test_select_backend_takes_a_device_name(monkeypatch):
    monkeypatch.delenv("SPECSAMPLE_BACKEND", raising=False)
    assert select_backend("cpu") == "torch"


def test_triton_backend_on_cpu_switches_the_interpreter_on():
    # SPECSAMPLE_BACKEND=triton on CPU tensors crashed deep inside Triton ("0 active drivers")
    # unless the user had set TRITON_INTERPRET=1 first.
    import os
    import subprocess
    import sys

    code = ("import torch, specsample as s\n"
            "b = s.SamplingBatch.from_params([s.SamplingParams(seed=1)], vocab_size=16)\n"
            "print(int(s.sample(torch.zeros(1, 16), b, positions=torch.tensor([0]))"
            ".token_ids[0]) in range(16))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["SPECSAMPLE_BACKEND"] = "triton"
    if torch.cuda.is_available():
        pytest.skip("the interpreter is for machines without CUDA")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


def test_verify_arguments_in_the_wrong_order_get_a_hint():
    batch = SamplingBatch.from_params([SamplingParams(seed=0)], vocab_size=8)
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="the order is verify\\(target_logits, draft_token_ids"):
        verify(logits, torch.tensor([1, 2]), batch, [2], positions=[0])


def test_float_draft_tensors_name_their_dtype():
    batch = SamplingBatch.from_params([SamplingParams(seed=0)], vocab_size=8)
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match="got a 1-D torch.float32 tensor"):
        verify(logits, torch.tensor([1.0, 2.0]), [2], batch, positions=[0])
    with pytest.raises(ValueError, match="got a 1-D torch.float32 tensor"):
        verify(logits, torch.tensor([1, 2]), torch.tensor([2.0]), batch, positions=[0])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_warmup_on_a_machine_without_cuda_says_so():
    # The README's warmup(vocab_size=V) defaults to device="cuda": on a CPU-only machine it
    # raised torch's "Torch not compiled with CUDA enabled" AssertionError from deep inside.
    with pytest.raises(ValueError, match="needs a CUDA device"):
        specsample.warmup(vocab_size=1024)
    assert specsample.warmup("cpu", vocab_size=64, dtypes=(torch.float32,),
                             methods=("token",)) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path without Triton's driver")
def test_warmup_on_cpu_without_the_interpreter():
    import os
    import subprocess
    import sys

    # warmup("cpu") launched the Triton layout and tree kernels whatever the backend: without
    # TRITON_INTERPRET (a user's CPU machine) Triton found no driver and warmup raised.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch, specsample; "
            "print(specsample.warmup('cpu', vocab_size=3000, dtypes=(torch.float32,), "
            "methods=('token',)), sorted(specsample.paths.counts()))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torch.verify.onehot" in out.stdout
