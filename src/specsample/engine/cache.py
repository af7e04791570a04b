"""A per-request KV cache over a transformers causal LM, with rollback and token trees.

One :class:`ModelCache` holds one sequence's keys and values (batch size 1). The engine keeps
one per request and per model, so requests of different lengths need no padding and rollback is
a plain crop.

Token trees (``--tree``): :meth:`ModelCache.forward_tree` feeds the nodes of a tree after a
committed prefix in one forward, with explicit position ids (prefix length + depth) and a
custom 4D attention mask (each node sees the prefix, its ancestors and itself), and
:meth:`ModelCache.keep_tree_path` then compacts the cache to the prefix plus one root-to-node
path, in order: the keys and values of that path were computed at the positions and with the
context a chain forward of the same tokens would have given them. This needs a model whose
forward takes a prepared 4D mask (transformers' Llama-family models with ``eager`` or ``sdpa``
attention) and a ``DynamicCache`` of full-attention layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch


def _cache_kwarg(model: Any) -> str:
    """Name of the forward's KV-cache argument: ``cache`` (transformers >= 5.2x) or the older
    ``past_key_values``."""
    try:
        params = inspect.signature(type(model).forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _new_dynamic_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


class ModelCache:
    """The KV cache of one sequence for one model, plus the token ids it holds.

    Attributes:
        model: the transformers causal LM.
        token_ids: the ids whose keys and values are in the cache, in order.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = _new_dynamic_cache(model)
        self._cache_kwarg = _cache_kwarg(model)
        self.token_ids: list[int] = []
        # The token tree after a committed prefix (forward_tree): its start, and each tree
        # entry's parent (an index into the tree entries, -1: none) and depth.
        self._tree_start: int | None = None
        self._tree_parents: list[int] = []
        self._tree_depths: list[int] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (no-op when already that short)."""
        remove = len(self.token_ids) - length
        if remove > 0:
            # A negative argument removes that many tokens in every transformers version.
            self.cache.crop(-remove)
            del self.token_ids[length:]
        if self._tree_start is not None:
            # (tree entries are in topological order: a prefix of them is still a tree)
            keep = max(length - self._tree_start, 0)
            del self._tree_parents[keep:], self._tree_depths[keep:]
            if not keep:
                self._tree_start = None

    def common_prefix(self, tokens: Sequence[int], start: int = 0) -> int:
        """Length of the longest common prefix of the cached ids and ``tokens``, assuming
        the first ``start`` ids are already known to agree."""
        n = min(len(self.token_ids), len(tokens))
        i = min(start, n)
        while i < n and self.token_ids[i] == tokens[i]:
            i += 1
        return i

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], *, logits_to_keep: int | None = None
                ) -> torch.Tensor:
        """Run ``token_ids`` after the cached ones and cache them.

        Args:
            token_ids: at least one id.
            logits_to_keep: return only the last that many rows (None: all).

        Returns:
            logits ``[rows, V]`` in the model's dtype (float32 for a float64 model) for the
            last ``rows`` fed positions (row r scores the token that follows the r-th of
            them).
        """
        if len(token_ids) == 0:
            raise ValueError("forward needs at least one token")
        device = self.model.get_input_embeddings().weight.device
        ids = torch.tensor([list(token_ids)], dtype=torch.int64, device=device)
        start = len(self.token_ids)
        positions = torch.arange(start, start + ids.shape[1], device=device).unsqueeze(0)
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache}
        if logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        # The DynamicCache is updated in place.
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **kwargs)
        self.token_ids.extend(int(t) for t in token_ids)
        return _sampler_logits(out.logits[0])

    def _attention_mask(self, visible: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The additive 4D mask ``[1, 1, q, kv]`` (0 where ``visible`` [q, kv] bool is True,
        the dtype's lowest value elsewhere), in the model's dtype: eager attention adds it to
        the scores, sdpa takes it as its float mask."""
        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl not in (None, "eager", "sdpa"):
            raise ValueError(f"tree forwards need eager or sdpa attention (a custom 4D mask); "
                             f"the model uses {impl!r} (load it with attn_implementation="
                             f"'eager')")
        dtype = self.model.get_input_embeddings().weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=device)
        mask.masked_fill_(~visible.to(device), torch.finfo(dtype).min)
        return mask[None, None]

    @torch.inference_mode()
    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int], *,
                     tree_start: int) -> torch.Tensor:
        """Run tree entries after a committed prefix of ``tree_start`` cached tokens and cache
        them (appended in the order given).

        The cache must hold the prefix plus the entries of the same tree fed so far (none on
        the first call). Entries are numbered in feeding order from 0 (the first entry after
        the prefix); entry e's ``parents[e]`` is an earlier entry number (already cached or
        fed before it in this call) or -1 (a tree root: it sees the prefix only). Entry e is
        at position ``tree_start + depth(e)`` (roots: depth 0) and attends to the prefix, its
        ancestors and itself.

        Args:
            token_ids: the new entries' ids (at least one).
            parents: one parent per new entry, in ``[-1, own number - 1]``.
            tree_start: the prefix length (the tree's first entry is cache entry
                ``tree_start``).

        Returns:
            logits ``[len(token_ids), V]`` (dtype as :meth:`forward`): row r scores the
            token after new entry r.

        Raises:
            ValueError: empty or mismatched lists, a parent out of range, a cache that does
                not hold exactly the prefix and this tree's earlier entries, or a model whose
                attention cannot take a custom mask.
        """
        if len(token_ids) == 0 or len(token_ids) != len(parents):
            raise ValueError(f"forward_tree needs one parent per token (at least one), got "
                             f"{len(token_ids)} tokens and {len(parents)} parents")
        if self._tree_start == tree_start:
            tree_parents, depths = list(self._tree_parents), list(self._tree_depths)
        else:  # a new tree
            tree_parents, depths = [], []
        first = len(tree_parents)
        if len(self.token_ids) != tree_start + first:
            raise ValueError(f"forward_tree: the cache holds {len(self.token_ids)} tokens, not "
                             f"the prefix of {tree_start} plus this tree's {first} entries")
        for e, p in enumerate(parents, start=first):
            p = int(p)
            if not -1 <= p < e:
                raise ValueError(f"forward_tree: entry {e} has parent {p}; parents must be "
                                 f"earlier entries or -1")
            tree_parents.append(p)
            depths.append(0 if p < 0 else depths[p] + 1)
        total = len(tree_parents)
        # Ancestor-or-self of every tree entry: [total, total] bool, built in entry order.
        anc = torch.eye(total, dtype=torch.bool)
        for e, p in enumerate(tree_parents):
            if p >= 0:
                anc[e] |= anc[p]
        visible = torch.ones((total - first, tree_start + total), dtype=torch.bool)
        visible[:, tree_start:] = anc[first:]
        device = self.model.get_input_embeddings().weight.device
        mask = self._attention_mask(visible, device)
        ids = torch.tensor([[int(t) for t in token_ids]], dtype=torch.int64, device=device)
        positions = torch.tensor([[tree_start + d for d in depths[first:]]],
                                 dtype=torch.int64, device=device)
        kwargs: dict[str, Any] = {self._cache_kwarg: self.cache}
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         use_cache=True, **kwargs)
        self.token_ids.extend(int(t) for t in token_ids)
        self._tree_start, self._tree_parents, self._tree_depths = tree_start, tree_parents, depths
        if len(self.token_ids) != _cached_length(self.cache):
            raise RuntimeError("forward_tree: the model did not append one cache entry per "
                               "fed token")
        return _sampler_logits(out.logits[0])

    @torch.inference_mode()
    def keep_tree_path(self, entries: Sequence[int]) -> None:
        """Keep the prefix and the tree entries ``entries`` (entry numbers as in
        :meth:`forward_tree`, increasing: a root-to-node path), in that order; drop the rest.

        Afterwards the cache is the prefix followed by the path, as if the path's tokens had
        been fed as a chain (their keys and values were computed at those positions with
        exactly that context), and holds no tree.

        Raises:
            ValueError: no tree in the cache, or ``entries`` not increasing, not in range, or
                not a path (each entry's parent is the previous one; the first is a root).
            TypeError: a cache whose layers do not expose ``keys`` / ``values`` tensors
                (sliding-window or quantised caches).
        """
        if self._tree_start is None:
            raise ValueError("keep_tree_path: the cache holds no tree (call forward_tree first)")
        start, parents = self._tree_start, self._tree_parents
        entries = [int(e) for e in entries]
        prev = -1
        for e in entries:
            if not prev < e < len(parents) or parents[e] != prev:
                raise ValueError(f"keep_tree_path: {entries} is not a root-to-node path of the "
                                 f"tree's {len(parents)} entries")
            prev = e
        n = len(entries)
        moved = [e for j, e in enumerate(entries) if e != j]
        if moved:
            src = torch.tensor(entries, dtype=torch.int64) + start
            for layer_kv in _layer_tensors(self.cache):
                for t in layer_kv:
                    t[:, :, start: start + n] = t[:, :, src.to(t.device)]
        tokens = [self.token_ids[start + e] for e in entries]
        self.token_ids[start: start + n] = tokens
        self.crop(start + n)
        self._tree_start, self._tree_parents, self._tree_depths = None, [], []


def _layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (keys, values) ``[1, heads, length, head_dim]`` of a DynamicCache
    (``cache.layers`` in transformers >= 4.56, ``key_cache`` / ``value_cache`` before)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        out = []
        for layer in layers:
            if getattr(layer, "is_sliding", False) or not isinstance(
                    getattr(layer, "keys", None), torch.Tensor):
                raise TypeError(f"tree speculation needs full-attention DynamicCache layers; "
                                f"got {type(layer).__name__}")
            out.append((layer.keys, layer.values))
        return out
    keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if keys is None or values is None:
        raise TypeError(f"tree speculation cannot compact a {type(cache).__name__}")
    return list(zip(keys, values, strict=True))


def _cached_length(cache: Any) -> int:
    return int(cache.get_seq_length())


def _sampler_logits(logits: torch.Tensor) -> torch.Tensor:
    """The model's logits as the sampler takes them: its own bf16 / fp16 / float32 rows, no
    float32 copy (the Triton kernels read them as they are); float64 (a CPU model kept in
    float64 for reproducible forwards) cast to float32, which the sampler takes at most."""
    if logits.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return logits
    return logits.float()
