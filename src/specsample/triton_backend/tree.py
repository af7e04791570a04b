"""``specsample.verify_tree`` on the Triton kernels.

A deterministic tree's target token at a node is the node row's own ``sample()`` draw at
position ``positions[i] + depth`` (docs/semantics.md, "Tree verification"), which is exactly
what the kernels draw for a ``verify()`` row of request ``row_req[r]`` at offset ``row_j[r]``.
So the tree's rows go through the same launches as ``verify()``'s separate ones (``draw_rows``:
the statistics kernel, the filter kernels when min_p / top_k / top_p are on, the draw)
with ``row_j`` = the node's depth and every row live (``k_given`` = the batch's deepest depth D
and D zero draft ids, so ``kernels._k_eff`` is D for every request). Without logprobs the
walk and the outputs are one launch (``walk_kernel``); with logprobs they are the PyTorch
backend's (``specsample.tree.walk``, ``assemble_output``), the logprobs from the kernels' row
statistics as in ``triton_backend.run``. Trees with ``draft_probs``
draw their rows the same way, then walk by the PyTorch backend's recursive rejection sampling
on the visited rows' distributions from those statistics.

Paths: ``triton.verify_tree.fused`` / ``.filtered`` (the model's own logits, no host
synchronisation) and ``.general`` (logit_bias, penalties or bans: the rows are processed in
PyTorch by ``specsample.tree._processed``, then the kernels draw at T = 1); with draft_probs
``triton.verify_tree.draft_probs.fused`` / ``.filtered`` / ``.general``; recorded by
``specsample.tree.verify_tree``; ``triton.logprobs.torch`` when logprobs are asked for.
``triton.verify_tree.walk`` (one count per request): deterministic trees without logprobs
walk in ``walk_kernel`` (the error bits, the walk and the outputs in one launch, no host
synchronisation) instead of the PyTorch walk (about 60 small operations).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import paths, workspace
from .. import tree as tree_mod
from ..outputs import TreeVerifyOutput
from ..torch_backend import ERR_DRAFT_ID, ERR_LOGITS_NAN, ERR_LOGITS_NO_FINITE, ERR_TREE_SIBLINGS
from . import _contiguous_rows, _interpreting, draw_rows, exact_rank_rows, kernels, stats_logprobs
from .launch import launch, wait_for_prior_grid

_FLAG_BAD = int(kernels.FLAG_BAD.value)
_FLAG_FINITE = int(kernels.FLAG_FINITE.value)


WALK_BLOCK_R = 128  # rows of a request's tree scanned per step for its error bits
WALK_BLOCK_W = 16  # children of a node compared per step
WALK_BLOCK_D = 32  # output positions written per step
_BAD = kernels.FLAG_BAD
_FINITE = kernels.FLAG_FINITE
_E_NAN = tl.constexpr(ERR_LOGITS_NAN)
_E_NO_FINITE = tl.constexpr(ERR_LOGITS_NO_FINITE)
_E_ID = tl.constexpr(ERR_DRAFT_ID)
_E_SIB = tl.constexpr(ERR_TREE_SIBLINGS)


@triton.jit(do_not_specialize=["V", "N", "R", "MAXR", "D", "W", "DL"])
def walk_kernel(y_ptr, stats_ptr, row_start_ptr, children_ptr, node_tok_ptr, row_parent_ptr,
                row_depth_ptr, row_node_ptr, path_ptr, err_in_ptr, V, N, R, MAXR, D, W, DL,
                tok_ptr, nacc_ptr, node_ptr, invalid_ptr, err_ptr, HAS_ERR_IN: tl.constexpr,
                CHECK_SIBLINGS: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_R: tl.constexpr, GDC: tl.constexpr):
    """One program per request: the error bits, the sample-and-match walk and the outputs of
    a deterministic tree (``specsample.tree._tree_errors``, ``_walk_match`` and
    ``assemble_output`` without logprobs, in one launch).

    y [R] int32: every node row's draw; stats [R, 3] float32 (column 2: the row's flags);
    the layout as ``specsample.tree.TreeLayout`` (row_start [N], children [R, W], row_parent,
    row_depth, row_node [R], path_rows [R, D + 1], int64); node_tok [M] int64: the nodes'
    tokens in the caller's order (row r > row_start[i] of request i holds node r - i - 1, so
    no per-row token array is needed: under CUDA-graph capture these are the caller's device
    tokens as given); err_in [N] int64 (the general path's bits, used instead of the rows'
    flags when HAS_ERR_IN). A node whose token is the placeholder -1 is pruned: neither it
    nor any node below it is checked or descended into (DL: D, or 0 when the host layout
    found no placeholder, which skips the search along each row's path). With CHECK_SIBLINGS
    (a layout made for CUDA-graph capture, whose tokens the host did not read; otherwise the
    host layout has raised ValueError already) two siblings with the same token set
    ERR_TREE_SIBLINGS: each node against its parent's earlier children, BLOCK_W at a time.
    Writes token_ids
    [N, D + 1], num_accepted [N], accepted_node_ids [N, D] (int64), invalid [N] bool, err [N]
    int64. Children, path positions and rows are read in fixed blocks (three variants in all,
    whatever the trees' width and depth: nothing to compile after warmup)."""
    wait_for_prior_grid(GDC)
    i = tl.program_id(0)
    rs = tl.load(row_start_ptr + i)
    nxt_start = tl.load(row_start_ptr + i + 1, mask=i + 1 < N, other=0)
    re = tl.where(i + 1 < N, nxt_start, R)
    tok_at = node_tok_ptr - i - 1  # (row r > rs holds node r - i - 1)
    # NaN / +inf in any row, a row without a finite logit, a node token outside [0, V); two
    # siblings with one token (a node whose parent has an earlier child with its token)
    e_nan = i * 0
    e_fin = i * 0
    e_id = i * 0
    e_sib = i * 0
    offs = tl.arange(0, BLOCK_R)
    for c in range(0, MAXR, BLOCK_R):
        r = rs + c + offs
        m = r < re
        par = tl.load(row_parent_ptr + r, mask=m, other=-1)
        # live: no placeholder (-1) on the path from the root down to the row (pruned rows
        # are not read)
        pruned = tl.zeros([BLOCK_R], dtype=tl.int1)
        for d in range(1, DL + 1):
            p = tl.load(path_ptr + r * (D + 1) + d, mask=m & (par >= 0), other=-1)
            ptok = tl.load(tok_at + p, mask=p >= 0, other=0)
            pruned = pruned | ((p >= 0) & (ptok == -1))
        live = m & ~pruned
        node = live & (par >= 0)
        tok = tl.load(tok_at + r, mask=node, other=0)
        if CHECK_SIBLINGS:
            for k0 in range(0, W, BLOCK_W):
                kofs = k0 + tl.arange(0, BLOCK_W)
                kid = tl.load(children_ptr + par[:, None] * W + kofs[None, :],
                              mask=node[:, None] & (kofs[None, :] < W), other=-1)
                earlier = (kid >= 0) & (kid < r[:, None])
                ktok = tl.load(tok_at + kid, mask=earlier, other=-1)
                dup = earlier & (ktok == tok[:, None])
                e_sib = tl.maximum(e_sib, tl.max(tl.max(dup.to(tl.int32), axis=1), axis=0))
        if not HAS_ERR_IN:
            flags = tl.load(stats_ptr + r * 3 + 2, mask=m, other=2.0).to(tl.int32)
            bad = live & ((flags & _BAD) != 0)
            no_fin = live & ((flags & _BAD) == 0) & ((flags & _FINITE) == 0)
            bad_id = node & ((tok < 0) | (tok >= V))
            e_nan = tl.maximum(e_nan, tl.max(bad.to(tl.int32), axis=0))
            e_fin = tl.maximum(e_fin, tl.max(no_fin.to(tl.int32), axis=0))
            e_id = tl.maximum(e_id, tl.max(bad_id.to(tl.int32), axis=0))
    if HAS_ERR_IN:
        err = tl.load(err_in_ptr + i)
    else:
        err = (e_nan * _E_NAN + e_fin * _E_NO_FINITE + e_id * _E_ID).to(tl.int64)
    err = err | (e_sib * _E_SIB).to(tl.int64)
    # The walk: descend while the row's draw is a child's token (siblings hold distinct
    # tokens: at most one child matches); D steps, a leaf or a miss stays where it is.
    cur = rs
    for _d in range(D):
        yv = tl.load(y_ptr + cur).to(tl.int64)
        nxt = cur * 0 - 1
        for c0 in range(0, W, BLOCK_W):
            kofs = c0 + tl.arange(0, BLOCK_W)
            kids = tl.load(children_ptr + cur * W + kofs, mask=kofs < W, other=-1)
            ktok = tl.load(tok_at + kids, mask=kids >= 0, other=-2)
            hit = tl.max(tl.where((kids >= 0) & (ktok >= 0) & (ktok == yv), kids, -1), axis=0)
            nxt = tl.maximum(nxt, hit)
        cur = tl.where(nxt >= 0, nxt, cur)
    invalid = err != 0
    nacc = tl.where(invalid, 0, tl.load(row_depth_ptr + cur))
    emit = tl.load(y_ptr + cur).to(tl.int64)
    for j0 in range(0, D + 1, BLOCK_D):
        j = j0 + tl.arange(0, BLOCK_D)
        path = tl.load(path_ptr + cur * (D + 1) + j + 1, mask=j < D, other=-1)  # depth j + 1
        tok_j = tl.load(tok_at + path, mask=path >= 0, other=-1)
        out = tl.where(j < nacc, tok_j, tl.where(j == nacc, emit, -1))
        out = tl.where(invalid, -1, out)
        tl.store(tok_ptr + i * (D + 1) + j, out, mask=j <= D)
        node = tl.load(row_node_ptr + path, mask=path >= 0, other=-1)
        tl.store(node_ptr + i * D + j, tl.where((j < nacc) & ~invalid, node, -1), mask=j < D)
    tl.store(nacc_ptr + i, nacc)
    tl.store(invalid_ptr + i, invalid)
    tl.store(err_ptr + i, err)


def _walk(plan: tree_mod.TreePlan, y: torch.Tensor, stats: torch.Tensor,
          err_in: torch.Tensor | None) -> tuple[TreeVerifyOutput, torch.Tensor]:
    """(TreeVerifyOutput without logprobs, [N] int64 ERR_* bits) of deterministic trees from
    the rows' draws ``y`` and flags ``stats`` (``walk_kernel``, one launch; the siblings are
    checked there for a layout made for capture, ``row_token`` None)."""
    tree, dev = plan.tree, plan.logits.device
    n, rows, d = plan.num_requests, plan.num_rows, tree.depth
    w = tree.children.shape[1]
    token_ids = torch.empty(n, d + 1, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(n, dtype=torch.int64, device=dev)
    node_ids = torch.empty(n, d, dtype=torch.int64, device=dev)
    invalid = torch.empty(n, dtype=torch.bool, device=dev)
    err = torch.empty(n, dtype=torch.int64, device=dev)
    # (a layout made for capture: tokens unread, placeholders unknown; a host layout: row_live
    # says whether any node is pruned)
    captured, pruned = tree.row_token is None, tree.row_live is not None
    launch(walk_kernel)[(n,)](
        y, stats, tree.row_start, tree.children, tree.node_token, tree.row_parent,
        tree.row_depth, tree.row_node, tree.path_rows, err if err_in is None else err_in,
        plan.vocab_size, n, rows, tree.max_rows, d, w, d if captured or pruned else 0,
        token_ids, num_accepted, node_ids, invalid, err, HAS_ERR_IN=err_in is not None,
        CHECK_SIBLINGS=captured, BLOCK_W=WALK_BLOCK_W, BLOCK_D=WALK_BLOCK_D,
        BLOCK_R=WALK_BLOCK_R,
        num_warps=4 if not _interpreting(dev) else 1)
    out = TreeVerifyOutput(token_ids=token_ids, num_accepted=num_accepted,
                           accepted_node_ids=node_ids, logprobs=None, logprob_token_ids=None,
                           invalid=invalid)
    return out, err


def path_kind(batch) -> str:
    """"general", "filtered" or "fused": the Triton path a deterministic tree of ``batch``
    takes (the suffix of its ``triton.verify_tree.*`` path)."""
    if batch.needs_general_path:
        return "general"
    return "filtered" if batch.needs_filter else "fused"


def run_tree(plan: tree_mod.TreePlan) -> tuple[TreeVerifyOutput, torch.Tensor]:
    """Verify the trees of ``plan`` (a ``specsample.tree.TreePlan``; R = N + M rows, logits
    [R, V] float32 / float16 / bfloat16) with the node rows drawn by the kernels. With
    ``plan.draft_probs`` the sampled requests walk by recursive rejection sampling
    (``specsample.tree._walk_rrs``, PyTorch) on the processed distributions of the rows they
    visit, computed from the kernels' row statistics (N rows per depth, no [R, V] float32
    copy on the fused and filtered paths; host synchronisations as the PyTorch walk's).

    Returns (TreeVerifyOutput, [N] int64 ERR_* bitmask), the same as
    ``specsample.tree._run_tree``: NaN / +inf logits or no finite logit in any row of the
    request (from the kernels' row flags), node tokens outside [0, V), invalid draft_probs
    rows of nodes with children; on the general path the processing's own bits (bans that
    leave no token, bias / penalty overflow). No host synchronisation on the fused and
    filtered paths without draft_probs.
    """
    batch, tree = plan.batch, plan.tree
    dev = plan.logits.device
    general = batch.needs_general_path
    filtered = batch.needs_filter and not general
    if general:
        # PyTorch processing (float32 copy, invalid requests' rows sanitised), its error bits.
        plan, x, err, _ = tree_mod._processed(plan)
        temp = torch.ones_like(batch.temperature)
    else:
        x = _contiguous_rows(plan.logits, "target")
        temp = batch.temperature
    # k_eff = D for every request (no -1 among the D draft ids): every row j <= D is live.
    draft_ids = workspace.zeros((max(tree.depth, 1),), torch.int64, dev)
    walk_here = plan.draft_probs is None and batch.max_logprobs < 0
    if walk_here:  # (recorded before the work, so that a forbidden path raises first)
        paths.record("triton.verify_tree.walk", plan.num_requests)
    _, _, _, y, stats, (cut_v, cut_i), _, _ = draw_rows(x, plan, temp, draft_ids, filtered)
    if walk_here:
        return _walk(plan, y, stats, err if general else None)
    if not general:
        # The kernels' row flags as the row maxima ``_tree_errors`` reads: NaN for a NaN /
        # +inf row, -inf for a row without a finite logit, 0 otherwise.
        flags = stats[:, 2].to(torch.int32)
        row_max = torch.where((flags & _FLAG_BAD) != 0, math.nan,
                              torch.where((flags & _FLAG_FINITE) != 0, 0.0, -math.inf))
        err = tree_mod._tree_errors(plan, plan.draft_probs, row_max)
    invalid = err != 0
    y = y.to(torch.int64)
    processed = stats_logprobs(x, plan, temp, stats, filtered, cut_v, cut_i,
                               exact_rank_rows(plan, general))
    final, emit = tree_mod.walk(plan, y, invalid, lambda r: processed(r)[0])
    if batch.max_logprobs >= 0:
        paths.record("triton.logprobs.torch", plan.num_rows)
    else:
        processed = None
    return tree_mod.assemble_output(plan, final, emit, invalid, processed), err


def warm(device: torch.device, vocab_size: int, dtype: torch.dtype) -> None:
    """Launch ``walk_kernel``'s three variants (the rows' flags; the general path's error
    bits; the rows' flags and the sibling check of a layout made for capture) once on a small
    tree of ``dtype`` rows of ``vocab_size`` on ``device`` (``warmup()``)."""
    from ..params import SamplingBatch, SamplingParams
    from ..tree import _tree_plan, build_tree_layout, verify_tree

    v = vocab_size
    x = torch.zeros(4, v, device=device, dtype=dtype)
    pos = torch.zeros(1, dtype=torch.int64, device=device)
    batches = [SamplingBatch.from_params([params], vocab_size=v, device=device)
               for params in (SamplingParams(temperature=0.0),
                              SamplingParams(temperature=0.0, logit_bias={0: 1.0}))]
    for batch in batches:
        verify_tree(x, [1, 2, 3], [0, 1, 1], [3], batch, strict=False, positions=pos)
    # (the captured form's layout, launched eagerly: the structure is the one just laid out)
    layout = build_tree_layout((3,), [0, 1, 1], torch.tensor([1, 2, 3], device=device),
                               device, capture=True)
    with workspace.call(x.device):
        run_tree(_tree_plan(x, batches[0], pos, layout))
