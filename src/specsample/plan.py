"""The validated, device-resident description of one sample() / verify() call.

``build_plan`` checks shapes and types (raising ``ValueError``) and derives the row layout of
docs/semantics.md: which request and draft index each target row belongs to, the effective
number of drafts after placeholders, and the absolute position of every row. Backends consume a
``Plan`` and never re-derive any of it.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .params import FRESH_PERIOD, FRESH_STRIDE, SamplingBatch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
METHODS = ("token", "block")
#: Error bit (the per-request ``err`` bitmask of the backends, next to torch_backend's ERR_*):
#: a device-resident ``num_draft_tokens`` that could not be checked on the host was wrong: the
#: request's entry is negative or above ``max_num_draft_tokens``, or (every request) the
#: entries do not sum to the number of drafts (``draft_token_ids.shape[0]``).
ERR_NUM_DRAFT_TOKENS = 1 << 8
ERR_NUM_DRAFT_TOKENS_TEXT = ("num_draft_tokens entry negative or above max_num_draft_tokens, or "
                             "the entries do not sum to the number of drafts")


@dataclass
class Plan:
    """One call's inputs and row layout. Shapes: N requests, T rows, S = sum k_i drafts.

    Host layout (``num_draft`` a tuple): the layout tensors are built from the host k_i.
    Device layout (``num_draft`` None: a device ``num_draft_tokens`` with
    ``max_num_draft_tokens``): they are derived on the device from T and S (host shapes) and
    the device k_i, never read on the host; ``layout_err`` then flags requests whose k_i could
    not be laid out (their ``k_given`` is 0 and every row but their first, and every draft, is
    dead), and the caller must mark those requests invalid in the output.
    """

    logits: torch.Tensor  # [T, V] raw target logits
    batch: SamplingBatch
    num_draft: tuple[int, ...] | None  # k_i as given (host), None for a device layout
    max_k: int  # K: the output width is K + 1 (max k_i, or max_num_draft_tokens)
    method: str
    positions: torch.Tensor  # [N] int64
    draft_token_ids: torch.Tensor  # [S] int64 (as given; -1 placeholders)
    draft_logits: torch.Tensor | None  # [S, V'] raw drafter logits
    draft_probs: torch.Tensor | None  # [S, V'] drafter probabilities
    row_start: torch.Tensor  # [N] int64
    draft_start: torch.Tensor  # [N] int64
    row_req: torch.Tensor  # [T] int64
    row_j: torch.Tensor  # [T] int64
    draft_req: torch.Tensor  # [S] int64
    draft_j: torch.Tensor  # [S] int64
    k_given: torch.Tensor  # [N] int64, the k_i as given (0 where layout_err is set)
    layout_err: torch.Tensor | None = None  # [N] int64 ERR_NUM_DRAFT_TOKENS bits (device layout)

    @functools.cached_property
    def draft_id_range(self) -> tuple[int, int] | None:
        """(smallest, largest) draft id, read on the host (:func:`_host_range`) when the drafts
        are CPU tensors; None off the CPU (reading would synchronise) or without drafts."""
        d = self.draft_token_ids
        if d.numel() == 0 or d.device.type != "cpu":
            return None
        return _host_range(d)

    @functools.cached_property
    def placeholder_free(self) -> bool:
        """True when the host knows that the layout comes from host k_i and no draft is a
        placeholder (-1): then k_eff is k_given and every row is live. The drafts are read
        on the host only on the CPU (elsewhere that would synchronise): False off the CPU
        unless there are no drafts."""
        d = self.draft_token_ids
        if self.num_draft is None:
            return False
        if d.numel() == 0:
            return True
        ids = self.draft_id_range
        return ids is not None and (ids[0] >= 0 or not bool((d == -1).any()))

    @functools.cached_property
    def uniform(self) -> bool:
        """True when every request has K = max_k drafts given (host layout): row r of
        request i is i (K + 1) + j, its draft i K + j."""
        return self.num_draft is not None and all(k == self.max_k for k in self.num_draft)

    def rows_per_request(self) -> tuple[torch.Tensor, int]:
        """([N] int64 how many rows each request has, the most any has): k_i + 1 rows from
        ``row_start[i]``."""
        return self.k_given + 1, self.max_k + 1

    @functools.cached_property
    def k_eff(self) -> torch.Tensor:
        """[N] int64: drafts before the request's first placeholder (-1), else k_i."""
        if self.draft_token_ids.numel() == 0 or self.placeholder_free:
            return self.k_given
        first = torch.where(self.draft_token_ids == -1, self.draft_j,
                            self.k_given[self.draft_req])
        return self.k_given.scatter_reduce(0, self.draft_req, first, reduce="amin",
                                           include_self=True)

    @functools.cached_property
    def draft_grid(self) -> torch.Tensor:
        """[N, K] int64: request i's live drafts d_0..d_{k_eff-1}, then -1 (placeholders, pad)."""
        k = self.max_k
        if self.uniform and self.placeholder_free:
            return self.draft_token_ids.view(self.num_requests, k)
        j = torch.arange(k, device=self.logits.device)
        if not self.draft_token_ids.numel():
            return torch.full((self.num_requests, k), -1, dtype=torch.int64,
                              device=self.logits.device)
        idx = (self.draft_start[:, None] + j).clamp_max(self.draft_token_ids.numel() - 1)
        d = self.draft_token_ids[idx]
        return torch.where(j < self.k_eff[:, None], d, torch.full_like(d, -1))

    @property
    def vocab_size(self) -> int:
        return self.logits.shape[1]

    @property
    def num_requests(self) -> int:
        return self.batch.num_requests

    @property
    def num_rows(self) -> int:
        return self.logits.shape[0]

    @property
    def has_draft_dist(self) -> bool:
        return self.draft_logits is not None or self.draft_probs is not None

    @functools.cached_property
    def row_pos(self) -> torch.Tensor:
        """[T] int64 absolute position of every row."""
        if self.num_rows == self.num_requests:  # (one row per request: j = 0)
            return self.positions
        return self.positions[self.row_req] + self.row_j

    @functools.cached_property
    def row_live(self) -> torch.Tensor:
        """[T] bool: the row is read (j <= k_eff of its request). Read only: CPU rows
        without placeholders share one tensor per row count."""
        if self.placeholder_free and self.logits.device.type == "cpu":  # (every row live)
            return _all_live(self.num_rows)
        return self.row_j <= self.k_eff[self.row_req]

    @functools.cached_property
    def draft_live(self) -> torch.Tensor:
        """[S] bool: the draft is read (before the request's first placeholder)."""
        return self.draft_j < self.k_eff[self.draft_req]

    def prior_draft_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, token) pairs: each live draft j' counted at rows j' + 1 .. k_eff of its request.
        Ids outside [0, V) are left out (their request is invalid: ERR_DRAFT_ID), or where
        the layout is the host's without placeholders, clamped into [0, V) (pairs at fixed
        places, cached per layout); either way only that invalid request's rows see them."""
        if self.draft_token_ids.numel() == 0:
            empty = self.draft_token_ids.new_empty(0)
            return empty, empty
        if self.placeholder_free:  # (every draft live, k_eff = k_i: the pairs' places are
            # fixed by the host k_i; an id outside [0, V) is clamped instead of left out: only
            # its own request's rows see it, and that request is invalid)
            rows, didx = _prior_pattern(self.num_draft, self.logits.device)
            return rows, self.draft_token_ids[didx].clamp(0, self.vocab_size - 1)
        kmax = self.max_k
        dj = self.draft_j[:, None]
        later = dj + 1 + torch.arange(kmax, device=dj.device)[None, :]  # [S, K] row js
        d = self.draft_token_ids
        ok = (self.draft_live & (d >= 0) & (d < self.vocab_size))[:, None] & (
            later <= self.k_eff[self.draft_req][:, None])
        rows = (self.row_start[self.draft_req][:, None] + later)[ok]
        toks = self.draft_token_ids[:, None].expand_as(later)[ok]
        return rows, toks


def _host_range(t: torch.Tensor) -> tuple[int, int]:
    """(smallest, largest) entry of a non-empty CPU integer tensor, read on the host: a few
    values as a list (cheaper than a reduction), more by one ``aminmax``."""
    if t.numel() <= 64:
        values = t.tolist()
        return min(values), max(values)
    lo, hi = torch.aminmax(t)
    return int(lo), int(hi)


@functools.lru_cache(maxsize=64)
def _all_live(num_rows: int) -> torch.Tensor:
    """[T] bool CPU tensor, every entry True (:attr:`Plan.row_live` of CPU rows without
    placeholders; read only)."""
    with torch.inference_mode(False):
        return torch.ones(num_rows, dtype=torch.bool)


@functools.lru_cache(maxsize=256)
def _prior_pattern(num_draft: tuple[int, ...], device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [P], draft indices [P]) int64 of :meth:`Plan.prior_draft_pairs` for a host
    layout without placeholders: draft j' of request i at its rows j' + 1 .. k_i (cached)."""
    rows, didx = [], []
    r = s = 0
    for k in num_draft:
        for j in range(1, k + 1):
            rows += [r + j] * j
            didx += range(s, s + j)
        r += k + 1
        s += k
    return (torch.tensor(rows, dtype=torch.int64, device=device),
            torch.tensor(didx, dtype=torch.int64, device=device))


@functools.lru_cache(maxsize=256)
def _layout(num_draft: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Row layout tensors for one tuple of k_i (cached: no host-to-device copy on replay)."""
    row_start, draft_start, row_req, row_j, draft_req, draft_j = [], [], [], [], [], []
    r = s = 0
    for i, k in enumerate(num_draft):
        row_start.append(r)
        draft_start.append(s)
        row_req += [i] * (k + 1)
        row_j += list(range(k + 1))
        draft_req += [i] * k
        draft_j += list(range(k))
        r += k + 1
        s += k
    return tuple(torch.tensor(x, dtype=torch.int64, device=device) for x in (
        row_start, draft_start, row_req, row_j, draft_req, draft_j, list(num_draft)))


def _device_layout(k: torch.Tensor, max_k: int, num_rows: int, num_drafts: int
                   ) -> tuple[torch.Tensor, ...]:
    """Row layout tensors (as :func:`_layout`, then the [N] ERR_NUM_DRAFT_TOKENS bits) derived
    on ``k``'s device from a device ``k`` ([N] int64) that is never read on the host.

    T = ``num_rows`` and S = ``num_drafts`` are host shapes (T = N + S is checked by the
    caller). If some k_i < 0 or sum k_i != S the whole batch is flagged and laid out as if
    every k_i were 0; a k_i > ``max_k`` (the output width) flags that request alone, whose
    rows and drafts keep their places but are dead (``k_given`` 0). Every index stays in
    bounds: rows and drafts no request owns map to the last request with j > its k_given.
    Device ops only (cumsum, searchsorted): capturable in a CUDA graph. The Triton backend
    passes ``triton_backend.layout.device_layout`` to :func:`build_plan` instead (the same
    tensors from one launch).
    """
    n = k.shape[0]
    dev = k.device
    kc = k.clamp(0, num_drafts + 1)  # (no overflow in the sum; any k_i > S breaks the sum)
    batch_ok = (k >= 0).all() & (kc.sum() == num_drafts)
    fits = batch_ok & (k <= max_k)
    lay = torch.where(batch_ok, kc, 0)
    k_given = torch.where(fits, k, 0)
    draft_end = lay.cumsum(0)
    draft_start = draft_end - lay
    row_end = draft_end + torch.arange(1, n + 1, device=dev)
    row_start = row_end - lay - 1
    r = torch.arange(num_rows, device=dev)
    row_req = torch.searchsorted(row_end, r, right=True).clamp_max(n - 1)
    row_j = r - row_start[row_req]
    d = torch.arange(num_drafts, device=dev)
    draft_req = torch.searchsorted(draft_end, d, right=True).clamp_max(n - 1)
    draft_j = d - draft_start[draft_req]
    err = torch.where(fits, 0, ERR_NUM_DRAFT_TOKENS)
    return row_start, draft_start, row_req, row_j, draft_req, draft_j, k_given, err


def _is_device_tensor(t) -> bool:
    """True for a tensor that reading on the host would synchronise with (not on the CPU)."""
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _check_num_draft_tensor(t: torch.Tensor, n: int) -> None:
    if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or (
            t.dtype == torch.bool):
        raise ValueError("num_draft_tokens must be a 1-D integer tensor or a list of ints, "
                         f"got a {t.dim()}-D {t.dtype} tensor")
    if t.shape[0] != n:
        raise ValueError(f"num_draft_tokens has {t.shape[0]} entries for {n} requests")


def _num_draft_tuple(num_draft_tokens, n: int) -> tuple[int, ...]:
    if isinstance(num_draft_tokens, torch.Tensor):
        _check_num_draft_tensor(num_draft_tokens, n)
        values = [int(v) for v in num_draft_tokens.tolist()]  # a device tensor: one sync
    elif type(num_draft_tokens) in (list, tuple) and all(
            type(v) is int for v in num_draft_tokens):
        values = num_draft_tokens  # (the usual host list of ints: no per-item conversion)
    else:
        try:
            values = list(num_draft_tokens)
        except TypeError:
            raise ValueError("num_draft_tokens must be a 1-D integer tensor or a list of ints, "
                             f"got {type(num_draft_tokens).__name__}") from None
        for idx, v in enumerate(values):
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise ValueError(f"num_draft_tokens must hold ints, got {v!r}")
            values[idx] = operator.index(v)  # numpy integers too
    if len(values) != n:
        raise ValueError(f"num_draft_tokens has {len(values)} entries for {n} requests")
    if values and min(values) < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {list(values)}")
    return tuple(values)


def _max_num_draft(value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__") or (
            isinstance(value, torch.Tensor)):
        raise ValueError(f"max_num_draft_tokens must be None or an int >= 0, got {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"max_num_draft_tokens must be >= 0, got {value}")
    return value


def _check_float_matrix(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_fresh_positions(batch: SamplingBatch) -> None:
    """ValueError when a request of ``batch`` has a user-given seed (positions are required
    then: fresh positions are only for batches without user seeds)."""
    if batch.user_seeded:
        raise ValueError("positions is required when a request has a user-given seed")


def fresh_positions(batch: SamplingBatch, device: torch.device | None = None) -> torch.Tensor:
    """[N] int64 positions for a call with ``positions=None``; advances the batch's counter.

    Every request gets ``(c mod FRESH_PERIOD) * FRESH_STRIDE`` (2**31 * (c mod 2**31)), ``c``
    the value of ``batch.fresh_counter`` ([1] int64) before the call; then
    ``batch.fresh_counter.add_(1)`` in place. Device ops only (no host work, no torch
    generator), so a captured CUDA graph advances the counter at every replay. Rows j < 2**31
    of consecutive calls never share a position, so no key (seed, position + j) repeats
    within 2**31 calls; the largest position, plus any row offset, stays below 2**62. Requests
    of one call share the position but have distinct random seeds (only batches without user
    seeds get here). ``device``: where the positions go (default the batch's device).

    Raises:
        ValueError: a request of ``batch`` has a user-given seed (positions are required).
    """
    check_fresh_positions(batch)
    counter = batch.fresh_counter
    pos = counter.remainder(FRESH_PERIOD).mul_(FRESH_STRIDE).repeat(batch.num_requests)
    counter.add_(1)  # after pos was computed from it (same stream)
    return pos if device is None else pos.to(device)


def _positions(positions, batch: SamplingBatch, n: int, device: torch.device,
               fresh: Callable | None = None) -> torch.Tensor:
    if positions is None:
        if fresh is not None and batch.fresh_counter.device == device:
            return fresh(batch)
        return fresh_positions(batch, device)
    if not isinstance(positions, torch.Tensor):
        try:
            positions = torch.as_tensor(positions)  # no dtype: floats must not be truncated
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise ValueError(f"positions must be integers in [0, 2**63): {exc}") from None
    if positions.dim() != 1 or positions.shape[0] != n:
        raise ValueError(f"positions must have shape [{n}], got {tuple(positions.shape)}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions must be an integer tensor, got {positions.dtype}")
    if positions.device.type == "cpu" and positions.numel() and _host_range(positions)[0] < 0:
        # (checked for host tensors and lists only: a device tensor would need a sync)
        raise ValueError(f"positions must be >= 0, got {positions.tolist()}")
    # (contiguous: the Triton kernels index positions by request without a stride)
    return positions.to(device=device, dtype=torch.int64).contiguous()


def _check_batch_device(name: str, device: torch.device, batch: SamplingBatch) -> None:
    """ValueError unless ``batch``'s tensors are on ``device`` (a batch built for "cuda" is
    on the device that was current then)."""
    if device != batch.temperature.device:
        raise ValueError(f"{name} are on {device} but the batch on {batch.temperature.device}")


def build_plan(
    logits: torch.Tensor,
    batch: SamplingBatch,
    *,
    draft_token_ids: torch.Tensor | Sequence[int] | None,
    num_draft_tokens,
    draft_logits: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    positions,
    method: str,
    logits_name: str = "target_logits",
    max_num_draft_tokens: int | None = None,
    device_layout: Callable | None = None,
    fresh: Callable | None = None,
) -> Plan:
    """Validate one call's inputs and derive its row layout.

    ``logits_name`` is the logits argument's name in the caller (for error messages).
    ``max_num_draft_tokens``: None (K = max k_i) or K >= every k_i, the output width K + 1.
    A device (non-CPU) ``num_draft_tokens`` tensor with ``max_num_draft_tokens`` is not read
    on the host: the layout is derived on the device (:func:`_device_layout`), S is
    ``draft_token_ids.shape[0]``, and wrong entries set ``Plan.layout_err`` instead of raising;
    without ``max_num_draft_tokens`` it is read on the host (one synchronisation).
    ``device_layout``: a function with :func:`_device_layout`'s arguments and results that
    builds that layout instead (the Triton backend's one launch); None: ``_device_layout``.
    ``fresh``: a function with :func:`fresh_positions`'s results (``fresh(batch)``) that makes
    the positions of ``positions=None`` when the batch's counter is on the logits' device (the
    Triton backend's one launch); None: :func:`fresh_positions`.

    Raises:
        ValueError: naming the argument, for a wrong type, dtype, shape, device, a negative
            num_draft_tokens entry (host values), a host entry above max_num_draft_tokens, a
            negative or non-int max_num_draft_tokens, both draft_logits and draft_probs,
            V' > V, an unknown method, or missing positions while a request has a user-given
            seed.

    With ``positions=None`` the positions come from :func:`fresh_positions`, which advances
    ``batch.fresh_counter`` by 1 (only once every other argument has been validated).
    """
    if not isinstance(batch, SamplingBatch):
        raise ValueError(f"batch must be a SamplingBatch, got {type(batch).__name__}")
    _check_float_matrix(logits_name, logits)
    n = batch.num_requests
    if logits.shape[1] != batch.vocab_size:
        raise ValueError(f"logits have {logits.shape[1]} columns but the batch was built for "
                         f"vocab_size={batch.vocab_size}")
    _check_batch_device("logits", logits.device, batch)
    if method not in METHODS:
        raise ValueError(f"method must be 'token' or 'block', got {method!r}")
    max_k = _max_num_draft(max_num_draft_tokens)
    device = logits.device
    if draft_token_ids is None:
        draft_token_ids = torch.empty(0, dtype=torch.int64, device=device)
    elif not isinstance(draft_token_ids, torch.Tensor):
        draft_token_ids = torch.as_tensor(list(draft_token_ids))  # floats are rejected below
        if draft_token_ids.numel() == 0:
            draft_token_ids = draft_token_ids.to(torch.int64)
    if draft_token_ids.dim() != 1 or draft_token_ids.dtype.is_floating_point or (
        draft_token_ids.dtype == torch.bool
    ):
        raise ValueError("draft_token_ids must be a 1-D integer tensor, got a "
                         f"{draft_token_ids.dim()}-D {draft_token_ids.dtype} tensor")
    on_device = max_k is not None and _is_device_tensor(num_draft_tokens)
    if on_device:
        _check_num_draft_tensor(num_draft_tokens, n)
        num_draft = None
        s = draft_token_ids.shape[0]
        if logits.shape[0] != n + s:
            raise ValueError(f"target_logits has {logits.shape[0]} rows; expected N + "
                             f"len(draft_token_ids) = {n} + {s} = {n + s}")
    else:
        num_draft = _num_draft_tuple(num_draft_tokens, n)
        if max_k is None:
            max_k = max(num_draft)
        elif max(num_draft) > max_k:
            raise ValueError(f"num_draft_tokens entries must be <= max_num_draft_tokens = "
                             f"{max_k}, got {list(num_draft)}")
        s = sum(num_draft)
        if logits.shape[0] != n + s:
            raise ValueError(f"target_logits has {logits.shape[0]} rows; expected N + sum k = "
                             f"{n} + {s} = {n + s}")
        if draft_token_ids.shape[0] != s:
            raise ValueError(f"draft_token_ids has {draft_token_ids.shape[0]} entries; "
                             f"sum(num_draft_tokens) = {s}")
    # (contiguous: the Triton kernels index the drafts without a stride)
    draft_token_ids = draft_token_ids.to(device=device, dtype=torch.int64).contiguous()
    if draft_logits is not None and draft_probs is not None:
        raise ValueError("give draft_logits or draft_probs, not both")
    for name, d in (("draft_logits", draft_logits), ("draft_probs", draft_probs)):
        if d is None:
            continue
        _check_float_matrix(name, d)
        if d.shape[0] != s:
            raise ValueError(f"{name} has {d.shape[0]} rows; the number of drafts is {s}")
        if not 1 <= d.shape[1] <= logits.shape[1]:
            raise ValueError(f"{name} has {d.shape[1]} columns; the draft vocabulary must be "
                             f"1..{logits.shape[1]} (the target's)")
        if d.device != device:
            raise ValueError(f"{name} is on {d.device} but target_logits on {device}")
    pos = _positions(positions, batch, n, device, fresh)
    layout_err = None
    if on_device:
        k = num_draft_tokens.to(device=device, dtype=torch.int64).contiguous()
        *layout, layout_err = (device_layout or _device_layout)(k, max_k, logits.shape[0], s)
    else:
        layout = _layout(num_draft, device)
    row_start, draft_start, row_req, row_j, draft_req, draft_j, k_given = layout
    return Plan(
        logits=logits, batch=batch, num_draft=num_draft, max_k=max_k, method=method,
        positions=pos, draft_token_ids=draft_token_ids, draft_logits=draft_logits,
        draft_probs=draft_probs, row_start=row_start, draft_start=draft_start, row_req=row_req,
        row_j=row_j, draft_req=draft_req, draft_j=draft_j, k_given=k_given,
        layout_err=layout_err,
    )
