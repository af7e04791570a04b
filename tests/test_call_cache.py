"""specsample.call_cache: eager calls recorded, checked and replayed.

On CPU the machinery is driven with a stand-in "kernel" (``ctypes.memmove`` between the
addresses a launch is given), so the recording, the address slots, the refusals and the
invalidation are tested without a GPU; the GPU tests replay real verify() / sample() calls
against the same calls with the cache off, token for token.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingParams, call_cache, paths, workspace


def _batch(device="cpu", n=1, vocab=8, **kw):
    return SamplingBatch.from_params([SamplingParams(seed=i, **kw) for i in range(n)],
                                     vocab_size=vocab, device=device)


def _copy_kernel(g0, g1, g2, stream, function, *rest):
    """The stand-in launcher: rest = (src, dst, nbytes, offset): dst[:] = src + offset bytes."""
    src, dst, nbytes, offset = rest
    ctypes.memmove(dst, src + offset, nbytes)


class _Call:
    """A call that allocates its output, "launches" a copy of ``x`` (from byte ``offset``, a
    view) into it, and reads one long-lived tensor; ``extra`` runs inside (to add an op)."""

    def __init__(self, keep: torch.Tensor, offset: int = 0, extra=None) -> None:
        self.keep, self.offset, self.extra, self.calls = keep, offset, extra, 0

    def __call__(self, x: torch.Tensor):
        self.calls += 1
        paths.record("test.call_cache.body", x.shape[0])
        src = x[self.offset // x.element_size():]  # (a view: its address is x's plus offset)
        out = torch.empty(src.shape[0], dtype=x.dtype)
        nbytes = out.numel() * out.element_size()
        args = (src, out, nbytes, 0)
        values = [src.data_ptr(), out.data_ptr(), nbytes, 0]
        rec = call_cache.recording()
        if rec is not None:
            rec.launch(_copy_kernel, (1, 1, 1), 0, 0, (), args, values, ())
            rec.launch(_copy_kernel, (1, 1, 1), 0, 0, (), (self.keep, self.keep, 4, 0),
                       [self.keep.data_ptr(), self.keep.data_ptr(), 4, 0], ())
        _copy_kernel(1, 1, 1, 0, 0, *values)
        if self.extra is not None:
            self.extra(out)
        return (out, None)


def _run(batch, fn, x, key=("k",)):
    return call_cache.run((key, [x]), batch, lambda: fn(x))


def test_third_call_on_replays_with_new_addresses():
    batch, fn = _batch(), _Call(torch.zeros(4))
    paths.reset()
    for step in range(6):
        x = torch.arange(10, dtype=torch.float32) + 100 * step
        out, none = _run(batch, fn, x)
        assert none is None
        assert torch.equal(out, x)
    assert fn.calls == 3  # the first call, then two recordings; then replays
    counts = paths.counts()
    assert counts["host.replay"] == {"calls": 3, "rows": 30}
    assert counts["test.call_cache.body"]["calls"] == 6  # replays count the recorded paths
    assert not any(k.startswith("host.replay_refused") for k in counts)


def test_replay_keeps_view_offsets():
    batch, fn = _batch(), _Call(torch.zeros(4), offset=8)  # reads x from element 2
    for step in range(5):
        x = torch.arange(10, dtype=torch.float32) * (step + 1)
        out, _ = _run(batch, fn, x)
        assert torch.equal(out, x[2:])


def test_allocations_are_made_again():
    batch, fn = _batch(), _Call(torch.zeros(4))

    def with_full(x):
        out, _ = fn(x)
        marker = torch.full((3,), -1.0)  # (a fresh allocation the call returns)
        _add(out, marker)
        return out, marker

    paths.reset()
    for step in range(5):
        x = torch.arange(10, dtype=torch.float32) + step
        out, marker = call_cache.run((("k",), [x]), batch, lambda x=x: with_full(x))
        assert torch.equal(out, x)
        assert torch.equal(marker, torch.tensor([step - 1.0, -1.0, -1.0]))
    assert paths.counts()["host.replay"]["calls"] == 2


def _add_kernel(g0, g1, g2, stream, function, src, dst):
    """dst[0] += src[0] (float32 addresses)."""
    a = ctypes.c_float.from_address(src)
    b = ctypes.c_float.from_address(dst)
    b.value = b.value + a.value


def _add(src: torch.Tensor, dst: torch.Tensor) -> None:
    """"A kernel" that adds src[0] to dst[0], recorded when a recording is on."""
    rec = call_cache.recording()
    if rec is not None:
        rec.launch(_add_kernel, (1, 1, 1), 0, 0, (), (src, dst),
                   [src.data_ptr(), dst.data_ptr()], ())
    _add_kernel(1, 1, 1, 0, 0, src.data_ptr(), dst.data_ptr())


def test_a_result_that_outlives_the_call_is_returned_by_every_replay():
    """A long-lived result (as the workspace's error bits): each replay's launch writes it and
    the replay hands back that same tensor."""
    batch, fn, bits = _batch(), _Call(torch.zeros(4)), torch.zeros(2)

    def with_bits(x):
        out, _ = fn(x)
        _add(out, bits)
        return out, bits

    paths.reset()
    for step in range(5):
        x = torch.arange(10, dtype=torch.float32) + step
        out, got = call_cache.run((("k",), [x]), batch, lambda x=x: with_bits(x), kept=(1,))
        assert got is bits and torch.equal(out, x)
        assert bits[0].item() == sum(range(step + 1))  # (written by every call, replays too)
    assert paths.counts()["host.replay"]["calls"] == 2
    # Given new memory, the kept result is no longer what the launches write: the key
    # records again (the call runs as usual and writes the new memory).
    bits.data = torch.full((2,), -7.0)
    for step in range(5, 8):
        x = torch.arange(10, dtype=torch.float32) + step
        _, got = call_cache.run((("k",), [x]), batch, lambda x=x: with_bits(x), kept=(1,))
        assert got is bits and bits[0].item() == -7.0 + sum(range(5, step + 1))
    assert paths.counts()["host.replay"]["calls"] == 2  # (a first call, two recordings)
    # Where the caller does not allow it (a user-visible output), such a result is refused.
    other = _batch()
    for _ in range(3):
        x = torch.arange(10, dtype=torch.float32)
        call_cache.run((("k",), [x]), other, lambda x=x: with_bits(x))
    assert paths.counts()["host.replay_refused.result_not_fresh"]["calls"] == 1


def test_a_result_viewing_an_input_is_refused():
    batch, fn = _batch(), _Call(torch.zeros(4))
    paths.reset()
    for step in range(4):
        x = torch.arange(10, dtype=torch.float32) + step
        out, view = call_cache.run((("k",), [x]), batch, lambda x=x: (fn(x)[0], x[1:]))
        assert torch.equal(view, x[1:]) and torch.equal(out, x)
    counts = paths.counts()
    assert counts["host.replay_refused.result_not_fresh"]["calls"] == 1
    assert "host.replay" not in counts


def test_an_operation_refuses_the_key_for_good():
    batch = _batch()
    fn = _Call(torch.zeros(4), extra=lambda out: out.add_(1))
    paths.reset()
    for step in range(5):
        x = torch.arange(10, dtype=torch.float32) + step
        out, _ = _run(batch, fn, x)
        assert torch.equal(out, x + 1)
    assert fn.calls == 5
    counts = paths.counts()
    assert counts["host.replay_refused.op.aten.add_.Tensor"]["calls"] == 1
    assert "host.replay" not in counts


def test_recordings_that_disagree_are_refused():
    batch, fn = _batch(), _Call(torch.zeros(4))
    paths.reset()
    results = []
    for step in range(5):
        fn.keep = torch.zeros(4 + step)  # a long-lived tensor that is not the same each call
        x = torch.arange(10, dtype=torch.float32) + step
        out, _ = _run(batch, fn, x)
        results.append(torch.equal(out, x))
    assert all(results) and fn.calls == 5
    assert paths.counts()["host.replay_refused.unstable"]["calls"] == 1


def test_a_failed_recording_is_refused():
    batch = _batch()
    fn = _Call(torch.zeros(4))

    def failing(x):
        rec = call_cache.recording()
        if rec is not None:
            rec.fail("launch.triton")
        return fn(x)

    paths.reset()
    for step in range(4):
        _run(batch, failing, torch.arange(10, dtype=torch.float32) + step)
    assert fn.calls == 4
    assert paths.counts()["host.replay_refused.launch.triton"]["calls"] == 1


def test_inputs_sharing_storage_are_refused():
    batch, fn = _batch(), _Call(torch.zeros(4))
    paths.reset()
    for _ in range(4):
        buf = torch.arange(20, dtype=torch.float32)
        x, y = buf[:10], buf[10:]
        call_cache.run((("k",), [x, y]), batch, lambda x=x: fn(x))
    assert fn.calls == 4
    assert paths.counts()["host.replay_refused.shared_storage"]["calls"] == 1


def test_changed_batch_or_released_workspace_records_again():
    batch, fn = _batch(), _Call(torch.zeros(4))
    for step in range(3):
        _run(batch, fn, torch.arange(10, dtype=torch.float32) + step)
    assert fn.calls == 3
    _run(batch, fn, torch.arange(10, dtype=torch.float32))
    assert fn.calls == 3  # replayed
    batch.needs_bans = batch.needs_bans  # any attribute set drops the entries
    _run(batch, fn, torch.arange(10, dtype=torch.float32))
    assert fn.calls == 4
    for _ in range(3):
        _run(batch, fn, torch.arange(10, dtype=torch.float32))
    assert fn.calls == 6
    workspace.release()
    _run(batch, fn, torch.arange(10, dtype=torch.float32))
    assert fn.calls == 7


def test_a_batch_tensor_given_new_memory_records_again():
    # ``t.data = ...`` gives a batch tensor new memory without setting the batch's attribute:
    # the replay must not go on reading (or writing) the old memory.
    batch = _batch()
    fn = _Call(batch.temperature)  # (a launch reads the batch's temperature)
    for step in range(4):
        _run(batch, fn, torch.arange(10, dtype=torch.float32) + step)
    assert fn.calls == 3
    batch.temperature.data = torch.full((1,), 0.5)
    fn.keep = batch.temperature
    for step in range(4):
        out, _ = _run(batch, fn, torch.arange(10, dtype=torch.float32) + step)
        assert torch.equal(out, torch.arange(10, dtype=torch.float32) + step)
    assert fn.calls == 6  # recorded again (twice), then replayed


def test_replays_under_forbid_raise_for_forbidden_paths_only():
    batch, fn = _batch(), _Call(torch.zeros(4))
    paths.reset()
    with paths.forbid("nothing.matches"):  # (as the bench times its calls)
        for step in range(5):
            out, _ = _run(batch, fn, torch.arange(10, dtype=torch.float32) + step)
            assert torch.equal(out, torch.arange(10, dtype=torch.float32) + step)
    assert fn.calls == 3 and paths.counts()["host.replay"]["calls"] == 2
    with paths.forbid("test.call_cache.*"), pytest.raises(paths.ForbiddenPathError):
        _run(batch, fn, torch.arange(10, dtype=torch.float32))
    assert fn.calls == 3  # (raised before any work)


def test_a_refusal_is_counted_even_when_host_paths_are_forbidden():
    batch = _batch()
    fn = _Call(torch.zeros(4), extra=lambda out: out.add_(1))
    with paths.forbid("host.*"):
        for step in range(4):  # (the refusal is counted after the call's work: no raise)
            out, _ = _run(batch, fn, torch.arange(10, dtype=torch.float32) + step)
            assert torch.equal(out, torch.arange(10, dtype=torch.float32) + step + 1)


def test_new_memory_between_the_two_recordings_records_again():
    batch = _batch()
    fn = _Call(batch.temperature)
    paths.reset()
    for step in range(2):  # (the first call, the first recording)
        _run(batch, fn, torch.arange(10, dtype=torch.float32) + step)
    batch.temperature.data = torch.full((1,), 0.5)
    fn.keep = batch.temperature
    for step in range(5):
        out, _ = _run(batch, fn, torch.arange(10, dtype=torch.float32) + step)
        assert torch.equal(out, torch.arange(10, dtype=torch.float32) + step)
    assert "host.replay_refused.unstable" not in paths.counts()
    assert paths.counts()["host.replay"]["calls"] == 3


def test_disabled_and_keys_per_batch():
    batch, fn = _batch(), _Call(torch.zeros(4))
    with call_cache.disabled():
        assert call_cache.call_key("sample", torch.zeros(1, 8), batch, None, None, None, None,
                                   torch.zeros(1, dtype=torch.int64), "token", None) is None
    for i in range(call_cache.MAX_KEYS + 3):  # (the oldest keys are dropped, not kept)
        _run(batch, fn, torch.arange(10, dtype=torch.float32), key=(i,))
    assert len(call_cache._entries(batch)) == call_cache.MAX_KEYS


def test_no_key_on_cpu_or_for_host_lists():
    batch = _batch()
    logits = torch.zeros(1, 8)
    assert call_cache.call_key("sample", logits, batch, None, None, None, None,
                               torch.zeros(1, dtype=torch.int64), "token", None) is None
    if torch.cuda.is_available():
        gpu = _batch("cuda")
        assert call_cache.call_key("sample", logits.cuda(), gpu, None, None, None, None, [0],
                                   "token", None) is None
        assert call_cache.call_key("verify", logits.cuda(), gpu, [1], [0], None, None, None,
                                   "token", None) is None
        for method, max_k in ((["token"], None), ("token", [2]), ("token", True)):
            # (unhashable or ambiguous: the usual path validates and raises)
            assert call_cache.call_key("verify", logits.cuda(), gpu, None, [0], None, None,
                                       None, method, max_k) is None
        keyed = call_cache.call_key("sample", logits.cuda(), gpu, None, None, None, None, None,
                                    "token", None)
        assert keyed is not None and len(keyed[1]) == 1  # (positions=None: logits alone)


@pytest.fixture
def cuda_like(monkeypatch):
    """call_key on CPU tensors as if they were on the current CUDA device and stream 77."""
    pytest.importorskip("specsample.triton_backend")
    monkeypatch.setattr(call_cache, "_on_cuda", lambda t: True)
    monkeypatch.setattr(call_cache, "_current_stream", lambda t: 77)
    monkeypatch.delenv("SPECSAMPLE_BACKEND", raising=False)


def _verify_key(batch, logits, ids, nd, **kw):
    args = dict(draft_logits=None, draft_probs=None, positions=torch.zeros(2, dtype=torch.int64),
                method="token", max_num_draft_tokens=None)
    args.update(kw)
    return call_cache.call_key("verify", logits, batch, ids, nd, args["draft_logits"],
                               args["draft_probs"], args["positions"], args["method"],
                               args["max_num_draft_tokens"])


def test_call_key_tells_calls_apart(cuda_like, monkeypatch):
    batch = _batch(n=2, vocab=8)
    x = torch.zeros(5, 8)
    ids = torch.zeros(3, dtype=torch.int64)
    key, inputs = _verify_key(batch, x, ids, [2, 1])
    assert inputs[0] is x and inputs[2] is ids
    same = _verify_key(batch, torch.ones(5, 8), torch.ones(3, dtype=torch.int64), [2, 1])[0]
    assert same == key  # (new contents and addresses, same key)
    different = [
        _verify_key(batch, x, ids, [1, 2]),
        _verify_key(batch, x.to(torch.bfloat16), ids, [2, 1]),
        _verify_key(batch, torch.zeros(8, 5).t(), ids, [2, 1]),  # (strides)
        _verify_key(batch, torch.zeros(41)[1:].view(5, 8), ids, [2, 1]),  # (alignment)
        _verify_key(batch, x, ids.to(torch.int32), [2, 1]),
        _verify_key(batch, x, ids, [2, 1], positions=None),
        _verify_key(batch, x, ids, [2, 1], method="block"),
        _verify_key(batch, x, ids, [2, 1], max_num_draft_tokens=2),
        _verify_key(batch, x, ids, [2, 1], draft_logits=torch.zeros(3, 8)),
        _verify_key(batch, x, ids, [2, 1], draft_probs=torch.zeros(3, 8)),
    ]
    assert all(k is not None and k[0] != key for k in different)
    assert len({k[0] for k in different}) == len(different)
    with triton_backend_separate():
        assert _verify_key(batch, x, ids, [2, 1])[0] != key
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    assert _verify_key(batch, x, ids, [2, 1])[0] != key
    # No key: the usual path runs (and validates, raises, or takes the torch backend).
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    assert _verify_key(batch, x, ids, [2, 1]) is None
    monkeypatch.delenv("SPECSAMPLE_BACKEND")
    for bad in ([True, 1], [2.0, 1], (2, 1.0), [2, np.int64(1)], [2, 1, 0][:1] + [1.0]):
        assert _verify_key(batch, x, ids, bad) is None
    assert _verify_key(batch, x, ids, [2, 1], method=["token"]) is None
    assert _verify_key(batch, x, ids, [2, 1], max_num_draft_tokens=True) is None
    assert _verify_key(batch, x, ids, [2, 1], max_num_draft_tokens=[2]) is None
    assert _verify_key(batch, x, ids, [2, 1], positions=[0, 0]) is None
    assert _verify_key(batch, x, [0, 0, 0], [2, 1]) is None
    assert _verify_key(batch, x, ids, torch.tensor([2, 1])) is None  # (no max_num_draft_tokens)
    device_counts = _verify_key(batch, x, ids, torch.tensor([2, 1]), max_num_draft_tokens=2)
    assert device_counts is not None and len(device_counts[1]) == 4
    general = _batch(n=2, vocab=8, repetition_penalty=1.2, top_k=3, logprobs=33)
    assert _verify_key(general, x, ids, [2, 1]) is None  # (33 top-n: the general path)
    # (logit_bias / penalties, with or without filters or logprobs = 0, run in the kernels:
    # recorded like any fused call)
    assert _verify_key(_batch(n=2, vocab=8, repetition_penalty=1.2, top_k=3, logprobs=0), x,
                       ids, [2, 1]) is not None
    assert _verify_key(_batch(n=2, vocab=8, repetition_penalty=1.2), x, ids, [2, 1]) is not None
    assert _verify_key(_batch(n=2, vocab=8, repetition_penalty=1.2, top_k=3), x, ids,
                       [2, 1]) is not None
    with call_cache.disabled():
        assert _verify_key(batch, x, ids, [2, 1]) is None


def triton_backend_separate():
    from specsample import triton_backend
    return triton_backend.separate_launches()


# ---------------------------------------------------------------------------------------------
# GPU: real calls, replayed against the same calls with the cache off

V, K = 4096, 3


def _verify_calls(device, kind: str, **params):
    g = torch.Generator(device=device).manual_seed(1)
    n = 6
    batch = _batch(device, n=n, vocab=V, **params)
    nd = [K, 0, 2, K, 1, K]
    rows = n + sum(nd)
    s = sum(nd)

    def inputs(step):
        logits = torch.randn(rows, V, device=device, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, V, (s,), device=device, generator=g)
        ids[0] = logits[0].float().argmax()  # (some accepted drafts)
        pos = torch.arange(n, device=device) * 7 + step * 5
        kw = {}
        if kind == "device_counts":
            kw = {"num_draft_tokens": torch.tensor(nd, device=device), "max_num_draft_tokens": K}
        if kind.startswith("block"):
            kw["method"] = "block"
        if kind in ("draft_logits", "block_draft_logits"):
            kw["draft_logits"] = torch.randn(s, V, device=device, generator=g)
        elif kind == "draft_probs":
            kw["draft_probs"] = torch.softmax(torch.randn(s, V, device=device, generator=g), -1)
        return logits, ids, pos, kw

    def call(step, inp):
        logits, ids, pos, kw = inp
        kw = {"num_draft_tokens": nd, **kw}
        return specsample.verify(logits, ids, batch=batch, positions=pos, strict=False, **kw)

    return batch, inputs, call


def _same(a, b):
    for f in ("token_ids", "num_accepted", "invalid", "logprob_token_ids"):
        x, y = getattr(a, f, None), getattr(b, f, None)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(x, y), f
    if getattr(a, "logprobs", None) is not None:
        assert torch.equal(a.logprobs, b.logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,params,replays", [
    ("onehot", {"temperature": 1.0}, True),
    ("onehot", {"temperature": 0.0}, True),
    ("onehot", {"temperature": 0.7, "top_k": 20, "top_p": 0.8}, True),
    ("onehot", {"temperature": 1.0, "min_p": 0.05, "logprobs": 5}, True),
    ("onehot", {"temperature": 1.0, "logprobs": 0}, True),
    ("draft_logits", {"temperature": 0.8}, True),
    ("block_draft_logits", {"temperature": 1.0}, True),
    ("device_counts", {"temperature": 1.0}, True),
    ("draft_probs", {"temperature": 1.0, "top_p": 0.9}, True),
    ("onehot", {"temperature": 1.0, "repetition_penalty": 1.2, "logit_bias": {3: 2.0}}, True),
    ("onehot", {"temperature": 1.0, "repetition_penalty": 1.2, "top_k": 20}, True),
    ("onehot", {"temperature": 1.0, "repetition_penalty": 1.2, "top_k": 20, "logprobs": 0},
     True),
    ("onehot", {"temperature": 1.0, "presence_penalty": 0.5, "logprobs": 3,
                "logprobs_mode": "processed"}, True),
    ("onehot", {"temperature": 1.0, "repetition_penalty": 1.2, "top_k": 20, "logprobs": 2},
     True),
    # (more than 32 top-n with penalties: the general path, never recorded)
    ("onehot", {"temperature": 1.0, "repetition_penalty": 1.2, "logprobs": 33}, False),
])
def test_gpu_verify_replays_token_for_token(kind, params, replays):
    dev = torch.device("cuda")
    batch, inputs, call = _verify_calls(dev, kind, **params)
    paths.reset()
    for step in range(6):
        inp = inputs(step)
        got = call(step, inp)
        with call_cache.disabled():
            want = call(step, inp)
        _same(got, want)
    counts = paths.counts()
    if replays:
        assert counts["host.replay"]["calls"] == 3, counts
        assert not any(k.startswith("host.replay_refused") for k in counts), counts
    else:  # (the general path: never recorded)
        assert not any(k.startswith("host.replay") for k in counts), counts


@pytest.mark.gpu
def test_gpu_sample_replays_and_forbid_still_raises():
    dev = torch.device("cuda")
    batch = _batch(dev, n=5, vocab=V, temperature=0.9, top_k=50)
    g = torch.Generator(device=dev).manual_seed(3)
    paths.reset()
    for step in range(5):
        logits = torch.randn(5, V, device=dev, generator=g).to(torch.float16)
        pos = torch.full((5,), step, device=dev, dtype=torch.int64)
        got = specsample.sample(logits, batch, positions=pos, strict=False)
        with call_cache.disabled():
            want = specsample.sample(logits, batch, positions=pos, strict=False)
        _same(got, want)
    assert paths.counts()["host.replay"]["calls"] == 2
    with paths.forbid("triton.sample.filtered"), pytest.raises(paths.ForbiddenPathError):
        specsample.sample(logits, batch, positions=pos, strict=False)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_gpu_fresh_positions_replay_and_advance_the_counter(temperature):
    dev = torch.device("cuda")
    batches = []
    for _ in range(2):  # twins: the same drawn seeds and counter start
        torch.manual_seed(11)
        batches.append(SamplingBatch.from_params(
            [SamplingParams(temperature=temperature)] * 3, vocab_size=V, device=dev))
    batch, twin = batches
    g = torch.Generator(device=dev).manual_seed(7)
    paths.reset()
    for _ in range(6):
        logits = torch.zeros(3, V, device=dev) + torch.rand(3, V, device=dev, generator=g) * 1e-3
        got = specsample.sample(logits, batch, strict=False)
        with call_cache.disabled():
            want = specsample.sample(logits, twin, strict=False)
        _same(got, want)
        assert torch.equal(batch.fresh_counter, twin.fresh_counter)
    assert paths.counts()["host.replay"]["calls"] == 3


@pytest.mark.gpu
def test_gpu_replay_then_graph_capture_and_a_misaligned_view():
    dev = torch.device("cuda")
    batch = _batch(dev, n=4, vocab=V, temperature=1.0)
    g = torch.Generator(device=dev).manual_seed(5)
    buf = torch.randn(4 * V + 8, device=dev, generator=g).to(torch.bfloat16)
    pos = torch.arange(4, device=dev)
    for _ in range(4):
        specsample.sample(buf[:4 * V].view(4, V), batch, positions=pos, strict=False)
    # A view that starts 2 bytes in: another alignment, another key, the same tokens.
    odd = buf[1:4 * V + 1].view(4, V)
    for _ in range(4):
        got = specsample.sample(odd, batch, positions=pos, strict=False)
        with call_cache.disabled():
            want = specsample.sample(odd, batch, positions=pos, strict=False)
        _same(got, want)
    # Capture after replays: the capture runs the usual path, and the replayed graph agrees.
    static = buf[:4 * V].view(4, V).clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        specsample.sample(static, batch, positions=pos, strict=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = specsample.sample(static, batch, positions=pos, strict=False)
    graph.replay()
    with call_cache.disabled():
        want = specsample.sample(static, batch, positions=pos, strict=False)
    _same(out, want)
