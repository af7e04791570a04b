"""Result types of sample(), verify() and verify_tree()."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SampleOutput:
    """Result of :func:`specsample.sample`.

    token_ids: [N] int64, the sampled token of each request (-1 for an invalid request).
    logprobs: [N, 1 + n] float32 or None; column 0 is the sampled token, columns 1..n the
        top-n tokens of the request's logprob distribution (n = max requested logprobs).
    logprob_token_ids: [N, 1 + n] int64 or None, the token ids of ``logprobs``.
    invalid: [N] bool, requests whose input data was invalid.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    logprob_token_ids: torch.Tensor | None
    invalid: torch.Tensor


@dataclass
class VerifyOutput:
    """Result of :func:`specsample.verify`.

    token_ids: [N, K + 1] int64; row i holds its accepted drafts, then one correction or bonus
        token, then -1 padding (all -1 for an invalid request).
    num_accepted: [N] int64, accepted drafts (0..k_i); emitted tokens = num_accepted + 1.
    logprobs / logprob_token_ids: [N, K + 1, 1 + n] float32 / int64 or None, per emitted
        position; positions not emitted hold ids -1 and logprobs -inf.
    invalid: [N] bool, requests whose input data was invalid.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    logprobs: torch.Tensor | None
    logprob_token_ids: torch.Tensor | None
    invalid: torch.Tensor


@dataclass
class TreeVerifyOutput:
    """Result of :func:`specsample.verify_tree`.

    token_ids: [N, D + 1] int64 (D: the deepest node's depth in the batch); row i holds the
        tokens of its accepted path (root excluded), then one correction or bonus token, then
        -1 padding (all -1 for an invalid request).
    num_accepted: [N] int64, the accepted path's length (0..depth of the tree); emitted tokens
        = num_accepted + 1.
    accepted_node_ids: [N, D] int64, the node numbers (1..m_i) of the accepted path in depth
        order, -1 padded: the KV-cache entries to keep.
    logprobs / logprob_token_ids: [N, D + 1, 1 + n] float32 / int64 or None, per emitted
        position (as :class:`VerifyOutput`); positions not emitted hold ids -1, logprobs -inf.
    invalid: [N] bool, requests whose input data was invalid.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    accepted_node_ids: torch.Tensor
    logprobs: torch.Tensor | None
    logprob_token_ids: torch.Tensor | None
    invalid: torch.Tensor
