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

A drafter sees one request at a time through :meth:`Drafter.propose`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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

    def propose(self, ctx: DraftContext) -> Draft:
        cache = self.caches[ctx.index]
        tokens = ctx.tokens
        keep = cache.common_prefix(tokens, self._known[ctx.index])
        keep = min(keep, len(tokens) - 1)  # the last committed token is always fed
        cache.crop(keep)
        self._known[ctx.index] = len(tokens)
        logits = cache.forward(list(tokens[keep:]), logits_to_keep=1)[-1]
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


def make_drafter(name: str, *, draft_model: Any = None, ngram_max: int = 3,
                 ngram_min: int = 1) -> Drafter:
    """Build a drafter by name.

    Args:
        name: ``"ngram"``, ``"model"`` or ``"none"``.
        draft_model: the transformers model for ``"model"`` (required there).
        ngram_max, ngram_min: suffix lengths for ``"ngram"``.

    Raises:
        ValueError: an unknown name, or ``"model"`` without a draft model.
    """
    if name == "ngram":
        return NgramDrafter(ngram_max, ngram_min)
    if name == "none":
        return NoDrafter()
    if name == "model":
        if draft_model is None:
            raise ValueError("drafter 'model' needs a draft model (--draft-model PATH)")
        return ModelDrafter(draft_model)
    raise ValueError(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")
