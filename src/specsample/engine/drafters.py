"""Drafters: where the draft tokens of a speculative step come from.

* :class:`NgramDrafter` (``"ngram"``): prompt lookup. Find the most recent earlier occurrence of
  the last n tokens (n from ``max_n`` down to ``min_n``) and propose up to k of the tokens that
  followed it. One-hot drafts (``draft_logits`` is None), so verification is sample-and-match
  and a seeded request emits exactly what plain decoding emits (API.md guarantee 4).
* :class:`ModelDrafter` (``"model"``): a second (small) transformers causal LM. Each draft is
  sampled from ``softmax(draft_logits / temperature)`` of the request, or, when the request
  has top_k / top_p / min_p, from that distribution after the same filters
  (``specsample.probs``), with the exact three-level Gumbel-max draw on the drafter's own
  streams ``rng.draft_streams(j)``, keyed by the request's seed, the draft's absolute position
  and its index j in the window; greedy requests take the argmax. Its raw logits go to
  ``verify()`` as ``draft_logits``, or its filtered distributions as ``draft_probs``.
* :class:`NoDrafter` (``"none"``): no drafts; the engine decodes through ``sample()``.

Tree drafters (``--tree``; verified by ``specsample.verify_tree`` with ``draft_probs=None``, so
each tree is a deterministic function of the context, chosen without the target's randomness):

* :class:`NgramTreeDrafter` (``"ngram"``): every earlier occurrence of the context's suffix
  (each end position once, with its longest matching suffix), each continuation up to the
  speculative depth, merged into a trie; the node budget goes to the best-supported nodes.
* :class:`ModelTreeDrafter` (``"model"``): best-first expansion of the draft model's top-b
  tokens per node by cumulative draft log-probability, one draft forward per level.

A drafter sees one request at a time through :meth:`Drafter.propose` (chains) or
:meth:`Drafter.propose_tree` (trees).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .. import rng
from ..api import probs
from ..params import SamplingBatch, SamplingParams
from ..torch_backend import tiled_gumbel_argmax
from .cache import ModelCache

DRAFTERS = ("ngram", "model", "none")


@dataclass
class Draft:
    """The proposal of one request for one step.

    Attributes:
        token_ids: up to k draft ids (may be empty).
        logits: ``[len(token_ids), V']`` float32 raw drafter logits, or None for one-hot drafts.
        probs: ``[len(token_ids), V']`` float32, the distributions the drafts were drawn from
            when the request's filters (top_k / top_p / min_p) shaped them (verify() then
            needs ``draft_probs``); None when ``softmax(logits / temperature)`` is that
            distribution.
    """

    token_ids: list[int]
    logits: torch.Tensor | None = None
    probs: torch.Tensor | None = None

    def distribution(self, temperature: float) -> torch.Tensor:
        """``[len(token_ids), V']`` float32: the distributions the drafts were drawn from,
        ``probs`` or ``softmax(logits / temperature)`` (temperature 1 when greedy, as
        verify() reads ``draft_logits``), for verify()'s ``draft_probs``."""
        if self.probs is not None:
            return self.probs
        t = max(temperature, 2.0**-126) if temperature > 0 else 1.0  # as the batch clamps T
        z = self.logits.float()
        return torch.softmax((z - z.amax(-1, keepdim=True)) / t, dim=-1)


@dataclass
class TreeDraft:
    """The token tree of one request for one step (verify_tree's layout for one request).

    Attributes:
        token_ids: the tokens of nodes 1..m (node 0, the root, is the last committed token).
        parents: each node's parent, a node number in ``[0, own number - 1]`` (0: the root),
            so nodes are numbered in topological order; siblings hold distinct tokens.
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    @property
    def depths(self) -> list[int]:
        """Depth of nodes 1..m (children of the root: 1)."""
        depth = [0]
        for p in self.parents:
            depth.append(depth[p] + 1)
        return depth[1:]

    def check(self, max_depth: int, max_nodes: int) -> None:
        """Raise RuntimeError when the tree is malformed or exceeds ``max_depth`` /
        ``max_nodes`` (a drafter bug: the message names what is wrong)."""
        m = len(self.token_ids)
        if len(self.parents) != m:
            raise RuntimeError(f"tree draft with {m} tokens but {len(self.parents)} parents")
        if m > max_nodes:
            raise RuntimeError(f"tree draft of {m} nodes, more than the budget {max_nodes}")
        seen = set()
        for n, (p, t) in enumerate(zip(self.parents, self.token_ids, strict=True), start=1):
            if not 0 <= p < n:
                raise RuntimeError(f"tree draft node {n} has parent {p} (must be in [0, {n - 1}])")
            if (p, t) in seen:
                raise RuntimeError(f"tree draft: two children of node {p} hold token {t}")
            seen.add((p, t))
        if m and max(self.depths) > max_depth:
            raise RuntimeError(f"tree draft of depth {max(self.depths)}, deeper than {max_depth}")


@dataclass
class DraftContext:
    """What a drafter knows about a request when proposing.

    Attributes:
        index: the request's index in the ``generate()`` call.
        tokens: the committed sequence (prompt + generated ids); the first draft is for
            absolute position ``len(tokens)``.
        k: the most drafts the engine will verify this step (>= 1).
        temperature: the request's temperature (0 = greedy).
        seed_lo, seed_hi: the request's Philox key words (``SamplingBatch.seed_lo[i]`` /
            ``seed_hi[i]``).
        params: the request's ``SamplingParams`` (a sampling drafter applies its top_k /
            top_p / min_p), or None (temperature only).
    """

    index: int
    tokens: Sequence[int]
    k: int
    temperature: float
    seed_lo: int
    seed_hi: int
    params: SamplingParams | None = None


class Drafter:
    """Base class. Subclasses implement :meth:`propose`.

    Attributes:
        name: ``"ngram"``, ``"model"`` or ``"none"``.
        gives_logits: True when drafts carry ``draft_logits`` (a sampling drafter).
        speculative: False only for the ``none`` drafter.
    """

    name = "base"
    gives_logits = False
    speculative = True

    def start(self, num_requests: int) -> None:
        """Reset per-request state before a ``generate()`` call of ``num_requests`` requests."""

    def propose(self, ctx: DraftContext) -> Draft:
        """Return up to ``ctx.k`` drafts for request ``ctx.index``."""
        raise NotImplementedError

    def propose_tree(self, ctx: DraftContext, max_nodes: int) -> TreeDraft:
        """Return a token tree of depth <= ``ctx.k`` and at most ``max_nodes`` nodes for
        request ``ctx.index`` (tree drafters only)."""
        raise NotImplementedError(f"drafter {self.name!r} does not propose trees")


class NoDrafter(Drafter):
    """No speculation: plain decoding through ``sample()``."""

    name = "none"
    speculative = False

    def propose(self, ctx: DraftContext) -> Draft:
        return Draft([])


class NgramDrafter(Drafter):
    """Prompt lookup (n-gram) drafting over the request's own prompt and output.

    Args:
        max_n: longest suffix to match (tried first).
        min_n: shortest suffix to match.

    Raises:
        ValueError: ``min_n < 1`` or ``max_n < min_n``.
    """

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"ngram sizes need 1 <= min_n <= max_n, got min_n={min_n}, "
                             f"max_n={max_n}")
        self.max_n = max_n
        self.min_n = min_n

    def propose(self, ctx: DraftContext) -> Draft:
        return Draft(ngram_lookup(ctx.tokens, ctx.k, self.max_n, self.min_n))


def ngram_lookup(tokens: Sequence[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup: the up-to-k tokens that followed the most recent earlier occurrence of the
    longest matching suffix of ``tokens`` (suffix lengths ``max_n`` down to ``min_n``).

    Returns ``[]`` when nothing matches (for example a sequence shorter than ``min_n + 1``).
    """
    length = len(tokens)
    if k <= 0 or length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n:]
        # Candidate starts s with s + n <= length - 1 (at least one following token, and the
        # occurrence is strictly earlier than the suffix itself).
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            s = int(hits[-1]) + n
            return [int(t) for t in arr[s: s + k]]
    return []


class ModelDrafter(Drafter):
    """A small causal LM as drafter (shares the target's tokenizer).

    Args:
        model: a transformers causal LM whose logits width V' is at most the target's V.

    The drafter keeps one KV cache per request and rolls it back lazily: at each proposal it
    keeps the longest prefix of its cache that agrees with the committed sequence.
    """

    name = "model"
    gives_logits = True

    def __init__(self, model: Any) -> None:
        self.model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.caches: list[ModelCache] = []
        self._known: list[int] = []

    def start(self, num_requests: int) -> None:
        self.caches = [ModelCache(self.model) for _ in range(num_requests)]
        self._known = [0] * num_requests

    def _feed_context(self, ctx: DraftContext) -> tuple[ModelCache, torch.Tensor]:
        """Bring the request's draft cache to the committed sequence (keeping the longest
        prefix that agrees with it); returns the cache and the drafter's logits [V'] for
        the token at position ``len(ctx.tokens)``."""
        cache = self.caches[ctx.index]
        tokens = ctx.tokens
        keep = cache.common_prefix(tokens, self._known[ctx.index])
        keep = min(keep, len(tokens) - 1)  # the last committed token is always fed
        cache.crop(keep)
        self._known[ctx.index] = len(tokens)
        return cache, cache.forward(list(tokens[keep:]), logits_to_keep=1)[-1]

    def propose(self, ctx: DraftContext) -> Draft:
        cache, logits = self._feed_context(ctx)
        tokens = ctx.tokens
        filters = self._filters(ctx, logits.device)
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        position = len(tokens)
        for j in range(ctx.k):
            if j > 0:
                logits = cache.forward([drafts[-1]], logits_to_keep=1)[-1]
            rows.append(logits)
            if filters is None:
                drafts.append(self.sample(logits, ctx, position + j, j))
            else:
                dists.append(probs(logits.float()[None], filters)[0])
                drafts.append(self.sample(torch.log(dists[-1]), ctx, position + j, j,
                                          normalised=True))
        return Draft(drafts, torch.stack(rows), torch.stack(dists) if dists else None)

    def _filters(self, ctx: DraftContext, device: torch.device) -> SamplingBatch | None:
        """A one-request batch with the request's temperature and filters (nothing else), or
        None when the request samples without filters (or greedily)."""
        p = ctx.params
        if p is None or p.greedy or not (p.top_k not in (0, -1) or p.top_p < 1 or p.min_p > 0):
            return None
        filtered = SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                  min_p=p.min_p, seed=0)  # no seed drawn from torch's generator
        return SamplingBatch.from_params([filtered], vocab_size=self.vocab_size, device=device)

    def sample(self, logits: torch.Tensor, ctx: DraftContext, position: int, j: int, *,
               normalised: bool = False) -> int:
        """Draw draft ``j`` of the window from ``softmax(logits / temperature)`` (argmax when
        greedy): the exact three-level Gumbel-max draw of ``torch_backend.tiled_gumbel_argmax``
        on the drafter's own streams ``rng.draft_streams(j)`` at the drafted position.
        ``normalised``: ``logits`` are already the log of the distribution to draw from (log
        of ``specsample.probs``, -inf for filtered tokens); no temperature is applied."""
        if ctx.temperature == 0.0:
            return int(torch.argmax(logits))
        dev = logits.device
        z = logits.float()[None]
        if not normalised:
            z = (z - z.max()) / max(ctx.temperature, 2.0**-126)  # as the batch clamps T

        def key(value: int) -> torch.Tensor:
            return torch.tensor([value], dtype=torch.int64, device=dev)

        token_stream, tile_stream = rng.draft_streams(j)
        return int(tiled_gumbel_argmax(z, None, key(ctx.seed_lo), key(ctx.seed_hi),
                                       key(position), token_stream, tile_stream)[0])


def ngram_tree(tokens: Sequence[int], depth: int, max_nodes: int, max_n: int, min_n: int, *,
               branching: int | None = None, max_matches: int = 64) -> TreeDraft:
    """Prompt lookup as a token tree: the continuations of every earlier occurrence of the
    context's suffix, merged into a trie, pruned to ``max_nodes`` nodes.

    Each earlier end position e of a suffix of ``tokens`` (suffix lengths ``max_n`` down to
    ``min_n``; e <= len(tokens) - 1) is one match, with its longest matching suffix length n;
    its continuation is ``tokens[e : e + depth]``. The ``max_matches`` best matches (longest n
    first, then most recent) are merged into a trie; a trie node's support is (the longest n
    of the matches through it, how many matches of that n pass through it, the most recent of
    them). Nodes are taken best-supported first (a node always after its parent: support never
    grows along a path), at most ``branching`` children per node (None: no limit), until
    ``max_nodes`` nodes. Numbered in the order taken, so parents come first; siblings are
    distinct (a trie). With a single match this is :func:`ngram_lookup`'s chain.

    Returns:
        :class:`TreeDraft` (empty when nothing matches, e.g. a sequence shorter than
        ``min_n + 1``, or ``depth`` / ``max_nodes`` < 1).
    """
    length = len(tokens)
    if depth <= 0 or max_nodes <= 0 or length < min_n + 1:
        return TreeDraft()
    arr = np.asarray(tokens, dtype=np.int64)
    found: dict[int, int] = {}  # end position -> longest matching suffix length
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[: length - 1], n)
        for s in np.flatnonzero((windows == arr[length - n:]).all(axis=1)).tolist():
            found.setdefault(s + n, n)
    matches = sorted(found.items(), key=lambda e: (-e[1], -e[0]))[:max_matches]
    # Trie node i: children {token: id}, support [n, count, most recent end], depth, token,
    # parent (node 0 is the root).
    children: list[dict[int, int]] = [{}]
    support: list[list[int]] = [[0, 0, 0]]
    info: list[tuple[int, int, int]] = [(0, -1, -1)]
    for end, n in matches:  # longest n first, then most recent: the first sets n and recency
        cur = 0
        for d, t in enumerate(arr[end: end + depth].tolist(), start=1):
            nxt = children[cur].get(t)
            if nxt is None:
                nxt = len(info)
                children[cur][t] = nxt
                children.append({})
                support.append([n, 0, end])
                info.append((d, t, cur))
            if support[nxt][0] == n:
                support[nxt][1] += 1
            cur = nxt

    def key(i: int) -> tuple:
        n, count, recent = support[i]
        return (-n, -count, -recent, info[i][0], info[i][1], i)

    heap = [key(c) for c in children[0].values()]
    heapq.heapify(heap)
    number = {0: 0}
    kids = [0] * len(info)
    tree = TreeDraft()
    while heap and len(tree.token_ids) < max_nodes:
        i = heapq.heappop(heap)[-1]
        parent = info[i][2]
        if branching is not None and kids[parent] >= branching:
            continue
        kids[parent] += 1
        tree.token_ids.append(info[i][1])
        tree.parents.append(number[parent])
        number[i] = len(tree.token_ids)
        for c in children[i].values():
            heapq.heappush(heap, key(c))
    return tree


class NgramTreeDrafter(NgramDrafter):
    """Prompt lookup proposing token trees (:func:`ngram_tree`); ``--tree --drafter ngram``.

    Args:
        max_n, min_n: suffix lengths (as :class:`NgramDrafter`).
        branching: the most children of one node (None: no limit).

    Raises:
        ValueError: bad suffix lengths, ``branching < 1``.
    """

    def __init__(self, max_n: int = 3, min_n: int = 1, branching: int | None = None) -> None:
        super().__init__(max_n, min_n)
        if branching is not None and branching < 1:
            raise ValueError(f"branching must be >= 1, got {branching}")
        self.branching = branching

    def propose_tree(self, ctx: DraftContext, max_nodes: int) -> TreeDraft:
        return ngram_tree(ctx.tokens, ctx.k, max_nodes, self.max_n, self.min_n,
                          branching=self.branching)


@dataclass
class _Candidate:
    score: float     # cumulative draft log-probability of the root-to-node path
    depth: int
    token: int
    parent: int      # index of the parent candidate, -1 for a child of the root


class ModelTreeDrafter(ModelDrafter):
    """A draft model proposing token trees: best-first top-b expansion; ``--tree --drafter
    model``.

    The root's top-``branching`` tokens by draft logit are the first candidates, scored by
    their draft log-probability (log_softmax of the logits / temperature; temperature 1 for
    greedy requests). Each round, every candidate among the current best ``max_nodes`` (by
    cumulative log-probability, shallower first on ties) that has not been expanded yet and
    is shallower than the depth k is expanded: one draft forward for all of them (a tree
    forward over the drafter's cache), adding each one's top-``branching`` children. After at
    most k - 1 rounds the best ``max_nodes`` candidates are the tree (a child never ranks
    above its parent). The tree depends only on the context and the draft model, never on
    any random draw, so verify_tree checks it with ``draft_probs=None``. With
    ``branching=1`` and ``max_nodes = k`` it is the drafter's greedy chain.

    Args:
        model: the draft transformers causal LM (V' <= the target's V).
        branching: b, the most children of one node (top-b tokens).

    Raises:
        ValueError: ``branching < 1``.
    """

    gives_logits = False  # trees are deterministic: verified without draft distributions

    def __init__(self, model: Any, branching: int = 4) -> None:
        super().__init__(model)
        if branching < 1:
            raise ValueError(f"branching must be >= 1, got {branching}")
        self.branching = branching

    def propose(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError("ModelTreeDrafter proposes trees (propose_tree)")

    def propose_tree(self, ctx: DraftContext, max_nodes: int) -> TreeDraft:
        cache, logits = self._feed_context(ctx)
        base = len(ctx.tokens)
        t = ctx.temperature if ctx.temperature > 0 else 1.0
        pool: list[_Candidate] = []

        def expand(row: torch.Tensor, parent: int, depth: int, score: float) -> None:
            logp = torch.log_softmax(row.double() / t, dim=-1)
            vals, ids = torch.topk(logp, min(self.branching, logp.shape[-1]))
            pool.extend(_Candidate(score + float(v), depth + 1, int(i), parent)
                        for v, i in zip(vals.tolist(), ids.tolist(), strict=True))

        def best() -> list[int]:
            order = sorted(range(len(pool)), key=lambda i: (-pool[i].score, pool[i].depth, i))
            return order[:max_nodes]

        if ctx.k >= 1 and max_nodes >= 1:
            expand(logits, -1, 0, 0.0)
        entry: dict[int, int] = {}  # candidate -> its entry in the draft cache's tree
        try:
            for _ in range(ctx.k - 1):
                todo = sorted(i for i in best() if i not in entry and pool[i].depth < ctx.k)
                if not todo:
                    break
                parents = [entry.get(pool[i].parent, -1) for i in todo]
                rows = cache.forward_tree([pool[i].token for i in todo], parents,
                                          tree_start=base)
                for r, i in enumerate(todo):
                    entry[i] = len(entry)
                    expand(rows[r], i, pool[i].depth, pool[i].score)
        finally:
            cache.crop(base)  # the committed sequence only (the tree's entries are dropped)
        chosen = sorted(best(), key=lambda i: (pool[i].depth, i))
        number = {-1: 0}
        tree = TreeDraft()
        for i in chosen:
            tree.token_ids.append(pool[i].token)
            tree.parents.append(number[pool[i].parent])
            number[i] = len(tree.token_ids)
        return tree


def make_drafter(name: str, *, draft_model: Any = None, ngram_max: int = 3,
                 ngram_min: int = 1, tree: bool = False,
                 tree_branching: int | None = None) -> Drafter:
    """Build a drafter by name.

    Args:
        name: ``"ngram"``, ``"model"`` or ``"none"``.
        draft_model: the transformers model for ``"model"`` (required there).
        ngram_max, ngram_min: suffix lengths for ``"ngram"``.
        tree: a tree drafter (:class:`NgramTreeDrafter` / :class:`ModelTreeDrafter`).
        tree_branching: the most children of one tree node (None: no limit for ``ngram``,
            4 for ``model``).

    Raises:
        ValueError: an unknown name, ``"model"`` without a draft model, ``tree`` with
            ``"none"``, or ``tree_branching < 1``.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
    if name == "model" and draft_model is None:
        raise ValueError("drafter 'model' needs a draft model (--draft-model PATH)")
    if tree:
        if name == "none":
            raise ValueError("tree speculation needs a drafter ('ngram' or 'model'), not 'none'")
        if name == "ngram":
            return NgramTreeDrafter(ngram_max, ngram_min, tree_branching)
        return ModelTreeDrafter(draft_model, 4 if tree_branching is None else tree_branching)
    if name == "ngram":
        return NgramDrafter(ngram_max, ngram_min)
    if name == "none":
        return NoDrafter()
    return ModelDrafter(draft_model)
