"""The PyTorch backend: sample() and verify() vectorised over requests, rows and vocabulary.

It computes exactly the function of docs/semantics.md, in float32, on any device (the CPU path
of the library, and the general path's reference on GPU). One pass builds the processed logits
``z'``; one-hot verification then samples every row by three-level Gumbel-max (noise for the
tiles, one tile's sub-tiles and one sub-tile's tokens per row, see ``tiled_gumbel_argmax``)
and matches drafts by prefix; draft distributions use token-level rejection sampling
(Leviathan et al. 2023, Alg. 1) or block verification (Sun et al. 2024, Alg. 2) with a
residual draw on at most one row per request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch

from . import cpu_compile, paths, processing, rng, workspace
from .outputs import VerifyOutput
from .plan import Plan
from .processing import block_total, process_rows, row_inputs, rows_emptied_by_bans

ERR_LOGITS_NAN = 1  # a NaN or +inf target logit
ERR_LOGITS_NO_FINITE = 2  # a target row with no finite logit
ERR_DRAFT_ID = 4  # a draft id outside [0, V) that is not the -1 placeholder
ERR_DRAFT_ROW = 8  # a draft_logits / draft_probs row that is not a valid distribution
ERR_PROCESSED_OVERFLOW = 16  # finite raw logits that logit_bias / penalties made NaN / inf
ERR_BANS = 32  # a live row whose bans (allowed_token_ids, bad words, min_tokens) leave no token
ERR_TREE_SIBLINGS = 64  # verify_tree under CUDA-graph capture: two siblings with one token

ERROR_NAMES = {
    ERR_LOGITS_NAN: "NaN or +inf target logit",
    ERR_LOGITS_NO_FINITE: "target row with no finite logit",
    ERR_DRAFT_ID: "draft id outside [0, V) (not the -1 placeholder)",
    ERR_DRAFT_ROW: "invalid draft_logits / draft_probs row",
    ERR_PROCESSED_OVERFLOW: "logit_bias or penalties pushed a logit to NaN / +inf or left no "
                            "finite logit (raw logits were finite)",
    ERR_BANS: "bans leave no token (allowed_token_ids, bad_words_token_ids, min_tokens)",
    ERR_TREE_SIBLINGS: "two siblings of the tree hold the same token",
}


def describe_errors(codes: list[int]) -> str:
    """Human-readable text for per-request error bitmasks (non-zero entries only)."""
    parts = []
    for i, code in enumerate(codes):
        if code:
            names = [text for bit, text in ERROR_NAMES.items() if code & bit]
            parts.append(f"request {i}: " + ", ".join(names))
    return "; ".join(parts)


def _or_per_request(flags: torch.Tensor, req: torch.Tensor, n: int, bit: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=torch.int64, device=flags.device)
    return out.scatter_reduce(0, req, flags.to(torch.int64) * bit, reduce="amax")


def request_errors(plan: Plan, row_max: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, bool]:
    """([N] int64 bitmask of ERR_* per request, over live rows and drafts only (no host
    synchronisation off the CPU); True when the host knows the bitmask is all 0 without
    reading it: CPU rows whose maxima are finite, drafts in range, no draft distribution).

    One max per row finds every target-row error: NaN propagates through the max, +inf is
    the max, and a row with no finite value has max -inf. ``row_max``: that [T] max, if the
    caller has it.
    """
    n = plan.num_requests
    mx = plan.logits.amax(dim=-1) if row_max is None else row_max
    # (on CPU a host read costs nothing: the per-request scatters only run when some value
    # is bad; on other devices they always run, with no synchronisation)
    on_cpu = mx.device.type == "cpu"
    # (a finite sum of the maxima: every one is finite; a sum that overflows takes the
    # per-request test, which finds nothing)
    known = on_cpu and math.isfinite(mx.sum(dtype=torch.float32).item())
    if known:
        err = torch.zeros(n, dtype=torch.int64)
    else:
        live = plan.row_live
        bad_nan = (torch.isnan(mx) | torch.isposinf(mx)) & live
        err = _or_per_request(bad_nan, plan.row_req, n, ERR_LOGITS_NAN)
        err |= _or_per_request(torch.isneginf(mx) & live, plan.row_req, n,
                               ERR_LOGITS_NO_FINITE)
    if plan.draft_token_ids.numel():
        d = plan.draft_token_ids
        ids = plan.draft_id_range  # (CPU drafts: one host read, which placeholder_free shares)
        if ids is None or ids[0] < 0 or ids[1] >= plan.vocab_size:
            known = False
            bad_id = (d < 0) | (d >= plan.vocab_size)
            err |= _or_per_request(bad_id & plan.draft_live, plan.draft_req, n, ERR_DRAFT_ID)
        if plan.has_draft_dist:
            known = False
        if plan.draft_logits is not None:
            dmx = plan.draft_logits.amax(-1)
            bad = torch.isnan(dmx) | torch.isinf(dmx)
            err |= _or_per_request(bad & plan.draft_live, plan.draft_req, n, ERR_DRAFT_ROW)
        elif plan.draft_probs is not None:
            q = plan.draft_probs
            bad = (~torch.isfinite(q) | (q < 0)).any(-1) | (q.float().sum(-1) <= 0)
            err |= _or_per_request(bad & plan.draft_live, plan.draft_req, n, ERR_DRAFT_ROW)
    return err, known


def _tile_sums(e: torch.Tensor) -> torch.Tensor:
    """[R, NT] sums of each ``rng.TILE``-wide vocabulary tile of ``e`` [R, V]."""
    r, v = e.shape
    full = v // rng.TILE
    # (unfold, not view: a view of the sliced rows would check their strides, which
    # torch.compile turns into a guard on the number of rows)
    parts = [e[:, :full * rng.TILE].unfold(1, rng.TILE, rng.TILE).sum(-1)] if full else []
    if v % rng.TILE:
        parts.append(e[:, full * rng.TILE:].sum(-1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def tile_logsumexp(z: torch.Tensor) -> torch.Tensor:
    """[R, NT] log-sum-exp of each ``rng.TILE``-wide vocabulary tile of ``z`` [R, V].

    ``z`` must be at most 0 (processed logits, whose row max is 0, or log-weights <= 0), so
    exp cannot overflow; a tile whose every value is below about -103 gets -inf, a probability
    under 1e-41 that float32 cannot represent anyway.
    """
    return torch.log(_tile_sums(torch.exp(z)))


def processed_tile_logsumexp(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile log-sum-exp [R, NT], row log-sum-exp [R]) of processed logits ``z`` whose row
    max is 0, from one fused softmax pass: p = softmax(z) gives each tile's share of the row
    mass, and the row's log-normaliser is -log(max p) (the max entry has z = 0). ``p`` lives in
    a reusable buffer on CPU (``workspace``)."""
    if z.requires_grad and torch.is_grad_enabled():  # (out= takes no autograd inputs)
        p = torch.softmax(z, dim=-1)
    else:
        p = workspace.buffer("softmax", tuple(z.shape), torch.float32, z.device)
        torch.ops.aten._softmax.out(z, -1, False, out=p)
    lse = -torch.log(p.amax(dim=-1))
    return torch.log(_tile_sums(p)) + lse[:, None], lse


def first_argmax(z: torch.Tensor) -> torch.Tensor:
    """[R] int64: the lowest index of each row's maximum of ``z`` [R, V] float32 (argmax with
    ties to the lowest id; a row holding NaN returns some index, never one outside [0, V)).

    From the ``rng.TILE``-wide tiles' maxima (one fast reduction): the first tile whose
    maximum is the row's, then the first maximum inside it (``torch.argmax`` over a whole row
    is several times slower on CPU)."""
    r, v = z.shape
    if v <= rng.TILE:
        return z.argmax(dim=-1)
    full = v // rng.TILE
    parts = [z[:, :full * rng.TILE].view(r, full, rng.TILE).amax(-1)]
    if v % rng.TILE:
        parts.append(z[:, full * rng.TILE:].amax(-1, keepdim=True))
    tmax = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
    best = tmax.argmax(dim=-1, keepdim=True)  # the first tile holding the row max
    tok = best * rng.TILE + torch.arange(rng.TILE, device=z.device)[None, :]
    vals = torch.where(tok < v, z.gather(1, tok.clamp_max(v - 1)), -math.inf)
    return tok.gather(1, vals.argmax(dim=-1, keepdim=True)).squeeze(1)


def tiled_gumbel_argmax(z: torch.Tensor, tile_lse: torch.Tensor | None, seed_lo: torch.Tensor,
                        seed_hi: torch.Tensor, pos: torch.Tensor, token_stream: int,
                        tile_stream: int) -> torch.Tensor:
    """Exact draw from softmax(z) per row by three-level Gumbel-max (docs/semantics.md).

    A tile t is drawn with keys ``tile_lse[t] + G(seed, pos, t, tile_stream)``, then a
    sub-tile s of it (``rng.SUBTILE`` tokens, global index s) with keys
    ``logsumexp(z[s]) + G(seed, pos, s, rng.sub_stream(tile_stream))``, then a token x of that
    sub-tile with keys ``z[x] + G(seed, pos, x, token_stream)``; ties go to the lowest index
    at every level. ``z``: [R, V] float32 (-inf allowed); ``tile_lse``: [R, NT] or None
    (computed); keys [R] int64. Returns [R] int64; a row of all -inf returns an id of tile 0.
    On the CPU the draw runs compiled (``specsample.cpu_compile``, path
    ``cpu.compiled.draw``): the same Philox words as the eager run (the float64 keys may
    differ from the eager run's by rounding). The CPU path's target rows are drawn by
    :func:`sample_processed` instead; this draws residual distributions and drafters' rows.
    """
    if tile_lse is None:
        tile_lse = tile_logsumexp(z)
    return _call_rows("draw", _draw, z, (tile_lse, torch.stack([seed_lo, seed_hi, pos], 1)),
                      token_stream, tile_stream, fixed_widths=False)


def _normal_tensors():
    """A context in which new tensors are normal ones (not inference tensors, which
    torch.compile guards apart): ``torch.inference_mode(False)`` where inference mode is on
    (entering it costs microseconds a call)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else (
        contextlib.nullcontext())


def _call_rows(name: str, fn, x: torch.Tensor, per_row: tuple, token_stream: int,
               tile_stream: int, *flags: bool, fixed_widths: bool = True) -> torch.Tensor:
    """``fn(x, *per_row, streams, *flags)`` through ``cpu_compile.call`` for the R rows of
    ``x`` [R, V] (``per_row``: tensors whose first dimension is R; ``streams``: the token,
    tile and sub-tile streams; ``flags``: bools, each value compiled apart). On the CPU the
    streams go as a tensor (torch.compile would specialise their values). With
    ``fixed_widths`` (every 2-D tensor of ``per_row`` has a width that no call changes) one
    row runs the graph compiled for many (``_call_cpu``'s ``row_args``); else one row goes
    padded to two. Returns ``fn``'s [R] result."""
    streams = (token_stream, tile_stream, rng.sub_stream(tile_stream))
    r = x.shape[0]
    if x.device.type != "cpu":
        return cpu_compile.call(name, fn, x, *per_row, streams, *flags, rows=r)
    if fixed_widths:
        y = _call_cpu(name, fn, x, per_row, streams, flags, row_args=len(per_row))
    else:  # (compiled shapes are dynamic except for sizes of 1: the row goes twice)
        if r == 1:
            x, *per_row = _two_rows(len(per_row) + 1, (x, *per_row), widths=False)
        y = _call_cpu(name, fn, x, per_row, streams, flags, rows=r)
    return y if y.shape[0] == r else y[:r]  # (a padded row's result)


def _call_cpu(name: str, fn, x: torch.Tensor, args: tuple, streams: tuple, flags: tuple,
              tags: tuple = (), row_args: int | None = None, rows: int | None = None):
    """``cpu_compile.call(name, fn, x, *args, streams, *flags)`` on CPU tensors, counted with
    x's rows; ``args`` may hold None. torch.compile guards on each tensor's kind (inference
    tensor or not): the small tensors are made normal ones, the logits' kind and dtype name a
    compiled variant, as do the flags that are set and the caller's ``tags`` (names of what
    else makes a different graph, such as None arguments). ``row_args``: the first
    ``row_args`` of ``args`` lead with x's rows, and the second dimension of every 2-D
    argument is a fixed width (marked static), so that one row runs the graph compiled for
    many (``cpu_compile.call``'s ``pad``); the caller reads the first R rows of the
    result. ``rows``: the rows to count (default x's; a caller that padded one row says 1)."""
    with _normal_tensors():
        # (contiguous with the standard strides, a size-1 dimension's included, and without
        # a _base: torch.compile guards on strides and on the base's shape)
        x, *args = (t if t is None or (t._base is None and not t.requires_grad
                                       and _dense(t) and (t is x or not t.is_inference()))
                    else (t.clone(memory_format=torch.contiguous_format)
                          if t is not x and t.is_inference() or not _dense(t)
                          else t.contiguous()).detach() for t in (x, *args))
    variant = (str(x.dtype).removeprefix("torch."), "inference" if x.is_inference() else "",
               *(f"flag{i}" for i, f in enumerate(flags) if f), *tags)
    pad = None
    if row_args is not None:
        _static_widths(args)
        pad = functools.partial(_two_rows, row_args + 1)
    return cpu_compile.call(name, fn, x, *args, _streams_tensor(streams), *flags,
                            rows=x.shape[0] if rows is None else rows,
                            variant=tuple(v for v in variant if v), pad=pad)


def _dense(t: torch.Tensor) -> bool:
    """True when ``t`` is contiguous with the standard strides (``is_contiguous`` ignores the
    stride of a size-1 dimension, which torch.compile guards on)."""
    return t.is_contiguous() and (t.dim() < 2 or t.stride(0) == math.prod(t.shape[1:]))


def _two_rows(n: int, args: tuple, widths: bool = True) -> tuple:
    """``args`` with each of the first ``n`` (x [1, V] first, then tensors of one row)
    repeated to two rows, x still an inference tensor if it was one (cat: a fraction of
    repeat's cost); ``widths``: the repeated 2-D tensors' widths marked static."""
    x = args[0]
    with torch.inference_mode(x.is_inference()):
        x = torch.cat([x, x])
    with _normal_tensors():
        rows = tuple(t if t is None else torch.cat([t, t]) for t in args[1:n])
    return (x, *(_static_widths(rows) if widths else rows), *args[n:])


def _static_widths(args):
    """``args``, with the second dimension of each 2-D tensor marked static for torch.compile
    (a graph compiled with size-oblivious sizes must not slice symbolic widths)."""
    for t in args:
        if t is not None and t.dim() > 1:
            torch._dynamo.mark_static(t, 1)
    return args


_STREAMS: dict[tuple, torch.Tensor] = {}


def _streams_tensor(streams: tuple) -> torch.Tensor:
    """The [3] int64 CPU tensor of ``streams``, made once per process (read only)."""
    t = _STREAMS.get(streams)
    if t is None:
        with torch.inference_mode(False):
            t = _STREAMS[streams] = torch.tensor(streams, dtype=torch.int64)
        torch._dynamo.mark_static(t, 0)
    return t


def _draw(z: torch.Tensor, tile_lse: torch.Tensor, rng_keys: torch.Tensor, streams
          ) -> torch.Tensor:
    """:func:`tiled_gumbel_argmax` with ``rng_keys`` [R, 3] int64 = (seed_lo, seed_hi, pos) and
    ``streams`` = (token, tile, sub-tile stream): ints, or a [3] int64 tensor (one function
    for the compiled and the eager run)."""
    read = _row_reader(z)

    def values(tok: torch.Tensor) -> torch.Tensor:
        return torch.where(tok < z.shape[1], read(tok), -math.inf)

    return _gumbel_levels(tile_lse, values, rng_keys, streams)


def _row_reader(x: torch.Tensor):
    """``read(tok)``: the entries of the rows of ``x`` [R, V] at ids ``tok`` [R, W] (ids past
    V read the last entry; callers mask them), one gather over the flattened rows."""
    r, v = x.shape
    flat, base = x.reshape(-1), torch.arange(r, device=x.device)[:, None] * v
    return lambda tok: flat.take(base + tok.clamp_max(v - 1))


def _gumbel_levels(tile_lse: torch.Tensor, values, rng_keys: torch.Tensor, streams
                   ) -> torch.Tensor:
    """The three Gumbel-max levels of :func:`tiled_gumbel_argmax`: ``tile_lse`` [R, NT]
    float32, ``values(tok)`` the rows' float32 values at ids ``tok`` [R, TILE] (-inf past V),
    ``rng_keys`` [R, 3] int64 (seed_lo, seed_hi, pos)."""
    dev = tile_lse.device
    seed_lo, seed_hi, pos = rng_keys[:, 0:1], rng_keys[:, 1:2], rng_keys[:, 2:3]
    t = torch.arange(tile_lse.shape[1], device=dev)
    tile_keys = tile_lse.double() + rng.gumbel(seed_lo, seed_hi, pos, t[None, :], streams[1])
    best_tile = tile_keys.argmax(dim=-1)
    # The chosen tile's values, -inf past V (padding draws no noise that matters).
    tok = best_tile[:, None] * rng.TILE + torch.arange(rng.TILE, device=dev)[None, :]
    vals = values(tok)
    nsub = rng.TILE // rng.SUBTILE
    sub = best_tile[:, None] * nsub + torch.arange(nsub, device=dev)[None, :]
    sub_keys = torch.logsumexp(vals.view(-1, nsub, rng.SUBTILE), dim=-1).double() + rng.gumbel(
        seed_lo, seed_hi, pos, sub, streams[2])
    best_sub = sub.gather(1, sub_keys.argmax(dim=-1, keepdim=True))
    tok = best_sub * rng.SUBTILE + torch.arange(rng.SUBTILE, device=dev)[None, :]
    # (ids past V have value -inf, so key -inf: the noise is finite)
    keys = vals.gather(1, tok - best_tile[:, None] * rng.TILE).double() + rng.gumbel(
        seed_lo, seed_hi, pos, tok, streams[0])
    return tok.gather(1, keys.argmax(dim=-1, keepdim=True)).squeeze(1)


def _same_rows(x: torch.Tensor, *per_row: torch.Tensor) -> None:
    """Tells torch.compile that every tensor of ``per_row`` has x's rows (their sizes are
    symbols of their own; without it, broadcasting one against another guards on the size,
    and a graph compiled for many rows would refuse one)."""
    for t in per_row:
        torch._check(t.shape[0] == x.shape[0])


def _processed_rows(x: torch.Tensor, m: torch.Tensor, pos: torch.Tensor, row_f: torch.Tensor,
                    row_i: torch.Tensor, streams, ties: bool) -> torch.Tensor:
    """[R] int64: the draw of :func:`tiled_gumbel_argmax` from the processed logits of each
    row, made on the fly from ``x`` [R, V] (the rows after bans, bias and penalties:
    ``processing.row_inputs``), ``m`` [R] float32 the rows' maxima (non-finite: 0, as
    ``processing.process_rows``), ``pos`` [R] int64 their positions, and per row ``row_f``
    [R, 2] float32 = (temperature (T = 0: divide by 1; the caller takes those rows' argmax),
    cut_v), ``row_i`` [R, 3] int64 = (cut_i, seed_lo, seed_hi) (a batch keeps these two while
    its requests do not change); see :func:`_draw_processed`. Compiled (``cpu_compile``): the
    rows are read once and z' is never stored."""
    _same_rows(x, m, pos, row_f, row_i)
    cut = (row_f[:, 1:2], row_i[:, 0:1].float())
    keys = torch.cat([row_i[:, 1:], pos[:, None]], 1)
    return _draw_processed(x, m[:, None], row_f[:, 0:1], cut, keys, streams, ties)


def _draw_processed(x: torch.Tensor, row_max: torch.Tensor, temperature: torch.Tensor,
                    cut: tuple | None, rng_keys: torch.Tensor, streams, ties: bool
                    ) -> torch.Tensor:
    """The draw of :func:`_processed_rows`: ``row_max`` and ``temperature`` [R, 1], ``cut``
    (cut_v [R, 1] float32, cut_i [R, 1] as float32, exact below 2**24) or None (no filter),
    ``rng_keys`` [R, 3] int64 (seed_lo, seed_hi, pos). The filter cut
    (``processing.filter_cut``) keeps ``x[j] > cut_v``, or ``== cut_v`` with ``j <= cut_i``;
    z = ``(x - max) / T`` there, -inf elsewhere. The tile level reads the tiles' masses as
    the fused GPU pass sums them, ``exp2((x - max) * log2(e) / T)`` (exp2 costs a fraction
    of exp on a CPU; the same masses to float32 rounding); the sub-tile and token levels read
    z itself. Without ``ties`` every ``cut_i`` must be V (a threshold: keep ``x >= cut_v``,
    one comparison per token). A row's values do not depend on whether the batch has a cut:
    (-inf, V) keeps the same masses as no cut."""
    v = x.shape[1]
    m = torch.where(torch.isfinite(row_max), row_max.float(), 0.0)
    t = torch.where(temperature > 0, temperature, 1.0)
    scale = (1.0 / t) * 1.4426950408889634  # exp(y / T) = exp2(y * scale)

    def kept(xv: torch.Tensor, ids: torch.Tensor, z: torch.Tensor, other: float
             ) -> torch.Tensor:
        if cut is None:
            return z
        cv, ci = cut
        keep = (xv > cv) | ((xv == cv) & (ids <= ci)) if ties else xv >= cv
        return torch.where(keep, z, other)

    xf = x.float()
    ids = torch.arange(v, device=x.device, dtype=torch.float32)[None, :]
    tile_lse = torch.log(_tile_sums(kept(xf, ids, torch.exp2((xf - m) * scale), 0.0)))
    read = _row_reader(x)

    def values(tok: torch.Tensor) -> torch.Tensor:  # (z' at the draw's ids)
        xv = read(tok).float()
        z = kept(xv, tok.float(), (xv - m) / t, -math.inf)
        return torch.where(tok < v, z, -math.inf)

    return _gumbel_levels(tile_lse, values, rng_keys, streams)


#: Candidates per row of :func:`_candidate_draw`: the top_k / top_p rows whose survivors
#: are among this many of the row's largest values are drawn from them alone.
CANDIDATES = 64
#: Values per block of :func:`_candidates`.
CANDIDATE_BLOCK = 16


def _candidates(x: torch.Tensor, cut: torch.Tensor, c: int, mass_of: tuple | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(values, ids) [R, c] of the c largest entries of each row of ``x`` [R, V] (as float32)
    that are at least ``cut`` [R, 1] float32, in rank order (value, then lower id; every
    entry above the c-th largest value is there, the tie group at the smallest value may be
    cut; -inf for entries below the cut), and with ``mass_of`` = (m [R, 1], s [R,
    1]) float32 the row's float64 sum of ``exp2((x - m) * s)`` over the entries at least
    ``cut`` [R, 1] (16 terms at a time in float32, as ``processing.block_total``), else None.

    One pass over the row takes the maximum (and the mass) of each block of
    ``CANDIDATE_BLOCK`` values: with nb = V // 16, block b holds the ids b + nb j (j < 16),
    so the pass is 16 whole slices of the row compared element by element (a maximum over
    16 neighbours is several times slower on a CPU), and the V mod 16 last ids form one more
    block. Fewer than c blocks hold an entry above the c-th largest value, so the c blocks
    with the largest maxima hold all of them, and the c groups of 8 consecutive blocks with
    the largest maxima hold those blocks: three top-k's of at most 8c values, none over the
    row (``torch.topk`` costs about 12 us per 8,192 values on a CPU, whatever c is)."""
    r, v = x.shape
    blk = CANDIDATE_BLOCK
    nb = v // blk
    parts = [x[:, :nb * blk].view(r, blk, nb)] if nb else []  # [R, 16, nb]: block b = column b
    if v % blk:
        parts.append(x[:, nb * blk:][:, :, None])
    # (the cut applies to the maxima: a block's largest entry at least the cut is its maximum
    # if that is, else none is)
    bmax = torch.cat([p.amax(1) for p in parts], dim=1).float()  # [R, blocks]
    bmax = torch.where(bmax >= cut, bmax, -math.inf)
    mass = None
    if mass_of is not None:
        m, s = mass_of
        mass = torch.cat([torch.where(p >= cut[:, :, None], torch.exp2(
            (p.float() - m[:, :, None]) * s[:, :, None]), 0.0).sum(1) for p in parts],
            dim=1).double().sum(-1, keepdim=True)
    n_blocks = bmax.shape[1]
    if n_blocks <= c:  # (a short row: its plain top-k)
        cols = torch.arange(v, device=x.device).expand(r, v)
        return (*_rank_top(x.float(), cols, cut, c), mass)
    per = 8
    if n_blocks > per * c:  # groups of `per` blocks first
        pad = -n_blocks % per
        padded = torch.nn.functional.pad(bmax, (0, pad), value=-math.inf) if pad else bmax
        groups = torch.topk(padded.view(r, -1, per).amax(-1), c, dim=-1).indices
        blocks = (groups[:, :, None] * per + torch.arange(per, device=x.device)).view(r, -1)
        bvals = padded.gather(1, blocks)
    else:
        blocks, bvals = None, bmax
    best = torch.topk(bvals, c, dim=-1).indices  # [R, c] blocks
    if blocks is not None:
        best = blocks.gather(1, best)
    j = torch.arange(blk, device=x.device)
    cols = torch.where(best[:, :, None] < nb, best[:, :, None] + nb * j,
                       nb * blk + j).view(r, -1)  # (the last block: the V mod 16 last ids)
    vals = torch.where(cols < v, x.gather(1, cols.clamp_max(v - 1)).float(), -math.inf)
    return (*_rank_top(vals, cols.clamp_max(v - 1), cut, c), mass)


def _rank_top(vals: torch.Tensor, ids: torch.Tensor, cut: torch.Tensor, c: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [R, c] of the c entries of ``vals`` [R, W] float32 (ids ``ids`` [R, W],
    below 2**31) that rank highest, value first, then the lower id, in that order; entries
    below ``cut`` [R, 1] count as -inf. One top-k of int64 keys that order both at once
    (the value's order-preserving bits above the id's complement)."""
    vals = torch.where(vals >= cut, vals + 0.0, -math.inf)  # (+ 0.0: -0.0 ranks as 0.0)
    bits = vals.view(torch.int32)
    key = (torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64) << 32) + (
        0x7FFFFFFF - ids)
    at = torch.topk(key, c, dim=-1).indices
    return vals.gather(1, at), ids.gather(1, at)


def _candidate_draw(x: torch.Tensor, m: torch.Tensor, row_f: torch.Tensor,
                    row_req: torch.Tensor, row_pos: torch.Tensor, live: torch.Tensor,
                    top_p: torch.Tensor, req_i: torch.Tensor, streams, need_total: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draw of sampled rows with top_k or top_p (and maybe min_p) from their candidates,
    the cut found on the way (:func:`_candidate_cut`): ([R] int64 tokens, [R] bool found).
    Per row: ``x`` [R, V] (the rows after bans, bias and penalties), ``m`` [R] float32 their
    finite maxima, ``row_f`` [R, 3] float32 = (temperature (> 0), min_p's cut or -inf, exp2
    scale: :func:`_row_args`),
    ``row_req`` / ``row_pos`` [R] int64, ``live`` [R] bool (rows that are not live count as
    found: nobody reads them); per request: ``top_p`` [N] float64 and ``req_i`` [N, 3] int64 =
    (top_k, seed_lo, seed_hi). ``need_total`` as in :func:`_candidate_cut`.

    A found row's token is drawn by the three levels of :func:`tiled_gumbel_argmax`, the tile
    level's masses summed from the survivors alone (float64 ``exp((y - m) / T)``, added into
    their tiles in rank order by one ``scatter_add``: no second pass over the row), the lower
    two from the chosen tile's values with the cut applied. The caller draws the rows that
    were not found from the cut of ``processing.filter_cut``."""
    v = x.shape[1]
    m, t = m[:, None], row_f[:, 0:1]
    i = req_i[row_req]
    k = i[:, 0:1]
    cand_v, cand_i, n_keep, found = _candidate_cut(
        x, m, t, row_f[:, 1:2], row_f[:, 2:3], torch.where((k > 0) & (k < v), k, v),
        top_p[row_req][:, None], need_total)
    cut_v, cut_i = cand_v.gather(1, n_keep - 1), cand_i.gather(1, n_keep - 1)
    # The tile level from the survivors' float64 masses (the candidates ranked < n_keep).
    rank = torch.arange(cand_v.shape[1], device=x.device)[None, :]
    mass = torch.where(rank < n_keep, torch.exp((cand_v.double() - m.double()) / t.double()),
                       0.0)
    tile_sum = torch.zeros(x.shape[0], (v + rng.TILE - 1) // rng.TILE, dtype=torch.float64,
                           device=x.device)
    tile_lse = torch.log(tile_sum.scatter_add(1, cand_i // rng.TILE, mass))
    read = _row_reader(x)

    def values(tok: torch.Tensor) -> torch.Tensor:  # (z' at the draw's ids)
        xv = read(tok).float()
        keep = ((xv > cut_v) | ((xv == cut_v) & (tok <= cut_i))) & (tok < v)
        return torch.where(keep, (xv - m) / t, -math.inf)

    keys = torch.cat([i[:, 1:3], row_pos[:, None]], 1)
    return _gumbel_levels(tile_lse, values, keys, streams), found[:, 0] | ~live


def _candidate_cut(x: torch.Tensor, m: torch.Tensor, t: torch.Tensor, min_cut: torch.Tensor,
                   scale: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   need_total: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filter cut of ``processing.filter_cut`` (min_p -> top_k -> top_p) of rows ``x``
    [R, V] from their ``CANDIDATES`` largest values: (values [R, C] float32 and ids [R, C]
    int64 of the candidates in rank order (value, then lower id), [R, 1] int64 how many of
    them the row keeps (its survivors), [R, 1] bool found). Per row [R, 1]: ``m`` float32
    finite maximum, ``t`` float32 temperature > 0, ``min_cut`` float32 (keep ``x >=`` it;
    -inf: off), ``scale`` float32 ``log2(e) / t`` (:func:`_row_args`), ``top_k`` int64 (V or
    more: off), ``top_p`` float64 (1: off).
    ``need_total``: some row has top_p without top_k, so its total mass is estimated from
    the whole row (float32 blocks of 16 in the candidates' pass, bound
    ``processing.NUCLEUS_TOTAL_TOL``).

    The candidates (:func:`_candidates`: one pass for block maxima, three small top-k's)
    are exact in rank order down to the tie group of the smallest one. top_k's cut
    is the k-th of them; top_p keeps a token while the float64 mass ``exp((y - m) / T)``
    ranked before it is below top_p times the survivors' total: the candidates' own masses
    after a top_k cut (or when every survivor of min_p is a candidate), else the estimate,
    with a kept count that the estimate's bound leaves undecided not found (the exact
    float64 total decides in ``processing.filter_cut``). A row is found when its survivors
    lie inside the exact part."""
    r, v = x.shape
    c = min(CANDIDATES, v)
    cand_v, cand_i, row_mass = _candidates(
        x, min_cut, c, (m, scale) if need_total else None)
    rank = torch.arange(c, device=x.device)[None, :]
    v_min = cand_v[:, -1:]
    # every survivor of min_p is a candidate, or only those above the smallest one's value
    all_in = (v_min == -math.inf) | (c == v)
    n_exact = torch.where(all_in, (cand_v > -math.inf).sum(-1, keepdim=True),
                          (cand_v > v_min).sum(-1, keepdim=True))
    k_on = top_k < v
    closed_k = k_on & (top_k <= n_exact)
    closed = all_in | closed_k  # the survivors after top_k are known
    n_k = torch.where(closed_k, top_k, n_exact)
    surv_k = rank < n_k
    ce = torch.where(surv_k, torch.exp((cand_v.double() - m.double()) / t.double()), 0.0)
    before = torch.cumsum(ce, dim=-1) - ce
    total = ce.sum(-1, keepdim=True)
    open_p = torch.zeros_like(closed)  # (top_p without top_k over more than the candidates)
    if need_total:
        total = torch.where(closed, total, row_mass)
        open_p = ~closed & ~k_on
    tol = torch.where(closed, 0.0, processing.NUCLEUS_TOTAL_TOL)
    goal = top_p * total
    n_lo = ((before < goal * (1 - tol)) & surv_k).sum(-1, keepdim=True).clamp_min(1)
    n_hi = ((before < goal * (1 + tol)) & surv_k).sum(-1, keepdim=True).clamp_min(1)
    p_on = top_p < 1
    found = closed | (p_on & open_p & (n_lo == n_hi) & (n_lo < n_exact))
    return cand_v, cand_i, torch.where(p_on, n_lo, n_k).clamp(1, c), found


def _matched_candidates(x: torch.Tensor, m: torch.Tensor, row_f: torch.Tensor,
                        row_req: torch.Tensor, row_pos: torch.Tensor, live: torch.Tensor,
                        top_p: torch.Tensor, req_i: torch.Tensor, rows: torch.Tensor,
                        d: torch.Tensor, streams, need_total: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-hot verification of top_k / top_p rows in one compiled call: every row's token
    as :func:`_candidate_draw` draws it (same arguments), then sample-and-match over the grid
    ``rows`` [N, K + 1] and drafts ``d`` [N, K] (:func:`_match_grid`). Returns (token_ids
    [N, K + 1], num_accepted [N], the rows' tokens [R], found [R]); the first two hold only
    where every row was found."""
    y, found = _candidate_draw(x, m, row_f, row_req, row_pos, live, top_p, req_i, streams,
                               need_total)
    return (*_match_grid(y, rows, d), y, found)


def _match_grid(y: torch.Tensor, rows: torch.Tensor, d: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample-and-match: (token_ids [N, K + 1]: the rows' tokens ``y`` [R] over the grid
    ``rows`` [N, K + 1] up to and including the first one that differs from its draft in
    ``d`` [N, K] (-1 past k_eff, which never matches), then -1; num_accepted [N])."""
    n, k = d.shape
    y_grid = y[rows]
    miss = torch.cat([d != y_grid[:, :k], torch.ones_like(d[:, :1], dtype=torch.bool)], 1)
    num_accepted = miss.to(torch.int32).argmax(dim=-1)  # the first mismatch (or K)
    j = torch.arange(k + 1, device=y.device)
    return torch.where(j <= num_accepted[:, None], y_grid, -1), num_accepted


def _matched_rows(x: torch.Tensor, m: torch.Tensor, cut_v: torch.Tensor | None,
                  cut_i: torch.Tensor | None, row_req: torch.Tensor, row_pos: torch.Tensor,
                  temperature: torch.Tensor, seeds: torch.Tensor, rows: torch.Tensor,
                  d: torch.Tensor, streams, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One-hot verification in one compiled call: every row's token as
    :func:`_draw_processed` draws it, then sample-and-match over the grid ``rows`` [N, K + 1]
    (request i's rows) and ``d`` [N, K] (its drafts, -1 past k_eff, which never match).
    Per row: ``x`` [R, V], ``m`` [R] maxima, the cut ``cut_v`` [R] float32 / ``cut_i`` [R]
    int64 (both None: no filter), ``row_req`` / ``row_pos`` [R] int64; per request:
    ``temperature`` [N] float32 (every one > 0), ``seeds`` [N, 2] int64 (seed_lo, seed_hi).
    Returns (token_ids [N, K + 1]: the rows' tokens up to and including the first mismatch,
    then -1; num_accepted [N]). The draws are the upstream part of the graph and only
    integers flow from them into the match, so they round as :func:`_processed_rows` alone
    does."""
    cut = None if cut_v is None else (cut_v[:, None], cut_i[:, None].float())
    keys = torch.cat([seeds[row_req], row_pos[:, None]], 1)
    y = _draw_processed(x, m[:, None], temperature[row_req][:, None], cut, keys, streams, ties)
    return _match_grid(y, rows, d)


def sample_rows(z: torch.Tensor, tile_lse: torch.Tensor, greedy: torch.Tensor,
                seed_lo: torch.Tensor, seed_hi: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[R] int64: argmax for greedy rows, an exact draw (STREAM_SAMPLE*) for the others (no
    noise is drawn when every row is greedy)."""
    if bool(greedy.all()):
        return first_argmax(z)
    y = tiled_gumbel_argmax(z, tile_lse, seed_lo, seed_hi, pos, rng.STREAM_SAMPLE,
                            rng.STREAM_SAMPLE_TILE)
    if bool(greedy.any()):
        idx = greedy.nonzero().squeeze(1)
        y[idx] = first_argmax(z[idx])
    return y


def draft_distribution(plan: Plan, draft_idx: torch.Tensor) -> torch.Tensor:
    """[M, V] float32 drafter probabilities q of drafts ``draft_idx`` (0 beyond V')."""
    if plan.draft_logits is not None:
        t = plan.batch.temperature[plan.draft_req[draft_idx]]
        t = torch.where(t > 0, t, torch.ones_like(t))
        q = plan.draft_logits[draft_idx].float()
        q = torch.softmax((q - q.amax(-1, keepdim=True)) / t[:, None], dim=-1)
    else:
        q = plan.draft_probs[draft_idx].float()
    pad = plan.vocab_size - q.shape[1]
    return torch.nn.functional.pad(q, (0, pad)) if pad else q


def _grid(plan: Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row index [N, K+1], draft id [N, K] (-1 past k_eff) and draft index [N, K] grids."""
    k1 = plan.max_k + 1
    j = torch.arange(k1, device=plan.logits.device)
    rows = (plan.row_start[:, None] + j).clamp_max(plan.num_rows - 1)
    didx = (plan.draft_start[:, None] + j[:-1]).clamp(0, max(plan.draft_token_ids.numel() - 1, 0))
    return rows, plan.draft_grid, didx


def _block_tau(plan: Plan, z: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor,
               d: torch.Tensor, didx: torch.Tensor, sampled_dist: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification: accepted length tau [N] and rho_tau [N] (Sun et al. 2024, Alg. 2)."""
    n, k = d.shape
    batch = plan.batch
    k_eff = plan.k_eff
    rho = torch.ones(n, k + 1, dtype=torch.float32, device=z.device)
    h = torch.zeros(n, k + 1, dtype=torch.float32, device=z.device)
    dsafe = d.clamp(0, plan.vocab_size - 1)  # ids of invalid requests are only read safely
    for j in range(k):
        live = (j < k_eff) & sampled_dist
        r = rows[:, j]
        p_row = torch.exp(z[r] - lse[r, None])
        q_row = draft_distribution(plan, didx[:, j])
        p_x = p_row.gather(1, dsafe[:, j:j + 1]).squeeze(1)
        q_x = q_row.gather(1, dsafe[:, j:j + 1]).squeeze(1)
        if j > 0:  # Z_j and h_j for 0 < j < k_eff use rho_j and row j.
            mass = torch.clamp(rho[:, j, None] * p_row - q_row, min=0).sum(-1)
            denom = mass + (1 - rho[:, j])  # not (mass + 1) - rho: keeps a tiny Z_j
            h[:, j] = torch.where(mass > 0, mass / torch.where(denom > 0, denom, 1.0), 0.0)
        ratio = torch.where(q_x > 0, p_x / torch.where(q_x > 0, q_x, 1.0),
                            torch.where(p_x > 0, math.inf, 0.0))
        nxt = torch.where(rho[:, j] > 0, torch.clamp(rho[:, j] * ratio, max=1.0), 0.0)
        rho[:, j + 1] = torch.where(live, nxt, rho[:, j])
    jj = torch.arange(k + 1, device=z.device)
    # h_j <= rho_j in real numbers (Z_j <= rho_j); min() makes it so in float32 too, so the
    # Triton path may skip Z_j wherever eta_j > rho_j and take the same tokens.
    h = torch.where(jj[None, :] == k_eff[:, None], rho, torch.minimum(h, rho))
    ju = jj[1:].expand(n, k)
    u = rng.uniform(batch.seed_lo[:, None], batch.seed_hi[:, None],
                    plan.positions[:, None] + ju - 1, ju, rng.STREAM_BLOCK_ACCEPT)
    acc = (u <= h[:, 1:]) & (ju <= k_eff[:, None])
    tau = (acc * ju).amax(dim=1) if k else torch.zeros(n, dtype=torch.int64, device=z.device)
    return tau, rho.gather(1, tau[:, None]).squeeze(1)


def top_n_logprobs(lp: torch.Tensor, n: int,
                   rank: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The n entries of each row of ``lp`` [R, V] (float32) that rank highest by ``rank``
    ([R, V], default ``lp``: the values before normalisation, whose order within a row is
    exact where ``lp = rank - log-normaliser`` may round distinct values together), and their
    ids, ordered by rank value then lower id first (ties), padded with -inf / -1 when n > V.

    No sort of the row: one ``torch.topk`` of n + 1 values; the entries tied with the n-th
    value are then taken lowest ids first (a second top-k over the tied ids). On CPU that
    second pass runs only when a tie crosses the boundary (when the (n+1)-th value equals the
    n-th in some row); on a device it always runs, since asking would synchronise with the
    host (and break CUDA-graph capture). The n chosen entries are ordered by (value, id) with
    two small stable sorts.
    """
    ranked = lp if rank is None else rank
    r, v = ranked.shape
    k = min(n, v)
    vals, ids = torch.topk(ranked, min(k + 1, v), dim=-1)
    if k < v and (ranked.device.type != "cpu"
                  or not bool((vals[:, k] < vals[:, k - 1]).all())):
        # A tie group crosses the boundary (or a NaN row): lowest tied ids first.
        lp0 = ranked.float() + 0.0  # -0.0 ties with 0.0
        last = vals[:, k - 1:k].float() + 0.0
        n_above = (lp0 > last).sum(-1, keepdim=True)  # these are all among the top-k
        col = torch.arange(k, device=lp.device)[None, :]
        tied = torch.topk(torch.where(lp0 == last, -torch.arange(
            v, device=lp.device, dtype=lp0.dtype), -math.inf), k, dim=-1).indices
        ids = torch.where(col < n_above, ids[:, :k], tied.gather(1, (col - n_above).clamp_min(0)))
    else:
        ids = ids[:, :k]
    ids = ids.gather(1, torch.sort(ids, dim=-1).indices)  # (stable) by id, then by value:
    order = torch.sort(ranked.gather(1, ids).float() + 0.0, dim=-1, descending=True,
                       stable=True).indices
    ids = ids.gather(1, order)
    vals = lp.gather(1, ids)
    if n > k:  # more logprobs asked than V: pad with -inf / -1
        vals = torch.nn.functional.pad(vals, (0, n - k), value=-math.inf)
        ids = torch.nn.functional.pad(ids, (0, n - k), value=-1)
    return vals, ids


def raw_log_normaliser(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log sum exp of the rows of ``y`` [R, V] float32 as ([R, 1] float32 max m, [R, 1]
    float32 log of the sum of exp(y - m)): the raw logprob of x is ``(x - m) - log_sum``, the
    two parts subtracted apart, as the kernels do, so that it stays exact to float32 rounding
    at any magnitude (``m + log_sum`` rounded first loses 1e-5 at logits of 1e3 and all of it
    at 1e38). The sum runs in blocks of 16 in float32 and the blocks in float64
    (``processing.block_total``), so it is exact to float32 rounding at any V
    (``torch.log_softmax`` in float32 drifts by 4e-4 at V = 131,072 on a row with a long flat
    tail) and each row's value does not depend on the batch. A row without a finite value
    gives m = 0 and log_sum = -inf."""
    m = y.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = block_total(torch.exp(y - m_safe))
    return m_safe, total.log().float()


def emitted_logprobs(plan: Plan, processed_logprobs, rows: torch.Tensor, tokens: torch.Tensor,
                     emitted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs [N, K+1, 1+n] and their ids for the emitted grid (semantics.md, Outputs).

    ``processed_logprobs(flat_rows)`` returns the [R, V] float32 processed log-distribution of
    target rows ``flat_rows`` and the [R, V] values it is ranked by for top-n (before
    normalisation, -inf where dropped), and ``processed_logprobs(flat_rows, tokens)`` only the
    [R] log-distribution entries at ``tokens``; raw logprobs are the raw logits minus
    :func:`raw_log_normaliser`, ranked by the raw logits. With n = 0 (the emitted token only)
    processed values are gathered (no [R, V] work); raw ones need one normaliser per row.
    Top-n comes from one top-k (:func:`top_n_logprobs`), no sort.
    ``rows``: [N, K+1] target row of each position; ``tokens``: [N, K+1] emitted ids;
    ``emitted``: [N, K+1] bool.
    """
    batch = plan.batch
    n = batch.max_logprobs
    flat = rows.reshape(-1)
    tok = tokens.reshape(-1).clamp_min(0)
    processed = batch.logprobs_processed[:, None].expand_as(rows).reshape(-1)
    # (column 0 of a request without logprobs follows its own logprobs_mode too)
    modes = {p.logprobs_mode for p in batch.params}
    any_processed, all_processed = "processed" in modes, modes == {"processed"}
    if n == 0:
        col0 = processed_logprobs(flat, tok) if any_processed else None
        if not all_processed:
            m, log_sum = raw_log_normaliser(plan.logits[flat].float())
            raw = ((plan.logits[flat, tok].float()[:, None] - m) - log_sum)[:, 0]
            col0 = raw if col0 is None else torch.where(processed, col0, raw)
        vals, ids = col0[:, None], tok[:, None]
    else:
        if not all_processed:
            raw_rank = plan.logits[flat].float()
            m, log_sum = raw_log_normaliser(raw_rank)
            raw_lp = (raw_rank - m) - log_sum
        if not any_processed:
            lp, rank = raw_lp, raw_rank
        elif all_processed:
            lp, rank = processed_logprobs(flat)
        else:
            proc_lp, proc_rank = processed_logprobs(flat)
            lp = torch.where(processed[:, None], proc_lp, raw_lp)
            rank = torch.where(processed[:, None], proc_rank, raw_rank)
        top_v, top_i = top_n_logprobs(lp, n, rank)
        vals = torch.cat([lp.gather(1, tok[:, None]), top_v], dim=1)
        ids = torch.cat([tok[:, None], top_i], dim=1)
    vals = vals.reshape(*rows.shape, n + 1)
    ids = ids.reshape(*rows.shape, n + 1)
    col = torch.arange(n + 1, device=rows.device)
    want = batch.logprobs_n.clamp_min(0)[:, None, None]
    keep = emitted[:, :, None] & ((col == 0) | (col <= want))
    vals = torch.where(keep, vals, torch.full_like(vals, -math.inf))
    ids = torch.where(keep, ids, torch.full_like(ids, -1))
    return vals, ids


def processed_logprobs(plan, z: torch.Tensor, lse: torch.Tensor):
    """The ``processed_logprobs`` callable of :func:`emitted_logprobs` from the processed
    logits ``z`` [R, V] and their log-normalisers ``lse`` [R] of ``plan``'s rows (``plan``
    as :func:`processed_logits` returns it).

    Top-n ranks by the values before the max is subtracted and T divides (the raw logits,
    -inf where dropped), since (y - m) / T can round two neighbouring logits together; with
    logit bias or penalties those values are not kept, and z' ranks."""
    exact_rank = not (plan.batch.needs_bias or plan.batch.needs_penalties)

    def processed(r: torch.Tensor, t: torch.Tensor | None = None):
        if t is not None:
            return z[r, t] - lse[r]
        zr = z[r]
        rank = torch.where(zr == -math.inf, -math.inf, plan.logits[r].float()) if (
            exact_rank) else zr
        return zr - lse[r, None], rank

    return processed


def processed_logits(plan: Plan, *, argmax_only: bool = False
                     ) -> tuple[Plan, torch.Tensor, torch.Tensor]:
    """Validate and process every row of ``plan``: (the plan with the rows of invalid requests
    and dead rows zeroed, processed logits z' [T, V] float32, [N] int64 ERR_* bitmask).

    Besides :func:`request_errors`' bits, a live row whose bans leave no token sets ERR_BANS,
    and one
    that logit_bias / penalties push to NaN / +inf or leave without a finite logit sets
    ERR_PROCESSED_OVERFLOW. Rows of invalid requests hold arbitrary values (possibly all -inf).
    With ``argmax_only`` (the caller only takes each row's first argmax) a batch with no bans,
    bias or penalties gets the cleaned logits themselves instead of z' (the same argmax:
    ``y - max`` is 0 exactly where ``y`` is the max, and monotone).
    """
    batch = plan.batch
    if argmax_only and not (batch.needs_bans or batch.needs_bias or batch.needs_penalties):
        plan, _, err, _ = clean_rows(plan)
        return plan, plan.logits, err
    plan, inputs, err, _ = checked_row_inputs(plan)
    return plan, process_rows(plan, inputs=inputs), err


def clean_rows(plan: Plan) -> tuple[Plan, torch.Tensor, torch.Tensor, bool]:
    """Validate ``plan``'s rows: (the plan with the rows of invalid requests and dead rows
    zeroed, [T] float max of each cleaned row, [N] int64 ERR_* bitmask, with ERR_BANS: see
    :func:`processed_logits`; True when every request is known valid (the bitmask all 0,
    every row maximum finite), False when some is not or, with bans, may not be)."""
    batch = plan.batch
    n = plan.num_requests
    row_max = plan.logits.amax(dim=-1)
    err, valid = request_errors(plan, row_max)
    valid = valid or not bool(err.any())
    if not valid or not plan.placeholder_free and bool((~plan.row_live).any()):
        invalid = err != 0
        bad_rows = invalid[plan.row_req] | ~plan.row_live
        clean = plan.logits.masked_fill(bad_rows[:, None], 0.0)
        clean = torch.where(torch.isnan(clean) | torch.isposinf(clean), 0.0, clean)
        plan = dataclasses.replace(plan, logits=clean)
        row_max = torch.where(bad_rows, 0.0, row_max)  # (the zeroed rows' own maximum)
    if batch.needs_bans:
        live = plan.row_live & (err == 0)[plan.row_req]
        err |= _or_per_request(rows_emptied_by_bans(plan) & live, plan.row_req, n, ERR_BANS)
        valid = False  # (not read on the host)
    return plan, row_max, err, valid


def processed_distribution(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, V] float32 processed distribution of every row, [N] int64 ERR_* bitmask).

    Sampled rows: softmax(z'); greedy rows: one-hot at argmax z' (lowest id on ties); rows of
    invalid requests and dead rows: all zeros.
    """
    plan, z, err = processed_logits(plan)
    p = torch.softmax(z, dim=-1)
    greedy = plan.batch.temperature[plan.row_req] == 0
    if plan.batch.any_greedy:
        onehot = torch.zeros_like(p).scatter_(1, z.argmax(dim=-1, keepdim=True), 1.0)
        p = torch.where(greedy[:, None], onehot, p)
    ok = (err == 0)[plan.row_req] & plan.row_live
    return torch.where(ok[:, None], p, 0.0), err


def accepted_grid(accept: torch.Tensor, d: torch.Tensor, emit: torch.Tensor,
                  k_eff: torch.Tensor, invalid: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The outputs of a verification from its decisions: (num_accepted [N] int64, token_ids
    [N, K+1] int64, emitted [N, K+1] bool).

    ``accept`` [N, K] bool: draft j passed its test; ``d`` [N, K] int64 the drafts (-1 past
    k_eff); ``emit`` [N, K+1] int64 the token emitted if the walk stops at j (correction or
    bonus); ``k_eff`` [N]; ``invalid`` [N] bool (no token, 0 accepted). The accepted length is
    the leading run of accepts within k_eff; token_ids hold the accepted drafts, the emitted
    token, then -1.
    """
    k = d.shape[1]
    dev = d.device
    live_j = torch.arange(k, device=dev) < k_eff[:, None]
    num_accepted = torch.cumprod((accept & live_j).to(torch.int64), dim=1).sum(1)
    num_accepted = torch.where(invalid, 0, num_accepted)
    j = torch.arange(k + 1, device=dev)
    d_full = torch.nn.functional.pad(d, (0, 1), value=-1)
    emitted_tok = emit.gather(1, num_accepted[:, None])
    token_ids = torch.where(j < num_accepted[:, None], d_full,
                            torch.where(j == num_accepted[:, None], emitted_tok, -1))
    token_ids = torch.where(invalid[:, None], -1, token_ids)
    emitted = (j <= num_accepted[:, None]) & ~invalid[:, None]
    return num_accepted, token_ids, emitted


def verify(plan: Plan) -> tuple[VerifyOutput, torch.Tensor]:
    """Run one verification (or, with every k_i = 0, one sampling step) on ``plan``.

    Returns the VerifyOutput (on the logits' device; docs/semantics.md gives the exact
    function) and the [N] int64 ERR_* bitmask of every request (0 = valid).
    """
    batch = plan.batch
    n = plan.num_requests
    # (an all-greedy batch without logprobs takes only argmaxes: no z', no normaliser)
    argmax_only = not batch.any_sampled and batch.max_logprobs < 0
    req = plan.row_req
    z = tile_lse = lse = None
    if not argmax_only and plan.logits.device.type == "cpu":
        # (every sampled CPU token comes from sample_processed, whatever else the call needs,
        # so a request's tokens never depend on the other requests' options)
        plan, inputs, err, valid = checked_row_inputs(plan)
        one_hot = not (batch.max_logprobs >= 0 or plan.has_draft_dist)
        if one_hot and plan.max_k > 0 and batch.num_greedy == 0:
            out = _match_cpu(plan, inputs, err, valid)  # (the draws and the match in one call)
            if out is not None:
                return out, err
        y = sample_processed(*inputs, batch, req, plan.row_pos)
        if not one_hot:  # (z' itself is needed)
            z = process_rows(plan, inputs=inputs)
            tile_lse, lse = processed_tile_logsumexp(z)
    else:
        plan, z, err = processed_logits(plan, argmax_only=argmax_only)
        valid = False  # (not read on the host)
        if not argmax_only:
            tile_lse, lse = processed_tile_logsumexp(z)
        y = sample_rows(z, tile_lse, (batch.temperature == 0)[req], batch.seed_lo[req],
                        batch.seed_hi[req], plan.row_pos)
    invalid = err != 0
    if plan.max_k == 0:  # sample(), or no drafts at all: each request emits its row's token
        token_ids = y[:, None] if plan.num_rows == n else y[plan.row_start][:, None]
        if y.device.type != "cpu" or not valid and bool(err.any()):  # (free on the CPU)
            token_ids = torch.where(invalid[:, None], -1, token_ids)
        num_accepted = torch.zeros(n, dtype=torch.int64, device=y.device)
        if batch.max_logprobs >= 0:
            # (a new tensor: the cached layout may hold inference-mode tensors, which
            # autograd must not save when the logits require grad)
            rows, emitted = plan.row_start[:, None].clone(), ~invalid[:, None]
    else:
        rows, num_accepted, token_ids, emitted = _verify_drafts(plan, z, lse, y, invalid)
    logprobs = logprob_ids = None
    if batch.max_logprobs >= 0:
        logprobs, logprob_ids = emitted_logprobs(plan, processed_logprobs(plan, z, lse), rows,
                                                 token_ids, emitted)
    return VerifyOutput(token_ids=token_ids, num_accepted=num_accepted, logprobs=logprobs,
                        logprob_token_ids=logprob_ids, invalid=invalid), err


def checked_row_inputs(plan: Plan) -> tuple[Plan, tuple, torch.Tensor, bool]:
    """(the cleaned plan, ``processing.row_inputs`` of its rows, [N] ERR_* bitmask, True when
    every request is known valid (:func:`clean_rows`)): the validation of
    :func:`processed_logits` without building z'. Bias and penalties can overflow finite
    logits (x + bias, x / r): a live row whose processed rows hold NaN / +inf or nothing
    finite sets ERR_PROCESSED_OVERFLOW, as the Triton general path does; it is read from the
    rows' maxima (z' has a non-finite maximum exactly when they do)."""
    batch = plan.batch
    req = plan.row_req
    plan, row_max, err, valid = clean_rows(plan)
    y, m, filters = row_inputs(plan, row_max=row_max, finite=valid)
    if batch.needs_bias or batch.needs_penalties:
        live = plan.row_live & (err == 0)[req]
        err |= _or_per_request(~torch.isfinite(m) & live, req, plan.num_requests,
                               ERR_PROCESSED_OVERFLOW)
        valid = False  # (not read on the host)
    if filters is not None:  # (no cut is searched for on the rows nobody reads)
        filters.live = plan.row_live if valid else plan.row_live & (err == 0)[req]
    return plan, (y, m, filters), err, valid


def sample_processed(x: torch.Tensor, m: torch.Tensor, filters: processing.RowFilters | None,
                     batch, row_req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """[R] int64: each row's token from its processed inputs (``processing.row_inputs``: the
    rows ``x`` after bans, bias and penalties, their maxima ``m``, their ``filters`` or
    None), the row's request ``row_req`` in ``batch`` and position ``pos`` [R]: the first
    argmax of ``x`` for greedy requests; for sampled requests with top_k or top_p the draw
    of :func:`_candidate_draw` (the cut found and the row drawn from its candidates in one
    compiled call), or where that finds no cut, the draw of :func:`_processed_rows` from the
    cut of ``processing.filter_cut``; for the other rows the draw of :func:`_processed_rows`
    (three-level Gumbel-max of z' made on the fly, min_p's threshold applied). Compiled on the
    CPU. Which function draws a row depends on the row alone, never on its batch. The CPU
    path draws every sampled row with this function, or with :func:`match_processed`, which
    draws alike."""
    n_ranked, need_total, _ = batch.rank_filters
    one_each = x.shape[0] == batch.num_requests  # (row i is request i: no gathers)
    temperature = batch.temperature if one_each else batch.temperature[row_req]
    if filters is None or n_ranked == 0:
        seeds = _seeds(batch) if one_each else _seeds(batch)[row_req]
        y = _draw_with_cut(x, m, None if filters is None else filters.threshold(),
                           temperature, seeds, pos, batch=batch if one_each else None)
    elif n_ranked == batch.num_requests:
        y = _draw_candidates(x, filters, batch, row_req, pos, None, need_total)
    else:
        ranked = filters.ranked
        y = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        idx = ranked.nonzero().squeeze(1)
        y[idx] = _draw_candidates(x, filters, batch, row_req, pos, idx, need_total)
        rest = (~ranked).nonzero().squeeze(1)
        cut = tuple(c[rest] for c in filters.threshold())
        y[rest] = _draw_with_cut(x[rest], m[rest], cut, temperature[rest],
                                 _seeds(batch)[row_req[rest]], pos[rest])
    if batch.any_greedy:
        greedy = temperature == 0
        if bool(greedy.any()):
            # (argmax z' = argmax of the rows before temperature where T = 0)
            idx = greedy.nonzero().squeeze(1)
            y[idx] = first_argmax(x[idx].float())
    return y


def _seeds(batch) -> torch.Tensor:
    """[N, 2] int64 (seed_lo, seed_hi) of ``batch``'s requests (kept by the batch while they
    are unchanged: ``SamplingBatch.derived``)."""
    return batch.derived("seeds", lambda b: torch.stack([b.seed_lo, b.seed_hi], 1),
                         batch.seed_lo, batch.seed_hi)


def _draw_with_cut(x: torch.Tensor, m: torch.Tensor, cut: tuple | None,
                   temperature: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                   id_rule: bool = False, batch=None) -> torch.Tensor:
    """[R] int64: the draw of :func:`_processed_rows` of rows ``x`` [R, V] with the filter
    ``cut`` (cut_v, cut_i) or None (greedy rows get a token their caller replaces);
    ``seeds`` [R, 2] int64 (seed_lo, seed_hi), ``pos`` [R] int64. ``id_rule``: every row
    takes the function with the id rule (the same kept set where cut_i = V). ``batch``: the
    SamplingBatch whose request i row i is, when it is, which then keeps the per-row
    arguments of a call without cut."""
    v = x.shape[1]
    if cut is None:
        ties, any_ties = None, False
        per_row = _pass_args(temperature, None, seeds, v) if batch is None else batch.derived(
            f"pass_args{v}", lambda b: _pass_args(b.temperature, None, _seeds(b), v),
            batch.temperature, batch.seed_lo, batch.seed_hi)
    else:
        if id_rule:
            ties, any_ties = None, True
        else:
            ties = cut[1] < v
            any_ties = bool(ties.any())
        per_row = _pass_args(temperature, cut, seeds, v)
    per_row = (m.float(), pos, *per_row)
    # A row whose cut splits a group of tied values takes the function with the id rule, any
    # other row the threshold one: the choice depends on the row alone, never on its batch.
    if ties is None or not any_ties or bool(ties.all()):
        return _call_rows("processed_rows", _processed_rows, x, per_row, rng.STREAM_SAMPLE,
                          rng.STREAM_SAMPLE_TILE, any_ties)
    y = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for flag in (False, True):
        idx = (ties == flag).nonzero().squeeze(1)
        y[idx] = _call_rows("processed_rows", _processed_rows, x[idx],
                            tuple(t[idx] for t in per_row), rng.STREAM_SAMPLE,
                            rng.STREAM_SAMPLE_TILE, flag)
    return y


def _pass_args(temperature: torch.Tensor, cut: tuple | None, seeds: torch.Tensor, v: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_processed_rows`' ``row_f`` [R, 2] float32 (temperature, cut_v) and ``row_i``
    [R, 3] int64 (cut_i, seed_lo, seed_hi) for a ``cut`` (cut_v, cut_i), or None: (-inf, V),
    which keeps every token."""
    if cut is None:
        cut = (torch.full(temperature.shape, -math.inf), torch.full(temperature.shape, v))
    return (torch.stack([temperature.float(), cut[0].float()], 1),
            torch.cat([cut[1][:, None], seeds], 1))


def _row_args(batch, row_req: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor:
    """[R, 3] float32 per-row arguments of :func:`_candidate_draw` for rows of requests
    ``row_req`` [R] (None: row i is request i) with finite maxima ``m`` [R]: (the
    temperature, min_p's cut as ``processing.filter_settings`` makes it, or -inf, the exp2
    scale ``log2(e) / t``). Without min_p the batch keeps them per request. (Made here, not
    in the compiled function: Inductor would compute a value derived there from the request
    index, or a division, again for every element of the row.)"""
    def per_request(b):
        t = b.temperature
        return torch.stack([t, torch.full_like(t, -math.inf),
                            (math.log2(math.e) / t.double()).float()], 1)

    args = batch.derived("candidate_args", per_request, batch.temperature)
    args = args if row_req is None else args[row_req]
    if batch.rank_filters[2]:
        t = args[:, 0]
        min_p = batch.min_p if row_req is None else batch.min_p[row_req]
        on = (min_p > 0) & (t > 0)
        cut = processing.round_up_f32(m.double() + t.double() * torch.log(
            torch.where(on, min_p, 1.0)))
        args = torch.stack([t, torch.where(on, cut, -math.inf).float(), args[:, 2]], 1)
    return args


def _request_args(batch, n_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-request arguments of :func:`_candidate_draw`: (top_p [N] float64, req_i [N, 3]
    int64 = (top_k, seed_lo, seed_hi)), each request repeated to ``n_pad`` when N is 1
    (compiled shapes are dynamic except for sizes of 1)."""
    def make(b):
        req_i = torch.stack([b.top_k, b.seed_lo, b.seed_hi], 1)
        if b.num_requests == 1:  # (new tensors: views would be copied at every call)
            return b.top_p.repeat(n_pad), req_i.repeat(n_pad, 1)
        return b.top_p, req_i

    return batch.derived(f"request_args{n_pad}", make, batch.top_k, batch.top_p,
                         batch.seed_lo, batch.seed_hi)


_CANDIDATE_STREAMS = (rng.STREAM_SAMPLE, rng.STREAM_SAMPLE_TILE,
                      rng.sub_stream(rng.STREAM_SAMPLE_TILE))


def _draw_candidates(x: torch.Tensor, filters: processing.RowFilters, batch,
                     row_req: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor | None,
                     need_total: bool) -> torch.Tensor:
    """The tokens of rows ``idx`` (sampled top_k / top_p rows; None: every row) by
    :func:`_candidate_draw`, and by :func:`_draw_with_cut` from the exact cut where their
    candidates did not hold it."""
    per_row = (x, filters.m, row_req, pos, filters.live)
    if idx is not None:
        per_row = tuple(t[idx] for t in per_row)
    one_each = idx is None and x.shape[0] == batch.num_requests  # (row i is request i)
    per_row = (per_row[0], per_row[1],
               _row_args(batch, None if one_each else per_row[2], per_row[1]), *per_row[2:])
    r = per_row[0].shape[0]
    if r == 1:  # (compiled shapes are dynamic except for sizes of 1: the row goes twice; the
        # candidates' graph guards on two rows or more, so one row cannot run it unpadded)
        per_row = _two_rows(len(per_row), per_row, widths=False)
    y, found = _call_cpu("candidate_rows", _candidate_draw, per_row[0],
                         (*per_row[1:], *_request_args(batch, 2)), _CANDIDATE_STREAMS,
                         (need_total,), rows=r)
    y, found = y[:r], found[:r]
    if not bool(found.all()):
        rows = torch.arange(x.shape[0]) if idx is None else idx
        y = _redraw_missed(x, filters, batch, row_req, pos, rows, y, found)
    return y


def _redraw_missed(x: torch.Tensor, filters: processing.RowFilters, batch,
                   row_req: torch.Tensor, pos: torch.Tensor, idx: torch.Tensor,
                   y: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
    """``y`` (the tokens of rows ``idx``) with the rows that :func:`_candidate_draw` did not
    find drawn again by :func:`_draw_with_cut`, from their exact cut (the filters' own if already
    made, else made as for wide nuclei, top_p's straight from a histogram of the row: these
    rows' survivors mostly outnumber the 64 candidates of the compiled call)."""
    paths.record("cpu.candidates_missed", int((~found).sum()))
    miss = idx[~found]
    if filters.has_cut:
        cut = tuple(c[miss] for c in filters.cut())
    else:  # (more survivors than candidates, mostly: a wide nucleus)
        cut = filters.select(miss, wide=True).cut()
    req = row_req[miss]
    y = y.clone()
    # (always the function with the id rule: which one draws a missed row depends on the row
    # alone, and a decode's warm-up compiles that one)
    y[~found] = _draw_with_cut(x[miss], filters.m[miss], cut, batch.temperature[req],
                               _seeds(batch)[req], pos[miss], id_rule=True)
    return y


def match_processed(x: torch.Tensor, m: torch.Tensor, filters: processing.RowFilters | None,
                    batch, row_req: torch.Tensor, row_pos: torch.Tensor, rows: torch.Tensor,
                    d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One-hot verification of sampled CPU rows in one compiled call (:func:`_matched_rows`,
    or :func:`_matched_candidates` when every request has top_k or top_p): (token_ids [N, K +
    1] int64, num_accepted [N] int64) from the rows' processed inputs
    (``processing.row_inputs``: ``x``, ``m``, ``filters``), each row's request ``row_req``
    and position ``row_pos`` [R], ``batch`` (every request sampled), the grid ``rows`` [N,
    K + 1] of each request's rows and its drafts ``d`` [N, K] (-1 past k_eff), K >= 1. The
    tokens are :func:`sample_processed`'s. Returns None when some requests have top_k /
    top_p and others not (two compiled draws): the caller then takes
    :func:`sample_processed`."""
    n, k = d.shape
    n_ranked, need_total, _ = batch.rank_filters
    candidates = filters is not None and n_ranked > 0
    if candidates and n_ranked < n:
        return None
    rows_in, d_in = rows, d
    per_row = (x, m if filters is None else filters.m, row_req, row_pos)
    if candidates:
        per_row = (x, filters.m, _row_args(batch, row_req, filters.m), row_req, row_pos,
                   filters.live)
    else:
        cut_v, cut_i = (None, None) if filters is None else filters.threshold()  # (min_p)
        per_row = (*per_row, cut_v, cut_i)
    # (compiled shapes are dynamic except for sizes of 1: a single row or request goes
    # twice, a single draft gets a placeholder after it, which never matches)
    if x.shape[0] == 1:
        per_row = _two_rows(len(per_row), per_row, widths=False)
    with _normal_tensors():
        if n == 1:
            rows, d = torch.cat([rows, rows]), torch.cat([d, d])
        if k == 1:
            rows, d = torch.cat([rows, rows[:, 1:]], 1), torch.cat([d, torch.full_like(d, -1)], 1)
    if candidates:
        token_ids, num_accepted, y, found = _call_cpu(
            "matched_candidates", _matched_candidates, per_row[0],
            (*per_row[1:], *_request_args(batch, 2), rows, d), _CANDIDATE_STREAMS,
            (need_total,))
        if not bool(found.all()):
            r = x.shape[0]
            y = _redraw_missed(x, filters, batch, row_req, row_pos, torch.arange(r), y[:r],
                               found[:r])
            token_ids, num_accepted = _match_grid(y, rows_in, d_in)
    else:
        temperature, seeds = batch.derived("matched_rows_args", lambda b: tuple(
            torch.cat([t, t]) if b.num_requests == 1 else t for t in (b.temperature, _seeds(b))),
            batch.temperature, batch.seed_lo, batch.seed_hi)
        x_, m_, req_, pos_, cut_v, cut_i = per_row
        token_ids, num_accepted = _call_cpu(
            "matched_rows", _matched_rows, x_, (m_, cut_v, cut_i, req_, pos_, temperature,
                                                seeds, rows, d), _CANDIDATE_STREAMS, (False,),
            ("nocut",) if filters is None else ())
    if k == 1:  # (the padded grid's own columns: a new, contiguous tensor)
        token_ids = token_ids[:n, :k + 1].contiguous()
    elif n == 1:
        token_ids = token_ids[:1]
    return token_ids, num_accepted if n > 1 else num_accepted[:1]


def _match_cpu(plan: Plan, inputs: tuple, err: torch.Tensor, valid: bool
               ) -> VerifyOutput | None:
    """:func:`verify`'s output for one-hot drafts of sampled requests on CPU rows through
    :func:`match_processed` (``inputs``: ``processing.row_inputs`` of the cleaned plan; ``err``
    the requests' ERR_* bits; ``valid``: every request known valid), or None when that
    declines the rows."""
    k = plan.max_k
    n = plan.num_requests
    if plan.uniform and plan.placeholder_free:  # (rows i (K + 1) + j)
        rows = _uniform_grid(n, k)
    else:
        rows = (plan.row_start[:, None] + torch.arange(k + 1)).clamp_max(plan.num_rows - 1)
    out = match_processed(*inputs, plan.batch, plan.row_req, plan.row_pos, rows,
                          plan.draft_grid)
    if out is None:
        return None
    token_ids, num_accepted = out
    invalid = err != 0
    if not valid and bool(err.any()):
        token_ids = torch.where(invalid[:, None], -1, token_ids)
        num_accepted = torch.where(invalid, 0, num_accepted)
    return VerifyOutput(token_ids=token_ids, num_accepted=num_accepted, logprobs=None,
                        logprob_token_ids=None, invalid=invalid)


@functools.lru_cache(maxsize=64)
def _uniform_grid(n: int, k: int) -> torch.Tensor:
    """[N, K + 1] int64 CPU rows i (K + 1) + j of a uniform layout (made once per shape;
    read only)."""
    with torch.inference_mode(False):
        return torch.arange(n * (k + 1)).view(n, k + 1).clone()  # (no _base)


def _match_drafts(plan: Plan, y: torch.Tensor, invalid: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_verify_drafts` for one-hot drafts (sample-and-match, and greedy verification):
    draft j is accepted when it equals row j's token ``y``, so the emitted tokens are the
    rows' own tokens up to and including the first mismatch (the leading run within k_eff:
    ``plan.draft_grid`` holds -1 past it, which never matches)."""
    k = plan.max_k
    j = torch.arange(k + 1, device=y.device)
    if plan.uniform and plan.placeholder_free:  # (rows i (K + 1) + j: views, no gather)
        rows = torch.arange(plan.num_rows, device=y.device).view(-1, k + 1)
        y_grid = y.reshape(-1, k + 1)
    else:
        rows = (plan.row_start[:, None] + j).clamp_max(plan.num_rows - 1)
        y_grid = y[rows]
    num_accepted = (plan.draft_grid == y_grid[:, :k]).cumprod(dim=1).sum(dim=1)
    num_accepted = torch.where(invalid, 0, num_accepted)
    emitted = (j <= num_accepted[:, None]) & ~invalid[:, None]
    return rows, num_accepted, torch.where(emitted, y_grid, -1), emitted


def _verify_drafts(plan: Plan, z: torch.Tensor, lse: torch.Tensor | None, y: torch.Tensor,
                   invalid: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verify`'s decisions on the drafts (sample-and-match, token-level rejection
    sampling or block verification, the residual draws): (rows [N, K+1], num_accepted [N],
    token_ids [N, K+1], emitted [N, K+1]) from the processed rows ``z`` (their
    log-normalisers ``lse``), the rows' samples ``y`` and the invalid requests."""
    batch = plan.batch
    n = plan.num_requests
    # (a draft distribution with no drafts at all, e.g. every k_i = 0 under a fixed
    # max_num_draft_tokens, has no row to read: every request just gets its bonus token)
    has_dist = plan.has_draft_dist and plan.draft_token_ids.numel() > 0
    if not has_dist:
        return _match_drafts(plan, y, invalid)
    greedy_req = batch.temperature == 0
    rows, d, didx = _grid(plan)
    k = plan.max_k
    k_eff = plan.k_eff
    y_grid = y[rows]
    sampled_dist = ~greedy_req
    accept = d == y_grid[:, :k]  # (greedy requests: verification against the argmax)
    emit = y_grid
    if bool(sampled_dist.any()):
        if plan.method == "block":
            n_acc_dist, rho_tau = _block_tau(plan, z, lse, rows, d, didx, sampled_dist)
        else:
            dsafe = d.clamp(0, plan.vocab_size - 1)
            p_x = torch.exp(z[rows[:, :k], dsafe] - lse[rows[:, :k]])
            q_all = draft_distribution(plan, didx.reshape(-1)).reshape(n, k, plan.vocab_size)
            q_x = q_all.gather(2, dsafe[:, :, None]).squeeze(2)
            ju = torch.arange(k, device=z.device)
            u = rng.uniform(batch.seed_lo[:, None], batch.seed_hi[:, None],
                            plan.positions[:, None] + ju, torch.zeros_like(ju),
                            rng.STREAM_ACCEPT)
            acc_dist = (u * q_x < p_x) & (ju < k_eff[:, None])
            n_acc_dist = torch.cumprod(acc_dist.to(torch.int64), dim=1).sum(1)
            rho_tau = torch.ones(n, dtype=torch.float32, device=z.device)
        accept = torch.where(sampled_dist[:, None],
                             torch.arange(k, device=z.device) < n_acc_dist[:, None], accept)
        # Residual draw at the first rejected row of each draft-distribution request.
        a = n_acc_dist
        need = sampled_dist & (a < k_eff)
        if bool(need.any()):
            ridx = need.nonzero().squeeze(1)
            ar = a[ridx]
            r = plan.row_start[ridx] + ar
            p_row = torch.exp(z[r] - lse[r, None])
            q_row = draft_distribution(plan, plan.draft_start[ridx] + ar)
            w = torch.clamp(rho_tau[ridx, None] * p_row - q_row, min=0)
            res = tiled_gumbel_argmax(torch.log(w), None, batch.seed_lo[ridx],
                                      batch.seed_hi[ridx], plan.positions[ridx] + ar,
                                      rng.STREAM_RESIDUAL, rng.STREAM_RESIDUAL_TILE)
            res = torch.where(w.sum(-1) > 0, res, y[r])
            emit = emit.clone()
            emit[ridx, ar] = res
    return (rows, *accepted_grid(accept, d, emit, k_eff, invalid))
