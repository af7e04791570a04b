"""``specsample.verify_tree`` on the Triton kernels.

A deterministic tree's target token at a node is the node row's own ``sample()`` draw at
position ``positions[i] + depth`` (docs/semantics.md, "Tree verification"), which is exactly
what the kernels draw for a ``verify()`` row of request ``row_req[r]`` at offset ``row_j[r]``.
So the tree's rows go through the same launches as ``verify()``'s (``draw_rows``: the
statistics kernel, the filter kernels when min_p / top_k / top_p are on, ``sample_kernel``)
with ``row_j`` = the node's depth and every row live (``k_given`` = the batch's deepest depth D
and D zero draft ids, so ``kernels._k_eff`` is D for every request). The walk and the outputs
are the PyTorch backend's (``specsample.tree.walk``, ``assemble_output``), the logprobs come
from the kernels' row statistics as in ``triton_backend.run``. Trees with ``draft_probs``
draw their rows the same way, then walk by the PyTorch backend's recursive rejection sampling
on the visited rows' distributions from those statistics.

Paths: ``triton.verify_tree.fused`` / ``.filtered`` (the model's own logits, no host
synchronisation) and ``.general`` (logit_bias, penalties or bans: the rows are processed in
PyTorch by ``specsample.tree._processed``, then the kernels draw at T = 1); with draft_probs
``triton.verify_tree.draft_probs.fused`` / ``.filtered`` / ``.general``; recorded by
``specsample.tree.verify_tree``; ``triton.logprobs.torch`` when logprobs are asked for.
"""

from __future__ import annotations

import math

import torch

from .. import paths
from .. import tree as tree_mod
from ..outputs import TreeVerifyOutput
from . import _contiguous_rows, draw_rows, exact_rank_rows, kernels, stats_logprobs

_FLAG_BAD = int(kernels.FLAG_BAD.value)
_FLAG_FINITE = int(kernels.FLAG_FINITE.value)


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
        plan, x, err = tree_mod._processed(plan)
        temp = torch.ones_like(batch.temperature)
    else:
        x = _contiguous_rows(plan.logits, "target")
        temp = batch.temperature
    # k_eff = D for every request (no -1 among the D draft ids): every row j <= D is live.
    draft_ids = torch.zeros(max(tree.depth, 1), dtype=torch.int64, device=dev)
    _, _, _, y, stats, (cut_v, cut_i), _ = draw_rows(x, plan, temp, draft_ids, filtered)
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
