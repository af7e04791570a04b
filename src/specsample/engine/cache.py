"""A per-request KV cache over a transformers causal LM, with rollback.

One :class:`ModelCache` holds one sequence's keys and values (batch size 1). The engine keeps
one per request and per model, so requests of different lengths need no padding and rollback is
a plain crop.
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

    def __len__(self) -> int:
        return len(self.token_ids)

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (no-op when already that short)."""
        remove = len(self.token_ids) - length
        if remove > 0:
            # A negative argument removes that many tokens in every transformers version.
            self.cache.crop(-remove)
            del self.token_ids[length:]

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
            float32 logits ``[rows, V]`` for the last ``rows`` fed positions (row r scores the
            token that follows the r-th of them).
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
        return out.logits[0].float()
