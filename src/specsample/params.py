"""Per-request sampling parameters and their batched, device-resident form."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .rng import split_seed

LOGPROBS_MODES = ("raw", "processed")
F32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (API.md).

    Processing order applied to a row's raw logits: logit_bias -> penalties (repetition, then
    frequency, then presence) -> temperature -> min_p -> top_k -> top_p.

    Raises:
        ValueError: naming the field, for any value outside its valid range.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    logprobs: int | None = None
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        def real(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            return value

        if real("temperature") < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if integer("top_k") < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k!r}")
        if not 0.0 < real("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= real("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None:
            integer("seed")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= real(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if real("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(f"logit_bias must be a mapping, got {type(self.logit_bias)}")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise ValueError(f"logit_bias key must be a token id >= 0, got {tok!r}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not (
                    math.isfinite(bias)
                ):
                    raise ValueError(f"logit_bias value for token {tok} must be finite, "
                                     f"got {bias!r}")
        if self.logprobs is not None and integer("logprobs") < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', "
                             f"got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature exactly 0)."""
        return self.temperature == 0.0


def _token_lists(name: str, lists: Sequence[Sequence[int]] | None, n: int,
                 vocab_size: int) -> list[list[int]]:
    if lists is None:
        return [[] for _ in range(n)]
    if len(lists) != n:
        raise ValueError(f"{name} has {len(lists)} entries for {n} requests")
    out = []
    for i, seq in enumerate(lists):
        seq = [int(t) for t in seq]
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}[{i}] holds token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(seq)
    return out


@dataclass
class SamplingBatch:
    """The batched, device-resident form of one ``SamplingParams`` per request.

    Build it with :meth:`from_params`. Tensor fields have one entry per request (``[N]``);
    the ``*_ids`` / ``*_req`` pairs are flat (request index, token id) lists used for penalties
    and logit bias. Python-level flags let backends skip work nobody asked for without a host
    sync.
    """

    params: tuple[SamplingParams, ...]
    vocab_size: int
    device: torch.device
    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] float64 (filter cuts are decided in float64)
    min_p: torch.Tensor  # [N] float64
    seed_lo: torch.Tensor  # [N] int64 (uint32 values)
    seed_hi: torch.Tensor  # [N] int64 (uint32 values)
    presence_penalty: torch.Tensor  # [N] float32
    frequency_penalty: torch.Tensor  # [N] float32
    repetition_penalty: torch.Tensor  # [N] float32
    logprobs_n: torch.Tensor  # [N] int64, -1 = None
    logprobs_processed: torch.Tensor  # [N] bool
    bias_req: torch.Tensor  # [nb] int64
    bias_ids: torch.Tensor  # [nb] int64
    bias_val: torch.Tensor  # [nb] float32
    output_req: torch.Tensor  # [no] int64 (one entry per output token occurrence)
    output_ids: torch.Tensor  # [no] int64
    prompt_req: torch.Tensor  # [np] int64
    prompt_ids: torch.Tensor  # [np] int64
    user_seeded: bool = False
    any_greedy: bool = False
    any_sampled: bool = False
    needs_filter: bool = False  # some sampled request uses min_p / top_k / top_p
    needs_penalties: bool = False
    needs_bias: bool = False
    max_logprobs: int = -1  # -1: nobody asked for logprobs
    any_processed_logprobs: bool = False

    @property
    def num_requests(self) -> int:
        return len(self.params)

    @property
    def needs_general_path(self) -> bool:
        """True when a processor beyond temperature is active (bias, penalties, filters)."""
        return self.needs_filter or self.needs_penalties or self.needs_bias

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """Batch ``params`` (one per request) for logits of ``vocab_size`` columns on ``device``.

        ``prompt_token_ids`` / ``output_token_ids``: one token-id sequence per request, needed
        only for penalties (presence / frequency count output tokens; repetition counts prompt
        and output tokens). Requests with ``seed=None`` get a fresh seed drawn from torch's
        default (CPU) generator here.

        Raises:
            ValueError: empty ``params``, a non-``SamplingParams`` entry, ``vocab_size < 1``,
                a logit_bias token id >= vocab_size, or token lists of the wrong length / with
                ids outside [0, vocab_size).
        """
        params = tuple(params)
        if not params:
            raise ValueError("params must hold at least one SamplingParams")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] is {type(p).__name__}, not SamplingParams")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        device = torch.device(device if device is not None else "cpu")
        n = len(params)
        prompts = _token_lists("prompt_token_ids", prompt_token_ids, n, vocab_size)
        outputs = _token_lists("output_token_ids", output_token_ids, n, vocab_size)

        seeds = []
        for p in params:
            if p.seed is None:
                seeds.append(int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)))
            else:
                seeds.append(p.seed)
        split = [split_seed(s) for s in seeds]

        bias_req, bias_ids, bias_val = [], [], []
        for i, p in enumerate(params):
            for tok, val in (p.logit_bias or {}).items():
                if tok >= vocab_size:
                    raise ValueError(f"params[{i}].logit_bias token id {tok} is outside "
                                     f"[0, {vocab_size})")
                bias_req.append(i)
                bias_ids.append(tok)
                bias_val.append(min(max(float(val), -F32_MAX), F32_MAX))

        penal = [p.presence_penalty != 0 or p.frequency_penalty != 0
                 or p.repetition_penalty != 1 for p in params]

        # Temperature and repetition penalty enter float32 kernels as divisors and factors:
        # keep them normal floats so neither 1/T nor a product can overflow to inf or 0
        # (subnormal T also gave NaN; T below 2**-149 rounded to 0, i.e. silent greedy).
        # Outside [2**-126, 2**126] softmax(z / T) only changes for logit gaps below 1e-36 or
        # logits above 1e36. logit_bias is clamped to float32's finite range.
        def normal(value: float) -> float:
            return min(max(value, 2.0**-126), 2.0**126)

        def f32(values):
            return torch.tensor(values, dtype=torch.float32, device=device)

        def f64(values):
            return torch.tensor(values, dtype=torch.float64, device=device)

        def i64(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        out_req = [i for i, seq in enumerate(outputs) if penal[i] for _ in seq]
        out_ids = [t for i, seq in enumerate(outputs) if penal[i] for t in seq]
        pr_req = [i for i, seq in enumerate(prompts)
                  if params[i].repetition_penalty != 1 for _ in seq]
        pr_ids = [t for i, seq in enumerate(prompts) if params[i].repetition_penalty != 1
                  for t in seq]
        sampled = [not p.greedy for p in params]
        top_k = [0 if p.top_k in (0, -1) else min(p.top_k, vocab_size) for p in params]
        return cls(
            params=params,
            vocab_size=vocab_size,
            device=device,
            temperature=f32([normal(p.temperature) if p.temperature > 0 else 0.0
                             for p in params]),
            top_k=i64(top_k),
            top_p=f64([p.top_p for p in params]),
            min_p=f64([p.min_p for p in params]),
            seed_lo=i64([s[0] for s in split]),
            seed_hi=i64([s[1] for s in split]),
            presence_penalty=f32([p.presence_penalty for p in params]),
            frequency_penalty=f32([p.frequency_penalty for p in params]),
            repetition_penalty=f32([normal(p.repetition_penalty) for p in params]),
            logprobs_n=i64([-1 if p.logprobs is None else p.logprobs for p in params]),
            logprobs_processed=torch.tensor(
                [p.logprobs_mode == "processed" for p in params], dtype=torch.bool,
                device=device),
            bias_req=i64(bias_req),
            bias_ids=i64(bias_ids),
            bias_val=f32(bias_val),
            output_req=i64(out_req),
            output_ids=i64(out_ids),
            prompt_req=i64(pr_req),
            prompt_ids=i64(pr_ids),
            user_seeded=any(p.seed is not None for p in params),
            any_greedy=not all(sampled),
            any_sampled=any(sampled),
            needs_filter=any(s and (k > 0 and k < vocab_size or p.top_p < 1 or p.min_p > 0)
                             for s, k, p in zip(sampled, top_k, params)),
            needs_penalties=any(penal),
            needs_bias=bool(bias_req),
            max_logprobs=max(-1 if p.logprobs is None else p.logprobs for p in params),
            any_processed_logprobs=any(p.logprobs is not None and p.logprobs_mode == "processed"
                                       for p in params),
        )
