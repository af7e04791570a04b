"""Bans, logit_bias and penalties inside the kernels: the processed row ``z`` of
docs/semantics.md (steps 0-2) made from the raw logits as they are loaded, with no [rows, V]
buffer.

What a request's tokens need is read where the kernels read its logits:

* bans: row j of request i's banned tokens (bad words, min_tokens), sorted, in row
  ``i * (K + 1) + j`` of the call's ban table (``ban_table_kernel``, [N * (K + 1), BW]
  int64, NO_ENTRY past the row's bans), looked up as the bias entries are; with
  allowed_token_ids, the request's row of the batch's ``allowed_mask`` ([NA, V] bool, found
  by ``allowed_slot``), read at the same ids. Banned tokens become -inf; a NaN or +inf stays
  (its request is invalid for the raw logit, as on the PyTorch backend).
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
values float32, draft ids int64, draft_start [N] int64, ban table int64, BW (its width: 0
without bad words or stop tokens), KP (K + 1), allowed_slot [N] int32 (-1: no
allowed_token_ids), allowed mask [NA, AV] uint8, AV (V, or 0 when no request has
allowed_token_ids)).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import wait_for_prior_grid

NO_ENTRY = tl.constexpr(2**62)  # the bias id past a request's last entry, the ban table's pad


BAN_COLUMNS = tl.constexpr(16)  # ban-table columns written per step of ban_table_kernel


@triton.jit(do_not_specialize=["KP", "BW", "W"])
def ban_table_kernel(out_ptr, tmp_ptr, KP, BW, tail_ptr, W, bad_start_ptr, bad_prefix_ptr,
                     bad_last_ptr, stop_start_ptr, stop_ids_ptr, num_output_ptr, min_tokens_ptr,
                     k_given_ptr, draft_ids_ptr, draft_start_ptr, GDC: tl.constexpr):
    """One program per row j of request i (grid N * KP): row i * KP + j of the ban table
    ``out`` [N * KP, BW] int64, sorted, NO_ENTRY where nothing is banned. Before the sort
    (written to ``tmp``, the same shape), column c < the request's bad words holds word c's
    last token where the context before row j ends with the word's other tokens, the next
    columns its stop tokens while ``num_output + j`` is below its min_tokens
    (docs/semantics.md, "Bans"); rows j > k_i ban nothing (nobody reads them). The context
    before row j is the request's ``context_tail`` [N, W] (prompt + outputs, right-aligned,
    -1 padded) then its drafts d_0 .. d_{j-1}; a word's prefix [W] is right-aligned with -1
    padding (-1 matches anything). The sort places each entry at its rank (entries below it,
    and equal ones in earlier columns): BW^2 / 256 steps of 16 x 16 comparisons."""
    wait_for_prior_grid(GDC)
    pid = tl.program_id(0)
    i = pid // KP
    j = pid % KP
    row = j <= tl.load(k_given_ptr + i)
    ws = tl.load(bad_start_ptr + i)
    nw = tl.load(bad_start_ptr + i + 1) - ws
    ss = tl.load(stop_start_ptr + i)
    ns = tl.load(stop_start_ptr + i + 1) - ss
    stops_on = tl.load(num_output_ptr + i) + j < tl.load(min_tokens_ptr + i)
    ds = tl.load(draft_start_ptr + i)
    base = pid.to(tl.int64) * BW
    for c0 in range(0, BW, BAN_COLUMNS):
        c = c0 + tl.arange(0, BAN_COLUMNS)
        is_word = row & (c < nw)
        w = (ws + c).to(tl.int64)
        match = is_word
        for p in range(0, W):  # (prefix token p against context token j + p of tail ++ drafts)
            q = j + p
            in_tail = q < W
            tok = tl.where(in_tail, tl.load(tail_ptr + i.to(tl.int64) * W + tl.minimum(q, W - 1)),
                           tl.load(draft_ids_ptr + ds + tl.maximum(q - W, 0),
                                   mask=~in_tail & row, other=-1))
            pref = tl.load(bad_prefix_ptr + w * W + p, mask=is_word, other=-1)
            match = match & ((pref == tok) | (pref < 0))
        ban = tl.where(match, tl.load(bad_last_ptr + w, mask=is_word, other=0), NO_ENTRY)
        is_stop = row & stops_on & (c >= nw) & (c < nw + ns)
        ban = tl.where(is_stop, tl.load(stop_ids_ptr + ss + c - nw, mask=is_stop, other=0), ban)
        tl.store(tmp_ptr + base + c, ban, mask=c < BW)
    tl.debug_barrier()  # (the row's entries written, by every thread of the program)
    for c0 in range(0, BW, BAN_COLUMNS):
        c = c0 + tl.arange(0, BAN_COLUMNS)
        v = tl.load(tmp_ptr + base + c, mask=c < BW, other=NO_ENTRY)
        rank = tl.zeros([BAN_COLUMNS], tl.int32)
        for c1 in range(0, BW, BAN_COLUMNS):
            e = c1 + tl.arange(0, BAN_COLUMNS)
            u = tl.load(tmp_ptr + base + e, mask=e < BW, other=NO_ENTRY)
            before = (u[None, :] < v[:, None]) | ((u[None, :] == v[:, None])
                                                  & (e[None, :] < c[:, None]))
            rank += tl.sum((before & (e[None, :] < BW)).to(tl.int32), axis=1)
        tl.store(out_ptr + base + rank, v, mask=c < BW)


@triton.jit
def _first_at_least(ids_ptr, a, b, lo):
    """The first index in [a, b) whose id (sorted ids at ``ids_ptr``) is >= ``lo``, or b: a
    bisection."""
    while a < b:
        mid = (a + b) // 2
        below = tl.load(ids_ptr + mid) < lo
        a = tl.where(below, mid + 1, a)
        b = tl.where(below, b, mid)
    return a


@triton.jit
def ban_setup(lo, req, j, pen):
    """What loads of row ``j`` of request ``req`` from token id ``lo`` up need for the bans:
    (the first entry >= lo of the row's sorted ban list (bad words, min_tokens), its id or
    NO_ENTRY, the request's row of the allowed_token_ids mask or -1). The entry is found by
    bisection."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV) = pen
    base = ban_ptr + (req.to(tl.int64) * KP + j) * BW
    a = _first_at_least(base, BW * 0, BW + 0, lo)
    tok = tl.load(base + a, mask=a < BW, other=NO_ENTRY)
    slot = tl.load(aslot_ptr + req, mask=AV > 0, other=-1)
    return a, tok, slot


@triton.jit
def ban(x, offs, hi, req, j, state, pen):
    """The bans of row ``j`` of request ``req`` on raw float32 values ``x`` at token ids ``offs``
    (< hi): -inf at the tokens its bad words and min_tokens ban there and, with
    allowed_token_ids, at every token outside them; NaN and +inf stay (the request is then
    invalid for its raw logits, as on the PyTorch backend, which checks them first). Returns
    (x, the state for the next load): ``state`` :func:`ban_setup`'s, from an id <= every
    offs."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV) = pen
    a, tok, slot = state
    base = ban_ptr + (req.to(tl.int64) * KP + j) * BW
    while tok < hi:
        x = tl.where((offs == tok) & (x < float("inf")), -float("inf"), x)
        a += 1
        tok = tl.load(base + a, mask=a < BW, other=NO_ENTRY)
    if slot >= 0:
        keep = tl.load(amask_ptr + slot.to(tl.int64) * AV + offs, mask=offs < AV, other=1) != 0
        x = tl.where(keep | ~(x < float("inf")), x, -float("inf"))
    return x, (a, tok, slot)


@triton.jit
def setup(lo, req, j, pen):
    """What loads of row ``j`` of request ``req`` from token id ``lo`` up need, read once per
    program: (the first bias entry >= lo, the end of the request's entries, that entry's id
    or NO_ENTRY, repetition, frequency, presence, whether a penalty is set, the request's
    first draft, :func:`ban_setup`'s state). The bias entry is found by bisection of the
    request's sorted ids."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV) = pen
    e = tl.load(bstart_ptr + req + 1)
    a = _first_at_least(bids_ptr, tl.load(bstart_ptr + req), e, lo)
    tok = tl.load(bids_ptr + a, mask=a < e, other=NO_ENTRY)
    rep = tl.load(rep_ptr + req)
    f = tl.load(freq_ptr + req)
    p = tl.load(pres_ptr + req)
    on = (rep != 1.0) | (f != 0.0) | (p != 0.0)
    return a, e, tok, rep, f, p, on, tl.load(draft_start_ptr + req), ban_setup(lo, req, j, pen)


@triton.jit
def process(x, offs, lo, hi, req, j, state, pen, PENALTIES: tl.constexpr):
    """``z`` (float32, the shape of ``x``) at token ids ``offs`` (lo <= offs < hi; ids >= V are the
    caller's masked lanes, kept as they are) of row ``j`` of request ``req``, from the raw float32
    values ``x`` there, and the state for the next load (ids >= hi). ``state``: :func:`setup`'s,
    from an id <= every offs (the loads of a program go up the row); the drafts d_0 .. d_{j-1} of
    the request are counted. Bans first (:func:`ban`), then the bias, then the penalties. A
    request's penalties are skipped where they change nothing (repetition 1; frequency and
    presence 0), as they would subtract or divide exactly nothing. Without PENALTIES (a batch
    with logit_bias or bans alone) no penalties."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV) = pen
    a, e, tok, rep, f, p, on, ds, bans = state
    x, bans = ban(x, offs, hi, req, j, bans, pen)
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
    return x, (a, e, tok, rep, f, p, on, ds, bans)


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
def _lane_entry(ids_ptr, a, e, tok, live, n):
    """Per lane of ``tok``: (the index in [a, e) of the first sorted id at ``ids_ptr`` >= tok,
    whether it equals tok (``live`` lanes only)), by ceil(log2(n + 1)) halvings (``n``, a
    scalar, at least every lane's e - a)."""
    steps = 0
    while n > 0:
        n = n // 2
        steps += 1
    a = (tok * 0).to(tl.int64) + a
    end = (tok * 0).to(tl.int64) + e
    b = end
    for _ in range(0, steps):
        go = a < b
        mid = (a + b) // 2
        below = tl.load(ids_ptr + mid, mask=live & go, other=0) < tok
        a = tl.where(go & below, mid + 1, a)
        b = tl.where(go & ~below, mid, b)
    hit = live & (a < end)
    return a, hit & (tl.load(ids_ptr + a, mask=hit, other=-1) == tok)


@triton.jit
def process_at(x, tok, req, j, live, pen, PENALTIES: tl.constexpr):
    """:func:`process` at single tokens: ``z`` (float32, the shape of ``x``) of token ``tok`` in
    row ``j`` of request ``req`` per lane (vectors of any ids in [0, V), rows and order; lanes
    not ``live`` are left as they are), from the raw float32 values ``x`` there: the same
    float32 operations, so the same bits. Each lane finds its bias entry by bisection of the
    request's sorted ids, and its row's ban entry likewise; the drafts d_0 .. d_{j-1} of its
    row are counted."""
    (rep_ptr, freq_ptr, pres_ptr, counts_ptr, prompt_ptr, CV, bstart_ptr, bids_ptr, bval_ptr,
     draft_ids_ptr, draft_start_ptr, ban_ptr, BW, KP, aslot_ptr, amask_ptr, AV) = pen
    if BW > 0:
        _, hit = _lane_entry(ban_ptr + (req.to(tl.int64) * KP + j) * BW, 0, BW, tok, live, BW)
        x = tl.where(hit & (x < float("inf")), -float("inf"), x)
    if AV > 0:
        slot = tl.load(aslot_ptr + req + tok * 0, mask=live, other=-1)
        keep = tl.load(amask_ptr + slot.to(tl.int64) * AV + tok, mask=live & (slot >= 0),
                       other=1) != 0
        x = tl.where(keep | ~(x < float("inf")), x, -float("inf"))
    a0 = tl.load(bstart_ptr + req)
    e = tl.load(bstart_ptr + req + 1)
    a, hit = _lane_entry(bids_ptr, a0, e, tok, live, e - a0)
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
