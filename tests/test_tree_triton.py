"""verify_tree on the Triton backend: the same outputs as the torch backend.

Both backends draw each node row's target token with ``sample()``'s noise at position
``positions[i] + depth`` and walk the same way (draft_probs trees: recursive rejection
sampling on the same distributions), so tokens, num_accepted, accepted_node_ids and
invalid must be identical, logprobs equal to float32 rounding (1e-5) with identical ids. On
CPU the kernels run in Triton's interpreter (V <= 4096); the ``gpu`` tests repeat the check at
V = 151,936 on CUDA and capture deterministic trees in CUDA graphs (the structure laid out by
an earlier eager call, the tokens read on the device at every replay). On CPU the captured
form runs with the capture state forced on (``api._capturing``): the same outputs as the
eager layout, siblings checked by the walk kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

import specsample
from specsample import SamplingBatch, SamplingError, SamplingParams, paths

pytest.importorskip("specsample.triton_backend")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_trees(gen: torch.Generator, n: int, *, max_depth: int = 4, vocab: int = 300,
                 allow_empty: bool = True):
    """N random trees (depth <= max_depth, 1-3 children per inner node, node numbers in
    breadth-first order): (num_nodes list, parents list, tokens list)."""
    num_nodes, parents, tokens = [], [], []
    for _ in range(n):
        depth = int(torch.randint(0 if allow_empty else 1, max_depth + 1, (), generator=gen))
        par, tok, level, count = [], [], [0], 0
        node_depth = {0: 0}
        while level:
            nxt = []
            for node in level:
                if node_depth[node] >= depth:
                    continue
                width = int(torch.randint(1, 4, (), generator=gen))
                kids = torch.randperm(vocab, generator=gen)[:width].tolist()
                for t in kids:
                    count += 1
                    par.append(node)
                    tok.append(t)
                    node_depth[count] = node_depth[node] + 1
                    nxt.append(count)
            level = nxt[:6]  # (keeps trees small: at most 6 nodes expanded per level)
        num_nodes.append(count)
        parents += par
        tokens += tok
    return num_nodes, parents, tokens


def tree_logits(gen: torch.Generator, num_nodes, parents, tokens, vocab: int, dtype,
                boost: float = 10.0) -> torch.Tensor:
    """[N + M, V] random logits where a node's row favours one of its children's tokens (so
    walks go deep); ``boost`` is added to that child's logit in the parent's row."""
    rows = len(num_nodes) + sum(num_nodes)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    g = 0
    for i, m in enumerate(num_nodes):
        start = i + g
        for n in range(1, m + 1):
            if torch.rand((), generator=gen) < 0.6:
                logits[start + parents[g + n - 1], tokens[g + n - 1]] += boost
        g += m
    return logits.to(dtype)


def params_list(gen: torch.Generator, n: int, mode: str, **kw) -> list[SamplingParams]:
    out = []
    for i in range(n):
        if mode == "greedy":
            t = 0.0
        elif mode == "sampled":
            t = [0.7, 1.0, 1.5][i % 3]
        else:
            t = [0.0, 0.8, 1.0, 1e-5][int(torch.randint(0, 4, (), generator=gen))]
        out.append(SamplingParams(temperature=t, seed=500 + i, **kw))
    return out


def run_both(monkeypatch, logits, tokens, parents, num_nodes, batch, pos, **kw):
    """(torch output, triton output, the Triton call's path counters)."""
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    ref = specsample.verify_tree(logits, tokens, parents, num_nodes, batch, positions=pos, **kw)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    paths.reset()
    out = specsample.verify_tree(logits, tokens, parents, num_nodes, batch, positions=pos, **kw)
    return ref, out, paths.counts()


def assert_same(ref, out):
    for name in ("token_ids", "num_accepted", "accepted_node_ids", "invalid"):
        assert torch.equal(getattr(out, name).cpu(), getattr(ref, name).cpu()), name
    assert (out.logprobs is None) == (ref.logprobs is None)
    if ref.logprobs is not None:
        assert torch.equal(out.logprob_token_ids.cpu(), ref.logprob_token_ids.cpu())
        torch.testing.assert_close(out.logprobs.cpu(), ref.logprobs.cpu(), atol=1e-5,
                                   rtol=1e-5, equal_nan=True)


def _case(seed: int, n: int, vocab: int, dtype, mode: str, *, logprobs=None, **kw):
    gen = torch.Generator().manual_seed(seed)
    ms, par, tok = random_trees(gen, n, vocab=vocab)
    logits = tree_logits(gen, ms, par, tok, vocab, dtype).to(DEVICE)
    lp = {} if logprobs is None else dict(logprobs=logprobs)
    batch = SamplingBatch.from_params(params_list(gen, n, mode, **lp, **kw), vocab_size=vocab,
                                      device=DEVICE)
    pos = torch.randint(0, 1000, (n,), generator=gen).to(DEVICE)
    return logits, tok, par, ms, batch, pos


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "mixed"])
def test_matches_torch_backend(monkeypatch, seed, mode):
    dtype = [torch.float32, torch.bfloat16, torch.float16][seed]
    case = _case(seed, 5, 300, dtype, mode, logprobs=[None, 0, 2][seed])
    ref, out, counts = run_both(monkeypatch, *case)
    assert_same(ref, out)
    assert counts["triton.verify_tree.fused"]["calls"] == 1
    assert not any(k.startswith("torch.") for k in counts)
    if mode != "greedy":  # the boosts make some walks go deep
        assert int(out.num_accepted.max()) >= 1


@pytest.mark.parametrize("lp", [None, 1])
def test_vocabulary_spanning_tiles(monkeypatch, lp):
    case = _case(7, 3, 3000, torch.bfloat16, "mixed", logprobs=lp)
    ref, out, _ = run_both(monkeypatch, *case)
    assert_same(ref, out)


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.05),
                                dict(top_k=20, top_p=0.9, min_p=0.01)])
@pytest.mark.parametrize("lp", [None, 1])  # (None: the walk kernel; 1: the PyTorch walk)
def test_filtered_path(monkeypatch, kw, lp):
    case = _case(11, 4, 300, torch.float32, "mixed", logprobs=lp, **kw)
    ref, out, counts = run_both(monkeypatch, *case)
    assert_same(ref, out)
    assert counts["triton.verify_tree.filtered"]["calls"] == 1
    assert ("triton.verify_tree.walk" in counts) == (lp is None)


@pytest.mark.parametrize("kw", [dict(presence_penalty=0.5, repetition_penalty=1.3),
                                dict(logit_bias={1: 2.0, 5: -1.0}, top_k=9)])
@pytest.mark.parametrize("lp", [None, 2])
def test_general_path(monkeypatch, kw, lp):
    case = _case(13, 4, 300, torch.bfloat16, "mixed", logprobs=lp, **kw)
    ref, out, counts = run_both(monkeypatch, *case)
    assert_same(ref, out)
    assert counts["triton.verify_tree.general"]["calls"] == 1
    assert ("triton.verify_tree.walk" in counts) == (lp is None)


@pytest.mark.parametrize("general", [False, True])
@pytest.mark.parametrize("lp", [None, 1])
def test_invalid_rows_only_their_request(monkeypatch, general, lp):
    gen = torch.Generator().manual_seed(3)
    n, vocab = 4, 300
    ms, par, tok = random_trees(gen, n, vocab=vocab, allow_empty=False)
    logits = tree_logits(gen, ms, par, tok, vocab, torch.float32)
    starts = [i + sum(ms[:i]) for i in range(n)]
    logits[starts[0] + ms[0], 7] = math.nan  # request 0: its last node's row
    logits[starts[2]] = -math.inf  # request 2: the root row has no finite logit
    tok = list(tok)
    tok[sum(ms[:3])] = vocab + 5  # request 3: a node token outside [0, V)
    kw = dict(presence_penalty=0.3) if general else {}
    lps = {} if lp is None else dict(logprobs=lp)
    batch = SamplingBatch.from_params(params_list(gen, n, "mixed", **lps, **kw),
                                      vocab_size=vocab, device=DEVICE)
    pos = torch.arange(n).to(DEVICE)
    logits = logits.to(DEVICE)
    ref, out, _ = run_both(monkeypatch, logits, tok, par, ms, batch, pos, strict=False)
    assert_same(ref, out)
    assert out.invalid.tolist() == [True, False, True, True]
    assert (out.token_ids[1] >= 0).any()
    with pytest.raises(SamplingError):
        specsample.verify_tree(logits, tok, par, ms, batch, positions=pos)


@pytest.mark.parametrize("lp", [None, 0])
def test_empty_trees(monkeypatch, lp):
    gen = torch.Generator().manual_seed(5)
    vocab = 300
    for ms, width in (([0, 0, 0], 1), ([0, 2, 0], 3)):
        par = [0, 1][:sum(ms)]
        tok = [4, 9][:sum(ms)]
        logits = tree_logits(gen, ms, par, tok, vocab, torch.float32).to(DEVICE)
        batch = SamplingBatch.from_params(params_list(gen, 3, "mixed",
                                                      **({} if lp is None else dict(logprobs=lp))),
                                          vocab_size=vocab, device=DEVICE)
        pos = torch.tensor([3, 4, 5]).to(DEVICE)
        ref, out, _ = run_both(monkeypatch, logits, tok, par, ms, batch, pos)
        assert_same(ref, out)
        assert out.token_ids.shape == (3, width)


@pytest.mark.parametrize("mode,kw,dv", [("sampled", {}, 300), ("mixed", dict(top_p=0.9), 250),
                                        ("mixed", dict(presence_penalty=0.4), 300)])
def test_draft_probs_trees(monkeypatch, mode, kw, dv):
    # Recursive rejection sampling on the visited rows' distributions from the kernels' row
    # statistics: the same walk as the torch backend's (random inputs: no near-ties).
    case = list(_case(17, 6, 300, torch.float32, mode, logprobs=1, **kw))
    gen = torch.Generator().manual_seed(1)
    q = torch.softmax(torch.randn(case[0].shape[0], dv, generator=gen) * 2, -1).to(DEVICE)
    ref, out, counts = run_both(monkeypatch, *case, draft_probs=q)
    assert_same(ref, out)
    kind = "general" if "presence_penalty" in kw else "filtered" if kw else "fused"
    assert counts[f"triton.verify_tree.draft_probs.{kind}"]["calls"] == 1
    assert not any(k.startswith("torch.") for k in counts)
    assert int(out.num_accepted.max()) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(top_k=50, top_p=0.9), dict(presence_penalty=0.5)])
def test_gpu_full_vocabulary(monkeypatch, kw):
    case = _case(21, 8, 151_936, torch.bfloat16, "mixed", logprobs=2, **kw)
    ref, out, _ = run_both(monkeypatch, *case)
    assert_same(ref, out)


@pytest.mark.gpu
def test_gpu_full_vocabulary_draft_probs(monkeypatch):
    case = _case(22, 8, 151_936, torch.bfloat16, "mixed", logprobs=1, top_p=0.95)
    gen = torch.Generator().manual_seed(2)
    q = torch.softmax(torch.randn(case[0].shape[0], 151_936, generator=gen) * 3, -1)
    ref, out, _ = run_both(monkeypatch, *case, draft_probs=q.to(DEVICE))
    assert_same(ref, out)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(top_k=50, top_p=0.9)])
def test_gpu_capture_and_replay(monkeypatch, kw):
    # A captured verify_tree replays with new logits, tokens and positions copied into its
    # inputs: the outputs of eager calls on the same data, for several replays.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    from specsample import tree as tree_mod

    gen = torch.Generator().manual_seed(23)
    ms, par, tok = random_trees(gen, 6, vocab=151_936, allow_empty=True)
    batch = SamplingBatch.from_params(params_list(gen, 6, "mixed", **kw), vocab_size=151_936,
                                      device=DEVICE)
    rounds = []
    for _ in range(3):
        t = torch.randperm(151_936, generator=gen)[:len(tok)]  # (distinct: valid siblings)
        logits = tree_logits(gen, ms, par, t.tolist(), 151_936, torch.bfloat16)
        rounds.append((logits.to(DEVICE), t.to(DEVICE),
                       torch.randint(0, 1000, (6,), generator=gen).to(DEVICE)))
    x, toks, pos = (r.clone() for r in rounds[0])
    specsample.verify_tree(x, toks, par, ms, batch, positions=pos, strict=False)  # layout
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    paths.reset()
    with torch.cuda.graph(graph):
        out = specsample.verify_tree(x, toks, par, ms, batch, positions=pos, strict=False)
    assert paths.counts()["triton.verify_tree.walk"]["rows"] == 6
    tree_mod.clear_layout_cache()  # (the captured structure stays)
    for logits, t, p in rounds:
        x.copy_(logits)
        toks.copy_(t)
        pos.copy_(p)
        graph.replay()
        ref = specsample.verify_tree(logits, t, par, ms, batch, positions=p, strict=False)
        assert_same(ref, out)
    t = toks.clone()
    t[::3] = -1  # (pruned nodes: the kernel skips their subtrees, as the eager layout does)
    toks.copy_(t)
    graph.replay()
    assert_same(specsample.verify_tree(x, t, par, ms, batch, positions=pos, strict=False), out)
    toks.copy_(rounds[-1][1])
    # Two siblings with one token: their request is flagged, the others are not.
    req = [i for i, m in enumerate(ms) for _ in range(m)]
    g, h = next((g, h) for g in range(len(par)) for h in range(g + 1, len(par))
                if req[g] == req[h] and par[g] == par[h])
    toks[h] = toks[g]
    graph.replay()
    assert out.invalid.tolist() == [i == req[g] for i in range(6)]


@pytest.mark.gpu
def test_gpu_capture_refusals(monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    logits, tok, par, ms, batch, pos = _case(24, 4, 151_936, torch.bfloat16, "mixed")
    toks = torch.tensor(tok, device=DEVICE)
    specsample.verify_tree(logits, toks, par, ms, batch, positions=pos, strict=False)
    torch.cuda.synchronize()
    lp = SamplingBatch.from_params([SamplingParams(logprobs=1)] * 4, vocab_size=151_936,
                                   device=DEVICE)
    for args, kw, match in (
            ((logits, tok, par, ms, batch), {}, "draft_token_ids as a tensor on"),
            ((logits, toks, par, ms, lp), {}, "logprobs"),
            ((logits, toks, par, ms, batch), dict(strict=True), "strict=True"),
            ((logits, toks, par[:-1] + [0], ms, batch), {}, "laid out by an earlier call")):
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match=match):
            with torch.cuda.graph(graph):
                specsample.verify_tree(*args, positions=pos, **{"strict": False, **kw})


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, dict(top_k=50, top_p=0.9)])
def test_gpu_no_host_sync_after_the_layout(kw):
    from specsample import tree as tree_mod
    from specsample.triton_backend import tree as triton_tree

    logits, tok, par, ms, batch, pos = _case(25, 8, 151_936, torch.bfloat16, "mixed", **kw)
    layout = tree_mod.build_tree_layout(tuple(ms), torch.tensor(par, dtype=torch.int64),
                                        torch.tensor(tok, dtype=torch.int64), logits.device)
    plan = tree_mod._tree_plan(logits, batch, pos, layout)
    ref, _ = triton_tree.run_tree(plan)  # (compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = triton_tree.run_tree(plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.token_ids, ref.token_ids)


@pytest.mark.gpu
def test_gpu_warmup_covers_trees():
    # verify_tree launches the kernels verify() uses: warmup() leaves nothing to compile.
    from specsample import triton_backend

    vocab = 32000
    try:
        specsample.warmup("cuda", vocab_size=vocab, dtypes=(torch.bfloat16, torch.float32),
                          on_compile="raise")
        for kw in ({}, dict(top_k=20, top_p=0.9), dict(presence_penalty=0.5)):
            case = _case(27, 6, vocab, torch.bfloat16, "mixed", logprobs=1, **kw)
            specsample.verify_tree(*case[:5], positions=case[5], strict=False)
        for kw in ({}, dict(top_k=20, top_p=0.9)):  # (captured: the separate launches)
            x, tok, par, ms, batch, pos = _case(28, 6, vocab, torch.bfloat16, "mixed", **kw)
            toks = torch.tensor(tok, device=DEVICE)
            specsample.verify_tree(x, toks, par, ms, batch, positions=pos, strict=False)
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                specsample.verify_tree(x, toks, par, ms, batch, positions=pos, strict=False)
        assert triton_backend.compilations_after_warmup() == []
    finally:
        triton_backend.disarm_compile_guard()


@pytest.mark.parametrize("mode", ["greedy", "mixed"])
def test_wide_and_deep_trees(monkeypatch, mode):
    # More children than the walk kernel compares per step (16) and a path longer than it
    # writes per step (32).
    gen = torch.Generator().manual_seed(9)
    vocab = 300
    ms = [20, 40, 3]
    par = [0] * 20 + list(range(40)) + [0, 1, 1]
    tok = list(range(100, 120)) + [7 + (i % 5) for i in range(40)] + [3, 4, 5]
    logits = tree_logits(gen, ms, par, tok, vocab, torch.float32)
    for n in range(1, 41):  # every chain node favoured by its parent's row: walks go deep
        logits[21 + n - 1, tok[20 + n - 1]] += 30.0
    logits = logits.to(DEVICE)
    batch = SamplingBatch.from_params(params_list(gen, 3, mode), vocab_size=vocab,
                                      device=DEVICE)
    pos = torch.tensor([1, 2, 3]).to(DEVICE)
    ref, out, counts = run_both(monkeypatch, logits, tok, par, ms, batch, pos)
    assert_same(ref, out)
    assert counts["triton.verify_tree.walk"]["calls"] == 1
    assert out.token_ids.shape == (3, 41)
    if mode == "greedy":
        assert int(out.num_accepted[1]) > 32


def _as_captured(monkeypatch):
    """verify_tree's CUDA-graph capture branch on CPU: the capture state forced on."""
    from specsample import api

    monkeypatch.setattr(api, "_capturing", lambda: True)


def test_captured_layout_matches_eager(monkeypatch):
    # The captured form (tokens as a device tensor, not read; the structure kept from an
    # earlier call) gives the eager layout's outputs, for new tokens on the same structure.
    # (The filters draw the same rows either way: the GPU capture test covers them.)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    gen = torch.Generator().manual_seed(31)
    ms, par, tok = random_trees(gen, 3, max_depth=3, vocab=600)
    batch = SamplingBatch.from_params(params_list(gen, 3, "mixed"), vocab_size=600,
                                      device=DEVICE)
    pos = torch.randint(0, 1000, (3,), generator=gen).to(DEVICE)
    specsample.verify_tree(tree_logits(gen, ms, par, tok, 600, torch.float32).to(DEVICE), tok,
                           par, ms, batch, positions=pos)  # (lays the structure out)
    for dtype in (torch.int64, torch.int32):
        t = torch.randperm(600, generator=gen)[:len(tok)]
        logits = tree_logits(gen, ms, par, t.tolist(), 600, torch.bfloat16).to(DEVICE)
        ref = specsample.verify_tree(logits, t.tolist(), par, ms, batch, positions=pos)
        with monkeypatch.context() as m:
            _as_captured(m)
            paths.reset()
            out = specsample.verify_tree(logits, t.to(DEVICE, dtype), par, ms, batch,
                                         positions=pos, strict=False)
            assert paths.counts()["triton.verify_tree.walk"]["rows"] == 3
        assert_same(ref, out)
        assert ref.num_accepted.sum() > 0  # (walks that descend: the tokens were read)


def test_captured_siblings_and_ids_flag_their_request(monkeypatch):
    # Under capture the tokens are not read on the host: two siblings with one token, or a
    # token outside [0, V), make their own request invalid (the walk kernel's bits), the
    # others unchanged; eagerly the same siblings raise ValueError.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    from specsample import torch_backend
    from specsample.tree import _tree_plan, build_tree_layout
    from specsample.triton_backend import tree as triton_tree

    ms, par = [3, 4, 2], [0, 0, 1, 0, 1, 1, 2, 0, 0]
    tok = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    gen = torch.Generator().manual_seed(4)
    logits = tree_logits(gen, ms, par, tok, 64, torch.float32).to(DEVICE)
    batch = SamplingBatch.from_params(params_list(gen, 3, "mixed"), vocab_size=64,
                                      device=DEVICE)
    pos = torch.tensor([3, 4, 5]).to(DEVICE)
    specsample.verify_tree(logits, tok, par, ms, batch, positions=pos)
    bad = list(tok)
    bad[4] = bad[5]  # request 1: nodes 2 and 3 are children of node 1 with one token
    bad[8] = 64  # request 2: a token outside [0, V)
    with pytest.raises(ValueError, match="siblings must have distinct tokens"):
        specsample.verify_tree(logits, bad, par, ms, batch, positions=pos)
    layout = build_tree_layout(tuple(ms), par, torch.tensor(bad).to(DEVICE), logits.device,
                               capture=True)
    out, err = triton_tree.run_tree(_tree_plan(logits, batch, pos, layout))
    assert err.tolist() == [0, torch_backend.ERR_TREE_SIBLINGS, torch_backend.ERR_DRAFT_ID]
    assert out.invalid.tolist() == [False, True, True]
    ref = specsample.verify_tree(logits, tok, par, ms, batch, positions=pos)
    assert torch.equal(out.token_ids[0], ref.token_ids[0])
    assert (out.token_ids[1:] == -1).all()
    _as_captured(monkeypatch)  # (the whole call: no ValueError, the requests flagged)
    out2 = specsample.verify_tree(logits, torch.tensor(bad).to(DEVICE), par, ms, batch,
                                  positions=pos, strict=False)
    assert_same(out, out2)
    assert "two siblings of the tree hold the same token" in torch_backend.describe_errors(
        err.tolist())


def test_captured_calls_refuse_what_they_cannot_capture(monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    gen = torch.Generator().manual_seed(5)
    ms, par, tok = [2, 1], [0, 1, 0], [3, 4, 5]
    logits = tree_logits(gen, ms, par, tok, 64, torch.float32).to(DEVICE)
    batch = SamplingBatch.from_params(params_list(gen, 2, "mixed"), vocab_size=64,
                                      device=DEVICE)
    pos = torch.tensor([1, 2]).to(DEVICE)
    toks = torch.tensor(tok).to(DEVICE)
    specsample.verify_tree(logits, tok, par, ms, batch, positions=pos)
    lp = SamplingBatch.from_params([SamplingParams(logprobs=0)] * 2, vocab_size=64,
                                   device=DEVICE)
    bias = SamplingBatch.from_params([SamplingParams(logit_bias={1: 1.0})] * 2, vocab_size=64,
                                     device=DEVICE)
    q = torch.full((5, 64), 1 / 64).to(DEVICE)
    _as_captured(monkeypatch)
    cases = [
        (dict(draft_token_ids=tok), "draft_token_ids as a tensor on"),
        (dict(draft_token_ids=toks[:2]), "draft_token_ids has 2 entries"),
        (dict(draft_token_ids=toks.float()), "1-D integer tensor"),
        (dict(batch=lp), "logprobs"),
        (dict(batch=bias), "the general path"),
        (dict(draft_probs=q), "draft_probs"),
        (dict(strict=True), "strict=True"),
        (dict(parents=[0, 0, 0]), "laid out by an earlier call"),
        (dict(positions=[1, 2]), "positions as a tensor"),
    ]
    for change, match in cases:
        kw = dict(target_logits=logits, draft_token_ids=toks, parents=par, num_nodes=ms,
                  batch=batch, positions=pos, strict=False)
        kw.update(change)
        with pytest.raises(ValueError, match=match):
            specsample.verify_tree(**kw)
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "torch")
    with pytest.raises(ValueError, match="Triton backend only"):
        specsample.verify_tree(logits, toks, par, ms, batch, positions=pos, strict=False)


def test_captured_structures_stay_pinned():
    # A structure a capture used is the one every later capture of that shape gets, even
    # after the cache was cleared and an eager call built a new copy (a graph captured
    # earlier still reads the first one: freeing it would leave that graph reading freed
    # memory).
    from specsample import tree as tree_mod

    ms, par, tok = (2, 1), [0, 1, 0], torch.tensor([3, 4, 5]).to(DEVICE)
    tree_mod.build_tree_layout(ms, par, tok.cpu(), DEVICE)
    first = tree_mod.build_tree_layout(ms, par, tok, DEVICE, capture=True)
    tree_mod.clear_layout_cache()
    again = tree_mod.build_tree_layout(ms, par, tok.cpu(), DEVICE)  # (a new copy)
    assert again.children.data_ptr() != first.children.data_ptr()
    later = tree_mod.build_tree_layout(ms, par, tok, DEVICE, capture=True)
    assert later.children.data_ptr() == first.children.data_ptr()
    assert later.node_token is tok
    with pytest.raises(ValueError, match="laid out by an earlier call"):
        tree_mod.build_tree_layout((3,), [0, 0, 0], tok, DEVICE, capture=True)


@pytest.mark.parametrize("with_q", [False, True])
def test_pruned_nodes(monkeypatch, with_q):
    # Placeholders (-1) prune their subtrees on the Triton backend as on the torch backend
    # (the general path, logprobs, draft_probs trees), and in the captured form, whose walk
    # kernel finds the pruned rows itself (the tokens are not read on the host).
    from test_tree import assert_pruned_is_absent, pruned_case

    (logits, toks, par, ms, q), absent, keep, params, pos = pruned_case(2)
    vocab = logits.shape[1]
    dev = dict(vocab_size=vocab, device=DEVICE)
    batch = SamplingBatch.from_params(params, **dev)
    x, pos = logits.to(DEVICE), pos.to(DEVICE)
    dp = q.to(DEVICE) if with_q else None
    ref, out, _ = run_both(monkeypatch, x, toks, par, ms, batch, pos, draft_probs=dp,
                           strict=False)
    assert_same(ref, out)
    if with_q:
        return
    plain = SamplingBatch.from_params(
        [SamplingParams(temperature=p.temperature, seed=p.seed) for p in params], **dev)
    want = specsample.verify_tree(*absent[:4], plain, positions=pos, strict=False)
    _as_captured(monkeypatch)
    out = specsample.verify_tree(x, toks.to(DEVICE), par, ms, plain, positions=pos,
                                 strict=False)
    assert_pruned_is_absent(out, want, keep)


def test_captured_sibling_check_across_blocks(monkeypatch):
    # The captured walk compares each node with its parent's earlier children 16 at a time: a
    # repeat between children 1 and 20 of a root with 20 children is found, placeholders are
    # never repeats, and without a repeat the tree matches the eager layout.
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    ms, par = [20, 2], [0] * 20 + [0, 1]
    tok = list(range(10, 30)) + [3, 4]
    gen = torch.Generator().manual_seed(6)
    logits = tree_logits(gen, ms, par, tok, 64, torch.float32).to(DEVICE)
    batch = SamplingBatch.from_params(params_list(gen, 2, "mixed"), vocab_size=64,
                                      device=DEVICE)
    pos = torch.tensor([3, 4]).to(DEVICE)
    ref = specsample.verify_tree(logits, tok, par, ms, batch, positions=pos)
    _as_captured(monkeypatch)
    for change, flagged in (({}, False), ({19: 10}, True), ({3: -1, 7: -1}, False)):
        t = list(tok)
        for g, v in change.items():
            t[g] = v
        out = specsample.verify_tree(logits, torch.tensor(t).to(DEVICE), par, ms, batch,
                                     positions=pos, strict=False)
        assert out.invalid.tolist() == [flagged, False]
        if not change:
            assert_same(ref, out)
