"""verify_tree on the Triton backend: the same outputs as the torch backend.

Both backends draw each node row's target token with ``sample()``'s noise at position
``positions[i] + depth`` and walk the same way (draft_probs trees: recursive rejection
sampling on the same distributions), so tokens, num_accepted, accepted_node_ids and
invalid must be identical, logprobs equal to float32 rounding (1e-5) with identical ids. On
CPU the kernels run in Triton's interpreter (V <= 4096); the ``gpu`` tests repeat the check at
V = 151,936 on CUDA and check CUDA-graph capture is refused with a ValueError (the tree layout
is read on the host).
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
def test_gpu_capture_is_refused(monkeypatch):
    monkeypatch.setenv("SPECSAMPLE_BACKEND", "triton")
    logits, tok, par, ms, batch, pos = _case(23, 4, 151_936, torch.bfloat16, "mixed")
    specsample.verify_tree(logits, tok, par, ms, batch, positions=pos, strict=False)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="CUDA-graph capture"):
        with torch.cuda.graph(graph):
            specsample.verify_tree(logits, tok, par, ms, batch, positions=pos, strict=False)


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
