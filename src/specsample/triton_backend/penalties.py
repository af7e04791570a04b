"""logit_bias and penalties inside the kernels: the processed row ``z`` of docs/semantics.md
(steps 1-2) made from the raw logits as they are loaded, with no [rows, V] buffer.

What a request's tokens need is read where the kernels read its logits:

* logit_bias: the request's entries, sorted by token id (``SamplingBatch.bias_*``; request
  i's are ``bias_start[i] .. bias_start[i + 1] - 1``), so a load of ids lo .. hi - 1 looks
  up the first entry >= lo by bisection and applies the entries below hi, a few per load.
* penalties: the batch's per-request device state, updated in place by
  ``SamplingBatch.append`` (``output_counts`` [N, V] float32 and ``prompt_mask`` [N, V]
  bool): the load reads the request's counts and prompt flags at the same ids (the K + 1 rows
  of a request are read by neighbouring programs, so all but the first can find them in L2;
  no per-call tensor of width V is made), plus, for
  row j, the drafts d_0 .. d_{j-1} of the request (placeholders excluded: a live row has none
  before it). Requests without a penalty read nothing.

The float32 operations are the PyTorch backend's (``processing.apply_bias_and_penalties``):
``x + bias``; repetition ``z / r`` (IEEE division, ``tl.div_rn``) or ``z * r`` at prompt or
counted tokens; frequency ``z - f * count`` (the product rounded, then the difference: the
kernels that process rows compile with ``enable_fp_fusion=False``, so no fused multiply-add
rounds it once); presence ``z - p``, at the counted tokens only. Both backends give the same
float32 ``z`` bit for bit (PyTorch's processing touches the same tokens: sparse pairs).

The kernels pass the inputs as one tuple, ``pen``: (repetition [N] float32, frequency [N]
float32, presence [N] float32, output counts [N, CV] float32, prompt mask [N, CV] uint8, CV
(V, or 0 when no request has a penalty), bias_start [N + 1] int64, bias ids int64, bias
values float32, draft ids int64, draft_start [N] int64).
"""

from __future__ import annotations

import triton
import triton.language as tl

NO_ENTRY = tl.constexpr(2**62)  # the bias id past a request's last entry


@triton.jit
def setup(lo, req, pen):
    """What loads of request ``req``'s rows from token id ``lo`` up need, read once per
    program: (the first bias entry >= lo, the end of the request's entries, that entry's id
    or NO_ENTRY, repetition, frequency, presence, whether a penalty is set, the request's
    first draft). The entry is found by bisection of the request's sorted ids."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr) = pen
    a = tl.load(bstart_ptr + req)
    e = tl.load(bstart_ptr + req + 1)
    b = e
    while a < b:
        mid = (a + b) // 2
        below = tl.load(bids_ptr + mid) < lo
        a = tl.where(below, mid + 1, a)
        b = tl.where(below, b, mid)
    tok = tl.load(bids_ptr + a, mask=a < e, other=NO_ENTRY)
    rep = tl.load(rep_ptr + req)
    f = tl.load(freq_ptr + req)
    p = tl.load(pres_ptr + req)
    on = (rep != 1.0) | (f != 0.0) | (p != 0.0)
    return a, e, tok, rep, f, p, on, tl.load(draft_start_ptr + req)


@triton.jit
def process(x, offs, lo, hi, req, j, state, pen, PENALTIES: tl.constexpr):
    """``z`` (float32, the shape of ``x``) at token ids ``offs`` (lo <= offs < hi; ids >= V are the
    caller's masked lanes, kept as they are) of row ``j`` of request ``req``, from the raw float32
    values ``x`` there, and the state for the next load (ids >= hi). ``state``: :func:`setup`'s,
    from an id <= every offs (the loads of a program go up the row); the drafts d_0 .. d_{j-1} of
    the request are counted. A request's penalties are skipped where they change nothing (repetition
    1; frequency and presence 0), as they would subtract or divide exactly nothing. Without
    PENALTIES (a batch with logit_bias alone) only the bias."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr) = pen
    a, e, tok, rep, f, p, on, ds = state
    while tok < hi:
        x = tl.where(offs == tok, x + tl.load(bval_ptr + a), x)
        a += 1
        tok = tl.load(bids_ptr + a, mask=a < e, other=NO_ENTRY)
    if PENALTIES and on:
        o = req.to(tl.int64) * CV + offs
        ok = offs < CV
        c = tl.load(counts_ptr + o, mask=ok, other=0.0)
        for jj in range(0, j):
            d = tl.load(draft_ids_ptr + ds + jj)
            if (d >= lo) & (d < hi):  # (most loads hold none of the drafts)
                c += tl.where(offs == d, 1.0, 0.0)
        x = _penalise(x, c, prompt_ptr + o, ok, rep, f, p)
    return x, (a, e, tok, rep, f, p, on, ds)


@triton.jit
def _penalise(x, c, prompt_ptrs, ok, rep, f, p):
    """The penalties' float32 operations on values ``x`` with counts ``c`` (output tokens plus
    the drafts before the row): repetition at counted tokens and at the prompt flags
    ``prompt_ptrs`` (read where ``ok``, and only with a repetition penalty), then frequency
    and presence at counted tokens. Lanes with ``c`` 0 and no prompt flag keep their value."""
    counted = c > 0
    if rep != 1.0:
        seen = counted | (tl.load(prompt_ptrs, mask=ok, other=0) != 0)
        x = tl.where(seen, tl.where(x > 0, tl.div_rn(x, rep), x * rep), x)
    if (f != 0.0) | (p != 0.0):
        # (two roundings, as PyTorch's z - f * count: the kernels that call this compile
        # without floating-point contraction, enable_fp_fusion=False)
        x = tl.where(counted, x - f * c - p, x)
    return x


@triton.jit
def process_at(x, tok, req, j, live, pen, PENALTIES: tl.constexpr):
    """:func:`process` at single tokens: ``z`` (float32, the shape of ``x``) of token ``tok`` in
    row ``j`` of request ``req`` per lane (vectors of any ids in [0, V), rows and order; lanes
    not ``live`` are left as they are), from the raw float32 values ``x`` there: the same
    float32 operations, so the same bits. Each lane finds its bias entry by bisection of the
    request's sorted ids; the drafts d_0 .. d_{j-1} of its row are counted."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr) = pen
    a0 = tl.load(bstart_ptr + req)
    e = tl.load(bstart_ptr + req + 1)
    steps = 0
    n = e - a0
    while n > 0:  # (ceil(log2(entries + 1)) halvings find any lane's entry)
        n = n // 2
        steps += 1
    a = (tok * 0).to(tl.int64) + a0
    b = (tok * 0).to(tl.int64) + e
    for _ in range(0, steps):
        go = a < b
        mid = (a + b) // 2
        below = tl.load(bids_ptr + mid, mask=go, other=0) < tok
        a = tl.where(go & below, mid + 1, a)
        b = tl.where(go & ~below, mid, b)
    hit = live & (a < e)
    hit = hit & (tl.load(bids_ptr + a, mask=hit, other=-1) == tok)
    x = tl.where(hit, x + tl.load(bval_ptr + a, mask=hit, other=0.0), x)
    if PENALTIES:
        rep = tl.load(rep_ptr + req)
        f = tl.load(freq_ptr + req)
        p = tl.load(pres_ptr + req)
        if (rep != 1.0) | (f != 0.0) | (p != 0.0):
            o = req.to(tl.int64) * CV + tok
            c = tl.load(counts_ptr + o, mask=live, other=0.0)
            ds = tl.load(draft_start_ptr + req)
            for jj in range(0, tl.max(tl.where(live, j, 0), axis=0)):
                d = tl.load(draft_ids_ptr + ds + jj)
                c += tl.where(live & (jj < j) & (tok == d), 1.0, 0.0)
            x = _penalise(x, c, prompt_ptr + o, live, rep, f, p)
    return x
