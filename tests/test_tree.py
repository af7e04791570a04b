"""specsample.verify_tree (token-tree verification, issue 10) on the torch backend.

Statistical exactness: test_exactness.py's small Markov target (V = 4, order 2; its order-1
drafter table for the draft distributions) and a
tree of depth 3 with branching 2-3; many seeded requests verify one tree each in ONE batch,
and the empirical law of the emitted sequences is compared with
``reference.exact_tree_step_law`` by a G-test (expected counts >= 5 per bin, smaller bins
pooled). That law is itself checked against the target's autoregressive law
(``reference.exact_target_law``) by composition: what a tree step emits, followed by target
samples, is the target's law. Power: the same test must reject a walk that descends into a
child without sampling, and a recursive-rejection residual that ignores the rejected siblings.

Then: speculation invariance against sample(), equivalence with the float64 reference (tokens
may differ only for requests the reference marks fragile), batch invariance, chains expressed
as trees giving verify()'s output, greedy trees, bad input.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams, paths, reference
from test_exactness import PROMPT, QTABLE, V, target_fn  # the Markov target and drafter

START = V
# Depth 3, branching 3 / 2 / 1: node n's parent is SHAPE[n - 1].
SHAPE = (0, 0, 0, 1, 1, 2, 4)
DET_TOKENS = (2, 0, 1, 2, 3, 0, 1)  # a deterministic tree on SHAPE (siblings distinct)


def draft_q(ctx: tuple) -> np.ndarray:
    """The drafter's distribution after ``ctx`` (prompt included): softmax of an order-1
    table, full support (children are drawn without replacement from it)."""
    row = QTABLE[ctx[-1] if ctx else START] * 0.8
    e = np.exp(row - row.max())
    return e / e.sum()


def _paths(parents, tokens) -> list[tuple]:
    """The token path (root excluded) of nodes 0..m."""
    out = [()]
    for n, par in enumerate(parents, start=1):
        out.append(out[par] + (tokens[n - 1],))
    return out


def _children(parents) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for n, par in enumerate(parents, start=1):
        kids[par].append(n)
    return kids


def _draw_tree(gen: np.random.Generator) -> tuple[list[int], np.ndarray]:
    """Tokens of SHAPE drawn by the drafter (each node's children from q at that node,
    without replacement, in node order), and the [m + 1, V] draft_probs rows."""
    kids = _children(SHAPE)
    tokens = [0] * len(SHAPE)
    qrows = np.zeros((len(SHAPE) + 1, V))
    path = {0: ()}
    for node in range(len(SHAPE) + 1):
        q = draft_q(PROMPT + path[node])
        qrows[node] = q
        if kids[node]:
            drawn = gen.choice(V, size=len(kids[node]), replace=False, p=q)
            for c, t in zip(kids[node], drawn):
                tokens[c - 1] = int(t)
                path[c] = path[node] + (int(t),)
    return tokens, qrows


def _tree_inputs(trees: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target_logits [N (m + 1), V], draft_token_ids, parents) for N trees on SHAPE."""
    rows, toks = [], []
    for tokens in trees:
        rows += [target_fn(PROMPT + p) for p in _paths(SHAPE, tokens)]
        toks += tokens
    logits = torch.tensor(np.array(rows), dtype=torch.float32)
    return logits, torch.tensor(toks), torch.tensor(list(SHAPE) * len(trees))


def _batch(params: SamplingParams, n: int, seed0: int) -> SamplingBatch:
    plist = [dataclasses.replace(params, seed=seed0 * 1_000_003 + 7919 * i) for i in range(n)]
    return SamplingBatch.from_params(plist, vocab_size=V, prompt_token_ids=[PROMPT] * n)


def g_test(samples: list[tuple], law: dict[tuple, float]) -> float:
    """p-value of the G-test of the emitted sequences ``samples`` against ``law``: bins with
    expected count < 5 are pooled (the pool joins the smallest other bin if it is still
    < 5); a sequence of probability 0 fails outright."""
    n = len(samples)
    observed = Counter(samples)
    if any(law.get(t, 0.0) <= 0 for t in observed):
        return 0.0
    keys = sorted(law, key=lambda t: -law[t])
    expected = np.array([law[t] * n for t in keys])
    counts = np.array([observed.get(t, 0) for t in keys])
    small = expected < 5
    if small.any():
        exp_big, obs_big = expected[~small].tolist(), counts[~small].tolist()
        pool_exp, pool_obs = expected[small].sum(), counts[small].sum()
        if pool_exp >= 5 or not exp_big:
            exp_big.append(pool_exp)
            obs_big.append(pool_obs)
        else:
            exp_big[-1] += pool_exp
            obs_big[-1] += pool_obs
        expected, counts = np.array(exp_big), np.array(obs_big)
    expected = expected * (n / expected.sum())
    return float(stats.power_divergence(counts, expected, lambda_="log-likelihood").pvalue)


def _emitted(out) -> list[tuple]:
    return [tuple(out.token_ids[i, : int(out.num_accepted[i]) + 1].tolist())
            for i in range(out.token_ids.shape[0])]


def _step_law(params: SamplingParams, **kw) -> dict[tuple, float]:
    def fn(ctx):
        return target_fn(PROMPT + tuple(ctx))

    def qfn(ctx):
        return draft_q(PROMPT + tuple(ctx))

    if "draft_fn" in kw:
        kw["draft_fn"] = qfn
    return reference.exact_tree_step_law(fn, SHAPE, params, prompt_token_ids=PROMPT, **kw)


DET_PARAMS = SamplingParams(temperature=0.8, top_k=3, frequency_penalty=0.4)
RRS_PARAMS = SamplingParams(temperature=1.2, top_p=0.95, presence_penalty=0.3)
N_REQUESTS = 4000
N_POWER = 3000


# ------------------------------------------------------------------ the exact step law


@pytest.mark.parametrize("kind", ["deterministic", "draft_probs", "greedy"])
def test_exact_step_law_composes_to_the_target_law(kind):
    """What one tree step emits, followed by target samples, is the target's law (L = 5)."""
    params = dataclasses.replace(RRS_PARAMS if kind == "draft_probs" else DET_PARAMS,
                                 temperature=0.0 if kind == "greedy" else 0.9)
    kw = {"tokens": DET_TOKENS} if kind == "deterministic" else {"draft_fn": True}
    step = _step_law(params, **kw)
    assert math.isclose(sum(step.values()), 1.0, abs_tol=1e-12)
    length = 5

    def fn(ctx):
        return target_fn(PROMPT + tuple(ctx))

    composed: dict[tuple, float] = {}
    for seq, p in step.items():
        rest = reference.exact_target_law(fn, params, length - len(seq), context=seq,
                                          prompt_token_ids=PROMPT)
        for r, p2 in rest.items():
            composed[seq + r] = composed.get(seq + r, 0.0) + p * p2
    target = reference.exact_target_law(fn, params, length, prompt_token_ids=PROMPT)
    assert max(abs(composed.get(t, 0.0) - target.get(t, 0.0))
               for t in set(composed) | set(target)) < 1e-12


# ------------------------------------------------------------ statistical exactness


def _run_deterministic(n: int, seed0: int, broken: str | None = None) -> list[tuple]:
    logits, toks, parents = _tree_inputs([list(DET_TOKENS)] * n)
    batch = _batch(DET_PARAMS, n, seed0)
    pos = torch.full((n,), len(PROMPT), dtype=torch.int64)
    if broken != "descend_without_sampling":
        return _emitted(specsample.verify_tree(logits, toks, parents, [len(SHAPE)] * n, batch,
                                               positions=pos))
    # Broken walk: the root's first child is taken without sampling; the walk then goes on
    # correctly from it (node 1's subtree: nodes 4, 5, 7 renumbered 1, 2, 3).
    # (node 1's token counts as an output of the sub-tree's rows, as on the full path)
    sub = [1, 4, 5, 7]
    rows = torch.tensor([r for i in range(n) for r in (8 * i + s for s in sub)])
    batch = SamplingBatch.from_params(batch.params, vocab_size=V, prompt_token_ids=[PROMPT] * n,
                                      output_token_ids=[[DET_TOKENS[0]]] * n)
    sub_toks = torch.tensor([DET_TOKENS[s - 1] for s in sub[1:]] * n)
    out = specsample.verify_tree(logits[rows], sub_toks, torch.tensor([0, 0, 1] * n), [3] * n,
                                 batch, positions=pos + 1)
    return [(DET_TOKENS[0],) + e for e in _emitted(out)]


def _run_rrs(n: int, seed0: int, broken: str | None = None) -> list[tuple]:
    gen = np.random.default_rng(seed0 + 17)
    trees, qrows = zip(*(_draw_tree(gen) for _ in range(n)))
    logits, toks, parents = _tree_inputs(list(trees))
    q = torch.tensor(np.concatenate(qrows), dtype=torch.float32)
    batch = _batch(RRS_PARAMS, n, seed0)
    pos = torch.full((n,), len(PROMPT), dtype=torch.int64)
    out = specsample.verify_tree(logits, toks, parents, [len(SHAPE)] * n, batch,
                                 draft_probs=q, positions=pos)
    emitted = _emitted(out)
    if broken == "residual_ignores_siblings":
        # When every child of the final node was rejected, draw the correction from
        # max(p - q, 0) of the node's original p and q, as if only one child had been tried.
        kids = _children(SHAPE)
        for i in range(n):
            a = int(out.num_accepted[i])
            node = int(out.accepted_node_ids[i, a - 1]) if a else 0
            if not kids[node]:
                continue
            path = emitted[i][:a]
            p = reference.processed_probs(target_fn(PROMPT + path), RRS_PARAMS,
                                          prompt_token_ids=PROMPT, output_token_ids=path)
            w = np.maximum(p - qrows[i][node], 0.0)
            emitted[i] = path + (int(gen.choice(V, p=w / w.sum())),)
    return emitted


PVALUES: dict[str, float] = {}


def test_deterministic_tree_law_is_exact():
    p = g_test(_run_deterministic(N_REQUESTS, 1), _step_law(DET_PARAMS, tokens=DET_TOKENS))
    PVALUES["deterministic/correct"] = p
    assert p > 1e-3, f"G-test p = {p:.3g}"


def test_draft_probs_tree_law_is_exact():
    p = g_test(_run_rrs(N_REQUESTS, 2), _step_law(RRS_PARAMS, draft_fn=True))
    PVALUES["draft_probs/correct"] = p
    assert p > 1e-3, f"G-test p = {p:.3g}"


def test_power_walk_that_descends_without_sampling():
    p = g_test(_run_deterministic(N_POWER, 3, "descend_without_sampling"),
               _step_law(DET_PARAMS, tokens=DET_TOKENS))
    PVALUES["deterministic/descend_without_sampling"] = p
    assert p < 1e-6, f"G-test p = {p:.3g} did not reject"


def test_power_residual_that_ignores_rejected_siblings():
    p = g_test(_run_rrs(N_POWER, 4, "residual_ignores_siblings"),
               _step_law(RRS_PARAMS, draft_fn=True))
    PVALUES["draft_probs/residual_ignores_siblings"] = p
    assert p < 1e-6, f"G-test p = {p:.3g} did not reject"


# -------------------------------------------------------- random trees at a larger V

VB = 300


def _random_case(seed: int, n: int = 4, max_nodes: int = 7, boost: float = 3.0, **param_kw):
    """(logits, tokens, parents, num_nodes, params list, draft_probs) of n random trees whose
    tokens come from a few likely ids (so the walks go deep)."""
    gen = np.random.default_rng(seed)
    ms = [int(gen.integers(0, max_nodes + 1)) for _ in range(n)]
    toks, par = [], []
    for m in ms:
        mine: list[tuple[int, int]] = []
        for node in range(1, m + 1):
            while True:
                pair = (int(gen.integers(0, node)), int(gen.integers(0, 6)))
                if pair not in mine:
                    break
            mine.append(pair)
        par += [p for p, _ in mine]
        toks += [t for _, t in mine]
    rows = n + sum(ms)
    logits = torch.tensor(gen.normal(size=(rows, VB)), dtype=torch.float32)
    logits[:, :6] += boost
    q = torch.softmax(torch.tensor(gen.normal(size=(rows, VB)), dtype=torch.float32)
                      + 3.0 * (torch.arange(VB) < 6), -1)
    params = []
    for _ in range(n):
        kw = {"temperature": float(gen.choice([0.0, 0.7, 1.3])),
              "seed": int(gen.integers(2**40)), "logprobs": int(gen.integers(0, 3)),
              "top_k": int(gen.choice([0, 5])), "frequency_penalty": float(gen.choice([0, 0.5]))}
        kw.update(param_kw)
        params.append(SamplingParams(**kw))
    pos = torch.tensor(gen.integers(0, 1000, size=n))
    return logits, torch.tensor(toks, dtype=torch.int64), torch.tensor(par, dtype=torch.int64), \
        ms, params, q, pos


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_matches_reference(seed, with_q):
    bans = {"bad_words_token_ids": [[1, 2], [4]], "min_tokens": 2, "stop_token_ids": [3]} if (
        seed % 2) else {}
    logits, toks, par, ms, params, q, pos = _random_case(seed, **bans)
    n = len(ms)
    batch = SamplingBatch.from_params(params, vocab_size=VB, output_token_ids=[[1]] * n,
                                      prompt_token_ids=[[5, 1]] * n)
    dp = q if with_q else None
    out = specsample.verify_tree(logits, toks, par, ms, batch, positions=pos, draft_probs=dp)
    ref, traces = reference.verify_tree(logits, toks, par, ms, batch, positions=pos,
                                        draft_probs=dp, return_traces=True)
    assert out.token_ids.shape == ref.token_ids.shape
    assert out.accepted_node_ids.shape == ref.accepted_node_ids.shape
    assert torch.equal(out.invalid, ref.invalid)
    for i in range(n):
        if not torch.equal(out.token_ids[i], ref.token_ids[i]):
            assert traces[i].fragile, (i, out.token_ids[i], ref.token_ids[i])
            continue
        assert torch.equal(out.accepted_node_ids[i], ref.accepted_node_ids[i])
        assert int(out.num_accepted[i]) == int(ref.num_accepted[i])
        if out.logprobs is not None:
            same = out.logprob_token_ids[i] == ref.logprob_token_ids[i]
            assert same[:, 0].all()
            fin = torch.isfinite(ref.logprobs[i]) & same
            assert torch.allclose(out.logprobs[i][fin].double(), ref.logprobs[i][fin],
                                  atol=1e-4, rtol=1e-4)


def test_speculation_invariance_against_sample():
    """A seeded request emits, at every position of its accepted path, what sample() emits
    on that node's row at that position (guarantee 4), whatever the tree."""
    logits, toks, par, ms, params, _, pos = _random_case(11, n=6, boost=6.0, frequency_penalty=0.0)
    batch = SamplingBatch.from_params(params, vocab_size=VB)
    out = specsample.verify_tree(logits, toks, par, ms, batch, positions=pos)
    starts = np.concatenate([[0], np.cumsum(np.array(ms) + 1)[:-1]])
    deep = 0
    for i in range(len(ms)):
        a = int(out.num_accepted[i])
        deep += a
        nodes = [0] + out.accepted_node_ids[i, :a].tolist()
        for j, node in enumerate(nodes):
            one = specsample.sample(logits[int(starts[i]) + node][None],
                                    batch.select([i]), positions=pos[i:i + 1] + j)
            assert int(one.token_ids[0]) == int(out.token_ids[i, j])
    assert deep > 0  # some paths were accepted


def test_batch_invariance():
    logits, toks, par, ms, params, q, pos = _random_case(5, n=5)
    batch = SamplingBatch.from_params(params, vocab_size=VB)
    full = specsample.verify_tree(logits, toks, par, ms, batch, positions=pos, draft_probs=q)
    starts = np.concatenate([[0], np.cumsum(np.array(ms) + 1)]).tolist()
    nstart = np.concatenate([[0], np.cumsum(ms)]).tolist()
    for order in ([4, 2, 0], [3], [1, 4, 0, 3, 2]):
        rows = [r for i in order for r in range(starts[i], starts[i + 1])]
        nodes = [g for i in order for g in range(nstart[i], nstart[i + 1])]
        sub = specsample.verify_tree(logits[rows], toks[nodes], par[nodes],
                                     [ms[i] for i in order], batch.select(order),
                                     positions=pos[order], draft_probs=q[rows])
        for r, i in enumerate(order):
            a = int(full.num_accepted[i])
            assert int(sub.num_accepted[r]) == a
            assert sub.token_ids[r, : a + 1].tolist() == full.token_ids[i, : a + 1].tolist()
            assert sub.accepted_node_ids[r, :a].tolist() == full.accepted_node_ids[i, :a].tolist()


# ------------------------------------------------------------- chains and greedy trees


@pytest.mark.parametrize("kind", ["onehot", "probs"])
def test_chain_as_tree_is_verify(kind):
    """A chain (node j's parent is j - 1) is verify(method="token") bit for bit: tokens,
    logprobs (with penalties and bans counting the path)."""
    gen = np.random.default_rng(7)
    n, k = 6, 3
    params = [SamplingParams(temperature=float(t), seed=i, logprobs=2, frequency_penalty=0.3,
                             bad_words_token_ids=[[1, 2]], min_tokens=2, stop_token_ids=[3],
                             logprobs_mode="processed" if i % 2 else "raw")
              for i, t in enumerate([0.9, 0.0, 1.3, 0.6, 1.0, 0.8])]
    batch = SamplingBatch.from_params(params, vocab_size=VB, output_token_ids=[[1]] * n)
    logits = torch.tensor(gen.normal(size=(n * (k + 1), VB)), dtype=torch.float32)
    logits[:, :5] += 4.0
    drafts = torch.tensor(gen.integers(0, 5, size=n * k))
    draft_rows = torch.arange(n * (k + 1)).view(n, k + 1)[:, :k].reshape(-1)
    logits[draft_rows, drafts] += 4.0  # drafts the target likes: long accepted prefixes
    pos = torch.tensor(gen.integers(0, 100, size=n))
    q = torch.softmax(logits * 0.7 + torch.tensor(gen.normal(size=logits.shape),
                                                  dtype=torch.float32), -1)
    kw_v, kw_t = {}, {}
    if kind == "probs":
        kw_v["draft_probs"] = q.view(n, k + 1, VB)[:, :k].reshape(n * k, VB)
        kw_t["draft_probs"] = q
    ref = specsample.verify(logits, drafts, [k] * n, batch, positions=pos, **kw_v)
    out = specsample.verify_tree(logits, drafts, torch.tensor([0, 1, 2] * n), [k] * n, batch,
                                 positions=pos, **kw_t)
    assert torch.equal(out.token_ids, ref.token_ids)
    assert torch.equal(out.num_accepted, ref.num_accepted)
    assert torch.equal(out.logprobs, ref.logprobs)
    assert torch.equal(out.logprob_token_ids, ref.logprob_token_ids)
    a = out.num_accepted
    expect = torch.where(torch.arange(k) < a[:, None], torch.arange(1, k + 1), -1)
    assert torch.equal(out.accepted_node_ids, expect)
    assert int(a.sum()) > 0


def test_empty_trees_are_sample():
    logits = torch.randn(3, VB, generator=torch.Generator().manual_seed(0))
    batch = SamplingBatch.from_params([SamplingParams(seed=s) for s in range(3)],
                                      vocab_size=VB)
    pos = torch.tensor([4, 5, 6])
    out = specsample.verify_tree(logits, [], [], [0, 0, 0], batch, positions=pos)
    assert out.token_ids.shape == (3, 1) and out.accepted_node_ids.shape == (3, 0)
    assert torch.equal(out.token_ids[:, 0], specsample.sample(logits, batch,
                                                              positions=pos).token_ids)


@pytest.mark.parametrize("with_q", [False, True])
def test_greedy_tree_walks_the_argmax(with_q):
    # root -> {1: token 5, 2: token 7}; node 1 -> {3: token 9}; node 2 -> {4: token 9}
    parents = torch.tensor([0, 0, 1, 2])
    toks = torch.tensor([5, 7, 9, 9])
    logits = torch.zeros(5, VB)
    logits[0, 7] = 3.0   # root: argmax 7 -> node 2
    logits[2, 9] = 2.0   # node 2: argmax 9 -> node 4
    logits[4, 11] = 1.0  # node 4 (leaf): bonus 11
    logits[1, 0] = 9.0   # node 1 is off the path
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0, logprobs=1)],
                                      vocab_size=VB)
    q = torch.full((5, VB), 1.0 / VB) if with_q else None
    paths.reset()
    out = specsample.verify_tree(logits, toks, parents, [4], batch, positions=[0],
                                 draft_probs=q)
    assert out.token_ids.tolist() == [[7, 9, 11]]
    assert out.accepted_node_ids.tolist() == [[2, 4]] and out.num_accepted.tolist() == [2]
    assert out.logprob_token_ids[0, :, 0].tolist() == [7, 9, 11]
    name = "torch.verify_tree." + ("draft_probs" if with_q else "onehot")
    assert paths.counts()[name] == {"calls": 1, "rows": 5}
    assert paths.counts()["requests.greedy"]["rows"] == 1


# ---------------------------------------------------------------------------- bad input


def _small():
    logits = torch.randn(5, VB, generator=torch.Generator().manual_seed(1))
    batch = SamplingBatch.from_params([SamplingParams(seed=1), SamplingParams(seed=2)],
                                      vocab_size=VB)
    # request 0: root -> 1 -> 2; request 1: one node
    return logits, torch.tensor([3, 4, 5]), torch.tensor([0, 1, 0]), [2, 1], batch


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(parents=torch.tensor([0, 2, 0])), "parent"),  # parent >= own number
    (lambda a: a.update(parents=torch.tensor([-1, 0, 0])), "parent"),
    (lambda a: a.update(parents=torch.tensor([0, 0, 0]), toks=torch.tensor([3, 3, 5])),
     "siblings"),
    (lambda a: a.update(logits=a["logits"][:4]), "rows"),
    (lambda a: a.update(toks=torch.tensor([3, 4])), "draft_token_ids"),
    (lambda a: a.update(parents=torch.tensor([0.0, 1.0, 0.0])), "parents"),
    (lambda a: a.update(num_nodes=[2, 1, 0]), "num_nodes"),
    (lambda a: a.update(num_nodes=[3, -1]), "num_nodes"),
    (lambda a: a.update(draft_probs=torch.full((4, VB), 1.0 / VB)), "draft_probs"),
    (lambda a: a.update(draft_probs=torch.full((5, VB + 1), 1.0 / VB)), "draft_probs"),
    (lambda a: a.update(logits=a["logits"][:, :-1]), "vocab_size"),
    (lambda a: a.update(positions=None), "positions"),
    (lambda a: a.update(batch=[SamplingParams()]), "SamplingBatch"),
])
def test_bad_input_raises_value_error(change, match):
    logits, toks, parents, num_nodes, batch = _small()
    args = {"logits": logits, "toks": toks, "parents": parents, "num_nodes": num_nodes,
            "batch": batch, "draft_probs": None, "positions": [3, 4]}
    change(args)
    with pytest.raises(ValueError, match=match):
        specsample.verify_tree(args["logits"], args["toks"], args["parents"], args["num_nodes"],
                               args["batch"], draft_probs=args["draft_probs"],
                               positions=args["positions"])


def test_value_error_leaves_the_fresh_counter_alone():
    logits, toks, _, num_nodes, _ = _small()
    batch = SamplingBatch.from_params([SamplingParams(), SamplingParams()], vocab_size=VB)
    before = batch.fresh_counter.clone()
    with pytest.raises(ValueError, match="siblings"):
        specsample.verify_tree(logits, torch.tensor([3, 3, 5]), torch.tensor([0, 0, 0]),
                               num_nodes, batch)
    assert torch.equal(batch.fresh_counter, before)
    specsample.verify_tree(logits, toks, torch.tensor([0, 1, 0]), num_nodes, batch)
    assert int(batch.fresh_counter) == int(before) + 1


@pytest.mark.parametrize("bad", ["nan_node_row", "inf_root", "token_out_of_range",
                                 "draft_row"])
def test_invalid_data(bad):
    logits, toks, parents, num_nodes, batch = _small()
    q = None
    if bad == "nan_node_row":
        logits[2, 7] = math.nan  # request 0's leaf row: read or not, the request is invalid
    elif bad == "inf_root":
        logits[0, 0] = math.inf
    elif bad == "token_out_of_range":
        toks = torch.tensor([3, VB, 5])
    else:
        q = torch.full((5, VB), 1.0 / VB)
        q[1, 3] = -0.5  # node 1 of request 0 has a child
        q[4, :] = math.nan  # request 1's leaf row: never read, not an error
    with pytest.raises(SamplingError) as err:
        specsample.verify_tree(logits, toks, parents, num_nodes, batch, positions=[3, 4],
                               draft_probs=q)
    assert err.value.requests == [0]
    out = specsample.verify_tree(logits, toks, parents, num_nodes, batch, positions=[3, 4],
                                 draft_probs=q, strict=False)
    assert out.invalid.tolist() == [True, False]
    assert out.token_ids[0].tolist() == [-1, -1, -1] and out.num_accepted[0] == 0
    assert out.accepted_node_ids[0].tolist() == [-1, -1]
    assert 0 <= int(out.token_ids[1, 0]) < VB
    ref = reference.verify_tree(logits, toks, parents, num_nodes, batch, positions=[3, 4],
                                draft_probs=q)
    assert ref.invalid.tolist() == [True, False]


def test_layout_of_interleaved_numbering():
    """Children in node-number order even when siblings are not numbered contiguously."""
    from specsample.tree import build_tree_layout

    # request 0: 0 -> {1, 2}, 1 -> {3, 5}, 2 -> {4}, 5 -> {6}; request 1: no node
    parents = torch.tensor([0, 0, 1, 2, 1, 5])
    toks = torch.tensor([10, 11, 12, 13, 14, 15])
    lay = build_tree_layout((6, 0), parents, toks, torch.device("cpu"))
    assert lay.depth == 3
    assert lay.row_depth.tolist() == [0, 1, 1, 2, 2, 2, 3, 0]
    assert lay.row_req.tolist() == [0] * 7 + [1]
    assert lay.children[0].tolist() == [1, 2] and lay.children[1].tolist() == [3, 5]
    assert lay.children[2].tolist() == [4, -1] and lay.children[7].tolist() == [-1, -1]
    assert lay.path_rows[6].tolist() == [0, 1, 5, 6]
    assert lay.path_tokens[6].tolist() == [10, 14, 15]
    assert lay.path_tokens[4].tolist() == [11, 13, -1]


def test_layout_structure_is_kept_and_tokens_are_not(monkeypatch):
    """A second call with the same num_nodes and parents reuses the structure (the same
    tensors) and lays out its own tokens; sibling checks and parent checks still run."""
    from specsample import tree as tree_mod

    parents = torch.tensor([0, 0, 1, 2, 1, 5])
    a = tree_mod.build_tree_layout((6, 0), parents, torch.tensor([10, 11, 12, 13, 14, 15]),
                                   torch.device("cpu"))
    b = tree_mod.build_tree_layout((6, 0), parents.tolist(), [20, 21, 22, 23, 24, 25],
                                   torch.device("cpu"))
    assert b.children is a.children and b.path_rows is a.path_rows
    assert b.row_token.tolist() == [-1, 20, 21, 22, 23, 24, 25, -1]
    assert a.row_token.tolist() == [-1, 10, 11, 12, 13, 14, 15, -1]  # (not overwritten)
    assert b.path_tokens[6].tolist() == [20, 24, 25]
    with pytest.raises(ValueError, match="distinct tokens"):  # nodes 3 and 5 share parent 1
        tree_mod.build_tree_layout((6, 0), parents, [20, 21, 22, 23, 22, 25],
                                   torch.device("cpu"))
    with pytest.raises(ValueError, match="parents"):
        tree_mod.build_tree_layout((6, 0), [0, 0, 1, 2, 1, 6], [1, 2, 3, 4, 5, 6],
                                   torch.device("cpu"))
    for i in range(tree_mod.SHAPE_CACHE_ENTRIES + 5):  # (a bounded cache, least recent out)
        tree_mod.build_tree_layout((1, i), [0] + [0] * i, list(range(1 + i)),
                                   torch.device("cpu"))
        tree_mod.build_tree_layout((6, 0), parents, list(range(6)), torch.device("cpu"))
    assert len(tree_mod._SHAPES) == tree_mod.SHAPE_CACHE_ENTRIES
    assert tree_mod.build_tree_layout((6, 0), parents, list(range(6)),
                                      torch.device("cpu")).children is a.children  # (kept)
    for lay in (a, b):  # every structure tensor on a 16-byte boundary
        for t in (lay.row_req, lay.row_node, lay.row_depth, lay.row_parent, lay.row_start,
                  lay.children, lay.path_rows, lay.draft_start, lay.k_given, lay.row_token):
            assert t.data_ptr() % 16 == 0
    tree_mod.clear_layout_cache()
    monkeypatch.setattr(tree_mod, "SHAPE_CACHE_BYTES", 1000)  # (too large to keep: not cached)
    tree_mod.build_tree_layout((30,), [0] * 30, list(range(30)), torch.device("cpu"))
    assert not tree_mod._SHAPES
    with pytest.raises(ValueError, match="int64"):
        tree_mod.verify_tree(torch.zeros(2, 5), [2**63], [0], [1],
                             SamplingBatch.from_params([SamplingParams()], vocab_size=5))


def test_forbidden_path_raises():
    logits, toks, parents, num_nodes, batch = _small()
    with paths.forbid("torch.verify_tree.*"):
        with pytest.raises(paths.ForbiddenPathError):
            specsample.verify_tree(logits, toks, parents, num_nodes, batch, positions=[3, 4])


def test_zz_report_pvalues():
    if PVALUES:
        print("\n" + "\n".join(f"{k}: p = {v:.3g}" for k, v in sorted(PVALUES.items())))


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("kw", [dict(temperature=1e-5, top_p=0.9),
                                dict(temperature=1.0, top_p=0.9, top_k=20, min_p=0.01)])
def test_invalid_row_with_filters_is_flagged_not_raised(bad, kw):
    # (a review found the filters reading the raw row maximum, +inf / NaN, of a request whose
    # rows had been sanitised: an IndexError from the nucleus search)
    batch = SamplingBatch.from_params([SamplingParams(seed=1, **kw)], vocab_size=300)
    x = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    x[1, 3] = bad
    out = specsample.verify_tree(x, [5], [0], [1], batch, positions=torch.tensor([0]),
                                 strict=False)
    assert out.invalid.tolist() == [True] and out.token_ids.tolist() == [[-1, -1]]


def pruned_case(seed: int, n: int = 5, max_nodes: int = 9):
    """A random case (``_random_case``) with some nodes pruned (token -1), the nodes below
    them holding garbage (out-of-range or repeated tokens, NaN rows), and the same trees
    with those nodes absent. Returns (pruned inputs, absent inputs, keep): inputs as
    (logits, tokens, parents, num_nodes, draft_probs); ``keep[i]`` maps request i's node
    numbers in the absent tree to the pruned tree's."""
    logits, toks, par, ms, params, q, pos = _random_case(seed, n=n, max_nodes=max_nodes)
    gen = np.random.default_rng(100 + seed)
    toks, par = toks.tolist(), par.tolist()
    rows_p, rows_a, toks_a, par_a, ms_a, keep = [], [], [], [], [], []
    g = row = 0
    for m in ms:
        dead = [False] * (m + 1)
        new = {0: 0}
        mine = [0]
        for node in range(1, m + 1):
            p = par[g + node - 1]
            if dead[p]:
                dead[node] = True
                toks[g + node - 1] = int(gen.choice([VB + 7, -1, toks[g + node - 1]]))
                if gen.random() < 0.5:
                    logits[row + node, 3] = math.nan
            elif gen.random() < 0.3:
                dead[node] = True
                toks[g + node - 1] = -1
            else:
                new[node] = len(mine)
                mine.append(node)
                toks_a.append(toks[g + node - 1])
                par_a.append(new[p])
        rows_a += [row + node for node in mine]
        rows_p += list(range(row, row + m + 1))
        ms_a.append(len(mine) - 1)
        keep.append(mine)
        g += m
        row += m + 1
    pruned = (logits, torch.tensor(toks), torch.tensor(par), ms, q)
    absent = (logits[rows_a], torch.tensor(toks_a, dtype=torch.int64),
              torch.tensor(par_a, dtype=torch.int64), ms_a, q[rows_a])
    return pruned, absent, keep, params, pos


def assert_pruned_is_absent(out_p, out_a, keep):
    """The pruned trees' output is the absent trees' (node ids mapped back; the width may be
    larger, the extra positions padding)."""
    w = out_a.token_ids.shape[1]
    assert torch.equal(out_p.invalid, out_a.invalid)
    assert torch.equal(out_p.num_accepted, out_a.num_accepted)
    assert torch.equal(out_p.token_ids[:, :w], out_a.token_ids)
    assert (out_p.token_ids[:, w:] == -1).all()
    for i, mine in enumerate(keep):
        ids = [mine[j] if j >= 0 else -1 for j in out_a.accepted_node_ids[i].tolist()]
        assert out_p.accepted_node_ids[i, :w - 1].tolist() == ids
    assert (out_p.accepted_node_ids[:, w - 1:] == -1).all()
    if out_a.logprobs is not None:
        assert torch.equal(out_p.logprob_token_ids[:, :w], out_a.logprob_token_ids)
        torch.testing.assert_close(out_p.logprobs[:, :w], out_a.logprobs, equal_nan=True)


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_pruned_nodes_are_absent(seed, with_q):
    # A node holding the placeholder -1 is pruned: it and everything below it (whatever their
    # tokens and rows hold) behave as if absent, on the torch backend and in the reference;
    # two pruned siblings are no repeated token. Fails if a pruned subtree is read (its NaN
    # rows or bad tokens would make the request invalid) or walked.
    pruned, absent, keep, params, pos = pruned_case(seed)
    assert any(len(k) - 1 < m for k, m in zip(keep, pruned[3]))  # (something was pruned)
    n = len(params)
    batch = SamplingBatch.from_params(params, vocab_size=VB, output_token_ids=[[1]] * n,
                                      prompt_token_ids=[[5, 1]] * n)
    outs = []
    for logits, toks, par, ms, q in (pruned, absent):
        dp = q if with_q else None
        outs.append((specsample.verify_tree(logits, toks, par, ms, batch, positions=pos,
                                            draft_probs=dp, strict=False),
                     reference.verify_tree(logits, toks, par, ms, batch, positions=pos,
                                           draft_probs=dp)))
    assert_pruned_is_absent(outs[0][0], outs[1][0], keep)
    assert_pruned_is_absent(outs[0][1], outs[1][1], keep)
    assert not outs[1][0].invalid.all()


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=3.0),
                                       dict(frequency_penalty=1.5, presence_penalty=0.5)])
def test_penalties_reach_every_node(penalties):
    # The penalties' (row, token) pairs cover each request's nodes (not rows j <= depth, a
    # chain's layout: repetition alone raised IndexError on trees, and pairs past a request's
    # first depth + 1 nodes were missed).
    bad = 0
    for seed in range(6):
        logits, toks, par, ms, params, q, pos = _random_case(seed)
        n = len(ms)
        params = [dataclasses.replace(p, **penalties) for p in params]
        batch = SamplingBatch.from_params(params, vocab_size=VB, output_token_ids=[[1]] * n,
                                          prompt_token_ids=[[5, 1]] * n)
        out = specsample.verify_tree(logits, toks, par, ms, batch, positions=pos)
        ref, traces = reference.verify_tree(logits, toks, par, ms, batch, positions=pos,
                                            return_traces=True)
        bad += sum(not torch.equal(out.token_ids[i], ref.token_ids[i]) and not traces[i].fragile
                   for i in range(n))
    assert bad == 0
