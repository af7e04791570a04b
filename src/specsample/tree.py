"""Exact token-tree verification (``specsample.verify_tree``): the PyTorch backend, the layout
and the dispatch (with the Triton backend the kernels draw the node rows, then the walks here
run: ``specsample.triton_backend.tree``).

Request i drafted a tree of m_i nodes numbered 1..m_i in topological order (a node's parent
has a smaller number); node 0 is the root, the request's last committed token. The target
scored every node: row ``row_start[i] + n`` of ``target_logits`` is the target's distribution
of the token after node n (the root's row first), so a node at depth d decides the token at
absolute position ``positions[i] + d``.

Two verification rules (docs/semantics.md, "Tree verification"):

* Deterministic trees (``draft_probs=None``; a tree chosen without looking at the target's
  randomness: n-gram / prompt-lookup trees, Medusa / EAGLE top-k trees): at each node the
  target token is drawn from the node's processed row with exactly the noise ``sample()`` uses
  at that position (STREAM_SAMPLE*); if it equals a child's token the walk descends to that
  child, else the token is emitted as the correction and the walk stops; at a leaf the draw is
  the bonus token. Every row is sampled in one pass (a node's draw depends on its position,
  not on its siblings), then each request walks its tree. This is ``sample()`` position by
  position along the accepted path (the one-hot rule of ``verify()``, SpecInfer's
  multi-draft sample-and-match; Miao et al. 2024, arXiv 2305.09781).
* ``draft_probs`` trees: recursive rejection sampling (Jeon et al. 2024, arXiv 2402.14160,
  Alg. 1 / Thm. 3.1; also Yang et al. 2024, arXiv 2402.16014): the children c_1..c_m of a node
  were drawn from the drafter's q at that node without replacement, in node-number order. With
  ``p^1`` the processed target row and ``q^1 = q``, child k is accepted iff
  ``u_k q^k(c_k) < p^k(c_k)``, ``u_k = U(seed, pos + d, k - 1, STREAM_ACCEPT)``; on rejection
  ``p^{k+1} = norm(max(p^k - q^k, 0))`` and ``q^{k+1}`` is ``q^k`` without ``c_k``,
  renormalised. If every child is rejected the correction is drawn from
  ``max(p^m - q^m, 0)`` by three-level Gumbel-max on STREAM_RESIDUAL* at ``pos + d``; at a leaf
  the bonus is the row's ``sample()`` draw. One child per node is token-level verification
  (Leviathan et al. 2023, Alg. 1) with the same random keys as ``verify()``.

Greedy requests (temperature 0) walk the argmax whatever the draft kind. Processing (bans,
logit_bias, penalties, temperature, min_p, top_k, top_p) is ``verify()``'s, per node row, with
the tokens of the nodes on the path from the root to the node (the node included) counted as
outputs for its row. The tree layout is read and checked on the host (one synchronisation for
device tensors), except under CUDA-graph capture, where deterministic trees without logprobs,
bias, penalties or bans take the Triton walk with the tokens left on the device
(:func:`verify_tree`). The structure of a batch of trees (``num_nodes`` and ``parents``) is
kept between calls (``_tree_shape``); the tokens are laid out per call. The placeholder -1
prunes a node and its subtree (as if absent).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Sequence

import numpy as np
import torch

from . import api, paths, rng, torch_backend, workspace
from .errors import SamplingError
from .outputs import TreeVerifyOutput
from .params import SamplingBatch
from .plan import Plan, _check_batch_device, _check_float_matrix, _num_draft_tuple, _positions
from .processing import _allowed_rows, outputs_before_row, process_rows, row_inputs
from .torch_backend import _or_per_request

__all__ = ["TreeLayout", "TreePlan", "build_tree_layout", "clear_layout_cache", "verify_tree"]


@dataclasses.dataclass
class TreeLayout:
    """The trees of one call, laid out by target row (R = N + M rows, M = sum m_i nodes).

    Row ``row_start[i] + n`` is node n of request i (n = 0: the root). Every tensor is int64
    on the logits' device; ``-1`` pads.

    row_req [R]: the request of each row; row_node [R]: its node number n (0..m_i);
    row_depth [R]: its depth (root 0); row_token [R]: the node's draft token (-1 for roots);
    row_parent [R]: the parent's row (-1 for roots); row_start [N]; children [R, B]: the rows
    of each node's children in node-number order (B = the largest number of children);
    path_rows [R, D + 1]: the rows of the nodes at depth 0..depth(r) on the root-to-node path
    of row r; path_tokens [R, D]: their tokens at depth 1..depth(r) (the node's own included),
    the outputs its row counts; node_token [M]: the nodes' tokens in the caller's order (row
    r > row_start[i] is node r - i - 1); row_live [R] bool: False for a pruned node (token -1)
    and every node below one (None when no node is pruned: every row is live). ``children``
    lists live children only, in node-number order
    (a pruned node's siblings move up). ``depth``: D, the deepest node's depth in the batch
    (pruned nodes included, so the output width depends on the structure alone);
    ``max_rows``: the most rows of one request (1 + its nodes). A layout built for CUDA-graph
    capture (``build_tree_layout(capture=True)``) has only ``node_token`` of the tokens
    (``row_token``, ``path_tokens`` and ``row_live`` None, ``children`` every child): the
    Triton walk reads nothing else, and finds the pruned nodes and checks the siblings itself.
    """

    row_req: torch.Tensor
    row_node: torch.Tensor
    row_depth: torch.Tensor
    row_token: torch.Tensor | None
    row_parent: torch.Tensor
    row_start: torch.Tensor
    children: torch.Tensor
    path_rows: torch.Tensor
    path_tokens: torch.Tensor | None
    node_token: torch.Tensor
    row_live: torch.Tensor | None
    depth: int
    max_rows: int  # the most rows of one request (its nodes and root)
    draft_start: torch.Tensor  # [N] zeros (the plan's; kept with the structure)
    k_given: torch.Tensor  # [N] all D (the plan's)


def _num_nodes_tuple(num_nodes, n: int) -> tuple[int, ...]:
    """``num_nodes`` ([N] ints >= 0, a list or an integer tensor) as a host tuple (the checks
    of ``verify()``'s num_draft_tokens, with this argument's name in the messages)."""
    try:
        return _num_draft_tuple(num_nodes, n)
    except ValueError as e:
        raise ValueError(str(e).replace("num_draft_tokens", "num_nodes")) from None


def _check_int_tensor(name: str, t: torch.Tensor, m: int) -> None:
    """ValueError unless ``t`` is a 1-D integer tensor of ``m`` entries."""
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or (
            t.dtype == torch.bool):
        raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} of shape "
                         f"{tuple(t.shape)}")
    _check_length(name, t.shape[0], m)


def _check_length(name: str, got: int, m: int) -> None:
    if got != m:
        raise ValueError(f"{name} has {got} entries; sum(num_nodes) = {m}")


def _int_vector(name: str, t, m: int) -> np.ndarray:
    """A [m] int64 numpy array from an integer tensor (on any device: a device tensor is read
    with one synchronisation) or a list of ints (ValueError otherwise)."""
    if isinstance(t, torch.Tensor):
        _check_int_tensor(name, t, m)
        return t.to("cpu", torch.int64).numpy()
    else:
        try:
            a = np.asarray(list(t))
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be a 1-D int64 tensor or a list of ints") from None
        if a.size == 0:
            a = a.astype(np.int64)
        if a.ndim != 1 or a.dtype.kind not in "iu" or (
                a.dtype == np.uint64 and a.size and a.max() > np.iinfo(np.int64).max):
            raise ValueError(f"{name} must be a 1-D integer tensor or a list of ints (int64), "
                             f"got {a.dtype} of shape {a.shape}")
        a = a.astype(np.int64, copy=False)
    _check_length(name, a.shape[0], m)
    return a


@dataclasses.dataclass
class _Shape:
    """The token-independent part of a batch of trees (numpy arrays as in TreeLayout, plus
    ``node_row`` [M] and ``node_req`` / ``node_num``), and its device tensors."""

    host: dict
    device: dict
    depth: int
    max_rows: int


def _tree_shape(num_nodes: tuple[int, ...], par: np.ndarray, device: torch.device,
                capture: bool = False) -> _Shape:
    """The trees' structure from the node counts and the parents (cached: an engine's tree
    shapes repeat from step to step, their tokens do not). With ``capture`` (a call inside
    CUDA-graph capture, which cannot copy a new structure to the device) it must have been
    built by an earlier call on this device, on any stream (its copy to the device completed
    before that call went on), and it stays for the life of the process: the graph reads its
    device tensors at every replay, so they are never freed (nor reused by another stream).

    Raises:
        ValueError: a parent outside [0, own number - 1]; with ``capture``, a structure no
            earlier call on this device built.
    """
    device, stream = workspace.stream_key(device)
    key = (num_nodes, par.tobytes(), device, stream)
    with _SHAPES_LOCK:
        hit = _SHAPES.get(key)
        if hit is not None:
            _SHAPES.move_to_end(key)
        if capture:  # (the pinned copy first: it is what earlier graphs read)
            hit = _PINNED.get(key[:3], hit)
            if hit is None:  # (built on another stream: the capture's is a side stream)
                hit = next((v for k, v in _SHAPES.items() if k[:3] == key[:3]), None)
            if hit is not None:
                _PINNED[key[:3]] = hit
        if hit is not None:
            return hit
    if capture:
        raise ValueError("verify_tree() inside CUDA-graph capture needs the trees' structure "
                         "(num_nodes and parents) laid out by an earlier call outside capture "
                         "on this device (capture cannot copy it there): run one call with "
                         "this tree shape before capturing, as a warm-up")
    m = np.asarray(num_nodes, dtype=np.int64)
    n = m.shape[0]
    total = int(m.sum())
    node_start = np.concatenate([[0], np.cumsum(m)[:-1]]).astype(np.int64)
    row_start = node_start + np.arange(n, dtype=np.int64)
    node_req = np.repeat(np.arange(n, dtype=np.int64), m)
    node_num = np.arange(total, dtype=np.int64) - node_start[node_req] + 1  # 1..m_i
    bad = (par < 0) | (par >= node_num)
    if bad.any():
        g = int(np.flatnonzero(bad)[0])
        raise ValueError(f"parents[{g}] = {int(par[g])}: node {int(node_num[g])} of request "
                         f"{int(node_req[g])} must have a parent in [0, {int(node_num[g]) - 1}]"
                         " (nodes are numbered 1..m_i in topological order, 0 is the root)")
    rows = n + total
    row_req = np.repeat(np.arange(n, dtype=np.int64), m + 1)
    row_node = np.arange(rows, dtype=np.int64) - row_start[row_req]
    node_row = row_start[node_req] + node_num
    row_parent = np.full(rows, -1, dtype=np.int64)
    row_parent[node_row] = row_start[node_req] + par
    # Depth: parents come first, so one pass in node order (vectorised per relaxation round).
    depth = np.zeros(rows, dtype=np.int64)
    for _ in range(total):
        new = np.where(row_parent >= 0, depth[np.maximum(row_parent, 0)] + 1, 0)
        if np.array_equal(new, depth):
            break
        depth = new
    d_max = int(depth.max()) if rows else 0
    # Children in node-number order: nodes sorted by (parent row, row).
    order = np.lexsort((node_row, row_parent[node_row]))
    par_sorted = row_parent[node_row][order]
    first = np.searchsorted(par_sorted, par_sorted, side="left")
    rank = np.arange(total) - first
    width = int(rank.max()) + 1 if total else 0
    children = np.full((rows, width), -1, dtype=np.int64)
    children[par_sorted, rank] = node_row[order]
    # Root-to-node paths, level by level: a node's path is its parent's, then itself.
    path_rows = np.full((rows, d_max + 1), -1, dtype=np.int64)
    roots = np.flatnonzero(depth == 0)
    path_rows[roots, 0] = roots
    for d in range(1, d_max + 1):
        r = np.flatnonzero(depth == d)
        path_rows[r] = path_rows[row_parent[r]]
        path_rows[r, d] = r
    host = dict(row_req=row_req, row_node=row_node, row_depth=depth, row_parent=row_parent,
                row_start=row_start, children=children, path_rows=path_rows,
                node_row=node_row, node_req=node_req,
                draft_start=np.zeros(n, dtype=np.int64),
                k_given=np.full(n, d_max, dtype=np.int64))
    device_keys = [k for k in host if k not in ("node_row", "node_req")]
    # One copy for all of them, made on this stream like every later use; each starts on a
    # 16-byte boundary (Triton specialises pointers on it: no new kernel variant per shape).
    sizes = [host[k].size for k in device_keys]
    starts = np.concatenate([[0], np.cumsum([-(-z // 2) * 2 for z in sizes])]).astype(int)
    flat_host = np.zeros(int(starts[-1]), dtype=np.int64)
    for k, at, z in zip(device_keys, starts, sizes):
        flat_host[at:at + z] = host[k].reshape(-1)
    with torch.inference_mode(False):  # (normal tensors: later calls may run outside it)
        flat = torch.from_numpy(flat_host).to(device)
        dev = {k: flat[at:at + z].view(host[k].shape)
               for k, at, z in zip(device_keys, starts, sizes)}
    shape = _Shape(host=host, device=dev, depth=d_max, max_rows=int(m.max()) + 1 if n else 1)
    nbytes = 2 * sum(a.nbytes for a in host.values())
    with _SHAPES_LOCK:
        if nbytes <= SHAPE_CACHE_BYTES:
            _SHAPES[key] = shape
            _SHAPES_BYTES[key] = nbytes
            while len(_SHAPES) > SHAPE_CACHE_ENTRIES or (
                    sum(_SHAPES_BYTES.values()) > SHAPE_CACHE_BYTES):
                old = next(iter(_SHAPES))
                del _SHAPES[old], _SHAPES_BYTES[old]
    return shape


#: The tree structures kept (least recently used dropped first): at most this many, and at most
#: this many bytes (host and device copies together). A tree shape that repeats from step to
#: step (Medusa / EAGLE static trees, a fixed budget per request) stays; data-dependent shapes
#: (prompt-lookup tries) miss and cost what they did before. Per CUDA stream: calls on
#: another stream build their own (so no stream reads memory another stream's queue writes).
SHAPE_CACHE_ENTRIES = 8
SHAPE_CACHE_BYTES = 64 << 20
_SHAPES: collections.OrderedDict = collections.OrderedDict()
_SHAPES_BYTES: dict = {}
_SHAPES_LOCK = threading.Lock()
#: Structures a captured CUDA graph reads (a capture used them), by (num_nodes, parents,
#: device): never dropped, since freeing their device tensors would leave the graph reading
#: freed memory.
_PINNED: dict = {}


def clear_layout_cache() -> None:
    """Drop the kept tree structures (:data:`SHAPE_CACHE_ENTRIES`); they are rebuilt on use.
    Those a CUDA-graph capture used stay (the graph reads them at every replay)."""
    with _SHAPES_LOCK:
        _SHAPES.clear()
        _SHAPES_BYTES.clear()


def build_tree_layout(num_nodes: Sequence[int], parents, draft_token_ids,
                      device: torch.device, *, capture: bool = False) -> TreeLayout:
    """Check the trees and lay them out (:class:`TreeLayout`), on the host with numpy.

    ``num_nodes``: host tuple of m_i; ``parents`` / ``draft_token_ids``: [M] int64 numpy
    arrays or CPU tensors (node n of request i at index ``sum_{i' < i} m_i' + n - 1``). The
    structure (everything but the tokens) is kept for the next call with the same num_nodes
    and parents on ``device``; the tokens' part costs one host-to-device copy. With
    ``capture`` (CUDA-graph capture) ``draft_token_ids`` is a contiguous [M] int64 tensor on
    ``device``, not read: the layout holds it as ``node_token`` (``row_token`` and
    ``path_tokens`` None), the structure must be kept from an earlier call
    (:func:`_tree_shape`), and sibling tokens are checked by the Triton walk
    (ERR_TREE_SIBLINGS) instead of here.

    Raises:
        ValueError: a parent outside [0, own number - 1] (nodes must be numbered in
            topological order), or two children of one node with the same token (siblings
            must differ: the walk descends to *the* child holding the sampled token); with
            ``capture``, a structure no earlier call laid out.
    """
    par = np.asarray(parents, dtype=np.int64)
    device = torch.device(device)
    shape = _tree_shape(tuple(num_nodes), par, device, capture)
    d = shape.device
    if capture:
        return TreeLayout(row_req=d["row_req"], row_node=d["row_node"],
                          row_depth=d["row_depth"], row_token=None,
                          row_parent=d["row_parent"], row_start=d["row_start"],
                          children=d["children"], path_rows=d["path_rows"], path_tokens=None,
                          node_token=draft_token_ids, row_live=None, depth=shape.depth,
                          max_rows=shape.max_rows, draft_start=d["draft_start"],
                          k_given=d["k_given"])
    tok = np.asarray(draft_token_ids, dtype=np.int64)
    h = shape.host
    node_row, node_req = h["node_row"], h["node_req"]
    rows = h["row_req"].shape[0]
    row_token = np.full(rows, -1, dtype=np.int64)
    row_token[node_row] = tok
    # Siblings: nodes sorted by (parent row, token) must not repeat a pair (but placeholders).
    node_parent = h["row_parent"][node_row]
    order = np.lexsort((tok, node_parent))
    key_p, key_t = node_parent[order], tok[order]
    dup = (key_p[1:] == key_p[:-1]) & (key_t[1:] == key_t[:-1]) & (key_t[1:] != -1)
    if dup.any():
        g = int(order[np.flatnonzero(dup)[0] + 1])
        raise ValueError(f"request {int(node_req[g])}: two children of node {int(par[g])} hold "
                         f"the token {int(tok[g])} (siblings must have distinct tokens)")
    path_rows = h["path_rows"]
    on_path = path_rows[:, 1:] >= 0
    path_tokens = np.where(on_path, row_token[np.maximum(path_rows[:, 1:], 0)], -1)
    # One host-to-device copy for the token arrays; node_token and the children (kernel
    # arguments) start on 16-byte boundaries, as the structure's arrays do.
    parts = [row_token, tok, path_tokens.reshape(-1)]
    children = None
    if (tok == -1).any():
        # A node is pruned when it or a node above it holds the placeholder -1; the live
        # children first, in node-number order.
        row_live = ~(on_path & (path_tokens == -1)).any(axis=1)
        children = h["children"]
        pruned = (children >= 0) & ~row_live[np.maximum(children, 0)]
        keep = np.argsort(pruned | (children < 0), axis=1, kind="stable")
        children = np.take_along_axis(np.where(pruned, -1, children), keep, axis=1)
        parts += [children.reshape(-1), row_live.astype(np.int64)]
    starts = np.concatenate([[0], np.cumsum([-(-a.size // 2) * 2 for a in parts])])
    flat = np.full(int(starts[-1]), -1, dtype=np.int64)
    for a, at in zip(parts, starts):
        flat[at:at + a.size] = a
    flat = torch.from_numpy(flat).to(device)
    view = [flat[at:at + a.size] for a, at in zip(parts, starts)]
    return TreeLayout(row_req=d["row_req"], row_node=d["row_node"], row_depth=d["row_depth"],
                      row_token=view[0], row_parent=d["row_parent"],
                      row_start=d["row_start"],
                      children=d["children"] if children is None else view[3].view(
                          children.shape),
                      path_rows=d["path_rows"], node_token=view[1],
                      path_tokens=view[2].view(rows, shape.depth),
                      row_live=None if children is None else view[4] != 0,
                      depth=shape.depth, max_rows=shape.max_rows,
                      draft_start=d["draft_start"], k_given=d["k_given"])


@dataclasses.dataclass
class TreePlan(Plan):
    """A :class:`specsample.plan.Plan` whose rows are tree nodes, for the row processors of
    ``specsample.processing`` (which read ``row_req``, ``batch``, ``logits`` and
    :meth:`prior_draft_pairs`): ``row_j`` is the node's depth and the drafts a row counts are
    the tokens on its root-to-node path. Every row is live but those of pruned nodes
    (``TreeLayout.row_live``). Bad words and min_tokens are not
    read from here (their chain layout does not fit a tree): :func:`_apply_tree_bans` applies
    them."""

    tree: TreeLayout | None = None

    @property
    def row_live(self) -> torch.Tensor:
        if self.tree.row_live is not None:
            return self.tree.row_live
        return torch.ones(self.num_rows, dtype=torch.bool, device=self.logits.device)

    def rows_per_request(self) -> tuple[torch.Tensor, int]:
        """([N] int64 nodes of each request's tree, the most any has), its rows from
        ``row_start[i]`` (reads the largest on the host)."""
        n = torch.bincount(self.row_req, minlength=self.num_requests)
        return n, int(n.max()) if n.numel() else 0

    def prior_draft_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token) pairs: every node on a row's path (the node included, the root not).
        Tokens outside [0, V) are left out (their request is invalid: ERR_DRAFT_ID)."""
        toks = self.tree.path_tokens
        ok = (toks >= 0) & (toks < self.vocab_size)
        rows = torch.arange(toks.shape[0], device=toks.device)[:, None].expand_as(toks)
        return rows[ok], toks[ok]


def _tree_plan(logits: torch.Tensor, batch: SamplingBatch, positions: torch.Tensor,
               tree: TreeLayout, draft_probs: torch.Tensor | None = None) -> TreePlan:
    empty = tree.row_start[:0]
    return TreePlan(
        logits=logits, batch=batch, num_draft=None, max_k=tree.depth, method="token",
        positions=positions, draft_token_ids=empty, draft_logits=None,
        draft_probs=draft_probs, row_start=tree.row_start, draft_start=tree.draft_start,
        row_req=tree.row_req, row_j=tree.row_depth, draft_req=empty, draft_j=empty,
        k_given=tree.k_given, tree=tree)


def _tree_ban_pairs(plan: TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs that bad words and min_tokens ban at the tree's rows.

    As ``processing.ban_pairs`` (docs/semantics.md, "Bans") with the context of a row being
    ``context_tail`` of its request followed by the tokens on its root-to-node path, and the
    output count ``num_output + depth``."""
    batch, tree = plan.batch, plan.tree
    dev = plan.logits.device
    rows_all = torch.arange(plan.num_rows, device=dev)
    rows, toks = [], []
    if batch.bad_req.numel():
        width = batch.bad_prefix.shape[1]
        w_idx, r = (batch.bad_req[:, None] == tree.row_req[None, :]).nonzero(as_tuple=True)
        if width:
            seq = torch.cat([batch.context_tail[tree.row_req[r]], tree.path_tokens[r]], dim=1)
            at = tree.row_depth[r][:, None] + torch.arange(width, device=dev)
            prefix = batch.bad_prefix[w_idx]
            match = ((seq.gather(1, at) == prefix) | (prefix < 0)).all(-1)
            w_idx, r = w_idx[match], r[match]
        rows.append(r)
        toks.append(batch.bad_last[w_idx])
    if batch.stop_req.numel():
        s_idx, r = (batch.stop_req[:, None] == tree.row_req[None, :]).nonzero(as_tuple=True)
        req = batch.stop_req[s_idx]
        ok = outputs_before_row(plan, req, tree.row_depth[r]) < batch.min_tokens[req]
        rows.append(r[ok])
        toks.append(batch.stop_ids[s_idx][ok])
    if not rows:
        return rows_all[:0], rows_all[:0]
    return torch.cat(rows), torch.cat(toks)


def _apply_tree_bans(plan: TreePlan) -> torch.Tensor:
    """float32 [R, V] copy of the plan's logits with every banned token at -inf."""
    y = plan.logits.float().clone()
    rows, toks = _tree_ban_pairs(plan)
    y[rows, toks] = -math.inf
    if plan.batch.allowed_users:  # (allowed_token_ids: the rows of its requests, by slot)
        a_rows, slots = _allowed_rows(plan)
        y[a_rows] = torch.where(plan.batch.allowed_mask[slots], y[a_rows], -math.inf)
    return y


def _tree_errors(plan: TreePlan, draft_probs: torch.Tensor | None, row_max: torch.Tensor
                 ) -> torch.Tensor:
    """[N] int64 ERR_* bitmask: NaN / +inf target logits or rows without a finite logit (any
    live row), live node tokens outside [0, V), invalid draft_probs rows of nodes with live
    children. Pruned nodes (and those below them) are not read."""
    tree, n = plan.tree, plan.num_requests
    req = tree.row_req
    live = plan.row_live
    nan = (torch.isnan(row_max) | torch.isposinf(row_max)) & live
    err = _or_per_request(nan, req, n, torch_backend.ERR_LOGITS_NAN)
    err |= _or_per_request(torch.isneginf(row_max) & live, req, n,
                           torch_backend.ERR_LOGITS_NO_FINITE)
    is_node = (tree.row_parent >= 0) & live
    bad_id = is_node & ((tree.row_token < 0) | (tree.row_token >= plan.vocab_size))
    err |= _or_per_request(bad_id, req, n, torch_backend.ERR_DRAFT_ID)
    if draft_probs is not None:
        q = draft_probs
        bad = (~torch.isfinite(q) | (q < 0)).any(-1) | (q.float().sum(-1) <= 0)
        has_children = (tree.children[:, 0] >= 0) if tree.children.shape[1] else bad & False
        err |= _or_per_request(bad & has_children, req, n, torch_backend.ERR_DRAFT_ROW)
    return err


def _processed(plan: TreePlan) -> tuple[TreePlan, torch.Tensor, torch.Tensor, tuple]:
    """(the plan with invalid requests' rows sanitised, processed logits z' [R, V] float32,
    [N] int64 ERR_* bitmask, what z' is made of: ``processing.row_inputs``):
    ``torch_backend.processed_logits`` for tree rows."""
    batch, n = plan.batch, plan.num_requests
    row_max = plan.logits.amax(dim=-1)
    err = _tree_errors(plan, plan.draft_probs, row_max)
    invalid = err != 0
    dead = invalid[plan.row_req] | ~plan.row_live
    if bool(dead.any()):  # (pruned nodes' rows too: nothing reads their draws)
        clean = plan.logits.masked_fill(dead[:, None], 0.0)
        plan = dataclasses.replace(plan, logits=clean)
        row_max = clean.amax(dim=-1)  # (the sanitised rows': the filters read it)
    proc_plan = plan
    if batch.needs_bans:
        y = _apply_tree_bans(plan)
        emptied = torch.isneginf(y.amax(-1)) & ~dead
        err |= _or_per_request(emptied, plan.row_req, n, torch_backend.ERR_BANS)
        # The bans are in y: the processors must not apply chain-layout bans on top.
        proc_plan = dataclasses.replace(plan, logits=y,
                                        batch=dataclasses.replace(batch, needs_bans=False))
        row_max = None
    inputs = row_inputs(proc_plan, row_max=row_max)
    if batch.needs_bias or batch.needs_penalties:
        live = ~(err != 0)[plan.row_req] & plan.row_live
        # (the rows' maxima: z' has a non-finite maximum exactly when they do)
        err |= _or_per_request(~torch.isfinite(inputs[1]) & live, plan.row_req, n,
                               torch_backend.ERR_PROCESSED_OVERFLOW)
    if inputs[2] is not None:  # (no cut is searched for on the rows nobody reads)
        inputs[2].live = ~(err != 0)[plan.row_req] & plan.row_live
    z = process_rows(proc_plan, inputs=inputs)
    return plan, z, err, inputs


def _draft_rows(draft_probs: torch.Tensor, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """[len(rows), V] float32 drafter distributions of ``rows`` (0 beyond V')."""
    q = draft_probs[rows].float()
    pad = vocab - q.shape[1]
    return torch.nn.functional.pad(q, (0, pad)) if pad else q


def _walk_match(tree: TreeLayout, y: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """[N] final row of each request's sample-and-match walk from its root ``start``: descend
    while the row's target token ``y`` is one of its children's tokens. Every row's matching
    child is found at once (siblings hold distinct tokens: at most one), then the walk follows
    those links D times (few small launches: the host time of a device call)."""
    cur = start.clone()
    if not tree.children.shape[1]:
        return cur
    kids = tree.children
    match = (kids >= 0) & (tree.row_token[kids.clamp_min(0)] == y[:, None])
    first = kids.gather(1, match.to(torch.int64).argmax(1, keepdim=True)).squeeze(1)
    nxt = torch.where(match.any(1), first, -1)  # [R] the child holding y, -1 if none
    for _ in range(tree.depth):
        step = nxt[cur]
        cur = torch.where(step >= 0, step, cur)
    return cur


def _walk_rrs(plan: TreePlan, logp, y: torch.Tensor, draft_probs: torch.Tensor,
              req_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling (Jeon et al. 2024, Alg. 1) for requests ``req_idx``.

    ``logp(rows)``: the [len(rows), V] float32 processed log-distributions of target rows
    ``rows`` (-inf where a filter or ban dropped a token), from the backend that drew ``y``.

    Returns ([n] final row, [n] emitted token) of each of those requests. At the current node
    (depth d) child k (0-based, node-number order) is accepted iff
    ``U(seed, pos + d, k, STREAM_ACCEPT) q^k(c) < p^k(c)``; on rejection
    ``p <- norm(max(p - q, 0))`` (kept when that mass is 0) and ``q <- q`` without c,
    renormalised (all zeros when nothing is left). When every child is rejected the emitted
    token is a three-level Gumbel-max draw from ``max(p^m - q^m, 0)`` (STREAM_RESIDUAL* at
    pos + d; the row's target token ``y`` if that mass is 0); at a leaf it is ``y``.
    """
    tree, batch = plan.tree, plan.batch
    v = plan.vocab_size
    dev = y.device
    n = req_idx.shape[0]
    cur = tree.row_start[req_idx].clone()
    emitted = torch.full((n,), -1, dtype=torch.int64, device=dev)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    seed_lo, seed_hi = batch.seed_lo[req_idx], batch.seed_hi[req_idx]
    pos0 = plan.positions[req_idx]
    width = tree.children.shape[1]
    resid_rows, resid_w, resid_pos = [], [], []
    for d in range(tree.depth + 1):
        kids = tree.children[cur] if width else cur[:, None][:, :0]
        leaf = ~done & ((kids[:, 0] < 0) if width else torch.ones_like(done))
        emitted = torch.where(leaf, y[cur], emitted)
        done |= leaf
        if bool(done.all()):
            break
        lp = logp(cur)
        p = torch.exp(lp)
        q = _draft_rows(draft_probs, cur, v)
        nxt = torch.full_like(cur, -1)
        last_w = torch.zeros_like(p)
        for k in range(width):
            child = kids[:, k]
            live = ~done & (nxt < 0) & (child >= 0)
            if not bool(live.any()):
                break
            c = tree.row_token[child.clamp_min(0)].clamp(0, v - 1)[:, None]
            # (k = 0: verify()'s float32 operations, so a chain is verify(method="token"))
            p_c = (torch.exp(lp.gather(1, c)) if k == 0 else p.gather(1, c)).squeeze(1)
            q_c = q.gather(1, c).squeeze(1)
            u = rng.uniform(seed_lo, seed_hi, pos0 + d, torch.full_like(cur, k),
                            rng.STREAM_ACCEPT)
            acc = live & (u * q_c < p_c)
            nxt = torch.where(acc, child, nxt)
            rej = live & ~acc
            w = torch.clamp(p - q, min=0)
            last_w = torch.where(rej[:, None], w, last_w)
            s = w.sum(-1, keepdim=True)
            p = torch.where(rej[:, None] & (s > 0), w / torch.where(s > 0, s, 1.0), p)
            q = torch.where(rej[:, None], q.scatter(1, c, 0.0), q)
            t = q.sum(-1, keepdim=True)
            q = torch.where(rej[:, None] & (t > 0), q / torch.where(t > 0, t, 1.0), q)
        all_rejected = ~done & (nxt < 0)
        if bool(all_rejected.any()):
            idx = all_rejected.nonzero().squeeze(1)
            resid_rows.append(idx)
            resid_w.append(last_w[idx])
            resid_pos.append(pos0[idx] + d)
            # (y for now: the residual draws of every depth are made together below)
            emitted = torch.where(all_rejected, y[cur], emitted)
        done |= all_rejected
        cur = torch.where(done, cur, nxt)
    if resid_rows:
        idx = torch.cat(resid_rows)
        w = torch.cat(resid_w)
        res = torch_backend.tiled_gumbel_argmax(
            torch.log(w), None, seed_lo[idx], seed_hi[idx], torch.cat(resid_pos),
            rng.STREAM_RESIDUAL, rng.STREAM_RESIDUAL_TILE)
        emitted[idx] = torch.where(w.sum(-1) > 0, res, emitted[idx])
    return cur, emitted


def _run_tree(plan: TreePlan) -> tuple[TreeVerifyOutput, torch.Tensor]:
    """Verify every request's tree (module docstring; ``plan.draft_probs`` or None) on the
    PyTorch backend; returns the output and the [N] ERR_* bitmask."""
    batch, tree = plan.batch, plan.tree
    plan, z, err, inputs = _processed(plan)
    invalid = err != 0
    tile_lse, lse = torch_backend.processed_tile_logsumexp(z)
    req = tree.row_req
    greedy_req = batch.temperature == 0
    pos = plan.positions[req] + tree.row_depth
    if z.device.type == "cpu":  # (the CPU path's one draw: as sample() and verify() draw)
        y = torch_backend.sample_processed(*inputs, batch, req, pos)
    else:
        y = torch_backend.sample_rows(z, tile_lse, greedy_req[req], batch.seed_lo[req],
                                      batch.seed_hi[req], pos)
    final, emit = walk(plan, y, invalid, lambda r: z[r] - lse[r, None])
    processed = None
    if batch.max_logprobs >= 0:
        processed = torch_backend.processed_logprobs(plan, z, lse)

    return assemble_output(plan, final, emit, invalid, processed), err


def walk(plan: TreePlan, y: torch.Tensor, invalid: torch.Tensor, logp
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] final row, [N] emitted token) of every request's walk (both backends): the
    sample-and-match walk on the rows' target tokens ``y`` [R] int64, or with
    ``plan.draft_probs`` recursive rejection sampling (:func:`_walk_rrs`, ``logp`` the
    processed log-distributions of rows) for the sampled valid requests (host synchronisations:
    the walk checks which requests are still walking)."""
    tree = plan.tree
    final = _walk_match(tree, y, tree.row_start)
    emit = y[final]
    if plan.draft_probs is not None:
        use = ~(plan.batch.temperature == 0) & ~invalid
        if bool(use.any()):
            idx = use.nonzero().squeeze(1)
            f, e = _walk_rrs(plan, logp, y, plan.draft_probs, idx)
            final = final.clone()
            emit = emit.clone()
            final[idx], emit[idx] = f, e
    return final, emit


def assemble_output(plan: TreePlan, final: torch.Tensor, emit: torch.Tensor,
                    invalid: torch.Tensor, processed) -> TreeVerifyOutput:
    """The :class:`TreeVerifyOutput` of a finished walk (both backends).

    ``final`` [N] int64: the row where each request's walk stopped; ``emit`` [N] int64: the
    token emitted there (correction or bonus); ``invalid`` [N] bool; ``processed``: None
    without logprobs, else the ``processed_logprobs`` callable of
    ``torch_backend.emitted_logprobs`` over the plan's rows."""
    tree = plan.tree
    dev = plan.logits.device
    d = tree.depth
    num_accepted = torch.where(invalid, 0, tree.row_depth[final])
    path = tree.path_rows[final]  # [N, D + 1]
    j = torch.arange(d + 1, device=dev)
    on_path = (j[None, :] <= num_accepted[:, None]) & ~invalid[:, None]
    path_tok = torch.nn.functional.pad(tree.row_token[path[:, 1:].clamp_min(0)], (0, 1),
                                       value=-1)  # depth j + 1 at column j
    token_ids = torch.where(j < num_accepted[:, None], path_tok,
                            torch.where(j == num_accepted[:, None], emit[:, None], -1))
    token_ids = torch.where(invalid[:, None], -1, token_ids)
    node_ids = tree.row_node[path[:, 1:].clamp_min(0)]
    accepted_node_ids = torch.where(on_path[:, 1:], node_ids, -1)
    logprobs = logprob_ids = None
    if processed is not None:
        rows = torch.where(on_path, path, tree.row_start[:, None]).clamp_min(0)
        logprobs, logprob_ids = torch_backend.emitted_logprobs(plan, processed, rows,
                                                               token_ids, on_path)
    return TreeVerifyOutput(token_ids=token_ids, num_accepted=num_accepted,
                            accepted_node_ids=accepted_node_ids, logprobs=logprobs,
                            logprob_token_ids=logprob_ids, invalid=invalid)


def _check_capturable(batch: SamplingBatch, device: torch.device, num_nodes, parents,
                      draft_probs, positions) -> None:
    """ValueError naming what keeps a verify_tree() call from CUDA-graph capture (the call
    must take the Triton walk, ``triton.verify_tree.walk``, which has no host work after the
    layout; the structure is fixed at capture, so it is host data)."""
    if api.select_backend(device) != "triton":
        raise ValueError("verify_tree() inside CUDA-graph capture runs on the Triton backend "
                         f"only (this call would take the {api.select_backend(device)} one)")
    why = [what for what, bad in (
        ("draft_probs (recursive rejection sampling walks on the host)",
         draft_probs is not None),
        ("logprobs", batch.max_logprobs >= 0),
        ("logit_bias, penalties or bans (the general path)", batch.needs_general_path)) if bad]
    if why:
        raise ValueError("verify_tree() inside CUDA-graph capture walks deterministic trees "
                         "without logprobs on the device; this call sets " + ", ".join(why))
    for name, value in (("num_nodes", num_nodes), ("parents", parents)):
        if isinstance(value, torch.Tensor) and value.device.type != "cpu":
            raise ValueError(f"verify_tree() inside CUDA-graph capture needs {name} as host "
                             f"data (a list or a CPU tensor), got a tensor on {value.device}: "
                             "the trees' structure is fixed when the graph is captured")
    if positions is not None and not (isinstance(positions, torch.Tensor)
                                      and positions.device == device):
        raise ValueError("verify_tree() inside CUDA-graph capture needs positions as a tensor "
                         f"on {device} (or None), so that a replay reads its current values")


def _device_tokens(t, m: int, device: torch.device) -> torch.Tensor:
    """The node tokens of a captured call: a [m] integer tensor on ``device``, not read on the
    host (checked by the walk kernel), as a contiguous int64 tensor on a 16-byte boundary."""
    if not isinstance(t, torch.Tensor) or t.device != device:
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"verify_tree() inside CUDA-graph capture needs draft_token_ids as a "
                         f"tensor on {device} (a replay reads its current values), got {where}")
    _check_int_tensor("draft_token_ids", t, m)
    if t.dtype != torch.int64 or not t.is_contiguous() or t.data_ptr() % 16:
        t = t.to(torch.int64, copy=True, memory_format=torch.contiguous_format)
    return t


def verify_tree(target_logits: torch.Tensor, draft_token_ids, parents, num_nodes,
                batch: SamplingBatch, *, draft_probs: torch.Tensor | None = None,
                positions=None, strict: bool = True) -> TreeVerifyOutput:
    """Verify token trees against the target; the emitted tokens follow the target exactly.

    Args:
        target_logits: [N + M, V] float32 / float16 / bfloat16 raw target logits,
            M = sum num_nodes; request i owns the m_i + 1 contiguous rows of its root (node 0)
            and its nodes 1..m_i in order: row n is the target's distribution of the token
            after node n.
        draft_token_ids: [M] int64 (tensor or list): each node's token, request by request,
            node 1..m_i. Siblings must hold distinct tokens. The placeholder -1 prunes a
            node: it and the nodes below it behave as if absent (not read or checked).
        parents: [M] int64 (tensor or list): the parent of each node, a node number in
            [0, own number - 1] (0: the root), so nodes are numbered in topological order.
        num_nodes: [N] ints >= 0 (list or integer tensor): m_i, the nodes of request i's tree.
        batch: SamplingBatch of the N requests.
        draft_probs: None (a tree chosen without looking at the target's randomness: verified
            by sampling each node's row with ``sample()``'s noise and descending while the
            sample is a child), or [N + M, V'] float (V' <= V): row n is the drafter's
            distribution at node n, from which node n's children were drawn without
            replacement in node-number order (recursive rejection sampling, Jeon et al.
            2024, arXiv 2402.14160). Rows of leaves are not read.
        positions: [N] int64 absolute position of the token after the root (a node at depth
            d decides position ``positions[i] + d``). Required with user seeds; None as in
            :func:`specsample.sample` (the batch's ``fresh_counter``, advanced by 1).
        strict: raise SamplingError for invalid data (with False: ``invalid`` flags, ids -1).

    Returns:
        TreeVerifyOutput: token_ids [N, D + 1] int64 (the accepted path's tokens, then the
        correction or bonus token, then -1; D the deepest node's depth in the batch),
        num_accepted [N] int64 (the accepted path's length), accepted_node_ids [N, D] int64
        (node numbers of the accepted path, -1 padded), logprobs / logprob_token_ids
        [N, D + 1, 1 + n] or None, invalid [N] bool.

    The tree layout is read on the host (one synchronisation for device tensors), except
    under CUDA-graph capture (strict=False, Triton backend): there a deterministic tree
    without logprobs, bias, penalties or bans (the ``triton.verify_tree.walk`` path) is
    captured with its structure (``num_nodes``, ``parents``: host data, laid out by an
    earlier call outside capture on the same device, and kept for the life of the process)
    and its tokens as a device tensor that each replay reads afresh; two siblings with the
    same token then flag the request invalid (ERR_TREE_SIBLINGS) instead of raising. Backends
    (``api.select_backend``): on the Triton backend the kernels draw every node row and walk
    deterministic trees without logprobs (``triton.verify_tree.walk``); other walks are
    PyTorch's (paths ``triton.verify_tree.fused`` / ``.filtered`` / ``.general``,
    ``triton.verify_tree.draft_probs.*`` with draft_probs; ``specsample.triton_backend.tree``);
    on the PyTorch backend ``torch.verify_tree.onehot`` / ``torch.verify_tree.draft_probs``.

    Raises:
        ValueError: wrong types, shapes, dtypes or devices; a num_nodes entry < 0; a parent
            outside [0, own number - 1]; two siblings with the same token; missing positions
            with user seeds.
        SamplingError: with strict=True, invalid data: NaN / +inf target logits or a row with
            no finite logit (any node's row), a node token outside [0, V), an invalid
            draft_probs row of a node with children, bans that leave no token, logit_bias or
            penalties that overflow.
        ValueError inside CUDA-graph capture: strict=True, the PyTorch backend, draft_probs,
            logprobs, bias / penalties / bans, num_nodes or parents on the device, tokens or
            positions not on the logits' device, a tree structure no earlier call laid out.
    """
    with api._current_device(target_logits):
        return _verify_tree(target_logits, draft_token_ids, parents, num_nodes, batch,
                            draft_probs, positions, strict)


def _verify_tree(target_logits, draft_token_ids, parents, num_nodes, batch, draft_probs,
                 positions, strict) -> TreeVerifyOutput:
    """:func:`verify_tree` with the logits' device current."""
    api._check_not_capturing(strict, "verify_tree")
    api._check_batch(batch)
    capture = api._capturing()
    n = batch.num_requests
    _check_float_matrix("target_logits", target_logits)
    if target_logits.shape[1] != batch.vocab_size:
        raise ValueError(f"target_logits have {target_logits.shape[1]} columns but the batch "
                         f"was built for vocab_size={batch.vocab_size}")
    device = target_logits.device
    _check_batch_device("target_logits", device, batch)
    if capture:
        _check_capturable(batch, device, num_nodes, parents, draft_probs, positions)
    m = _num_nodes_tuple(num_nodes, n)
    total = sum(m)
    if target_logits.shape[0] != n + total:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows; expected N + "
                         f"sum(num_nodes) = {n} + {total} = {n + total}")
    if capture:
        tokens = _device_tokens(draft_token_ids, total, device)
    else:
        tokens = _int_vector("draft_token_ids", draft_token_ids, total)
    par = _int_vector("parents", parents, total)
    if draft_probs is not None:
        _check_float_matrix("draft_probs", draft_probs)
        if draft_probs.shape[0] != n + total:
            raise ValueError(f"draft_probs has {draft_probs.shape[0]} rows; expected one per "
                             f"row of target_logits ({n + total})")
        if not 1 <= draft_probs.shape[1] <= target_logits.shape[1]:
            raise ValueError(f"draft_probs has {draft_probs.shape[1]} columns; the draft "
                             f"vocabulary must be 1..{target_logits.shape[1]} (the target's)")
        if draft_probs.device != device:
            raise ValueError(f"draft_probs is on {draft_probs.device} but target_logits on "
                             f"{device}")
    if capture:
        # (first: the structure is pinned once laid out, so nothing after may raise; a
        # captured counter advance runs only at replays)
        pos = _positions(positions, batch, n, device)
        tree = build_tree_layout(m, par, tokens, device, capture=True)
    else:
        tree = build_tree_layout(m, par, tokens, device)
        pos = _positions(positions, batch, n, device)  # last: positions=None advances a counter
    plan = _tree_plan(target_logits, batch, pos, tree, draft_probs)
    # Recorded before running, so that a forbidden path raises before doing any work.
    if api.select_backend(device) == "triton":
        from .triton_backend import tree as triton_tree

        kind = ("" if draft_probs is None else "draft_probs.") + triton_tree.path_kind(batch)
        paths.record(f"triton.verify_tree.{kind}", n + total)
        with workspace.call(plan.logits.device):
            out, err = triton_tree.run_tree(plan)
    else:
        kind = "onehot" if draft_probs is None else "draft_probs"
        paths.record(f"torch.verify_tree.{kind}", n + total)
        out, err = _run_tree(plan)
    n_greedy = batch.num_greedy
    if n_greedy:
        paths.record("requests.greedy", n_greedy)
    if n_greedy < n:
        paths.record("requests.sampled", n - n_greedy)
    if strict and bool((err != 0).any()):
        codes = err.tolist()
        raise SamplingError([i for i, c in enumerate(codes) if c],
                            torch_backend.describe_errors(codes))
    return out
