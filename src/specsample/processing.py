"""Logit processors in PyTorch (float32): the general path shared by every backend.

``process_rows`` turns raw logits rows into the processed logits ``z'`` of docs/semantics.md:
bans (allowed_token_ids, bad words, min_tokens) -> logit_bias -> penalties -> temperature (after
subtracting the row maximum) -> min_p -> top_k -> top_p, the filters decided exactly on the
float32 values (``filter_cut``). The Triton
backend's general path materialises this float32 tensor and then runs its kernels on it (a
named, counted fallback); the fused path applies temperature, the filters, and logit_bias and
penalties on their own (``triton_backend.penalties``: the same float32 operations) inside the
kernels.
"""

from __future__ import annotations

import math

import torch

from . import rng, workspace
from .params import SamplingBatch
from .plan import Plan


def _count_pairs(plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(row, token) pairs [P] int64, each once, whose output count is > 0, and the counts [P]
    float32: the request's outputs (the batch's ``output_counts``) + its drafts before the
    row (drafts j' < j <= k_eff). Sparse: the request's tokens from
    ``SamplingBatch.seen_pairs`` at each of its rows (:func:`_request_rows`), then the drafts'
    pairs; reads sizes on the host."""
    batch, v = plan.batch, plan.vocab_size
    req, tok = batch.seen_pairs()
    rows, tok = _request_rows(plan, req, tok)
    d_rows, d_toks = plan.prior_draft_pairs()
    n_seen = rows.shape[0]
    key, inv = torch.unique(torch.cat([rows, d_rows]) * v + torch.cat([tok, d_toks]),
                            return_inverse=True)
    rows, tok = key // v, key % v
    counts = batch.output_counts[plan.row_req[rows], tok]
    if d_rows.numel():
        counts = counts + torch.bincount(inv[n_seen:], minlength=key.shape[0]).float()
    live = counts > 0
    return rows[live], tok[live], counts[live]


def outputs_before_row(plan: Plan, req: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """Output tokens that min_tokens counts at row ``j`` of request ``req`` (broadcast int64):
    the request's outputs plus its drafts 0..j-1 (a live row has no placeholder before it)."""
    return plan.batch.num_output[req] + j


def ban_pairs(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs [M] int64 that bad words and min_tokens ban (duplicates allowed).

    Bad word ``(w_1 .. w_L)`` of request i bans ``w_L`` at row j when the context before row j
    (the batch's ``context_tail`` of prompt + outputs, then drafts 0..j-1) ends with
    ``w_1 .. w_{L-1}``; a stop token of request i is banned at row j while
    :func:`outputs_before_row` is below its min_tokens. Rows j <= k_i of every request are
    covered (rows past a placeholder too: nobody reads them).
    """
    batch = plan.batch
    dev = plan.logits.device
    j = torch.arange(plan.max_k + 1, device=dev)
    rows, toks = [], []
    if batch.bad_req.numel():
        req = batch.bad_req
        width = batch.bad_prefix.shape[1]
        prefix = batch.bad_prefix[:, None, :]  # [nw, 1, W]
        if width:
            seq = torch.cat([batch.context_tail, plan.draft_grid], dim=1)[req]  # [nw, W + K]
            tails = seq[:, j[:, None] + torch.arange(width, device=dev)]  # [nw, K + 1, W]
            match = ((tails == prefix) | (prefix < 0)).all(-1)
        else:
            match = torch.ones(req.shape[0], j.shape[0], dtype=torch.bool, device=dev)
        ok = match & (j <= plan.k_given[req][:, None])
        rows.append((plan.row_start[req][:, None] + j)[ok])
        toks.append(batch.bad_last[:, None].expand_as(ok)[ok])
    if batch.stop_req.numel():
        req = batch.stop_req
        ok = (outputs_before_row(plan, req[:, None], j) < batch.min_tokens[req][:, None]) & (
            j <= plan.k_given[req][:, None])
        rows.append((plan.row_start[req][:, None] + j)[ok])
        toks.append(batch.stop_ids[:, None].expand_as(ok)[ok])
    if not rows:
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        return empty, empty
    return torch.cat(rows), torch.cat(toks)


def _allowed_rows(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [R], their request's slot in ``batch.allowed_mask`` [R]) of the requests that
    have allowed_token_ids: every row of such a request (dead rows too; nobody reads them).

    Found on the device from ``plan.row_req`` and ``batch.allowed_slot``, so host and device
    layouts alike; the row count R is read on the host (one synchronisation, on the general
    path, which has others).
    """
    slot = plan.batch.allowed_slot.long()[plan.row_req]
    rows = (slot >= 0).nonzero().squeeze(1)
    return rows, slot[rows]


def apply_bans(y: torch.Tensor, plan: Plan) -> torch.Tensor:
    """In place on float32 ``y`` [T, V]: -inf at every banned token (allowed_token_ids, bad
    words, min_tokens); a no-op unless ``batch.needs_bans``."""
    batch = plan.batch
    if not batch.needs_bans:
        return y
    if batch.allowed_users:
        rows, slots = _allowed_rows(plan)
        y[rows] = y[rows].masked_fill(~batch.allowed_mask[slots], -math.inf)
    rows, toks = ban_pairs(plan)
    if rows.numel():
        y[rows, toks] = -math.inf
    return y


def rows_emptied_by_bans(plan: Plan) -> torch.Tensor:
    """[T] bool: rows whose bans leave no finite logit (such a request is invalid).

    The rows must be sanitised as for :func:`process_rows` (no NaN / +inf; every row of a
    valid request has a finite logit). Costs one float32 copy of the rows; all False without
    bans.
    """
    if not plan.batch.needs_bans:
        return torch.zeros(plan.num_rows, dtype=torch.bool, device=plan.logits.device)
    y = plan.logits.to(torch.float32, copy=True)
    return torch.isneginf(apply_bans(y, plan).amax(-1))


def apply_bias_and_penalties(z: torch.Tensor, plan: Plan) -> torch.Tensor:
    """In place on float32 ``z`` [T, V]: logit_bias, then repetition, frequency, presence."""
    batch = plan.batch
    if batch.needs_bias:
        # Sparse: each row's request's entries only (x + bias at those tokens; no [N, V]
        # tensor, and the other values are left as they are, -0.0 included, as the kernels do)
        rows, entry = _bias_entries(plan)
        ids = batch.bias_ids[entry]
        z[rows, ids] = z[rows, ids] + batch.bias_val[entry]
    if batch.needs_penalties:
        # Only the penalties some request sets, at the tokens they touch (sparse (row, token)
        # pairs, no [T, V] counts; the same float32 operations on those entries as the kernels:
        # the others are unchanged)
        req = plan.row_req
        freq = any(p.frequency_penalty != 0 for p in batch.params)
        presence = any(p.presence_penalty != 0 for p in batch.params)
        if any(p.repetition_penalty != 1 for p in batch.params):
            rows, cols = _repetition_pairs(plan)
            rep = batch.repetition_penalty[req[rows]]
            vals = z[rows, cols]  # (a pair listed twice writes the same value twice)
            z[rows, cols] = torch.where(vals > 0, vals / rep, vals * rep)
        if freq or presence:
            rows, cols, counts = _count_pairs(plan)
            vals = z[rows, cols]
            if freq:  # (z - f * count: the product rounded, then the difference)
                vals = vals - batch.frequency_penalty[req[rows]] * counts
            if presence:
                vals = vals - batch.presence_penalty[req[rows]]
            z[rows, cols] = vals
    return z


def _bias_entries(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(row [P], bias entry [P]) int64: every row of ``plan`` with each logit_bias entry of its
    request (``SamplingBatch.bias_*``; a request's token ids are distinct, so no (row, token)
    pair repeats). Reads the pair count on the host."""
    batch = plan.batch
    start = batch.bias_start[plan.row_req]
    n = batch.bias_start[plan.row_req + 1] - start
    rows = torch.repeat_interleave(torch.arange(n.shape[0], device=n.device), n)
    first = torch.repeat_interleave(n.cumsum(0) - n, n)  # (the pair index of each row's first)
    return rows, start[rows] + torch.arange(rows.shape[0], device=n.device) - first


def _repetition_pairs(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs [P] int64 that repetition_penalty touches, duplicates allowed: the
    tokens of each request's prompt and outputs at every row of the request (rows j <= k_i,
    as :func:`ban_pairs` lays them out), and each live draft at the rows after it
    (:meth:`Plan.prior_draft_pairs`). Sparse: the request's tokens come from
    ``SamplingBatch.seen_pairs`` (no scan of the [N, V] state per call)."""
    req, tok = plan.batch.seen_pairs()
    rows, tok = _request_rows(plan, req, tok)
    d_rows, d_toks = plan.prior_draft_pairs()
    return torch.cat([rows, d_rows]), torch.cat([tok, d_toks])


def _request_rows(plan: Plan, req: torch.Tensor, tok: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs: each (request, token) pair of ``req`` / ``tok`` at every row of its
    request (``Plan.rows_per_request``: rows j <= k_i of a chain, the nodes of a tree)."""
    n_rows, width = plan.rows_per_request()
    j = torch.arange(width, device=plan.logits.device)
    rows = plan.row_start[req][:, None] + j  # [M, width]
    tok = tok[:, None].expand_as(rows)
    if plan.uniform:  # (every request has rows j <= K)
        return rows.reshape(-1), tok.reshape(-1)
    ok = j < n_rows[req][:, None]
    return rows[ok], tok[ok]


def round_up_f32(t: torch.Tensor) -> torch.Tensor:
    """The smallest float32 >= each float64 value of ``t`` (so ``y < result`` for a float32
    ``y`` is exactly ``y < t`` in real arithmetic)."""
    t32 = t.float()
    up = torch.nextafter(t32, torch.full_like(t32, math.inf))
    return torch.where(t32.double() < t, up, t32)


def filter_settings(y: torch.Tensor, m: torch.Tensor, plan: Plan, vocab: int, *,
                    as_cut: bool = False) -> tuple:
    """Per-row filter settings of ``plan``'s rows and min_p's decision (sampled rows only):
    (drop [T, W] bool or None, t64 [T] float64 temperature, top_k [T], k_on [T], top_p [T]
    float64, p_on [T]). ``y`` [T, W]: the rows (or a vocabulary shard of them) before
    temperature; ``m`` [T]: the rows' global maxima; ``vocab``: the global V (top_k >= V is
    off). min_p drops ``y < m + T log(min_p)``, the cut computed in float64 and rounded up to
    float32 (exact for float32 values); with ``as_cut`` the first entry is that cut instead
    ([T] float32, -inf where min_p is off), or None."""
    batch, req = plan.batch, plan.row_req
    sampled = batch.temperature[req] > 0
    t64 = batch.temperature[req].double()
    drop = None
    min_p = batch.min_p[req]
    on = sampled & (min_p > 0)
    if bool(on.any()):
        cut = round_up_f32(m.double() + t64 * torch.log(torch.where(on, min_p, 1.0)))
        cut = torch.where(on, cut, -math.inf)
        drop = cut if as_cut else y < cut[:, None]
    k = batch.top_k[req]
    k_on = sampled & (k > 0) & (k < vocab)
    top_p = batch.top_p[req]
    p_on = sampled & (top_p < 1)
    return drop, t64, k, k_on, top_p, p_on


class RowFilters:
    """The filter settings of a call's rows (min_p -> top_k -> top_p, sampled rows only) and
    each row's exact cut (:meth:`cut`, what :func:`filter_cut` returns), both computed when
    first asked for: the torch backend's CPU draw finds the cut of top_k / top_p rows inside
    its compiled call (``torch_backend._candidate_draw``) and needs them only where it
    finds none.

    ``y`` [T, W]: the rows before temperature; ``m`` [T] float32: their finite maxima;
    ``live`` [T] bool: the rows that are read (no cut is searched for on the others: they
    keep min_p's); ``plan``: the call's plan (the settings come from its batch), or
    ``settings``: :func:`filter_settings`' (min_cut, t64, top_k, k_on, top_p, p_on) with
    ``as_cut``; ``wide``: the rows' top_p nuclei are known to be wide (the cut goes straight
    to the histogram of the row, :func:`_nucleus`)."""

    def __init__(self, y: torch.Tensor, m: torch.Tensor, live: torch.Tensor,
                 plan: Plan | None = None, settings: tuple | None = None,
                 wide: bool = False) -> None:
        self.y, self.m, self.live = y, m, live
        self._plan, self._settings, self.wide = plan, settings, wide
        self._cut: tuple | None = None

    @property
    def settings(self) -> tuple:
        """(min_cut [T] float32 or None when no row has min_p, t64 [T] float64, top_k [T]
        int64, k_on [T] bool, top_p [T] float64, p_on [T] bool): :func:`filter_settings`."""
        if self._settings is None:
            self._settings = filter_settings(self.y, self.m, self._plan, self.y.shape[1],
                                             as_cut=True)
        return self._settings

    @property
    def ranked(self) -> torch.Tensor:
        """[T] bool: rows with top_k or top_p (their cut needs a ranking of the row)."""
        _, _, _, k_on, _, p_on = self.settings
        return k_on | p_on

    @property
    def has_cut(self) -> bool:
        """Whether :meth:`cut` has been computed."""
        return self._cut is not None

    def threshold(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cut_v, cut_i) of min_p alone: (min_cut or -inf, V) for every row (new tensors)."""
        t_rows, v = self.y.shape
        min_cut = self.settings[0]
        cut_v = min_cut.clone() if min_cut is not None else torch.full(
            (t_rows,), -math.inf, device=self.y.device)
        return cut_v, torch.full((t_rows,), v, dtype=torch.int64, device=self.y.device)

    def cut(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cut_v [T] float32, cut_i [T] int64): every row's cut (:func:`filter_cut`)."""
        if self._cut is None:
            self._cut = _cut_rows(self)
        return self._cut

    def select(self, rows: torch.Tensor, *, wide: bool = False) -> RowFilters:
        """The filters of ``rows`` (an index tensor) alone (``wide``: see the class)."""
        return RowFilters(self.y[rows], self.m[rows], self.live[rows], settings=tuple(
            None if t is None else t[rows] for t in self.settings), wide=wide)


def row_filters(y: torch.Tensor, m: torch.Tensor, plan: Plan) -> RowFilters | None:
    """The :class:`RowFilters` of ``plan``'s rows ``y`` [T, V] (before temperature; ``m``
    [T] float32 finite maxima), or None when no request is filtered."""
    return RowFilters(y, m, plan.row_live, plan) if plan.batch.needs_filter else None


@torch.no_grad()
def filter_cut(y: torch.Tensor, m: torch.Tensor, plan: Plan
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's filter cut (min_p -> top_k -> top_p, sampled rows only), or None when no
    row is filtered: (cut_v [T] float32, cut_i [T] int64); the row keeps token x iff
    ``y[x] > cut_v`` or (``y[x] == cut_v`` and ``x <= cut_i``), a prefix of the row in rank
    order (value, then lower id). ``cut_i = V`` makes it the threshold ``y >= cut_v``;
    unfiltered rows have (-inf, V).

    ``y``: the rows before temperature (raw logits in any float dtype, or float32 after bias
    and penalties); ``m``: [T] float32 finite row maxima of ``y``. Decisions are made on ``y``
    itself, never on rounded sums (docs/semantics.md, "Filters in float32"):

    * min_p keeps ``y >= m + T log(min_p)``, the cut computed in float64 and rounded up to
      float32, so the test is exact for the float32 values;
    * top_k keeps the k largest values by rank alone (lower ids first on ties), with no
      probability sum involved (one top-k of k + 1 values, no sort of the row; a tie pass only
      when the (k+1)-th value equals the k-th);
    * top_p accumulates ``exp((y - m) / T)`` in float64 over the survivors in rank order; a
      token is kept iff the mass ranked before it is < top_p times the survivors' mass
      (float64, relative error about 1e-16 per token, so nothing saturates at 1);
      :func:`_nucleus` ranks only the top candidates.

    Each filter's kept set is a prefix of the rank order, so their intersection is the
    shortest prefix: one cut per row, and no [T, V] boolean mask unless a boundary splits a
    tie group (boolean tensor passes are several times slower than a threshold on CPU).
    """
    f = row_filters(y, m, plan)
    return None if f is None else f.cut()


@torch.no_grad()
def _cut_rows(f: RowFilters) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`RowFilters.cut`."""
    y, m = f.y, f.m
    min_p_cut, t64, k, k_on, top_p, p_on = f.settings
    rows = (k_on | p_on) & f.live  # (rows nobody reads: no candidate search)
    cut_v, cut_i = f.threshold()
    if not bool(rows.any()):
        return cut_v, cut_i
    every = bool(rows.all())
    idx = None if every else rows.nonzero().squeeze(1)
    yy = y if every else y[idx]
    cv, ci = (cut_v, cut_i) if every else (cut_v[idx], cut_i[idx])
    scratch = workspace.buffer("filter", tuple(yy.shape), torch.float32, y.device)
    sub = apply_cut(yy, cv, ci, out=scratch) if min_p_cut is not None else yy.float()
    k_sub, p_sub = (k_on, p_on) if every else (k_on[idx], p_on[idx])
    if bool(k_sub.any()):
        cv, ci = _top_k_cut(sub, k if every else k[idx], k_sub, cv, ci)
        if bool(p_sub.any()):
            sub = apply_cut(yy, cv, ci, out=scratch)
    if bool(p_sub.any()):
        m_p, t_p, top_p = (m, t64, top_p) if every else (m[idx], t64[idx], top_p[idx])
        nv, ni = _tighter(*_nucleus(sub, m_p, t_p, top_p, f.wide), cv, ci)
        cv, ci = torch.where(p_sub, nv, cv), torch.where(p_sub, ni, ci)
    if every:
        return cv, ci
    cut_v[idx], cut_i[idx] = cv, ci
    return cut_v, cut_i


#: Rows up to which :func:`apply_cut` thresholds row by row (fast) instead of building a mask.
CUT_ROW_LOOP = 64


def apply_cut(y: torch.Tensor, cut_v: torch.Tensor, cut_i: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` [T, V] as float32 with -inf where the cut (:func:`filter_cut`) drops a token,
    into ``out`` (a new tensor when None). On CPU, float32 rows whose cut is a threshold
    (``cut_i >= V``) take one ``torch.threshold`` each (up to CUT_ROW_LOOP rows); otherwise
    a boolean mask (one kernel on a GPU)."""
    t_rows, v = y.shape
    if out is None:
        out = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    plain = cut_i >= v
    if (y.device.type == "cpu" and y.dtype == torch.float32 and t_rows <= CUT_ROW_LOOP
            and not y.requires_grad and bool(plain.all())):
        # keep y >= cut  <=>  y > the float32 just below cut (threshold keeps x > t)
        below = torch.nextafter(cut_v, torch.full_like(cut_v, -math.inf)).tolist()
        for r, t in enumerate(below):
            torch.threshold(y[r], t, -math.inf, out=out[r])
        return out
    out.copy_(y)
    cv, ci = cut_v[:, None], cut_i[:, None]
    if bool(plain.all()):
        keep = y >= cv
    else:
        ids = torch.arange(v, device=y.device)[None, :]
        keep = (y > cv) | ((y == cv) & (ids <= ci))
    return out.masked_fill_(~keep, -math.inf)


def _top_k_cut(sub: torch.Tensor, k: torch.Tensor, k_on: torch.Tensor, cut_v: torch.Tensor,
               cut_i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cut after top_k of rows ``sub`` (float32, -inf = dropped already by the cut
    (cut_v, cut_i)) for the rows ``k_on`` ([R] bool; other rows keep their cut): the k largest
    values, lower ids first on ties. One top-k of k + 1 values finds the k-th value v_k; when
    the next value is smaller (no tie crosses the boundary) the cut is the threshold v_k,
    else a tie pass finds the id of the last tied token kept."""
    r, v = sub.shape
    kk = torch.where(k_on, k, 1).clamp(1, v - 1)[:, None]
    width = min(int(kk.max()) + 1, v)
    # (only the values matter: the multiset of the largest ones, in descending order)
    top = _top_candidates(sub, width)[0].sort(dim=-1, descending=True).values
    v_k = top.gather(1, kk - 1)
    v_next = top.gather(1, kk.clamp_max(width - 1))
    on = k_on[:, None] & (v_k > -math.inf)  # (fewer than k survivors: the cut stays)
    new_i = torch.full_like(kk, v)
    tie = on & (v_next == v_k)
    if bool(tie.any()):  # keep the lowest ids of the v_k group: k - (#values above v_k)
        above = (sub > v_k).sum(-1, keepdim=True)
        tied = (sub == v_k).cumsum(-1)
        last = (tied >= kk - above).int().argmax(-1, keepdim=True)  # first id reaching it
        new_i = torch.where(tie, last, new_i)
    new_v, new_i = _tighter(v_k[:, 0], new_i[:, 0], cut_v, cut_i)
    return torch.where(on[:, 0], new_v, cut_v), torch.where(on[:, 0], new_i, cut_i)


def _tighter(a_v: torch.Tensor, a_i: torch.Tensor, b_v: torch.Tensor, b_i: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The shorter of two rank-order prefixes (value, then lower id), as cuts: the
    intersection of what both keep. (A threshold (v, V) found on a masked row keeps the
    masked row's tokens of value v only with the mask's own cut.)"""
    first = (a_v > b_v) | ((a_v == b_v) & (a_i < b_i))
    return torch.where(first, a_v, b_v), torch.where(first, a_i, b_i)


#: Relative bound on the float32 estimate of a top_p total mass (see :func:`_nucleus`).
NUCLEUS_TOTAL_TOL = 1e-5


def _nucleus(masked: torch.Tensor, m: torch.Tensor, t64: torch.Tensor, top_p: torch.Tensor,
             wide: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_p cut (:func:`filter_cut`: (cut_v [R] float32, cut_i [R] int64)) of the
    survivors of rows ``masked`` (float32, -inf = dropped already).

    A token is kept iff the float64 mass of the survivors ranked before it (value, then lower
    id) is < top_p times their total mass. Only the highest-ranked candidates are ranked
    (:func:`_top_candidates`, 16 first, 4 times more each round) until the boundary token
    lies inside them (a full sort of the row is the
    last resort): the tie group at the candidates' smallest value may be cut arbitrarily by
    the top-k, so a boundary there counts as not found yet. The candidates' masses are float64;
    the total is first estimated from float32 ``exp2((y - m) * log2(e) / T)``
    (:func:`block_total`; torch's exp2 is about 3x faster than its exp on CPU), whose relative
    error is below ``3 log(V) 2**-24`` (the subtraction, the rounded factor and the product
    each err by at most ``|z| 2**-24`` in the result, and the mean |z| under softmax(z) is at
    most log V) plus exp2's ulp plus ``15 * 2**-24`` (blocks of 16 summed in float32), far
    inside ``NUCLEUS_TOTAL_TOL``: when the kept count is the same at both ends of that bound
    the decision is the exact one, else the total is recomputed in float64 from every
    survivor. Past ``NUCLEUS_CANDIDATES_MAX`` candidates (flat rows: a nucleus of thousands of
    tokens, where each round's top-k and sorts cost more than one pass over the row) the
    cut comes from :func:`_nucleus_by_histogram` on CPU tensors, and at once with ``wide``
    (rows whose nucleus is known to hold more than tens of tokens).
    """
    if wide and masked.device.type == "cpu":
        return _nucleus_by_histogram(masked, m, t64, top_p)
    r, v = masked.shape
    m64, t = m.double()[:, None], t64[:, None]
    e32 = workspace.buffer("nucleus", tuple(masked.shape), torch.float32, masked.device)
    torch.sub(masked, m[:, None], out=e32).mul_((math.log2(math.e) / t64).float()[:, None])
    e32.exp2_()
    total = block_total(e32)
    goals = (top_p[:, None] * total * (1 - NUCLEUS_TOTAL_TOL),
             top_p[:, None] * total * (1 + NUCLEUS_TOTAL_TOL))
    c = min(v, 16)
    while True:
        cand_v, cand_i = _top_candidates(masked, c)
        order = torch.sort(cand_i, dim=-1).indices  # by id, then (stably) by value: rank order
        cand_v, cand_i = cand_v.gather(1, order), cand_i.gather(1, order)
        order = torch.sort(cand_v, dim=-1, descending=True, stable=True).indices
        cand_v, cand_i = cand_v.gather(1, order), cand_i.gather(1, order)
        ce = torch.exp((cand_v.double() - m64) / t)
        before = torch.cumsum(ce, dim=-1) - ce
        live = cand_v > -math.inf
        n_lo, n_hi = (((before < g) & live).sum(-1, keepdim=True).clamp_min(1) for g in goals)
        if not bool((n_lo == n_hi).all()):  # within the bound: the exact float64 total
            e = torch.exp((masked.double() - m64) / t)
            goal = top_p[:, None] * e.sum(-1, keepdim=True)
            n_lo = n_hi = ((before < goal) & live).sum(-1, keepdim=True).clamp_min(1)
            goals = (goal, goal)
        n_keep = n_lo
        last_v = cand_v.gather(1, n_keep - 1)
        found = (n_keep < c) & (last_v > cand_v[:, -1:])
        if c == v or bool(found.all()):
            break
        if 4 * c > NUCLEUS_CANDIDATES_MAX and masked.device.type == "cpu":
            # a wide nucleus: the histogram of the row instead (on CPU only: CUDA's bincount
            # adds float64 weights by atomics, in no fixed order)
            return _nucleus_by_histogram(masked, m, t64, top_p)
        c = min(v, 4 * c)
    last_i = cand_i.gather(1, n_keep - 1)
    # No token of last_v's value ranks after the boundary: the threshold y >= last_v.
    alone = cand_v.gather(1, n_keep.clamp_max(c - 1)) < last_v
    if c == 1:
        alone = torch.ones_like(alone)
    return last_v[:, 0], torch.where(alone, v, last_i)[:, 0]


#: Most candidates :func:`_nucleus` ranks before it takes the histogram of the row.
NUCLEUS_CANDIDATES_MAX = 256
_COARSE_SHIFT = 20  # coarse bins: a float32 key's top 12 bits (values within 2**(1/8))
_COARSE_BINS = 1 << (32 - _COARSE_SHIFT)


def _nucleus_by_histogram(masked: torch.Tensor, m: torch.Tensor, t64: torch.Tensor,
                          top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_p cut of :func:`_nucleus` (same arguments, same rule) from one pass over the
    rows: every survivor's float64 mass ``exp((y - m) / T)`` summed per coarse bin (the top 12
    bits of the float32 value's order-preserving key, so the bins are ranges of values in
    rank order: ``torch.bincount`` with weights, in index order), the bin where the mass
    before it stops being below top_p x total, then its tokens ranked exactly (value, then
    lower id) with their own masses. Returns (cut_v [R] float32, cut_i [R] int64: the last
    kept token's value and id)."""
    r, v = masked.shape
    dev = masked.device
    nb = _COARSE_BINS
    live = masked > -math.inf
    e = torch.exp((masked.double() - m.double()[:, None]) / t64[:, None])
    bits = (masked + 0.0).view(torch.int32)  # (+ 0.0: -0.0 ranks as +0.0)
    # bin 0 holds the largest values; dropped tokens go to an extra bin nb, not read
    rank_bin = (nb // 2 - 1) - ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) >> _COARSE_SHIFT)
    rank_bin = torch.where(live, rank_bin, nb)
    flat = (rank_bin + torch.arange(0, r * (nb + 1), nb + 1, device=dev,
                                    dtype=torch.int32)[:, None]).view(-1)
    mass = torch.bincount(flat, weights=e.view(-1), minlength=r * (nb + 1)).view(r, nb + 1)
    count = torch.bincount(flat, minlength=r * (nb + 1)).view(r, nb + 1)
    mass, count = mass[:, :nb], count[:, :nb]
    before = mass.cumsum(-1) - mass  # mass ranked before each bin (bins in rank order)
    goal = top_p * mass.sum(-1)
    slot = torch.arange(nb, device=dev)
    edge = torch.where((count > 0) & (before < goal[:, None]), slot, -1).amax(-1)
    # the edge bin's tokens, in rank order (value descending, then id), per row
    in_edge = rank_bin == edge[:, None]
    row, col = in_edge.nonzero(as_tuple=True)  # (row, then id order)
    vals = masked[row, col]
    order = torch.sort(vals, descending=True, stable=True).indices
    order = order[torch.sort(row[order], stable=True).indices]
    row, col, vals = row[order], col[order], vals[order]
    tok_e = e[row, col]
    n_in = torch.bincount(row, minlength=r)
    start = n_in.cumsum(0) - n_in
    # each row's running mass from its own first token (a cumsum over the rows one after
    # another would round a row's sums by the rows before it)
    slot = torch.arange(row.numel(), device=dev) - start[row]
    run = torch.zeros(r, int(n_in.max()) if row.numel() else 0, dtype=torch.float64,
                      device=dev)
    run[row, slot] = tok_e
    run = run.cumsum(-1)[row, slot]
    tok_before = before.gather(1, edge[:, None])[:, 0][row] + (run - tok_e)
    n_keep = torch.bincount(row[tok_before < goal[row]], minlength=r).clamp_min(1)
    last = start + n_keep - 1
    return vals[last], col[last]


def block_total(e: torch.Tensor) -> torch.Tensor:
    """[R, 1] float64 sums of the rows of ``e`` [R, V] (float32, >= 0): blocks of 16 summed in
    float32 (any order of 15 additions of non-negative terms: relative error at most
    15 * 2**-24), then the blocks in float64. Reads ``e`` once; no [R, V] float64 copy (from
    a cold cache, as between two model forwards, that copy cost as much as the exps)."""
    r, v = e.shape
    full = v - v % 16
    total = e[:, :full].view(r, full // 16, 16).sum(-1).double().sum(-1, keepdim=True)
    if full < v:
        total += e[:, full:].double().sum(-1, keepdim=True)
    return total


def _top_candidates(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [R, c] of the c largest entries of each row of ``x`` [R, V] float32, in
    no particular order, the tie group at the smallest value cut arbitrarily (as
    ``torch.topk``). Through ``rng.SUBTILE``-wide sub-tiles: the c sub-tiles with the largest
    maxima hold every entry above the c-th largest sub-tile maximum, hence the c largest
    entries up to ties at the smallest; one top-k over those c x 128 entries (``torch.topk``
    over a whole row costs several times a max on CPU, whatever c is)."""
    r, v = x.shape
    sub = rng.SUBTILE
    full = v // sub
    if full < 2 * c:  # (small rows, or most of the row wanted: the plain top-k)
        return torch.topk(x, c, dim=-1)
    smax = x[:, :full * sub].view(r, full, sub).amax(-1)
    if v % sub:
        smax = torch.cat([smax, x[:, full * sub:].amax(-1, keepdim=True)], dim=1)
    best = torch.topk(smax, c, dim=-1).indices  # [R, c] sub-tiles
    cols = (best[:, :, None] * sub + torch.arange(sub, device=x.device)).view(r, -1)
    vals = x.gather(1, cols.clamp_max(v - 1))
    if v % sub:  # (the last sub-tile's padding)
        vals = vals.masked_fill(cols >= v, -math.inf)
    top_v, at = torch.topk(vals, c, dim=-1)
    return top_v, cols.gather(1, at).clamp_max(v - 1)  # (padding: -inf values)


def row_inputs(plan: Plan, *, filters: bool = True, row_max: torch.Tensor | None = None,
               finite: bool = False) -> tuple[torch.Tensor, torch.Tensor, RowFilters | None]:
    """What the processed logits of ``plan``'s rows are made of: (``y`` [T, V], the rows after
    bans (-inf), logit bias and penalties; ``m`` [T] float32, their maxima, NaN / +-inf
    included; the rows' :class:`RowFilters` (the cut of :func:`filter_cut`, computed when
    asked for), or None). ``row_max``: [T] max of the raw rows if the caller has it; without
    bans, logit bias or penalties ``y`` is then the raw logits themselves (any float dtype:
    no float32 copy) and ``m`` is ``row_max``. ``finite``: every entry of ``row_max`` is
    known finite."""
    batch: SamplingBatch = plan.batch
    if row_max is not None and not (batch.needs_bias or batch.needs_penalties
                                    or batch.needs_bans):
        y, m = plan.logits, row_max.float()
    else:
        finite = False
        y = plan.logits.float().clone() if plan.logits.dtype == torch.float32 else (
            plan.logits.float())
        apply_bans(y, plan)
        apply_bias_and_penalties(y, plan)
        m = y.amax(dim=-1)
    filt = None
    if filters and batch.needs_filter:
        filt = row_filters(y, m if finite else torch.where(torch.isfinite(m), m,
                                                           torch.zeros_like(m)), plan)
    return y, m, filt


def process_rows(plan: Plan, *, filters: bool = True, row_max: torch.Tensor | None = None,
                 inputs: tuple | None = None) -> torch.Tensor:
    """The processed float32 logits ``z'`` [T, V] of every row of ``plan`` (semantics.md §2).

    ``z' = (y - max y) / T`` (greedy rows: T = 1; the max maps to exactly 0) where ``y`` is the
    raw row after bans (-inf), logit bias and penalties, then -inf where a filter drops the
    token (:func:`filter_cut`). A row whose bans leave nothing is all -inf. Rows of invalid
    requests must have been sanitised by the caller. ``row_max`` as in :func:`row_inputs`;
    ``inputs``: what :func:`row_inputs` returned, if the caller has it. On CPU the result is
    the reusable ``workspace`` buffer "z": valid until the thread's next call.
    """
    batch: SamplingBatch = plan.batch
    y, m, filt = inputs or row_inputs(plan, filters=filters, row_max=row_max)
    cut = None if filt is None else filt.cut()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all -inf rows stay -inf
    t = batch.temperature[plan.row_req]
    t = torch.where(t > 0, t, torch.ones_like(t))
    if y.requires_grad and torch.is_grad_enabled():  # (out= takes no autograd inputs)
        z = torch.sub(y, m[:, None]) if cut is None else apply_cut(y, *cut).sub_(m[:, None])
    else:
        z = workspace.buffer("z", tuple(y.shape), torch.float32, y.device)
        if cut is None:
            torch.sub(y, m[:, None], out=z)
        else:  # (the dropped tokens' -inf survive the subtraction and the division)
            apply_cut(y, *cut, out=z).sub_(m[:, None])
    if batch.any_sampled:  # (greedy rows divide by 1)
        z.div_(t[:, None])
    return z
