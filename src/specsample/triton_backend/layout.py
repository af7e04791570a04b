"""The row layout of a call whose ``num_draft_tokens`` is a device tensor, in one launch.

``plan._device_layout`` derives the layout tensors from the device k_i with about 25 small
PyTorch operations (cumsum, searchsorted, ...): each is a kernel of its own, so a captured
step paid 50-60 us of launches for them on an H200. ``layout_kernel`` writes the same
tensors, bit for bit, from one program: two loops over the requests (validity, then the
prefix sums and each request's rows and drafts), then the rows and drafts no request owns.
No host read, so a CUDA graph with changing draft counts replays it.

``fresh_positions`` is ``plan.fresh_positions`` (the positions of a call with
``positions=None``) in one launch instead of four tensor operations, so that such an eager call
is only launches and ``specsample.call_cache`` can replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..params import FRESH_PERIOD, FRESH_STRIDE
from ..plan import ERR_NUM_DRAFT_TOKENS, check_fresh_positions
from .launch import launch, wait_for_prior_grid

BLOCK_N = 256  # requests per step of the loops
BLOCK_J = 8  # rows per request per step of the scatter
_ERR = tl.constexpr(ERR_NUM_DRAFT_TOKENS)
_PERIOD = tl.constexpr(FRESH_PERIOD)
_STRIDE = tl.constexpr(FRESH_STRIDE)


@triton.jit(do_not_specialize=["N"])
def fresh_positions_kernel(counter_ptr, pos_ptr, N, BLOCK: tl.constexpr, GDC: tl.constexpr):
    """Grid (1,). counter [1] int64 (the batch's ``fresh_counter``, c); writes pos [N] int64
    = (c mod FRESH_PERIOD) * FRESH_STRIDE, then sets the counter to c + 1 (one program: it
    reads the counter before it writes it)."""
    wait_for_prior_grid(GDC)
    c = tl.load(counter_ptr)
    p = (c % _PERIOD) * _STRIDE
    offs = tl.arange(0, BLOCK)
    for b in range(0, N, BLOCK):
        i = b + offs
        tl.store(pos_ptr + i, tl.zeros((BLOCK,), tl.int64) + p, mask=i < N)
    tl.store(counter_ptr, c + 1)


def fresh_positions(batch) -> torch.Tensor:
    """``plan.fresh_positions(batch)`` on the batch's device in one launch: [N] int64
    positions from ``batch.fresh_counter``, which it advances by 1 (same values, same
    errors)."""
    check_fresh_positions(batch)
    counter = batch.fresh_counter
    n = batch.num_requests
    pos = torch.empty(n, dtype=torch.int64, device=counter.device)
    launch(fresh_positions_kernel)[(1,)](counter, pos, n, BLOCK=BLOCK_N)
    return pos


@triton.jit(do_not_specialize=["N", "S", "T", "max_k"])
def layout_kernel(k_ptr, N, S, T, max_k, row_start_ptr, draft_start_ptr, row_req_ptr,
                  row_j_ptr, draft_req_ptr, draft_j_ptr, k_given_ptr, err_ptr,
                  BLOCK: tl.constexpr, BJ: tl.constexpr, GDC: tl.constexpr):
    """Grid (1,). k [N] int64 (device, never read on the host); N requests, S drafts,
    T = N + S rows, the output width ``max_k`` + 1. Writes the [N] row_start, draft_start,
    k_given, err, the [T] row_req, row_j and the [S] draft_req, draft_j of
    ``plan._device_layout``: if some k_i < 0 or sum k_i != S every request is flagged and laid
    out with k_i = 0 (rows and drafts no request owns go to the last request, with j past its
    k_given); a k_i > max_k flags that request alone, whose rows keep their places."""
    wait_for_prior_grid(GDC)
    offs = tl.arange(0, BLOCK)
    s64 = S.to(tl.int64)
    neg = N * 0
    tot = s64 * 0
    for b in range(0, N, BLOCK):
        i = b + offs
        m = i < N
        k = tl.load(k_ptr + i, mask=m, other=0)
        neg += tl.sum((k < 0).to(tl.int32), 0)
        tot += tl.sum(tl.minimum(tl.maximum(k, 0), s64 + 1), 0)
    ok = (neg == 0) & (tot == s64)
    js = tl.arange(0, BJ)
    carry = s64 * 0
    for b in range(0, N, BLOCK):
        i = b + offs
        m = i < N
        k = tl.load(k_ptr + i, mask=m, other=0)
        lay = tl.where(ok & m, tl.minimum(tl.maximum(k, 0), s64 + 1), 0)
        fits = ok & (k <= max_k)
        dstart = carry + tl.cumsum(lay, 0) - lay
        rstart = dstart + i
        tl.store(draft_start_ptr + i, dstart, mask=m)
        tl.store(row_start_ptr + i, rstart, mask=m)
        tl.store(k_given_ptr + i, tl.where(fits, k, 0), mask=m)
        tl.store(err_ptr + i, tl.where(fits, 0, _ERR).to(tl.int64), mask=m)
        req = tl.broadcast_to(i[:, None].to(tl.int64), (BLOCK, BJ))
        top = tl.max(lay, 0).to(tl.int32)  # rows j = 0..lay of each request
        for j0 in range(0, top + 1, BJ):
            j = (j0 + js)[None, :].to(tl.int64)
            jj = tl.broadcast_to(j, (BLOCK, BJ))
            tl.store(row_req_ptr + rstart[:, None] + j, req, mask=m[:, None] & (j <= lay[:, None]))
            tl.store(row_j_ptr + rstart[:, None] + j, jj, mask=m[:, None] & (j <= lay[:, None]))
            tl.store(draft_req_ptr + dstart[:, None] + j, req, mask=m[:, None] & (j < lay[:, None]))
            tl.store(draft_j_ptr + dstart[:, None] + j, jj, mask=m[:, None] & (j < lay[:, None]))
        carry += tl.sum(lay, 0)
    # A flagged batch owns rows 0..N-1 and no draft: the rest go to request N - 1, whose row
    # and draft starts are N - 1 and 0.
    last = (N - 1).to(tl.int64)
    for b in range(N, T, BLOCK):
        r = b + offs
        m = (r < T) & (ok == 0)
        tl.store(row_req_ptr + r, tl.broadcast_to(last, (BLOCK,)), mask=m)
        tl.store(row_j_ptr + r, r.to(tl.int64) - last, mask=m)
    for b in range(0, S, BLOCK):
        d = b + offs
        m = (d < S) & (ok == 0)
        tl.store(draft_req_ptr + d, tl.broadcast_to(last, (BLOCK,)), mask=m)
        tl.store(draft_j_ptr + d, d.to(tl.int64), mask=m)


def _even(n: int) -> int:
    return n + (n & 1)


def device_layout(k: torch.Tensor, max_k: int, num_rows: int, num_drafts: int
                  ) -> tuple[torch.Tensor, ...]:
    """``plan._device_layout`` in one launch: the same eight int64 tensors (row_start,
    draft_start, row_req, row_j, draft_req, draft_j, k_given, err), the same values.

    ``k``: [N] int64 on the device (contiguous); ``num_rows`` T = N + ``num_drafts`` S (host
    shapes, checked by the caller). The tensors are views of one buffer, each starting on a
    16-byte boundary (the kernels that read them are specialised on pointer alignment).
    """
    n = k.shape[0]
    sizes = (n, n, num_rows, num_rows, num_drafts, num_drafts, n, n)
    buf = torch.empty(sum(_even(s) for s in sizes), dtype=torch.int64, device=k.device)
    views, at = [], 0
    for s in sizes:
        views.append(buf[at:at + s])
        at += _even(s)
    if n:
        launch(layout_kernel)[(1,)](k, n, num_drafts, num_rows, max_k, *views,
                                    BLOCK=BLOCK_N, BJ=BLOCK_J)
    return tuple(views)


@triton.jit(do_not_specialize=["W", "L"])
def mark_kernel(layout_err_ptr, token_ids_ptr, W, num_accepted_ptr, invalid_ptr, err_ptr,
                lp_ptr, lp_ids_ptr, L, HAS_LP: tl.constexpr, BLOCK: tl.constexpr,
                GDC: tl.constexpr):
    """Grid (N,): request i with ``layout_err[i] != 0`` becomes invalid in place: its W token
    ids -1, num_accepted 0, ``err[i] |= layout_err[i]``, its W x L logprobs -inf and their
    ids -1 (``HAS_LP``). Other requests are not touched."""
    wait_for_prior_grid(GDC)
    i = tl.program_id(0).to(tl.int64)
    e = tl.load(layout_err_ptr + i)
    if e != 0:
        offs = tl.arange(0, BLOCK)
        for w0 in range(0, W, BLOCK):
            w = w0 + offs
            tl.store(token_ids_ptr + i * W + w, tl.full([BLOCK], -1, tl.int64), mask=w < W)
        tl.store(num_accepted_ptr + i, 0)
        tl.store(invalid_ptr + i, 1)
        tl.store(err_ptr + i, tl.load(err_ptr + i) | e)
        if HAS_LP:
            n = W * L
            for a0 in range(0, n, BLOCK):
                a = a0 + offs
                tl.store(lp_ptr + i * n + a, tl.full([BLOCK], float("-inf"), tl.float32),
                         mask=a < n)
                tl.store(lp_ids_ptr + i * n + a, tl.full([BLOCK], -1, tl.int64), mask=a < n)


def mark_layout_errors(out, err: torch.Tensor, layout_err: torch.Tensor):
    """``api._mark_layout_errors`` in one launch, in place on the backend's outputs
    (``out`` a VerifyOutput: token_ids [N, W] int64, num_accepted [N] int64, invalid [N]
    bool, logprobs [N, W, L] float32 and their int64 ids, or None; ``err`` [N] int64).
    Returns (out, err), with contiguous copies where a tensor was not contiguous."""
    n, width = out.token_ids.shape
    if not n:
        return out, err
    fields = {f: getattr(out, f) for f in ("token_ids", "num_accepted", "invalid", "logprobs",
                                            "logprob_token_ids")}
    fields = {f: None if t is None else t.contiguous() for f, t in fields.items()}
    err = err.contiguous()
    lp, ids = fields["logprobs"], fields["logprob_token_ids"]
    has_lp = lp is not None
    launch(mark_kernel)[(n,)](
        layout_err, fields["token_ids"], width, fields["num_accepted"], fields["invalid"], err,
        lp if has_lp else err, ids if has_lp else err, lp.shape[2] if has_lp else 0,
        HAS_LP=has_lp, BLOCK=32)
    return type(out)(**fields), err


def warm(device: torch.device) -> None:
    """Launch ``layout_kernel``, both variants of ``mark_kernel`` (with and without
    logprobs) and ``fresh_positions_kernel`` once on small valid inputs on ``device``
    (``warmup()``: every call with a device ``num_draft_tokens`` launches the first two, whatever
    the rest of the call, and every call with ``positions=None`` the last)."""
    from ..outputs import VerifyOutput
    from ..params import SamplingBatch, SamplingParams

    device_layout(torch.tensor([2, 1], device=device), 2, 5, 3)
    fresh_positions(SamplingBatch.from_params([SamplingParams()], vocab_size=1, device=device))
    for n_lp in (None, 2):
        lp = None if n_lp is None else torch.zeros(2, 3, n_lp, device=device)
        out = VerifyOutput(
            token_ids=torch.zeros(2, 3, dtype=torch.int64, device=device),
            num_accepted=torch.zeros(2, dtype=torch.int64, device=device), logprobs=lp,
            logprob_token_ids=None if lp is None else torch.zeros(2, 3, n_lp, dtype=torch.int64,
                                                                  device=device),
            invalid=torch.zeros(2, dtype=torch.bool, device=device))
        mark_layout_errors(out, torch.zeros(2, dtype=torch.int64, device=device),
                           torch.tensor([0, ERR_NUM_DRAFT_TOKENS], device=device))
