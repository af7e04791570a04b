"""Generation statistics, per request and in total."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestStats:
    """Counters of one request.

    Attributes:
        steps: target forwards (verify or sample calls) the request took part in.
        drafted: draft tokens proposed and verified.
        accepted: draft tokens accepted.
        emitted: tokens returned (after EOS / max_new_tokens truncation).
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per target forward: 1 + accepted / steps (1.0 without speculation)."""
        return 1.0 + self.accepted / self.steps if self.steps else 0.0

    def to_dict(self, elapsed_s: float | None = None) -> dict:
        out = {
            "steps": self.steps,
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "generated_tokens": self.emitted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
        }
        if elapsed_s is not None:
            out["tokens_per_s"] = self.emitted / elapsed_s if elapsed_s > 0 else 0.0
        return out


@dataclass
class GenerationStats:
    """Totals of one ``generate()`` call.

    Attributes:
        requests: one :class:`RequestStats` per request.
        steps: engine steps (each runs one target forward per active request and one
            ``verify()`` / ``sample()`` call for all of them).
        prefill_s: seconds spent on prompt prefill.
        decode_s: seconds spent in the step loop.
        sampler_s: seconds of ``decode_s`` spent in ``sample()`` / ``verify()`` (reading
            their outputs and ``batch.append`` included; on CUDA the device is synchronised
            first, so the forward's kernels are not counted).
        paths: ``specsample.paths.counts()`` delta over the call.
        drafter, method, num_speculative_tokens: the engine's settings (k is the tree's
            depth with trees).
        tree_nodes: the node budget of a tree with tree speculation (``drafted`` then counts
            tree nodes, so the acceptance rate is accepted / nodes), 0 with chains.
    """

    requests: list[RequestStats] = field(default_factory=list)
    steps: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    sampler_s: float = 0.0
    paths: dict = field(default_factory=dict)
    drafter: str = ""
    method: str = ""
    num_speculative_tokens: int = 0
    tree_nodes: int = 0

    @property
    def total(self) -> RequestStats:
        """The sum of every request's counters (steps summed over requests)."""
        t = RequestStats()
        for r in self.requests:
            t.steps += r.steps
            t.drafted += r.drafted
            t.accepted += r.accepted
            t.emitted += r.emitted
        return t

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of decoding (prefill excluded: it is the same work with
        or without speculation)."""
        return self.total.emitted / self.decode_s if self.decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        """JSON-ready totals (``tokens_per_s``, ``acceptance_rate``, ``mean_accepted_length``,
        ``steps``, ``paths``, ...) and a ``per_request`` list."""
        total = self.total
        return {
            "drafter": self.drafter,
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "tree_nodes": self.tree_nodes,
            "steps": self.steps,
            "request_steps": total.steps,
            "draft_tokens": total.drafted,
            "accepted_tokens": total.accepted,
            "generated_tokens": total.emitted,
            "acceptance_rate": total.acceptance_rate,
            "mean_accepted_length": total.mean_accepted_length,
            "tokens_per_s": self.tokens_per_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "sampler_s": self.sampler_s,
            "sampler_share": self.sampler_s / self.decode_s if self.decode_s > 0 else 0.0,
            "paths": self.paths,
            "per_request": [r.to_dict(self.decode_s) for r in self.requests],
        }


def paths_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two ``specsample.paths.counts()`` snapshots (zero entries dropped)."""
    out = {}
    for name, entry in after.items():
        prev = before.get(name, {})
        delta = {key: value - prev.get(key, 0) for key, value in entry.items()}
        if any(delta.values()):
            out[name] = delta
    return out
