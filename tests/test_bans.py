"""Bans (allowed_token_ids, bad_words_token_ids, min_tokens with stop / eos tokens) on every
backend: validation, agreement with the float64 reference, greedy rows, and the speculation
rule (row j of a request counts drafts 0..j-1, for min_tokens and for the bad words' context).

The statistical test compares what one verify() step emits (draft_probs, token and block
methods) with ``reference.exact_step_law`` by a G-test; its power check runs the same test on
a deliberately wrong implementation (min_tokens that ignores the drafts before row j) and
requires it to reject. Those run on the torch backend (Triton's interpreter takes ~0.1 s per
request on CPU); the Triton backend is held to the same law by emitting the same tokens as
the torch backend on a slice of that setup.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams, paths, processing, reference

BACKENDS = ["torch", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", request.param)
    return request.param


# ------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("field, value", [
    ("allowed_token_ids", []),
    ("allowed_token_ids", [1, -1]),
    ("allowed_token_ids", "ab"),
    ("allowed_token_ids", [1.5]),
    ("bad_words_token_ids", [[]]),
    ("bad_words_token_ids", [1, 2]),
    ("bad_words_token_ids", [[1, -2]]),
    ("bad_words_token_ids", 3),
    ("min_tokens", -1),
    ("min_tokens", 1.5),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 3),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sequences_are_stored_as_tuples():
    p = SamplingParams(allowed_token_ids=np.array([3, 1]), bad_words_token_ids=[[1, 2], (4,)],
                       stop_token_ids=torch.tensor([5]), min_tokens=np.int64(2))
    assert p.allowed_token_ids == (3, 1)
    assert p.bad_words_token_ids == ((1, 2), (4,))
    assert p.stop_token_ids == (5,)
    assert p.min_tokens == 2 and type(p.min_tokens) is int


@pytest.mark.parametrize("kwargs, name", [
    ({"allowed_token_ids": [0, 8]}, "allowed_token_ids"),
    ({"stop_token_ids": [9]}, "stop_token_ids"),
    ({"bad_words_token_ids": [[1], [1, 8]]}, r"bad_words_token_ids\[1\]"),
])
def test_ids_checked_against_the_vocabulary(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingBatch.from_params([SamplingParams(**kwargs)], vocab_size=8)


def test_eos_ids_checked():
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingBatch.from_params([SamplingParams()], vocab_size=8, eos_token_ids=[8])
    with pytest.raises(ValueError, match="eos_token_ids"):
        SamplingBatch.from_params([SamplingParams()], vocab_size=8, eos_token_ids=[-1])


def test_bans_run_in_the_kernels(backend):
    # On the Triton backend the kernels apply the bans (with more than 32 top-n logprobs: the
    # general path).
    v = 8
    x = torch.zeros(2, v)
    for p in (SamplingParams(allowed_token_ids=[1]), SamplingParams(bad_words_token_ids=[[2]]),
              SamplingParams(min_tokens=1, stop_token_ids=[3]),
              SamplingParams(min_tokens=1, stop_token_ids=[3], logprobs=33)):
        batch = SamplingBatch.from_params([p, SamplingParams()], vocab_size=v)
        assert batch.needs_bans and batch.needs_general_path
        paths.reset()
        specsample.sample(x, batch)
        fused = p.logprobs is None
        name = ("torch.sample" if backend == "torch" else
                "triton.sample.fused" if fused else "triton.sample.general")
        assert name in paths.counts()
        assert ("triton.processing.fused" in paths.counts()) == (backend == "triton" and fused)
    # min_tokens already reached, or no stop token: nothing to ban
    for p, outputs in ((SamplingParams(min_tokens=1, stop_token_ids=[3]), [[4]]),
                       (SamplingParams(min_tokens=5), [[]])):
        batch = SamplingBatch.from_params([p], vocab_size=v, output_token_ids=outputs)
        assert not batch.needs_bans


# ------------------------------------------------------------------- against the reference


def _random_params(gen: np.random.Generator, v: int) -> SamplingParams:
    kw = {"temperature": float(gen.choice([0.0, 0.7, 1.3])), "seed": int(gen.integers(2**40))}
    if gen.random() < 0.5:
        kw["allowed_token_ids"] = sorted(gen.choice(v, size=int(gen.integers(2, v)),
                                                    replace=False).tolist())
    if gen.random() < 0.6:
        kw["bad_words_token_ids"] = [gen.integers(0, v, size=int(gen.integers(1, 4))).tolist()
                                     for _ in range(int(gen.integers(1, 4)))]
    if gen.random() < 0.6:
        kw["min_tokens"] = int(gen.integers(0, 5))
        kw["stop_token_ids"] = gen.integers(0, v, size=2).tolist()
    if gen.random() < 0.3:
        kw["logit_bias"] = {int(gen.integers(v)): float(gen.normal() * 2)}
    if gen.random() < 0.3:
        kw["frequency_penalty"] = 0.5
    if gen.random() < 0.4:
        kw["top_k"] = int(gen.integers(1, v))
    if gen.random() < 0.3:
        kw["top_p"] = 0.8
    return SamplingParams(**kw)


@pytest.mark.parametrize("kind", ["onehot", "probs"])
@pytest.mark.parametrize("case", range(6))
def test_verify_matches_the_reference(backend, case, kind):
    """Random bans (with other processors) under speculation: the same tokens as the float64
    reference, request by request (requests whose decisions are near float32 ties skipped)."""
    gen = np.random.default_rng(100 + case)
    v, n = 9, 6
    params = [_random_params(gen, v) for _ in range(n)]
    ks = gen.integers(0, 4, size=n).tolist()
    prompts = [gen.integers(0, v, size=3).tolist() for _ in range(n)]
    outputs = [gen.integers(0, v, size=int(gen.integers(0, 4))).tolist() for _ in range(n)]
    batch = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=prompts,
                                      output_token_ids=outputs, eos_token_ids=[v - 1])
    t = sum(ks) + n
    x = torch.tensor(gen.normal(size=(t, v)) * 2, dtype=torch.float32)
    drafts = torch.tensor(gen.integers(0, v, size=sum(ks)), dtype=torch.int64)
    kw = {}
    if kind == "probs":
        kw["draft_probs"] = torch.softmax(torch.tensor(gen.normal(size=(sum(ks), v)),
                                                       dtype=torch.float32), -1)
    pos = torch.tensor(gen.integers(0, 1000, size=n), dtype=torch.int64)
    out = specsample.verify(x, drafts, ks, batch, positions=pos, strict=False, **kw)
    ref, traces = reference.verify(x, drafts, ks, batch, positions=pos, return_traces=True, **kw)
    assert torch.equal(out.invalid, ref.invalid)
    checked = 0
    for i in range(n):
        if traces[i].fragile:
            continue
        checked += 1
        assert out.token_ids[i].tolist() == ref.token_ids[i].tolist(), (i, params[i])
    assert checked >= n // 2


def test_greedy_rows_never_emit_a_banned_token(backend):
    v = 6
    x = torch.tensor([[0.0, 1.0, 2.0, 9.0, 3.0, 0.5]]).repeat(3, 1)
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[0, 1, 2, 4]),
              SamplingParams(temperature=0.0, bad_words_token_ids=[[3]]),
              SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3])]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    assert specsample.sample(x, batch).token_ids.tolist() == [4, 4, 4]
    plain = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * 3, vocab_size=v)
    assert specsample.sample(x, plain).token_ids.tolist() == [3, 3, 3]


def test_sampled_rows_never_emit_a_banned_token(backend):
    v, n = 6, 32
    x = torch.tensor([[0.0, 1.0, 2.0, 4.0, 3.0, 0.5]])
    params = [SamplingParams(seed=i, allowed_token_ids=[0, 3, 5], bad_words_token_ids=[[2, 5]],
                             min_tokens=2, stop_token_ids=[3]) for i in range(n)]
    batch = SamplingBatch.from_params(params, vocab_size=v, prompt_token_ids=[[2]] * n)
    tokens = specsample.sample(x, batch, positions=torch.arange(n),
                               logits_index=torch.zeros(n, dtype=torch.int64)).token_ids
    assert set(tokens.tolist()) == {0}


def test_eos_ids_join_every_requests_stop_tokens(backend):
    v = 5
    x = torch.tensor([[0.0, 5.0, 1.0, 2.0, 0.0]]).repeat(2, 1)
    params = [SamplingParams(temperature=0.0, min_tokens=1),
              SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[3])]
    batch = SamplingBatch.from_params(params, vocab_size=v, eos_token_ids=[1])
    assert specsample.sample(x, batch).token_ids.tolist() == [3, 2]


# ----------------------------------------------------------------------------- invalid rows


def test_bans_that_leave_no_token_make_the_request_invalid(backend):
    v = 4
    x = torch.randn(2, v)
    params = [SamplingParams(allowed_token_ids=[1, 2], bad_words_token_ids=[[1], [2]]),
              SamplingParams(seed=1)]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    out = specsample.sample(x, batch, positions=torch.tensor([0, 0]), strict=False)
    assert out.invalid.tolist() == [True, False]
    assert out.token_ids[0] == -1 and 0 <= out.token_ids[1] < v
    with pytest.raises(SamplingError) as info:
        specsample.sample(x, batch, positions=torch.tensor([0, 0]))
    assert info.value.requests == [0]
    assert "bans leave no token" in str(info.value)


def test_a_row_emptied_by_bans_under_speculation_invalidates_the_request(backend):
    # min_tokens bans 0 at rows 0..1; bad word (1, 1) bans 1 after a 1: row 1 (after draft 1)
    # has nothing left; with a placeholder at draft 0 that row is never reached.
    v = 2
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[0],
                       bad_words_token_ids=[[1, 1]])
    batch = SamplingBatch.from_params([p], vocab_size=v, prompt_token_ids=[[0]])
    x = torch.zeros(3, v)
    out = specsample.verify(x, torch.tensor([1, 1]), [2], batch, strict=False)
    assert out.invalid.tolist() == [True]
    assert out.token_ids.tolist() == [[-1, -1, -1]]
    out = specsample.verify(x, torch.tensor([-1, 1]), [2], batch, strict=False)
    assert out.invalid.tolist() == [False]
    assert out.token_ids.tolist() == [[1, -1, -1]]


# ------------------------------------------------------------------ the speculation rule


def _stop_heavy_rows(k: int, v: int = 6, stop: int = 0) -> torch.Tensor:
    x = torch.zeros(k + 1, v)
    x[:, stop] = 8.0
    x[:, 1] = 4.0
    return x


@pytest.mark.parametrize("outputs", [0, 1, 2])
def test_min_tokens_counts_the_drafts_before_the_row_greedy(backend, outputs):
    """Stop token 0 is every row's argmax. Row j bans it while outputs + j < min_tokens = 3:
    drafts of 0 before that are rejected, and accepted from there on."""
    v, k, stop = 6, 4, 0
    p = SamplingParams(temperature=0.0, min_tokens=3)
    batch = SamplingBatch.from_params([p], vocab_size=v, output_token_ids=[[2] * outputs],
                                      eos_token_ids=[stop])
    first = 3 - outputs  # the first row where the stop token is allowed
    drafts = [1] * first + [stop] * (k - first)
    out = specsample.verify(_stop_heavy_rows(k), torch.tensor(drafts), [k], batch)
    assert out.token_ids[0].tolist() == drafts + [stop]
    # a stop token drafted one row too early is rejected (the argmax there is 1)
    early = drafts.copy()
    early[first - 1] = stop
    out = specsample.verify(_stop_heavy_rows(k), torch.tensor(early), [k], batch)
    assert out.token_ids[0, :first].tolist() == drafts[:first - 1] + [1]
    assert int(out.num_accepted[0]) == first - 1


def test_min_tokens_under_speculation_sampled(backend):
    """Sampled requests, one-hot drafts: a stop token drafted before min_tokens is reached is
    never accepted (p = 0); once reached it is accepted often (p ~ 0.98)."""
    v, k, n, stop = 6, 3, 24, 0
    params = [SamplingParams(seed=i, min_tokens=2, stop_token_ids=[stop]) for i in range(n)]
    batch = SamplingBatch.from_params(params, vocab_size=v)
    x = _stop_heavy_rows(k).repeat(n, 1)
    pos = torch.arange(n) * 10
    out = specsample.verify(x, torch.tensor([stop, stop, stop] * n), [k] * n, batch,
                            positions=pos)
    assert (out.num_accepted == 0).all()  # row 0: 0 outputs < 2
    assert (out.token_ids[:, 0] != stop).all()
    out = specsample.verify(x, torch.tensor([1, 1, stop] * n), [k] * n, batch, positions=pos)
    assert (out.token_ids[:, :3] == stop).sum() > 0
    accepted_stop = (out.num_accepted == 3).sum()
    rows_with_1s = ((out.token_ids[:, 0] == 1) & (out.token_ids[:, 1] == 1)).sum()
    assert accepted_stop > 0.8 * rows_with_1s
    # rows 0 and 1 (0 and 1 tokens counted) never emit the stop token
    assert not (out.token_ids[:, :2] == stop).any()


def test_bad_words_see_the_drafts_before_the_row(backend):
    """Word (1, 2): 2 is banned at a row whose previous token (a draft, or the context's last
    token at row 0) is 1; a three-token word reaches back over the drafts into the prompt."""
    v = 6
    x = torch.zeros(3, v)
    x[0, 1] = 5.0  # row 0 argmax 1
    x[1:, 2] = 5.0  # rows 1, 2 argmax 2, then 3
    x[:, 3] = 3.0
    p = SamplingParams(temperature=0.0, bad_words_token_ids=[[1, 2]])
    batch = SamplingBatch.from_params([p], vocab_size=v, prompt_token_ids=[[0]])
    out = specsample.verify(x, torch.tensor([1, 2]), [2], batch)
    assert out.token_ids.tolist() == [[1, 3, -1]]  # draft 2 after 1 rejected; argmax 3
    out = specsample.verify(x, torch.tensor([4, 2]), [2], batch)
    assert out.token_ids.tolist() == [[1, -1, -1]]  # (draft 4 is not the argmax 1)
    # the word's first token in the prompt bans 2 at row 0
    x0 = x[1:2]
    batch = SamplingBatch.from_params([p], vocab_size=v, prompt_token_ids=[[0, 1]])
    assert specsample.sample(x0, batch).token_ids.tolist() == [3]
    # output tokens count too: prompt (5,), outputs (1,), drafts (2, ...)
    p3 = SamplingParams(temperature=0.0, bad_words_token_ids=[[5, 1, 2]])
    batch = SamplingBatch.from_params([p3], vocab_size=v, prompt_token_ids=[[0, 5]],
                                      output_token_ids=[[1]])
    assert specsample.sample(x0, batch).token_ids.tolist() == [3]
    batch = SamplingBatch.from_params([p3], vocab_size=v, prompt_token_ids=[[0, 5]])
    x1 = torch.zeros(3, v)
    x1[0, 1] = 5.0
    x1[1:, 2] = 5.0
    x1[:, 3] = 3.0
    out = specsample.verify(x1, torch.tensor([1, 2]), [2], batch)
    assert out.token_ids.tolist() == [[1, 3, -1]]


# --------------------------------------------------------- statistical exactness (one step)

V = 5
STOP = 4
PROMPT = (3,)
K = 2
_gen = np.random.default_rng(7)
TABLE = _gen.normal(size=(V, V)) * 1.0 + np.array([0.0, 0.8, 0.8, 0.0, 1.5])  # [prev] -> [V]
QTABLE = np.abs(_gen.normal(size=(V, V))) + 0.3  # drafter weights [prev] -> [V]
STAT_PARAMS = SamplingParams(temperature=1.0, min_tokens=2, bad_words_token_ids=[[1, 2]])


def _target(ctx: tuple) -> np.ndarray:
    return TABLE[(PROMPT + ctx)[-1]]


def _q(ctx: tuple) -> np.ndarray:
    w = QTABLE[(PROMPT + ctx)[-1]]
    return w / w.sum()


def _one_step(n: int, method: str, seed: int) -> list[tuple]:
    gen = np.random.default_rng(seed)
    rows, qrows, drafts = [], [], []
    for _ in range(n):
        ctx: tuple = ()
        for _j in range(K):
            q = _q(ctx)
            rows.append(_target(ctx))
            qrows.append(q)
            d = int(gen.choice(V, p=q))
            drafts.append(d)
            ctx += (d,)
        rows.append(_target(ctx))
    params = [SamplingParams(**{**STAT_PARAMS.__dict__, "seed": seed * 100_003 + i})
              for i in range(n)]
    batch = SamplingBatch.from_params(params, vocab_size=V, prompt_token_ids=[PROMPT] * n,
                                      eos_token_ids=[STOP])
    out = specsample.verify(torch.tensor(np.array(rows), dtype=torch.float32),
                            torch.tensor(drafts), [K] * n, batch,
                            draft_probs=torch.tensor(np.array(qrows), dtype=torch.float32),
                            positions=torch.full((n,), 5, dtype=torch.int64), method=method)
    return [tuple(r[: a + 1]) for r, a in zip(out.token_ids.tolist(),
                                               out.num_accepted.tolist())]


def _g_test(samples: list[tuple], law: dict[tuple, float]) -> float:
    n = len(samples)
    observed: dict[tuple, int] = {}
    for s in samples:
        observed[s] = observed.get(s, 0) + 1
    if any(law.get(s, 0.0) <= 0 for s in observed):
        return 0.0  # an outcome of probability 0
    keys = sorted(law, key=lambda t: -law[t])
    big = [t for t in keys if law[t] * n >= 5]
    small = [t for t in keys if law[t] * n < 5]
    f_exp = [law[t] * n for t in big] + ([sum(law[t] for t in small) * n] if small else [])
    f_obs = [observed.get(t, 0) for t in big] + (
        [sum(observed.get(t, 0) for t in small)] if small else [])
    if f_exp[-1] < 5:
        last_exp, last_obs = f_exp.pop(), f_obs.pop()  # (pop first: a[-2] += a.pop()
        f_exp[-1] += last_exp  # would read one bin and write another)
        f_obs[-1] += last_obs
    f_exp = np.array(f_exp) * n / sum(f_exp)
    assert (f_exp >= 5).all() and len(f_exp) >= 10
    return float(stats.power_divergence(f_obs, f_exp, lambda_="log-likelihood").pvalue)


def _law(method: str) -> dict[tuple, float]:
    return reference.exact_step_law(_target, _q, K, STAT_PARAMS, method, "probs",
                                    prompt_token_ids=PROMPT, eos_token_ids=[STOP])


N_STAT = 3000


@pytest.mark.parametrize("method", ["token", "block"])
def test_one_step_law_with_bans_is_exact(method):
    law = _law(method)
    # the stop token can only come at the bonus row (0 + 2 drafts >= min_tokens)
    assert all(STOP not in t[:2] for t in law if law[t] > 0)
    assert sum(p for t, p in law.items() if t[-1] == STOP) > 0.1
    p = _g_test(_one_step(N_STAT, method, seed=1), law)
    assert p > 1e-3, f"G-test p = {p:.3g}"


def test_power_min_tokens_ignoring_the_drafts_fails(monkeypatch):
    """The same test rejects min_tokens counting only the outputs (not drafts 0..j-1)."""
    monkeypatch.setattr(processing, "outputs_before_row",
                        lambda plan, req, j: plan.batch.num_output[req] + 0 * j)
    p = _g_test(_one_step(N_STAT, "token", seed=2), _law("token"))
    assert p < 1e-6, f"G-test p = {p:.3g} did not reject"


@pytest.mark.parametrize("method", ["token", "block"])
def test_triton_emits_what_torch_emits_on_the_statistical_setup(method, monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    expected = _one_step(40, method, seed=3)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    assert _one_step(40, method, seed=3) == expected
