"""Regression tests from a review of the device-resident num_draft_tokens layout
(verify(max_num_draft_tokens=K)) and the persistent SamplingBatch (append / select / concat /
refresh_min_tokens): the bugs it found (test_bug_*, fixed since) and gaps in the coverage.
"""

from __future__ import annotations

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams
from specsample import plan as plan_mod
from specsample.outputs import SampleOutput, VerifyOutput
from specsample.plan import ERR_NUM_DRAFT_TOKENS
from test_persistent_batch import _same  # outputs equal field by field


def _device_counts(monkeypatch):
    """Every num_draft_tokens tensor takes the device layout (CPU tensors too)."""
    monkeypatch.setattr(plan_mod, "_is_device_tensor", lambda t: isinstance(t, torch.Tensor))




# ------------------------------------------------------------------ 1. max_num_draft_tokens


@pytest.mark.parametrize("kind", ["draft_logits", "draft_probs"])
@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("device_layout", [False, True])
def test_bug_no_drafts_with_draft_distribution_and_max_num_draft_tokens(
        kind, method, device_layout, monkeypatch):
    # BUG (torch backend): every k_i = 0 (S = 0, a [0, V] draft distribution) with
    # max_num_draft_tokens = K > 0 raises IndexError in torch_backend.draft_distribution
    # (torch_backend._grid clamps the draft index to max(S - 1, 0) = 0 and indexes the empty
    # draft_logits / draft_probs). Valid input: a CUDA-graph caller with a fixed K whose
    # drafter proposed nothing this step. Without max_num_draft_tokens (K = 0) and on the
    # Triton backend the same call works.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    v = 16
    gen = torch.Generator().manual_seed(0)
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.8, seed=1),
                                       SamplingParams(temperature=0.0, seed=2)], vocab_size=v)
    logits = torch.randn(2, v, generator=gen) * 3
    pos = torch.tensor([3, 9])
    ref = specsample.verify(logits, torch.empty(0, dtype=torch.int64), [0, 0], batch,
                            positions=pos, method=method)
    if device_layout:
        _device_counts(monkeypatch)
    out = specsample.verify(logits, torch.empty(0, dtype=torch.int64),
                            torch.tensor([0, 0]) if device_layout else [0, 0], batch,
                            positions=pos, method=method, max_num_draft_tokens=2,
                            **{kind: torch.rand(0, v, generator=gen)})
    assert out.token_ids.shape == (2, 3)
    assert torch.equal(out.token_ids[:, :1], ref.token_ids)
    assert (out.token_ids[:, 1:] == -1).all() and (out.num_accepted == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bug_device_counts_that_do_not_fit_with_no_drafts_and_draft_probs(backend,
                                                                          monkeypatch):
    # BUG (same root as above, torch backend): device counts [1, 0] for S = 0 drafts (a sum
    # that disagrees with the drafts) with a [0, V] draft_probs raise IndexError instead of
    # returning every request invalid (ERR_NUM_DRAFT_TOKENS); the Triton backend does so.
    if backend == "triton":
        pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", backend)
    _device_counts(monkeypatch)
    v = 16
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.8, seed=1)] * 2,
                                      vocab_size=v)
    out = specsample.verify(torch.randn(2, v), torch.empty(0, dtype=torch.int64),
                            torch.tensor([1, 0]), batch, positions=[0, 0],
                            draft_probs=torch.rand(0, v), max_num_draft_tokens=2, strict=False)
    assert out.invalid.tolist() == [True, True] and (out.token_ids == -1).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_device_layout_general_path_with_wide_k_matches_host(backend, monkeypatch):
    # Regression: K above every k_i, requests with 0 drafts, a placeholder, penalties, bad
    # words spanning the history and the drafts, min_tokens with eos, allowed ids, logit bias
    # and processed logprobs: the device layout gives the host layout's outputs exactly.
    if backend == "triton":
        pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", backend)
    v, k_max = 12, 4
    gen = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(temperature=0.9, seed=1, presence_penalty=1.0, repetition_penalty=1.5,
                       bad_words_token_ids=[[1, 2, 3]], logprobs=2, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, seed=2, min_tokens=3, stop_token_ids=[4],
                       allowed_token_ids=[1, 2, 3, 4, 5, 11]),
        SamplingParams(temperature=1.3, seed=3, logit_bias={2: 2.0}, top_k=4, logprobs=1),
    ]
    batch = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=[[1], [2], [3]],
                                      output_token_ids=[[1, 2], [], [5]], eos_token_ids=[11])
    ks = [3, 0, 2]
    logits = torch.randn(3 + sum(ks), v, generator=gen) * 2
    logits[:, 1:4] += 3
    drafts = torch.tensor([3, 1, 2, 2, -1])
    for method in ("token", "block"):
        for extra in ({}, {"draft_probs": torch.softmax(torch.randn(5, v, generator=gen), -1)}):
            pos = torch.tensor([7, 8, 9])
            host = specsample.verify(logits, drafts, ks, batch, positions=pos, method=method,
                                     strict=False, max_num_draft_tokens=k_max, **extra)
            with monkeypatch.context() as mp:
                _device_counts(mp)
                dev = specsample.verify(logits, drafts, torch.tensor(ks, dtype=torch.int32),
                                        batch, positions=pos, method=method, strict=False,
                                        max_num_draft_tokens=k_max, **extra)
            assert host.token_ids.shape == (3, k_max + 1)
            _same(host, dev)


def test_device_layout_bad_counts_never_emit_out_of_range(monkeypatch):
    # Regression: a count above K, a negative count, a wrong sum and huge counts on the
    # general path with draft_probs: no exception, ids in [-1, V), the right requests invalid.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    _device_counts(monkeypatch)
    v, k_max = 10, 2
    gen = torch.Generator().manual_seed(1)
    params = [SamplingParams(seed=i, temperature=0.7, presence_penalty=0.5, logprobs=3,
                             bad_words_token_ids=[[1, 2]], min_tokens=2) for i in range(3)]
    batch = SamplingBatch.from_params(params, vocab_size=v, eos_token_ids=[0])
    s = 4
    logits = torch.randn(3 + s, v, generator=gen)
    drafts = torch.randint(0, v, (s,), generator=gen)
    q = torch.softmax(torch.randn(s, v, generator=gen), -1)
    for ks, invalid in (([0, 4, 0], [False, True, False]), ([1, 3, 0], [False, True, False]),
                        ([-1, 5, 0], [True] * 3), ([1, 1, 1], [True] * 3),
                        ([2**62, 2**62, 0], [True] * 3), ([0, 0, -(2**63)], [True] * 3)):
        for method in ("token", "block"):
            out = specsample.verify(logits, drafts, torch.tensor(ks), batch, draft_probs=q,
                                    positions=torch.arange(3), method=method, strict=False,
                                    max_num_draft_tokens=k_max)
            assert out.invalid.tolist() == invalid, ks
            assert ((out.token_ids >= -1) & (out.token_ids < v)).all()
            assert ((out.logprob_token_ids >= -1) & (out.logprob_token_ids < v)).all()
            assert (out.token_ids[torch.tensor(invalid)] == -1).all()
        with pytest.raises(SamplingError) as e:
            specsample.verify(logits, drafts, torch.tensor(ks), batch, draft_probs=q,
                              positions=torch.arange(3), max_num_draft_tokens=k_max)
        assert e.value.requests == [i for i, bad in enumerate(invalid) if bad]
    assert ERR_NUM_DRAFT_TOKENS == 1 << 8


# ------------------------------------------------------------------ 2. persistent batch


def test_multi_token_bad_word_prefix_spans_steps_and_drafts():
    # Regression: the word (1, 2, 3, 4): 1 in the prompt, 2 emitted by sample(), 3 an accepted
    # draft of the next verify(); 4 must be banned at the row after the draft 3 and the
    # persistent batch must agree with the rebuilt one at every step, also after a select()
    # that reorders and a concat() with a batch of longer words.
    v = 8
    word = [1, 2, 3, 4]
    p = SamplingParams(temperature=0.0, seed=1, bad_words_token_ids=[word])
    q = SamplingParams(temperature=0.0, seed=2)
    batch = SamplingBatch.from_params([q, p], vocab_size=v, prompt_token_ids=[[5], [0, 1]])
    history = [[], []]

    def rebuilt(params, prompts, outs):
        return SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=prompts,
                                         output_token_ids=outs)

    logits = torch.zeros(2, v)
    logits[:, 2] = 5.0
    out = specsample.sample(logits, batch, positions=[0, 0])
    assert out.token_ids.tolist() == [2, 2]
    batch.append(out)
    history = [[2], [2]]
    batch = batch.select([1, 0])  # reorder
    params, prompts, history = [p, q], [[0, 1], [5]], [history[1], history[0]]
    other = SamplingParams(temperature=0.0, seed=3, bad_words_token_ids=[[6, 6, 6, 6, 6, 6]])
    batch = SamplingBatch.concat([batch, SamplingBatch.from_params([other], vocab_size=v)])
    params, prompts, history = params + [other], prompts + [[]], history + [[]]
    # Request 0 drafts 3 (accepted: the argmax), then the bonus row prefers 4 (banned).
    t = torch.zeros(2 + 1 + 1, v)
    t[0, 3] = 9.0
    t[1, 4] = 9.0
    t[1, 7] = 1.0
    t[2, 4] = 9.0  # request 1 (no bad words): 4 is fine
    t[3, 4] = 9.0
    ref = specsample.verify(t, [3], [1, 0, 0], rebuilt(params, prompts, history),
                            positions=[1, 1, 0])
    out = specsample.verify(t, [3], [1, 0, 0], batch, positions=[1, 1, 0])
    _same(out, ref)
    assert out.token_ids.tolist() == [[3, 7], [4, -1], [4, -1]]
    batch.append(out)
    history = [history[0] + [3, 7], history[1] + [4], [4]]
    assert torch.equal(batch.num_output, torch.tensor([3, 2, 1]))
    assert batch.context_tail[0, -3:].tolist() == [2, 3, 7]


def test_min_tokens_threshold_with_and_without_refresh():
    # Regression: stop ids (own + eos) stay banned exactly until the count is reached, on
    # rows that count the drafts before them; refresh_min_tokens() only changes the flags.
    v = 6
    p = SamplingParams(temperature=0.0, seed=1, min_tokens=3, stop_token_ids=[4])
    for refresh in (False, True):
        batch = SamplingBatch.from_params([p], vocab_size=v, eos_token_ids=[5])
        hist = []
        logits = torch.zeros(3, v)
        logits[:, 5] = 9.0
        logits[:, 4] = 8.0
        logits[:, 1] = 1.0
        # num_output 0: rows 0, 1 (0 + j < 3) ban, row 2 (with 2 drafts accepted) ban too.
        out = specsample.verify(logits, [1, 1], [2], batch, positions=[0])
        assert out.token_ids.tolist() == [[1, 1, 1]]
        batch.append(out)
        hist += [1, 1, 1]
        if refresh:
            assert batch.refresh_min_tokens() and not batch.needs_bans
        ref = SamplingBatch.from_params([p], vocab_size=v, output_token_ids=[hist],
                                        eos_token_ids=[5])
        one = torch.zeros(1, v)
        one[0, 5] = 9.0
        a = specsample.sample(one, batch, positions=[3])
        b = specsample.sample(one, ref, positions=[3])
        _same(a, b)
        assert a.token_ids.tolist() == [5]


def test_invalid_request_appends_nothing_even_with_tokens_left_in_the_output():
    v = 6
    ps = [SamplingParams(seed=1, frequency_penalty=1.0, bad_words_token_ids=[[1, 2]],
                         min_tokens=4)]
    b = SamplingBatch.from_params(ps, vocab_size=v, eos_token_ids=[0])
    before = (b.num_output.clone(), b.output_counts.clone(), b.context_tail.clone())
    b.append(VerifyOutput(token_ids=torch.tensor([[1, 2, 3]]), num_accepted=torch.tensor([2]),
                          logprobs=None, logprob_token_ids=None, invalid=torch.tensor([True])))
    b.append(SampleOutput(token_ids=torch.tensor([3]), logprobs=None, logprob_token_ids=None,
                          invalid=torch.tensor([True])))
    for x, y in zip(before, (b.num_output, b.output_counts, b.context_tail), strict=True):
        assert torch.equal(x, y)


def test_select_shares_counter_so_fresh_noise_never_repeats():
    # positions=None: a selection and its source draw from one counter; every call (on
    # either) gets a new position, so a request never sees the same (seed, position) twice.
    torch.manual_seed(0)
    a = SamplingBatch.from_params([SamplingParams(), SamplingParams()], vocab_size=2048)
    s = a.select([1])
    start = int(a.fresh_counter)
    logits = torch.zeros(2, 2048)
    toks = []
    for call in range(6):
        if call % 2:
            toks.append(specsample.sample(logits[:1], s).token_ids.item())
        else:
            toks.append(specsample.sample(logits, a).token_ids[1].item())
    assert int(a.fresh_counter) == start + 6 and s.fresh_counter is a.fresh_counter
    assert len(set(toks)) == len(toks)  # flat logits: a repeated key would repeat the token
    c = SamplingBatch.concat([s, SamplingBatch.from_params([SamplingParams()], vocab_size=2048)])
    assert int(c.fresh_counter) >= start + 6
    toks.append(specsample.sample(logits, c).token_ids[0].item())
    assert len(set(toks)) == len(toks)


def test_append_rejects_outputs_that_do_not_fit():
    b = SamplingBatch.from_params([SamplingParams(seed=1, presence_penalty=0.5)] * 2,
                                  vocab_size=6)
    bad = [
        VerifyOutput(token_ids=torch.tensor([1, 2]), num_accepted=torch.tensor([0, 0]),
                     logprobs=None, logprob_token_ids=None, invalid=torch.tensor([False] * 2)),
        VerifyOutput(token_ids=torch.tensor([[1], [2], [3]]), num_accepted=torch.tensor([0, 0]),
                     logprobs=None, logprob_token_ids=None, invalid=torch.tensor([False] * 2)),
        SampleOutput(token_ids=torch.tensor([[1], [2]]), logprobs=None, logprob_token_ids=None,
                     invalid=torch.tensor([False] * 2)),
        SampleOutput(token_ids=torch.tensor([1, 2]), logprobs=None, logprob_token_ids=None,
                     invalid=torch.tensor([False])),
        SampleOutput(token_ids=torch.tensor([1, 2, 3]), logprobs=None, logprob_token_ids=None,
                     invalid=torch.tensor([False] * 3)),  # another batch's output
    ]
    for out in bad:
        with pytest.raises(ValueError, match="append"):
            b.append(out)
    assert b.num_output.tolist() == [0, 0] and b.output_counts.sum() == 0


@pytest.mark.parametrize("bad", ["nan", "posinf", "all_neginf"])
@pytest.mark.parametrize("op", ["sample", "verify"])
def test_bug_triton_general_path_strict_false_reports_invalid_target_rows(bad, op,
                                                                          monkeypatch):
    # BUG (triton_backend.run, general path): torch_backend.processed_logits zeroes the rows
    # of requests with NaN / +inf / no finite target logits before the kernels run, so the
    # kernels see finite rows and emit a token; run() then ORs the processing's error bits
    # into ``err`` only, not into ``invalid`` / ``token_ids`` / ``num_accepted`` /
    # ``logprobs``. With strict=False the request comes back invalid=False with a real token
    # (and a NaN logprob), where the torch backend (and the fused Triton path) says
    # invalid=True, token -1 (api.md guarantee 5). Every batch that needs the general path is
    # affected, and the persistent batch keeps batches on it (needs_bans stays True until
    # refresh_min_tokens()); append() then records the garbage token as an output.
    pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    v = 16
    params = [SamplingParams(temperature=1.0, seed=1, presence_penalty=0.5, logprobs=0),
              SamplingParams(temperature=0.0, seed=2)]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    assert batch.needs_general_path
    gen = torch.Generator().manual_seed(0)
    rows = 2 if op == "sample" else 3
    logits = torch.randn(rows, v, generator=gen)
    logits[0] = {"nan": float("nan"), "posinf": 0.0, "all_neginf": -float("inf")}[bad]
    if bad == "posinf":
        logits[0, 3] = float("inf")
    if op == "sample":
        out = specsample.sample(logits, batch, positions=[0, 0], strict=False)
        tok0 = out.token_ids[0]
    else:
        out = specsample.verify(logits, [5], [1, 0], batch, positions=[0, 0], strict=False)
        tok0 = out.token_ids[0]
        assert out.num_accepted[0] == 0
    assert out.invalid.tolist() == [True, False]
    assert (tok0 == -1).all()
    assert (out.logprobs[0] == -float("inf")).all()
    batch.append(out)
    assert batch.num_output.tolist() == [0, 1] and batch.output_counts[0].sum() == 0


@pytest.mark.parametrize("made_by", ["from_params", "select", "concat"])
def test_bug_batch_made_under_inference_mode_can_be_appended_outside_it(made_by):
    # BUG (params.SamplingBatch.from_params / select / concat + append): a batch built inside
    # torch.inference_mode() holds inference tensors, so append() (in place: output_counts,
    # context_tail, num_output) outside inference mode raises "Inplace update to inference
    # tensor outside InferenceMode is not allowed". The same kind of mixed use was fixed for
    # the workspace buffers (commit 474ce49); a server that builds batches in one mode and
    # steps them in another (or the engine's batch reused after generate()) hits it.
    ps = [SamplingParams(seed=1, presence_penalty=0.5, bad_words_token_ids=[[1, 2]],
                         min_tokens=2)]
    plain = SamplingBatch.from_params(ps, vocab_size=8, eos_token_ids=[0])
    with torch.inference_mode():
        if made_by == "from_params":
            batch = SamplingBatch.from_params(ps, vocab_size=8, eos_token_ids=[0])
        elif made_by == "select":
            batch = plain.select([0])
        else:
            batch = SamplingBatch.concat([plain])
    out = specsample.sample(torch.randn(1, 8), batch, positions=[0])
    batch.append(out)
    assert batch.num_output.tolist() == [1]


def test_triton_unrefreshed_min_tokens_batch_matches_rebuilt_after_refresh(monkeypatch):
    # After append() a request that reached min_tokens keeps its stop-token entries until
    # refresh_min_tokens(), so the Triton backend runs its general path while the batch
    # rebuilt from the history runs the fused path: the same law, rounded differently
    # (docs/api.md, persistent batch). After refresh_min_tokens() the outputs are identical.
    pytest.importorskip("specsample.triton_backend")
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    v = 64
    p = SamplingParams(temperature=1.9, seed=1, min_tokens=1, logprobs=2,
                       logprobs_mode="processed")
    batch = SamplingBatch.from_params([p], vocab_size=v, eos_token_ids=[0])
    batch.append(SampleOutput(token_ids=torch.tensor([5]), logprobs=None,
                              logprob_token_ids=None, invalid=torch.tensor([False])))
    rebuilt = SamplingBatch.from_params([p], vocab_size=v, eos_token_ids=[0],
                                        output_token_ids=[[5]])
    logits = torch.randn(1, v, generator=torch.Generator().manual_seed(4)) * 5
    stale = specsample.sample(logits, batch, positions=[3])
    want = specsample.sample(logits, rebuilt, positions=[3])
    assert torch.allclose(stale.logprobs, want.logprobs, atol=1e-5)
    assert batch.needs_bans and batch.refresh_min_tokens() and not batch.needs_bans
    _same(specsample.sample(logits, batch, positions=[3]), want)


def test_persistent_batch_with_device_draft_counts_matches_rebuilt(monkeypatch):
    # Regression: the persistent batch stepped with device-laid-out verify() calls (counts
    # change every step, K fixed, some requests without drafts, an over-K step that makes a
    # request invalid and must append nothing), select() reordering and refresh, equals the
    # batch rebuilt from the history (host layout) at every step.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    v, k_max = 10, 3
    params = [
        SamplingParams(temperature=0.8, seed=1, frequency_penalty=0.7, repetition_penalty=1.3,
                       bad_words_token_ids=[[1, 2, 3]], logprobs=1),
        SamplingParams(temperature=0.0, seed=2, min_tokens=4, stop_token_ids=[3]),
        SamplingParams(temperature=1.2, seed=3, bad_words_token_ids=[[2, 2]], top_k=4),
    ]
    prompts, hist = [[1, 2], [3], [2]], [[], [1], []]
    batch = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=prompts,
                                      output_token_ids=hist, eos_token_ids=[0])
    gen = torch.Generator().manual_seed(11)
    counts = [[3, 0, 1], [0, 2, 2], [1, 1, 1], [4, 0, 0], [2, 3, 0], [0, 0, 0]]
    for step, ks in enumerate(counts):
        n = len(params)
        ks = ks[:n]
        s = sum(ks)
        logits = torch.randn(n + s, v, generator=gen) * 2
        logits[:, 1:4] += 2
        drafts = torch.randint(1, 4, (s,), generator=gen)
        pos = torch.tensor([10 * step + i for i in range(n)])
        ref_ks = [min(k, k_max) for k in ks]
        with monkeypatch.context() as mp:
            _device_counts(mp)
            out = specsample.verify(logits, drafts, torch.tensor(ks), batch, positions=pos,
                                    strict=False, max_num_draft_tokens=k_max)
        over = [k > k_max for k in ks]
        assert out.invalid.tolist() == over
        if not any(over):
            rebuilt = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=prompts,
                                                output_token_ids=hist, eos_token_ids=[0])
            ref = specsample.verify(logits, drafts, ref_ks, rebuilt, positions=pos,
                                    strict=False, max_num_draft_tokens=k_max)
            _same(out, ref)
        batch.append(out)
        for i in range(n):
            if not out.invalid[i]:
                hist[i] = hist[i] + [t for t in out.token_ids[i].tolist() if t >= 0]
        assert batch.num_output.tolist() == [len(h) for h in hist]
        if step == 2:
            order = [2, 0, 1]
            batch = batch.select(order)
            params, prompts, hist = ([x[i] for i in order] for x in (params, prompts, hist))
        if step == 3:
            batch.refresh_min_tokens()


def test_bug_concat_of_batches_sharing_a_counter_repeats_noise():
    # BUG (params.SamplingBatch.concat, positions=None): select() results share their
    # source's fresh_counter ("calls with positions=None on either draw fresh noise"), but
    # concat() always makes a new counter holding the largest value, even when every input
    # shares one counter tensor. The joined batch then continues from the same value as the
    # source and the other selections: the next positions=None call on the source (or on a
    # selection) reuses the (seed, position) keys the joined batch just used, i.e. the same
    # noise, token for token. Reusing the shared tensor when all inputs share it would keep
    # the guarantee (distinct counters cannot be merged without such a hazard; see the
    # docstring's "keep using the joined batch").
    torch.manual_seed(0)
    a = SamplingBatch.from_params([SamplingParams(), SamplingParams()], vocab_size=4096)
    c = SamplingBatch.concat([a.select([0]), a.select([1])])
    logits = torch.zeros(2, 4096)  # flat: the token is the noise's argmax
    from_c = specsample.sample(logits, c).token_ids.tolist()
    from_a = specsample.sample(logits, a).token_ids.tolist()
    assert from_c != from_a  # the same two requests (same seeds) must not redraw one key


def test_concat_refuses_the_same_batch_twice():
    batch = SamplingBatch.from_params([SamplingParams()], vocab_size=8)
    with pytest.raises(ValueError, match="same batch appears twice"):
        SamplingBatch.concat([batch, batch])
