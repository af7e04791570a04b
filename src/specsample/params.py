"""Per-request sampling parameters and their batched, device-resident form."""

from __future__ import annotations

import functools
import itertools
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from . import call_cache
from .rng import split_seed

LOGPROBS_MODES = ("raw", "processed")
F32_MAX = 3.4028234663852886e38
#: Calls with ``positions=None`` use positions ``(c mod FRESH_PERIOD) * FRESH_STRIDE``, c the
#: batch's ``fresh_counter`` (docs/semantics.md): below 2**62 with any row offset j < 2**31.
FRESH_STRIDE = 2**31
FRESH_PERIOD = 2**31
#: The most top-n logprobs per request the Triton kernels compute (more take PyTorch code).
MAX_FUSED_TOP_N = 32


def _as_float(value, name: str) -> float:
    """``value`` as a float: a finite real number (numpy scalars too; bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:  # an int beyond float's range
        out = math.inf
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return out


def _as_int(value, name: str) -> int:
    """``value`` as an int: an integer (numpy integers too; bools are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return int(value)


def _id_tuple(value, name: str, *, nonempty: bool) -> tuple[int, ...]:
    """``value`` as a tuple of token ids >= 0: a sequence of ints or a 1-D numpy array / torch
    tensor of integers (strings are refused)."""
    if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a sequence of token ids, got {value!r}")
    ids = []
    for tok in value:
        if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
            raise ValueError(f"{name} must hold token ids >= 0, got {tok!r}")
        ids.append(int(tok))
    if nonempty and not ids:
        raise ValueError(f"{name} must not be empty")
    return tuple(ids)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request (API.md).

    Processing order applied to a row's raw logits: bans (allowed_token_ids, bad words,
    min_tokens) -> logit_bias -> penalties (repetition, then frequency, then presence) ->
    temperature -> min_p -> top_k -> top_p.

    Bans: ``allowed_token_ids`` (None or a non-empty sequence of ids) lets only those tokens be
    emitted; ``bad_words_token_ids`` (None or a sequence of non-empty id sequences) bans a
    word's last token at a row whose context (prompt + output tokens + the drafts before that
    row) ends with the word's other tokens (a one-token word is always banned); while the
    request has fewer than ``min_tokens`` output tokens (the drafts before the row count), its
    stop tokens (``stop_token_ids`` and the batch's ``eos_token_ids``) are banned. Ids are
    checked against the vocabulary in :meth:`SamplingBatch.from_params`; the sequences are
    stored as tuples.

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
    allowed_token_ids: Sequence[int] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    min_tokens: int = 0
    stop_token_ids: Sequence[int] | None = None

    def __post_init__(self) -> None:
        # numpy scalars count as numbers; the frozen fields then hold plain Python int / float.
        def real(name: str) -> float:
            value = _as_float(getattr(self, name), name)
            object.__setattr__(self, name, value)
            return value

        def integer(name: str) -> int:
            value = _as_int(getattr(self, name), name)
            object.__setattr__(self, name, value)
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
            bias = {}
            for tok, val in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, numbers.Integral) or tok < 0:
                    raise ValueError(f"logit_bias key must be a token id >= 0, got {tok!r}")
                bias[int(tok)] = _as_float(val, f"logit_bias value for token {tok}")
            object.__setattr__(self, "logit_bias", bias)
        if self.logprobs is not None and integer("logprobs") < 0:
            raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', "
                             f"got {self.logprobs_mode!r}")
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _id_tuple(
                self.allowed_token_ids, "allowed_token_ids", nonempty=True))
        if self.bad_words_token_ids is not None:
            words = self.bad_words_token_ids
            if isinstance(words, (str, bytes)) or not isinstance(words, Sequence):
                raise ValueError(f"bad_words_token_ids must be a sequence of token-id "
                                 f"sequences, got {words!r}")
            object.__setattr__(self, "bad_words_token_ids", tuple(
                _id_tuple(w, f"bad_words_token_ids[{i}]", nonempty=True)
                for i, w in enumerate(words)))
        if integer("min_tokens") < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", _id_tuple(
                self.stop_token_ids, "stop_token_ids", nonempty=False))

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature exactly 0)."""
        return self.temperature == 0.0


def _token_lists(name: str, lists: Sequence[Sequence[int]] | None, n: int,
                 vocab_size: int) -> list[list[int]]:
    if lists is None:
        return [[] for _ in range(n)]
    if len(lists) != n:
        raise ValueError(f"{name} must hold one sequence of token ids per request: "
                         f"{len(lists)} entries for {n} request(s)")
    out = []
    for i, seq in enumerate(lists):
        if not isinstance(seq, (Sequence, torch.Tensor)) and not hasattr(seq, "__array__"):
            raise ValueError(f"{name}[{i}] must be a sequence of token ids (one per request), "
                             f"got {type(seq).__name__}")
        seq = [int(t) for t in seq]
        bad = [t for t in seq if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name}[{i}] holds token ids outside [0, {vocab_size}): {bad[:5]}")
        out.append(seq)
    return out


def _normal(value: float) -> float:
    """Temperature and repetition penalty enter float32 kernels as divisors and factors: keep
    them normal floats so neither 1/T nor a product can overflow to inf or 0 (subnormal T also
    gave NaN; T below 2**-149 rounded to 0, i.e. silent greedy). Outside [2**-126, 2**126]
    softmax(z / T) only changes for logit gaps below 1e-36 or logits above 1e36."""
    return min(max(value, 2.0**-126), 2.0**126)


def _penalised(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _stop_tokens(p: SamplingParams, eos: tuple[int, ...]) -> tuple[int, ...]:
    """The tokens min_tokens bans for ``p``: its own stop tokens, then the batch's eos ids."""
    return tuple(dict.fromkeys((*(p.stop_token_ids or ()), *eos)))


def _static_fields(params: tuple[SamplingParams, ...], vocab_size: int, eos: tuple[int, ...],
                   device: torch.device, stop_users: tuple[int, ...]) -> dict:
    """The SamplingBatch fields that follow from the params alone (ids already checked against
    ``vocab_size``, but logit_bias): per-request scalars, logit bias, bans, the flags.
    ``stop_users``: the requests whose stop tokens min_tokens may still ban."""

    def f32(values):
        return torch.tensor(values, dtype=torch.float32, device=device)

    def i64(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    bias_req, bias_ids, bias_val, bias_start = [], [], [], [0]
    for i, p in enumerate(params):
        for tok, val in sorted((p.logit_bias or {}).items()):
            if tok >= vocab_size:
                raise ValueError(f"params[{i}].logit_bias token id {tok} is outside "
                                 f"[0, {vocab_size})")
            bias_req.append(i)
            bias_ids.append(tok)
            bias_val.append(min(max(float(val), -F32_MAX), F32_MAX))
        bias_start.append(len(bias_ids))
    stop_req = [i for i in stop_users for _ in _stop_tokens(params[i], eos)]
    stop_ids = [t for i in stop_users for t in _stop_tokens(params[i], eos)]
    allowed_users = tuple(i for i, p in enumerate(params) if p.allowed_token_ids is not None)
    allowed_mask = torch.zeros(len(allowed_users), vocab_size, dtype=torch.bool)
    for slot, i in enumerate(allowed_users):
        allowed_mask[slot, list(params[i].allowed_token_ids)] = True
    words = [(i, word) for i, p in enumerate(params) for word in p.bad_words_token_ids or ()]
    width = max((len(word) - 1 for _, word in words), default=0)
    # (request i's bad words are bad_start[i] .. bad_start[i + 1] - 1, its stop entries
    # likewise: the Triton kernels' ban table reads them by request)
    n_words = [len(p.bad_words_token_ids or ()) for p in params]
    n_stops = [0] * len(params)
    for i in stop_req:
        n_stops[i] += 1
    bad_start = [0, *itertools.accumulate(n_words)]
    stop_start = [0, *itertools.accumulate(n_stops)]
    used = [a + b for a, b in zip(n_words, n_stops)]
    allowed_slot = [-1] * len(params)
    for slot, i in enumerate(allowed_users):
        allowed_slot[i] = slot
    bad_prefix = torch.full((len(words), width), -1, dtype=torch.int64)
    for w, (_, word) in enumerate(words):
        if len(word) > 1:
            bad_prefix[w, width - len(word) + 1:] = torch.tensor(word[:-1])
    sampled = [not p.greedy for p in params]
    top_k = [0 if p.top_k in (0, -1) else min(p.top_k, vocab_size) for p in params]
    # sampled requests that rank their row (top_k below V, or top_p)
    rank = [s and (k > 0 and k < vocab_size or p.top_p < 1)
            for s, k, p in zip(sampled, top_k, params)]
    return dict(
        temperature=f32([_normal(p.temperature) if p.temperature > 0 else 0.0 for p in params]),
        top_k=i64(top_k),
        top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device),
        min_p=torch.tensor([p.min_p for p in params], dtype=torch.float64, device=device),
        presence_penalty=f32([p.presence_penalty for p in params]),
        frequency_penalty=f32([p.frequency_penalty for p in params]),
        repetition_penalty=f32([_normal(p.repetition_penalty) for p in params]),
        logprobs_n=i64([-1 if p.logprobs is None else p.logprobs for p in params]),
        logprobs_processed=torch.tensor([p.logprobs_mode == "processed" for p in params],
                                        dtype=torch.bool, device=device),
        bias_req=i64(bias_req),
        bias_ids=i64(bias_ids),
        bias_val=f32(bias_val),
        bias_start=i64(bias_start),
        min_tokens=i64([p.min_tokens for p in params]),
        stop_req=i64(stop_req),
        stop_ids=i64(stop_ids),
        stop_users=tuple(i for i in stop_users if _stop_tokens(params[i], eos)),
        allowed_users=allowed_users,
        allowed_mask=allowed_mask.to(device),
        bad_req=i64([i for i, _ in words]),
        bad_prefix=bad_prefix.to(device),
        bad_last=i64([word[-1] for _, word in words]),
        bad_start=i64(bad_start),
        stop_start=i64(stop_start),
        ban_width=max(used, default=0),
        allowed_slot=torch.tensor(allowed_slot, dtype=torch.int32, device=device),
        user_seeded=any(p.seed is not None for p in params),
        any_greedy=not all(sampled),
        any_sampled=any(sampled),
        needs_filter=any(r or s and p.min_p > 0 for r, s, p in zip(rank, sampled, params)),
        needs_rank_filter=any(rank),
        needs_penalties=any(_penalised(p) for p in params),
        needs_bias=bool(bias_req),
        needs_bans=bool(stop_req or allowed_users or words),
        max_logprobs=max(-1 if p.logprobs is None else p.logprobs for p in params),
    )


def _fit_width(tail: torch.Tensor, width: int) -> torch.Tensor:
    """``tail`` [N, W] (right-aligned, -1 padded left) as [N, width]: its last ``width`` columns,
    or padded with -1 on the left."""
    if tail.shape[1] >= width:
        return tail[:, tail.shape[1] - width:].contiguous()
    return torch.nn.functional.pad(tail, (width - tail.shape[1], 0), value=-1)


def _state_key(tensors) -> tuple | None:
    """What changes when one of ``tensors`` is replaced or changed in place (their version
    counters and addresses), or None for inference tensors (they keep no version)."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple((t._version, t.data_ptr()) for t in tensors)


@dataclass
class SamplingBatch:
    """The batched, device-resident form of one ``SamplingParams`` per request.

    Build it with :meth:`from_params`. Tensor fields have one entry per request (``[N]``);
    the ``bias_*`` / ``stop_*`` / ``bad_*`` fields are flat (request index, token id) lists
    (``bias_*`` by request, then token id, with ``bias_start`` [N + 1] the first entry of each
    request).
    Python-level flags let backends skip work nobody asked for without a host sync.

    Persistent use: :meth:`append` adds the tokens a ``sample()`` / ``verify()`` call emitted
    to the device state below, in place and without host synchronisation; :meth:`select` keeps
    a subset of the requests and :meth:`concat` joins batches, both carrying the state. The
    output-token state costs the same per step whatever the history length:

    * penalties: ``output_counts`` [N, V] float32, how often each token occurs among the
      request's output tokens (exact integers up to 2**24), and ``prompt_mask`` [N, V] bool,
      its prompt tokens; both [N, 0] when no request has a penalty, and zero rows for
      requests without one (as :meth:`from_params` records only penalised requests);
    * bad words: ``context_tail`` [N, W], the last W = (longest bad word - 1) tokens of
      prompt + outputs of each request with bad words, right-aligned, -1 padded;
    * min_tokens: ``num_output`` [N], the output count, compared on the device with
      ``min_tokens`` at every row, so the stop-token entries (``stop_req`` / ``stop_ids`` of
      ``stop_users``, host tuple) stay exact after min_tokens is reached; ``needs_bans`` then
      stays conservatively True until :meth:`refresh_min_tokens` (one host read) drops them.
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
    # [N + 1] int64: request i's entries are bias_start[i] .. bias_start[i + 1] - 1, by token id
    bias_start: torch.Tensor
    output_counts: torch.Tensor  # [N, V] float32 output-token counts (penalties), else [N, 0]
    prompt_mask: torch.Tensor  # [N, V] bool prompt tokens (repetition penalty), else [N, 0]
    num_output: torch.Tensor  # [N] int64 output tokens so far (min_tokens)
    min_tokens: torch.Tensor  # [N] int64
    stop_req: torch.Tensor  # [ns] int64: stop tokens (own + eos) of stop_users
    stop_ids: torch.Tensor  # [ns] int64
    stop_users: tuple[int, ...]  # requests that were below min_tokens when last known (host)
    allowed_users: tuple[int, ...]  # requests with allowed_token_ids (host)
    allowed_mask: torch.Tensor  # [len(allowed_users), V] bool, True = may be emitted
    bad_req: torch.Tensor  # [nw] int64, one entry per bad word
    bad_prefix: torch.Tensor  # [nw, W] int64 the word's tokens but its last, right-aligned, -1 pad
    bad_last: torch.Tensor  # [nw] int64 the word's last token (the one banned)
    # [N + 1] int64: request i's bad words are bad_start[i] .. bad_start[i + 1] - 1, its stop
    # entries stop_start[i] .. stop_start[i + 1] - 1 (the Triton kernels' ban table)
    bad_start: torch.Tensor
    stop_start: torch.Tensor
    ban_width: int  # the most bad words + stop entries of one request (0 without any)
    allowed_slot: torch.Tensor  # [N] int32 the request's row of allowed_mask, -1 for none
    context_tail: torch.Tensor  # [N, W] int64 last W tokens of prompt + outputs, -1 padded left
    # [1] int64: calls so far with positions=None (plus a random start); plan.fresh_positions
    # reads it and advances it in place, so replayed CUDA graphs draw fresh noise too.
    fresh_counter: torch.Tensor
    eos_token_ids: tuple[int, ...] = ()
    user_seeded: bool = False
    any_greedy: bool = False
    any_sampled: bool = False
    needs_filter: bool = False  # some sampled request uses min_p / top_k / top_p
    needs_rank_filter: bool = False  # some sampled request uses top_k / top_p
    needs_penalties: bool = False
    needs_bias: bool = False
    needs_bans: bool = False  # some request has allowed_token_ids, bad words or min_tokens left
    max_logprobs: int = -1  # -1: nobody asked for logprobs

    def __setattr__(self, name: str, value) -> None:
        # Any change drops the eager calls recorded with this batch (specsample.call_cache).
        object.__setattr__(self, name, value)
        for kept in ("_seen", "_derived"):
            self.__dict__.pop(kept, None)
        call_cache.forget(self)

    @property
    def num_requests(self) -> int:
        return len(self.params)

    @functools.cached_property
    def num_greedy(self) -> int:
        """How many requests have temperature 0 (``params`` is a tuple: computed once)."""
        return sum(p.greedy for p in self.params)

    @functools.cached_property
    def rank_filters(self) -> tuple[int, bool, bool]:
        """(how many requests are sampled with top_k below V or top_p below 1, whose filter
        cut ranks the row; whether one of them has top_p without top_k; whether a sampled
        request has min_p), computed once."""
        v = self.vocab_size
        sampled = [p for p in self.params if not p.greedy]
        ranked = [(0 < (p.top_k if p.top_k > 0 else 0) < v, p.top_p < 1) for p in sampled]
        ranked = [(k, q) for k, q in ranked if k or q]
        return (len(ranked), any(q and not k for k, q in ranked),
                any(p.min_p > 0 for p in sampled))

    @property
    def processing_in_kernels(self) -> bool:
        """True when the batch sets bans, logit_bias or penalties, with or without min_p /
        top_k / top_p: the Triton kernels apply them (``triton_backend.fused_processing``),
        with one-hot drafts or a draft distribution, and logprobs, unless a request asks for
        more than MAX_FUSED_TOP_N top-n logprobs."""
        return self.needs_general_path and self.max_logprobs <= MAX_FUSED_TOP_N

    @property
    def needs_general_path(self) -> bool:
        """True when a processor beyond temperature and the filters is active (bans, bias,
        penalties). On the Triton backend they take the counted general path unless the
        kernels apply them (``triton_backend.fused_processing``: unless more than 32 top-n
        logprobs).
        Temperature and the filters (min_p, top_k, top_p) are fused."""
        return self.needs_penalties or self.needs_bias or self.needs_bans

    @staticmethod
    def _flat(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(request index, token id) pairs [M] int64 of a dense [N, V] count / mask, each pair
        repeated by its count, ordered by request then id (reads the sizes on the host)."""
        if not dense.shape[1]:
            empty = torch.empty(0, dtype=torch.int64, device=dense.device)
            return empty, empty
        req, ids = dense.nonzero(as_tuple=True)
        reps = dense[req, ids].to(torch.int64)
        return req.repeat_interleave(reps), ids.repeat_interleave(reps)

    def derived(self, name: str, make, *sources: torch.Tensor):
        """``make(self)`` (made outside inference mode), kept under ``name`` while the
        ``sources`` (the batch tensors it reads) are unchanged: a backend's tensors derived
        from the per-request fields, such as stacked seeds. An attribute set, an in-place
        change of a source, or sources that are inference tensors make it again."""
        key = _state_key(sources)
        kept = self.__dict__.setdefault("_derived", {})
        got = kept.get(name)
        if got is None or key is None or got[0] != key:
            with torch.inference_mode(False):
                got = kept[name] = (key, make(self))
        return got[1]

    def _seen_key(self) -> tuple | None:
        if self.output_counts.device.type != "cpu":
            return None  # (a CUDA graph's replay of append() changes them unversioned)
        return _state_key((self.output_counts, self.prompt_mask))

    def seen_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(request, token id) pairs [M] int64 of every recorded prompt and output token
        (``prompt_mask``, ``output_counts`` > 0): the tokens repetition_penalty touches, in
        no set order, a token possibly listed more than once. Found by one scan of the
        [N, V] state (reading its size on the host); on the CPU kept while that state is
        unchanged (in place or replaced), and :meth:`append` adds the tokens it counts for
        the first time, so a decode loop never scans [N, V] again and the pairs stay about
        as many as the distinct tokens. Off the CPU every call scans (a CUDA graph's replay
        of append() changes the state without a trace)."""
        key = self._seen_key()
        kept = self.__dict__.get("_seen")
        if key is not None and kept is not None and kept[0] == key:
            return kept[1], kept[2]
        req, tok = ((self.output_counts > 0) | self.prompt_mask).nonzero(as_tuple=True)
        self.__dict__["_seen"] = (key, req, tok)
        return req, tok

    @property
    def output_req(self) -> torch.Tensor:
        """[no] int64 request of every counted output token occurrence (from ``output_counts``;
        a host synchronisation: for references and tests)."""
        return self._flat(self.output_counts)[0]

    @property
    def output_ids(self) -> torch.Tensor:
        """[no] int64 the counted output token occurrences, by request then id (host sync)."""
        return self._flat(self.output_counts)[1]

    @property
    def prompt_req(self) -> torch.Tensor:
        """[np] int64 request of every distinct prompt token recorded (repetition penalty)."""
        return self._flat(self.prompt_mask)[0]

    @property
    def prompt_ids(self) -> torch.Tensor:
        """[np] int64 the distinct prompt tokens recorded, by request then id (host sync)."""
        return self._flat(self.prompt_mask)[1]

    @classmethod
    @torch.inference_mode(False)  # (normal tensors: append() may run outside inference mode)
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        output_token_ids: Sequence[Sequence[int]] | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> SamplingBatch:
        """Batch ``params`` (one per request) for logits of ``vocab_size`` columns on ``device``.

        ``prompt_token_ids`` / ``output_token_ids``: one token-id sequence per request, needed
        only for penalties (presence / frequency count output tokens; repetition counts prompt
        and output tokens), bad words (the context a word's other tokens must end) and
        min_tokens (the output count); missing lists count as empty. Later outputs can be
        added with :meth:`append` instead of rebuilding. ``eos_token_ids``: ids
        shared by every request that join each request's ``stop_token_ids`` (min_tokens bans
        them). Requests with ``seed=None`` get a fresh seed drawn from torch's default (CPU)
        generator here, and the batch gets ``fresh_counter`` ([1] int64 on ``device``; when no
        request has a user seed, a start in [0, 2**31) drawn from the same generator, else 0):
        calls with ``positions=None`` key their noise by it and advance it in place
        (``specsample.plan.fresh_positions``).

        Raises:
            ValueError: empty ``params``, a non-``SamplingParams`` entry, ``vocab_size < 1``,
                a logit_bias / allowed_token_ids / bad_words_token_ids / stop_token_ids /
                eos_token_ids id outside [0, vocab_size), or token lists of the wrong length /
                with ids outside [0, vocab_size).
        """
        if isinstance(params, SamplingParams) or not isinstance(params, Iterable):
            raise ValueError("params must be a sequence of SamplingParams, one per request "
                             f"(got {type(params).__name__})")
        params = tuple(params)
        if not params:
            raise ValueError("params must hold at least one SamplingParams")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"params[{i}] is {type(p).__name__}, not SamplingParams")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or (
                vocab_size < 1):
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        vocab_size = int(vocab_size)
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
        # (drawn only when positions=None is allowed: no draw for batches with user seeds)
        counter_start = 0 if any(p.seed is not None for p in params) else int(
            torch.randint(0, FRESH_PERIOD, (), dtype=torch.int64))

        eos = () if eos_token_ids is None else _id_tuple(eos_token_ids, "eos_token_ids",
                                                          nonempty=False)

        def check_ids(name: str, ids: Sequence[int]) -> None:
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} holds token ids outside [0, {vocab_size}): {bad[:5]}")

        check_ids("eos_token_ids", eos)
        for i, p in enumerate(params):
            for name in ("allowed_token_ids", "stop_token_ids"):
                check_ids(f"params[{i}].{name}", getattr(p, name) or ())
            for w, word in enumerate(p.bad_words_token_ids or ()):
                check_ids(f"params[{i}].bad_words_token_ids[{w}]", word)

        # min_tokens: the stop tokens of requests still below their min_tokens (row j of a
        # request bans them while num_output + j < min_tokens).
        stop_users = tuple(i for i, p in enumerate(params) if len(outputs[i]) < p.min_tokens)
        static = _static_fields(params, vocab_size, eos, device, stop_users)
        width = static["bad_prefix"].shape[1]
        tail = torch.full((n, width), -1, dtype=torch.int64)
        if width:
            for i in {i for i, p in enumerate(params) if p.bad_words_token_ids}:
                context = (prompts[i] + outputs[i])[-width:]
                if context:
                    tail[i, width - len(context):] = torch.tensor(context)
        cols = vocab_size if static["needs_penalties"] else 0
        counts = torch.zeros(n, cols, dtype=torch.float32)
        prompt = torch.zeros(n, cols, dtype=torch.bool)
        for i, p in enumerate(params):
            if _penalised(p) and outputs[i]:
                counts[i].index_put_((torch.tensor(outputs[i]),), torch.ones(len(outputs[i])),
                                     accumulate=True)
            if p.repetition_penalty != 1 and prompts[i]:
                prompt[i, prompts[i]] = True

        def i64(values):
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            params=params,
            vocab_size=vocab_size,
            device=device,
            seed_lo=i64([s[0] for s in split]),
            seed_hi=i64([s[1] for s in split]),
            output_counts=counts.to(device),
            prompt_mask=prompt.to(device),
            num_output=i64([len(seq) for seq in outputs]),
            context_tail=tail.to(device),
            fresh_counter=i64([counter_start]),
            eos_token_ids=eos,
            **static,
        )

    # ------------------------------------------------------------------ persistent batch

    def append(self, out) -> None:
        """Add the tokens ``out`` emitted to every request's output tokens, in place.

        ``out``: the ``SampleOutput`` or ``VerifyOutput`` of a ``sample()`` / ``verify()``
        call on this batch (N requests, on its device). A request's emitted tokens are its
        accepted drafts and its correction / bonus token (``token_ids[:, :num_accepted + 1]``,
        one token for a SampleOutput); an invalid request emits none. Updates ``num_output``,
        ``output_counts`` (penalised requests) and ``context_tail`` (requests with bad
        words) with device ops whose cost depends on N and K only, never on the history
        length; no host synchronisation (CUDA graphs can capture it). Tokens outside
        [0, vocab_size) are not counted (sample() and verify() never emit them).

        Raises:
            ValueError: ``out`` is not a SampleOutput / VerifyOutput, or its shapes or device
                do not match the batch.
        """
        from .outputs import SampleOutput, VerifyOutput

        n = self.num_requests
        if isinstance(out, VerifyOutput):
            tok = out.token_ids
            if tok.dim() != 2 or tok.shape[0] != n or out.num_accepted.shape != (n,):
                raise ValueError(f"append(): VerifyOutput token_ids must be [{n}, K+1] and "
                                 f"num_accepted [{n}], got {tuple(tok.shape)} and "
                                 f"{tuple(out.num_accepted.shape)}")
            j = torch.arange(tok.shape[1], device=tok.device)
            emitted = j[None, :] <= out.num_accepted[:, None]
        elif isinstance(out, SampleOutput):
            if out.token_ids.shape != (n,):
                raise ValueError(f"append(): SampleOutput token_ids must be [{n}], got "
                                 f"{tuple(out.token_ids.shape)}")
            tok = out.token_ids[:, None]
            emitted = torch.ones_like(tok, dtype=torch.bool)
        else:
            raise ValueError(f"append() takes a SampleOutput or VerifyOutput, got "
                             f"{type(out).__name__}")
        if out.invalid.shape != (n,):
            raise ValueError(f"append(): invalid must be [{n}], got {tuple(out.invalid.shape)}")
        if tok.device != self.num_output.device:
            raise ValueError(f"append(): the output is on {tok.device} but the batch on "
                             f"{self.num_output.device}")
        emitted = emitted & ~out.invalid[:, None] & (tok >= 0) & (tok < self.vocab_size)
        tok = torch.where(emitted, tok, -1)
        count = emitted.sum(1)
        if self.output_counts.shape[1]:
            penal = ((self.presence_penalty != 0) | (self.frequency_penalty != 0)
                     | (self.repetition_penalty != 1))
            # One scatter-add of 0 / 1 per emitted slot into the flat [N * V] counts (exact
            # integers in any order; no sort, capturable).
            flat = torch.arange(n, device=tok.device)[:, None] * self.vocab_size + tok.clamp_min(0)
            counted = emitted & penal[:, None]
            key = self._seen_key()
            kept = self.__dict__.get("_seen")
            if key is not None and kept is not None and kept[0] == key:  # (CPU)
                # seen_pairs gains the tokens seen for the first time (the list stays as
                # long as the distinct tokens, whatever the history length)
                fresh = counted & (self.output_counts.view(-1)[flat] == 0) & ~(
                    self.prompt_mask.view(-1)[flat])
                req, j = fresh.nonzero(as_tuple=True)
                new_pairs = (torch.cat([kept[1], req]), torch.cat([kept[2], tok[req, j]]))
            else:
                new_pairs = None
            self.output_counts.view(-1).scatter_add_(0, flat.reshape(-1),
                                                     counted.to(torch.float32).reshape(-1))
            if new_pairs is not None:
                self.__dict__["_seen"] = (self._seen_key(), *new_pairs)
        width = self.context_tail.shape[1]
        if width:
            # The last W of (tail, emitted tokens): columns count .. count + W - 1.
            seq = torch.cat([self.context_tail, tok], dim=1)
            rolled = seq.gather(1, count[:, None] + torch.arange(width, device=tok.device))
            # (index_fill_ takes the value as a scalar: no host tensor to copy under capture)
            words = torch.zeros(n, dtype=torch.bool, device=tok.device).index_fill_(
                0, self.bad_req, True)
            self.context_tail.copy_(torch.where(words[:, None], rolled, self.context_tail))
        self.num_output.add_(count)

    @torch.inference_mode(False)
    def select(self, indices) -> SamplingBatch:
        """A batch of the requests at ``indices`` (in that order), with their state.

        ``indices``: distinct ints in [0, N) (a sequence or a 1-D CPU integer tensor; at least
        one), e.g. the unfinished requests. Seeds, ``output_counts``, ``prompt_mask``,
        ``num_output`` and ``context_tail`` rows follow their requests (device copies, no host
        read); the result shares this batch's ``fresh_counter``, so calls with
        ``positions=None`` on either draw fresh noise. Tensors are new: CUDA graphs that
        captured this batch must be captured again for the selection.

        Raises:
            ValueError: ``indices`` empty, not ints, out of range or repeated.
        """
        if isinstance(indices, torch.Tensor):
            if indices.device.type != "cpu" or indices.dim() != 1 or (
                    indices.dtype.is_floating_point or indices.dtype == torch.bool):
                raise ValueError("select(): indices must be host ints (a sequence or a 1-D "
                                 "CPU integer tensor)")
            indices = indices.tolist()
        try:
            idx = [_as_int(i, "select() index") for i in indices]
        except TypeError:
            raise ValueError(f"select(): indices must be a sequence of ints, got "
                             f"{type(indices).__name__}") from None
        n = self.num_requests
        if not idx:
            raise ValueError("select(): indices must name at least one request")
        bad = [i for i in idx if not 0 <= i < n]
        if bad:
            raise ValueError(f"select(): indices must be in [0, {n}), got {bad[:5]}")
        if len(set(idx)) != len(idx):
            raise ValueError(f"select(): indices must be distinct, got {idx}")
        params = tuple(self.params[i] for i in idx)
        pos = {i: new for new, i in enumerate(idx)}
        stop_users = tuple(pos[i] for i in self.stop_users if i in pos)
        static = _static_fields(params, self.vocab_size, self.eos_token_ids, self.device,
                                sorted(stop_users))
        rows = torch.tensor(idx, dtype=torch.int64, device=self.device)
        cols = self.vocab_size if static["needs_penalties"] else 0
        return SamplingBatch(
            params=params, vocab_size=self.vocab_size, device=self.device,
            seed_lo=self.seed_lo[rows], seed_hi=self.seed_hi[rows],
            output_counts=self.output_counts[rows, :cols].contiguous(),
            prompt_mask=self.prompt_mask[rows, :cols].contiguous(),
            num_output=self.num_output[rows],
            context_tail=_fit_width(self.context_tail[rows], static["bad_prefix"].shape[1]),
            fresh_counter=self.fresh_counter, eos_token_ids=self.eos_token_ids, **static)

    @staticmethod
    @torch.inference_mode(False)
    def concat(batches: Sequence[SamplingBatch]) -> SamplingBatch:
        """One batch of the requests of ``batches``, in order, with their state.

        The batches must share ``vocab_size``, ``device`` and ``eos_token_ids``. State rows
        are joined (device copies, no host read); ``context_tail`` is widened with -1 on the
        left where a batch's words were shorter (its requests' own words never look further
        back), ``output_counts`` / ``prompt_mask`` get zero rows for a batch without
        penalties (its requests have none). When every batch shares one ``fresh_counter``
        (selections of one batch) the joined batch shares it too; otherwise it gets a new
        tensor holding the largest of their counters: keep using the joined batch then (the
        sources' counters are not advanced by its calls).

        Raises:
            ValueError: no batches, a non-SamplingBatch, the same batch twice, or batches
                that differ in vocab_size, device or eos_token_ids.
        """
        batches = list(batches) if isinstance(batches, Iterable) else None
        if not batches or not all(isinstance(b, SamplingBatch) for b in batches):
            raise ValueError("concat() needs a non-empty sequence of SamplingBatch")
        first = batches[0]
        for b in batches[1:]:
            if (b.vocab_size, b.device, b.eos_token_ids) != (
                    first.vocab_size, first.device, first.eos_token_ids):
                raise ValueError("concat(): batches must share vocab_size, device and "
                                 f"eos_token_ids, got ({first.vocab_size}, {first.device}, "
                                 f"{first.eos_token_ids}) and ({b.vocab_size}, {b.device}, "
                                 f"{b.eos_token_ids})")
        if len({id(b) for b in batches}) < len(batches):
            raise ValueError("concat(): the same batch appears twice (its requests would be "
                             "duplicated with the same seeds and state)")
        params = tuple(p for b in batches for p in b.params)
        stop_users, offset = [], 0
        for b in batches:
            stop_users += [offset + i for i in b.stop_users]
            offset += b.num_requests
        static = _static_fields(params, first.vocab_size, first.eos_token_ids, first.device,
                                tuple(stop_users))
        width = static["bad_prefix"].shape[1]
        cols = first.vocab_size if static["needs_penalties"] else 0

        def dense(b: SamplingBatch, t: torch.Tensor) -> torch.Tensor:
            return t if t.shape[1] == cols else torch.zeros(
                b.num_requests, cols, dtype=t.dtype, device=t.device)

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(b, name) for b in batches])

        return SamplingBatch(
            params=params, vocab_size=first.vocab_size, device=first.device,
            seed_lo=cat("seed_lo"), seed_hi=cat("seed_hi"),
            output_counts=torch.cat([dense(b, b.output_counts) for b in batches]),
            prompt_mask=torch.cat([dense(b, b.prompt_mask) for b in batches]),
            num_output=cat("num_output"),
            context_tail=torch.cat([_fit_width(b.context_tail, width) for b in batches]),
            fresh_counter=(first.fresh_counter if all(
                b.fresh_counter is first.fresh_counter for b in batches) else
                torch.stack([b.fresh_counter for b in batches]).amax(0)),
            eos_token_ids=first.eos_token_ids, **static)

    def refresh_min_tokens(self) -> bool:
        """Drop the stop-token bans of requests that reached their min_tokens; one host read.

        :meth:`append` counts outputs on the device, so the host does not know when a
        request passes its min_tokens: its stop tokens stay in ``stop_req`` (banned only
        while ``num_output + j < min_tokens``, so results are exact) and ``needs_bans``
        stays True (the Triton kernels keep looking them up; with more than 32 top-n logprobs the
        batch keeps the general path). Call this where the
        caller synchronises anyway (e.g. after reading the tokens); it reads ``num_output``
        (only when some request still has stop-token entries) and rebuilds the entries.
        Returns whether anything changed; when it did, the stop-token tensors are new, so
        CUDA graphs that captured this batch must be captured again.
        """
        if not self.stop_users:
            return False
        num_output = self.num_output.tolist()
        mins = [p.min_tokens for p in self.params]
        keep = tuple(i for i in self.stop_users if num_output[i] < mins[i])
        if keep == self.stop_users:
            return False
        static = _static_fields(self.params, self.vocab_size, self.eos_token_ids, self.device,
                                keep)
        for name in ("stop_req", "stop_ids", "stop_users", "stop_start", "ban_width",
                     "needs_bans"):
            setattr(self, name, static[name])
        return True
