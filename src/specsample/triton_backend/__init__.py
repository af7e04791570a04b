"""The Triton backend: launchers for the kernels in ``kernels.py``, warmup and compile guard.

Paths (``specsample.paths``):

* ``triton.sample.fused`` / ``triton.verify.fused``: the kernels read the model's own bf16 /
  fp16 / fp32 logits, temperature applied inside; no FP32 [rows, V] buffer, no host sync.
* ``triton.sample.filtered`` / ``triton.verify.filtered``: the fused path with min_p / top_k /
  top_p: the kernels of ``filters`` find each row's cut exactly from the model's own logits
  (no sort of the row, no FP32 copy), then the same kernels draw from the survivors.
* ``triton.sample.fused`` / ``triton.verify.fused`` also serve bans (allowed_token_ids, bad
  words, min_tokens), logit_bias and presence / frequency / repetition penalties, applied as
  the kernels load each row (``penalties``: the row's banned tokens from
  ``penalties.ban_table_kernel``, the request's row of the allowed mask, the bias entries of the
  request, its output counts and prompt flags from the batch's device state, the drafts
  before the row), unless a request asks for more than 32 top-n logprobs
  (:func:`fused_processing`; with a draft distribution the finish and residual kernels
  process the target values they read too, and the logprob kernels process what they read);
  the path ``triton.processing.fused`` counts those rows. With min_p / top_k / top_p too, the
  filter kernels read the rows processed the same way (``triton.*.filtered``).
* ``triton.sample.general`` / ``triton.verify.general``: a batch with bans, logit_bias or
  penalties in which a request asks for more than 32 top-n logprobs; the
  processed float32 logits are materialised by ``specsample.processing`` (PyTorch), then the
  same kernels run on them (a counted fallback).
* ``triton.verify_tree.fused`` / ``.filtered`` / ``.general``: ``verify_tree()`` of
  deterministic trees, the same launches over the node rows (``tree.py``);
  ``triton.verify_tree.walk``: without logprobs, their walk and outputs in one more launch.
* ``triton.logprobs.finish``: logprobs = 0 for every request that asks, whose values the
  sampling statistics give (processed mode, or raw mode at temperature 0 / 1 in a batch
  without top_k / top_p / min_p; no bans, logit_bias or penalties): the request's finish
  (``finish_kernel``, or the single launch's) writes them with the tokens, no launch of
  their own.
* ``triton.logprobs.fused``: other logprobs (top-n up to ``logprobs.NPAD`` = 32): up to two
  launches over the emitted positions only (``logprobs.py``; three for raw top-n when the
  kernels process the rows), no [rows, V] buffer.
* ``triton.logprobs.torch``: more than 32 top-n logprobs, top-n on the general path inside
  :func:`general_path` (but processed top-n with logit_bias or penalties), or
  ``verify_tree()``: the emitted rows are gathered and their log-distributions computed
  with PyTorch from the kernels' row statistics.
* ``triton.copy.noncontiguous``: the logits' last dimension was not contiguous and was copied.
* ``triton.one_launch``: a call whose rows were read, drawn and finished in one launch
  (``kernels.stats_draw_kernel``), eager or captured in a CUDA graph: no filter kernels (the
  general path, which filters in PyTorch first, qualifies), no draft distributions, no top-n
  logprobs, not inside :func:`separate_launches`. Other calls take the separate statistics /
  sampling / finish launches and are not counted here.
* ``triton.stats.draft_probs_apart``: draft probabilities of more than
  ``MERGED_PROBS_MAX_ROWS`` (64) rows, whose statistics took a launch of their own (rows:
  the draft rows); draft logits, and fewer rows of probabilities, share the target rows'
  statistics launch.

On CPU tensors the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` must be set
before triton is imported); that is how the CPU test suite runs them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import time
import warnings

import torch
import triton
from triton import knobs

from .. import paths, rng, workspace
from ..outputs import VerifyOutput
from ..plan import Plan
from ..torch_backend import ERR_DRAFT_ID, ERR_DRAFT_ROW, emitted_logprobs, processed_logits
from . import filters, kernels, layout, penalties
from . import logprobs as logprobs_kernels
from .launch import PDL, _hooked, launch

S_MAX = 128  # most vocabulary splits of one row
# Mantissa bits that are zero in every float32 value converted from the logits' dtype: the
# filter kernel's search runs over the remaining bits only (4 passes for bf16 instead of 8).
_KEY_SHIFT = {torch.bfloat16: 16, torch.float16: 13, torch.float32: 0}
BLOCK = rng.TILE  # kernel tiles are the sampling tiles of the RNG definition
# The statistics pass loads 2 tiles (4,096 tokens) per iteration, with 4 warps a program: at
# 48 registers ten programs fit on an SM. A study of that pass alone (H200, V = 151,936, bf16;
# BENCHMARKS.md, "The statistics pass with 4 warps and 2 tiles a chunk") measured it 3.5-8.5%
# faster than 8 warps with 4 tiles (ptxas: 48 registers, five programs an SM) at 640 to 2,080
# rows, and within 4% of a plain read of the rows; a flattened schedule of equal chunk ranges
# per program was slower than the hardware's scheduling of (row, split) programs.
TILES_PER_CHUNK = 2
# (the sampling kernel and the single launch of eager calls take the same number of warps: their
# sums then round alike, so eager calls and graph replays give the same logprobs bit for bit)
STATS_NUM_WARPS = 4
# block_mass_kernel reads 2 tiles of the target and the draft row per iteration: with 4 the
# B = 128 call took 246 us, with 2 233 us (H200, BENCHMARKS.md, "The residual draw from block
# verification's masses"). residual_kernel reads one.
MASS_TILES_PER_CHUNK = 2
NUM_WARPS = 8
PROGRAMS_PER_SM = 8
# Registers per thread of ``stats_draw_kernel``. Its draw and finish (Philox, the tile and
# sub-tile keys) would take 103 registers, the statistics pass alone 48 (ptxas, sm_90, at the
# 8 warps it then ran with); a launch gets the larger, and at 103 two programs of 8 warps fit
# on an SM instead of five: the B = 128 pass became 10% slower. Capped at 48 (12 bytes of
# spills, in the draw), the statistics pass keeps its occupancy (BENCHMARKS.md, "One launch
# for an eager call's unfiltered rows").
FUSED_MAXNREG = 48
# Launch options of the kernels that apply logit_bias / penalties (``penalties``): no
# floating-point contraction, so that ``z - f * count`` rounds as PyTorch's does.
PEN_OPTIONS = {"enable_fp_fusion": False}
# Their single launch's register cap and tiles per chunk of their statistics pass: at
# FUSED_MAXNREG (48) and 2 tiles the processing spills (repetition + presence at B = 128:
# 1.4 ms); 1 tile at 96 registers was the best of 1-2 tiles x 64-168 registers for both
# penalties (272-274 us) and logit_bias alone (126 us) (H200, BENCHMARKS.md, "logit_bias
# and penalties in the kernels").
PEN_MAXNREG = 96
PEN_TILES_PER_CHUNK = 1
_SEPARATE = contextvars.ContextVar("specsample_separate_launches", default=False)
_GENERAL = contextvars.ContextVar("specsample_general_path", default=False)


def _interpreting(device: torch.device) -> bool:
    return device.type != "cuda"


@functools.lru_cache(maxsize=8)
def _num_programs_target(device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return PROGRAMS_PER_SM * sms
    return 4


def _splits(rows: int, vocab: int, tpc: int, device: torch.device) -> tuple[int, int, int]:
    """(S, CPS, NT): splits per row, chunks (of ``tpc`` tiles) per split, tiles per row."""
    nt = max(1, math.ceil(vocab / BLOCK))
    chunks = math.ceil(nt / tpc)
    want = max(1, math.ceil(_num_programs_target(device) / max(rows, 1)))
    s = min(want, chunks, S_MAX)
    cps = math.ceil(chunks / s)
    s = math.ceil(chunks / cps)
    return s, cps, nt


# Draft probabilities (float32, twice the bytes of a bf16 row) share the target rows' launch
# only up to this many draft rows: in one launch B = 128 (512 draft rows) took 236 us against
# 214 us in two, B = 32 87 against 85 us, while B = 1 took 22.6 against 26.6 us (H200, V =
# 151,936, K = 4; BENCHMARKS.md). Draft logits share it at every size.
MERGED_PROBS_MAX_ROWS = 64


def fused_processing(plan: Plan) -> bool:
    """Whether the kernels apply the batch's bans, logit_bias and penalties themselves
    (``penalties``; the filter kernels too, on the processed rows, and with draft_logits /
    draft_probs the kernels that read target rows after the statistics: the finish's p(d_j),
    the residual's masses and draw; the logprob kernels) instead of the general path: a
    batch that sets some of them, unless a request asks for more than 32 top-n logprobs
    (``SamplingBatch.processing_in_kernels``)."""
    return plan.batch.processing_in_kernels and not _GENERAL.get()


@contextlib.contextmanager
def general_path():
    """Within the block (this thread or task), logit_bias and penalties take the general path
    even where the kernels could apply them (:func:`fused_processing`): the baseline that
    ``specsample.bench`` measures the fused path against."""
    token = _GENERAL.set(True)
    try:
        yield
    finally:
        _GENERAL.reset(token)


def route(plan: Plan) -> str:
    """The path of a sample() / verify() call on this backend: "general", "filtered" or
    "fused" (module docstring)."""
    batch = plan.batch
    if batch.needs_general_path and not fused_processing(plan):
        return "general"
    return "filtered" if batch.needs_filter else "fused"


def _pen_kind(plan: Plan, pen: bool) -> int:
    """The kernels' PEN constexpr: 0 (no processing), 1 (bans / logit_bias), 2 (penalties
    too)."""
    return 0 if not pen else 2 if plan.batch.needs_penalties else 1


def _pen_args(plan: Plan, on: bool, draft_ids: torch.Tensor) -> tuple:
    """The kernels' ``penalties`` arguments (rep, freq, presence, counts, prompt mask, CV,
    bias_start, bias ids, bias values, ban table, its width BW, its rows per request KP,
    allowed slots, allowed mask, its width AV) of the batch (``draft_ids``: the call's draft
    ids, which bad words read), or placeholders of the same dtypes when not ``on`` (the
    batch's own tensors, never read: no look-up per call)."""
    batch, dev = plan.batch, plan.logits.device
    if not on:
        f32, i64, u8 = batch.temperature, batch.seed_lo, batch.logprobs_processed.view(
            torch.uint8)
        return (f32, f32, f32, f32, u8, 0, i64, i64, f32, i64, 0, 1, batch.allowed_slot, u8, 0)
    f32 = workspace.zeros((1,), torch.float32, dev)
    i64 = workspace.zeros((1,), torch.int64, dev)
    u8 = workspace.zeros((1,), torch.uint8, dev)
    counts, cv = batch.output_counts, batch.output_counts.shape[1]
    prompt = batch.prompt_mask.view(torch.uint8)
    ids, vals = batch.bias_ids, batch.bias_val
    av = batch.vocab_size if batch.allowed_users else 0
    return (batch.repetition_penalty, batch.frequency_penalty, batch.presence_penalty,
            counts if cv else f32, prompt if cv else u8, cv, batch.bias_start,
            ids if ids.numel() else i64, vals if vals.numel() else f32,
            _ban_table(plan, draft_ids) if batch.ban_width else i64, batch.ban_width,
            plan.max_k + 1, batch.allowed_slot,
            batch.allowed_mask.view(torch.uint8) if av else u8, av)


def _ban_table(plan: Plan, draft_ids: torch.Tensor) -> torch.Tensor:
    """The call's ban table: [N * (K + 1), ban_width] int64, row i * (K + 1) + j the tokens
    that bad words and min_tokens ban at row j of request i, sorted, then
    ``penalties.NO_ENTRY`` (``penalties.ban_table_kernel``): one launch, no host
    synchronisation."""
    batch, dev = plan.batch, plan.logits.device
    kp, width = plan.max_k + 1, batch.bad_prefix.shape[1]
    rows = batch.num_requests * kp
    table = torch.empty(rows, batch.ban_width, dtype=torch.int64, device=dev)
    unsorted = torch.empty(rows, batch.ban_width, dtype=torch.int64, device=dev)

    def given(t: torch.Tensor) -> torch.Tensor:  # (an empty tensor is never read)
        return t if t.numel() else workspace.zeros((1,), torch.int64, dev)

    launch(penalties.ban_table_kernel)[(rows,)](
        table, unsorted, kp, batch.ban_width, given(batch.context_tail), width, batch.bad_start,
        given(batch.bad_prefix), given(batch.bad_last), batch.stop_start,
        given(batch.stop_ids), batch.num_output, batch.min_tokens, plan.k_given, draft_ids,
        plan.draft_start, num_warps=1)
    return table


def _launch_stats(x: torch.Tensor, plan: Plan, draft_ids, temp, pen_args: tuple, *,
                  write_top: bool, draft: tuple | None = None, pen: bool = False):
    """The statistics pass (``kernels.stats_kernel``) of the target rows x [R, V] and, with
    ``draft`` ((draft [D, DV] logits or probabilities, whether probabilities)), of the draft
    rows at the request temperatures: in the same launch, except for more than
    ``MERGED_PROBS_MAX_ROWS`` rows of probabilities or with ``pen`` (then a launch of their
    own first).
    Returns ((part_m, part_s, part_f), tiles, (S, CPS, NT)) of the target rows and
    ((part_m, part_s, part_f), DS) of the draft rows (None without ``draft``). ``pen``: the
    target rows are processed with the batch's logit_bias and penalties, ``pen_args``
    (:func:`_pen_args`)."""
    rows, vocab = x.shape
    dev = x.device
    warps = STATS_NUM_WARPS if not _interpreting(dev) else 1
    tpc = PEN_TILES_PER_CHUNK if pen else TILES_PER_CHUNK
    s, cps, nt = _splits(rows, vocab, tpc, dev)
    part_m, part_s, part_f, tiles = _stats_buffers(rows, s, nt, dev)
    target = (x, x.stride(0), vocab, plan.row_req, plan.row_j, draft_ids, plan.draft_start,
              plan.k_given, temp, part_m, part_s, part_f, *tiles, s, cps, nt)

    def target_rows():  # (DRAFT=0: the draft arguments are placeholders, never read)
        if rows:
            launch(kernels.stats_kernel)[(rows, s)](
                *target, 0, x, x.stride(0), vocab, plan.row_req, plan.row_j, temp, part_m,
                part_s, part_f, s, cps, *pen_args, WRITE_TOP=write_top, DRAFT=0,
                PEN=_pen_kind(plan, pen), TPC=tpc, BLOCK=BLOCK, num_warps=warps,
                **(PEN_OPTIONS if pen else {}))

    if draft is None:
        target_rows()
        return (part_m, part_s, part_f), tiles, (s, cps, nt), None
    d, is_probs = draft
    drows, dv = d.shape
    ds, dcps, _ = _splits(drows, dv, TILES_PER_CHUNK, dev)
    dparts = tuple(workspace.scratch(f"draft.part_{n}", (drows, ds), t, dev)
                   for n, t in (("m", torch.float32), ("s", torch.float32), ("f", torch.int32)))
    # (processed target rows take chunks of their own size and register cap: the draft rows
    # are then a launch of their own, before them)
    apart = is_probs and drows > MERGED_PROBS_MAX_ROWS
    merged = not (apart or pen)
    grid = (drows + rows, max(s, ds)) if merged else (drows, ds)
    launch(kernels.stats_kernel)[grid](
        *target, drows, d, d.stride(0), dv, plan.draft_req, plan.draft_j,
        plan.batch.temperature, *dparts, ds, dcps, *pen_args,
        WRITE_TOP=write_top if merged else False, DRAFT=1 + int(is_probs), PEN=0,
        TPC=TILES_PER_CHUNK, BLOCK=BLOCK, num_warps=warps)
    if not merged:
        if apart:
            paths.record("triton.stats.draft_probs_apart", drows)
        target_rows()
    return (part_m, part_s, part_f), tiles, (s, cps, nt), (dparts, ds)


def _stats_buffers(rows: int, s: int, nt: int, dev: torch.device):
    """The target rows' statistics: per (row, split) max, sum and flags; per (row, tile)
    reference, sum and maximum."""
    part_m = workspace.scratch("target.part_m", (rows, s), torch.float32, dev)
    part_s = workspace.scratch("target.part_s", (rows, s), torch.float32, dev)
    part_f = workspace.scratch("target.part_f", (rows, s), torch.int32, dev)
    tiles = [workspace.scratch(f"target.tiles{i}", (rows, nt), torch.float32, dev)
             for i in range(3)]
    return part_m, part_s, part_f, tiles


def _contiguous_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.stride(1) != 1:
        paths.record(f"triton.copy.noncontiguous.{name}", x.shape[0])
        return x.contiguous()
    return x


# Candidates per row that the filter select kernel sorts; more take the serial search. (Triton's
# interpreter runs tl.sort element by element, so the CPU test suite sorts 64.)
FILTER_CAP = 512
FILTER_CAP_INTERPRETED = 64
# Gather programs: about FILTER_GATHER_PROGRAMS x the programs target, a few tiles each (one
# tile per program was 15-30% slower at B = 128 on an H200, 12 tiles the same).
FILTER_GATHER_PROGRAMS = 8


def _filter_counters(device: torch.device) -> torch.Tensor:
    """[2] int64 on ``device``: filtered rows that overflowed the candidate buffer and took the
    serial search, and those the histogram search served. One tensor per device, whatever
    name it was given ("cuda" and "cuda:0" are the same counters)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _counters_of(device)


@functools.lru_cache(maxsize=8)
def _counters_of(device: torch.device) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64, device=device)


def _read_counter(device, slot: int, name: str) -> int:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}(device={str(device)!r}): CUDA is not available; "
                         "pass the device the filters ran on ('cpu' for Triton's interpreter)")
    return int(_filter_counters(dev)[slot].item())


def filter_serial_rows(device="cuda") -> int:
    """How many filtered rows took the filter kernels' serial search since the process started
    on ``device`` (rows with more than FILTER_CAP candidates, 512 on CUDA, that the histogram
    search cannot serve: float32 logits; rows processed with logit_bias or penalties in the
    kernels (keyed as float32 values); bf16 / fp16 rows whose tokens from the maximum down
    to the cut's bound need more than 16 chunks of 4,096 keys, key ranges that no token has
    being skipped; or rounding of top_p's bound). Reading it synchronises with the device.

    Raises ValueError for a CUDA device when CUDA is not available (on CPU tensors the
    kernels run in Triton's interpreter: pass ``device="cpu"``)."""
    return _read_counter(device, 0, "filter_serial_rows")


def filter_histogram_rows(device="cuda") -> int:
    """How many filtered rows overflowed the candidate buffer (flat rows with a large
    nucleus, top_k above the number of vocabulary tiles) and took the exact-key histogram
    search (bf16 / fp16 logits: a few reads of the row) since the process started on
    ``device``. Reading it synchronises with the device. Errors as :func:`filter_serial_rows`."""
    return _read_counter(device, 1, "filter_histogram_rows")


def _run_filters(x, plan: Plan, temp, draft_ids, parts, s: int, tiles, nt: int,
                 pen_args: tuple, pen: bool):
    """Launch the filter kernels (``filters``): each row's candidate bounds and the gather of
    its candidates (skipped when no request has top_k or top_p), select each row's cut (and
    the tile sums of rows cut from their candidates), rewrite the other filtered rows' tile
    sums to the survivors'. With ``pen`` (:func:`fused_processing`) the kernels read the rows
    processed with the batch's logit_bias and penalties (``pen_args``, :func:`_pen_args`) and
    key them as float32 values (a processed value need not be one of the model dtype's).
    Returns (cut_v [T] float32, cut_i [T] int32)."""
    batch, dev = plan.batch, x.device
    rows = plan.num_rows
    warps = NUM_WARPS if not _interpreting(dev) else 1
    tps = max(
        math.ceil(nt / filters.S_G_MAX.value),
        math.ceil(nt * rows / (FILTER_GATHER_PROGRAMS * _num_programs_target(dev))))
    sg = math.ceil(nt / tps)
    cap = FILTER_CAP_INTERPRETED if _interpreting(dev) else FILTER_CAP
    cand = workspace.scratch("filter.cand", (rows, cap), torch.int64, dev)
    # (zeroed by bounds_kernel)
    count = workspace.scratch("filter.count", (rows,), torch.int32, dev)
    tail = workspace.scratch("filter.tail", (rows, sg), torch.float64, dev)
    cut_v = workspace.scratch("filter.cut_v", (rows,), torch.float32, dev)
    cut_i = workspace.scratch("filter.cut_i", (rows,), torch.int32, dev)
    row_args = (x, x.stride(0), plan.vocab_size, plan.row_req, plan.row_j, draft_ids,
                plan.draft_start, plan.k_given, temp, batch.top_k, batch.top_p, batch.min_p,
                *parts, s, tiles[0], tiles[1], tiles[2], nt)
    shift = 0 if pen else _KEY_SHIFT[x.dtype]
    pen_kind = _pen_kind(plan, pen)
    options = PEN_OPTIONS if pen else {}
    meta = dict(CAP=cap, NT_PAD=triton.next_power_of_2(nt), SHIFT=shift, PEN=pen_kind,
                S_MAX=S_MAX, BLOCK=BLOCK)
    if batch.needs_rank_filter:  # (min_p alone: its cut needs no candidates)
        bnd = workspace.scratch("filter.bnd", (rows, 4), torch.int64, dev)
        mt = workspace.scratch("filter.mt", (rows, 2), torch.float32, dev)
        launch(filters.bounds_kernel)[(rows,)](*row_args, bnd, mt, count,
                                               NT_PAD=meta["NT_PAD"],
                                               SHIFT=shift, S_MAX=S_MAX, BLOCK=BLOCK,
                                               num_warps=warps)
        launch(filters.gather_kernel)[(rows, sg)](
            x, x.stride(0), plan.vocab_size, tiles[0], tiles[1], tiles[2], nt, tps, bnd, mt,
            cand, count, tail, plan.row_req, plan.row_j, draft_ids, plan.draft_start,
            *pen_args, CAP=cap, SHIFT=shift, PEN=pen_kind, BLOCK=BLOCK, num_warps=warps,
            **options)
    hist = workspace.scratch("filter.hist", (rows, filters.NB.value), torch.int32, dev)
    done = workspace.scratch("filter.done", (rows,), torch.int32, dev)
    launch(filters.select_kernel)[(rows,)](*row_args, sg, cand, count, tail, cut_v, cut_i,
                                           _filter_counters(dev), hist, done, *pen_args,
                                           **meta, num_warps=warps, **options)
    sr, tpr, _ = _splits(rows, plan.vocab_size, 1, dev)
    launch(filters.rewrite_kernel)[(rows, sr)](
        x, x.stride(0), plan.vocab_size, tiles[0], tiles[1], tiles[2], nt, tpr, temp,
        plan.row_req, cut_v, cut_i, done, plan.row_j, draft_ids, plan.draft_start, *pen_args,
        PEN=pen_kind, BLOCK=BLOCK, num_warps=warps, **options)
    return cut_v, cut_i


def one_launch() -> bool:
    """Whether a call may take the single launch (``kernels.stats_draw_kernel``,
    for batches without filter kernels, draft distributions or top-n logprobs: :func:`run`),
    eager or under CUDA-graph capture: each launch saved is 15-25 us of host time on an eager
    call, and a graph replays it 0-2.6 us faster than the three separate launches at B = 1-256
    (H200, BENCHMARKS.md). Both give the same tokens. :func:`separate_launches` turns it off in
    a block (warmup compiles both)."""
    return not _SEPARATE.get()


def launch_settings() -> tuple | None:
    """What decides a call's launches beyond its arguments (``specsample.call_cache`` keys
    by it): :func:`separate_launches`, Triton's debug and instrumentation settings. None while
    Triton launch hooks are installed (a profiler) or inside :func:`general_path`: calls are
    then neither recorded nor replayed."""
    if (_GENERAL.get() or _hooked(knobs.runtime.launch_enter_hook)
            or _hooked(knobs.runtime.launch_exit_hook)):
        return None
    return _SEPARATE.get(), knobs.runtime.debug, knobs.compilation.instrumentation_mode


@contextlib.contextmanager
def separate_launches():
    """Within the block (this thread or task), unfiltered rows take the separate statistics,
    sampling and finish launches even on eager calls (:func:`one_launch`)."""
    token = _SEPARATE.set(True)
    try:
        yield
    finally:
        _SEPARATE.reset(token)


def draw_rows(x: torch.Tensor, plan: Plan, temp: torch.Tensor, draft_ids: torch.Tensor,
              filtered: bool, rank: int = 0, finish: tuple | None = None,
              draft: tuple | None = None, pen: bool = False, pen_args: tuple | None = None):
    """Statistics, filters (when ``filtered``) and the draw of every live row of ``plan``
    (``row_j <= k_eff`` of its request): x [R, V] the rows (model dtype, or the general path's
    float32 processed logits with ``temp`` all ones), temp [N] float32, draft_ids [>= max
    k_given] int64 (``kernels._k_eff`` reads them); with ``filtered`` or ``rank`` the
    statistics pass also writes each tile's maximum (``tiles[2]``), and with ``rank`` the rows
    of requests that ask for top-n logprobs rank their tiles by it (``logprobs.rank_tiles``;
    ``rank`` 2: by z', for processed top-n with logit_bias or penalties).
    With ``finish`` (row_start, then ``finish_kernel``'s outputs from token ids to K, then its
    logprob arguments: the tuple ``run`` builds for a plan without draft distributions or
    top-n logprobs), not ``filtered``, unless :func:`one_launch` says no: one launch
    (``kernels.stats_draw_kernel``: the last split program of a row draws it, the last live
    row of a request finishes it). Otherwise the statistics, the filter kernels when
    filtered, then ``kernels.sample_kernel``; the caller launches the finish. With ``draft``
    ((draft [D, DV] logits or probabilities, whether probabilities, a [D, 3] float32
    buffer); ``finish`` must then be None, else ValueError), the statistics pass covers the
    draft rows too (:func:`_launch_stats`: in the target rows' launch, or one of their own
    for many rows of probabilities), and ``sample_kernel`` combines their splits into that
    buffer (max, log-normaliser, flags). ``pen``: the kernels apply the batch's logit_bias
    and penalties to the rows as they read them (:func:`fused_processing`), with the
    arguments ``pen_args`` (:func:`_pen_args`; made here when not given).

    Returns ((part_m, part_s, part_f) split statistics, tiles (ref, sum, maximum per tile),
    NT, y [R] int32 each row's token (0 in the rows of sampled requests with ``draft``:
    ``kernels.sample_kernel`` leaves them undrawn), stats [R, 3] float32 (max,
    log-normaliser, flags),
    (cut_v, cut_i) the filters' cuts (split statistics when not filtered, which the kernels
    do not read), the ranking ([R, NPAD] int64 tile keys, [R] int32 counts) or None, and
    whether the requests were finished). No host synchronisation."""
    if draft is not None and finish is not None:
        raise ValueError("draw_rows: a draft distribution needs the separate finish launch")
    batch, dev, rows = plan.batch, x.device, plan.num_rows
    y = workspace.scratch("y", (rows,), torch.int32, dev)
    stats = workspace.scratch("stats", (rows, 3), torch.float32, dev)
    npad = logprobs_kernels.NPAD
    ranking = None
    if rank:
        ranking = (workspace.scratch("rank.keys", (rows, npad), torch.int64, dev),
                   workspace.scratch("rank.count", (rows,), torch.int32, dev))
    draw_args = (batch.seed_lo, batch.seed_hi, plan.positions)
    interp = _interpreting(dev)
    if pen_args is None:
        pen_args = _pen_args(plan, pen, draft_ids)
    if finish is not None and not filtered and one_launch():
        tpc = PEN_TILES_PER_CHUNK if pen else TILES_PER_CHUNK
        s, cps, nt = _splits(rows, plan.vocab_size, tpc, dev)
        part_m, part_s, part_f, tiles = _stats_buffers(rows, s, nt, dev)
        if rows:
            paths.record("triton.one_launch", rows)
            done = workspace.counters("draw", (rows + plan.num_requests,), dev)
            launch(kernels.stats_draw_kernel)[(rows, s)](
                x, x.stride(0), plan.vocab_size, plan.row_req, plan.row_j, draft_ids,
                plan.draft_start, plan.k_given, temp, batch.temperature, *draw_args,
                part_m, part_s, part_f, tiles[0], tiles[1], s, cps, nt, y, stats, done,
                *finish, *pen_args, PEN=_pen_kind(plan, pen), S_MAX=S_MAX, TPC=tpc, BLOCK=BLOCK,
                **({"num_warps": 1} if interp else
                   {"num_warps": STATS_NUM_WARPS,
                    "maxnreg": PEN_MAXNREG if pen else FUSED_MAXNREG}),
                **(PEN_OPTIONS if pen else {}))
        return (part_m, part_s, part_f), tiles, nt, y, stats, (part_m, part_f), ranking, True
    (part_m, part_s, part_f), tiles, (s, _cps, nt), draft_parts = _launch_stats(
        x, plan, draft_ids, temp, pen_args, write_top=filtered or rank,
        draft=None if draft is None else draft[:2], pen=pen)
    # (not read unless filtered; cut_i typed int32 all the same: one kernel variant)
    cut_v, cut_i = part_m, part_f
    if filtered:
        cut_v, cut_i = _run_filters(x, plan, temp, draft_ids, (part_m, part_s, part_f), s,
                                    tiles, nt, pen_args, pen)
    dparts, ds = draft_parts or ((part_m, part_s, part_f), 1)
    dstats = stats if draft is None else draft[2]
    draft_kind = 0 if draft is None else 1 + int(draft[1])
    if rows:
        launch(kernels.sample_kernel)[(rows,)](
            x, x.stride(0), plan.vocab_size, plan.row_req, plan.row_j, draft_ids,
            plan.draft_start, plan.k_given, temp, batch.temperature, *draw_args,
            part_m, part_s, part_f, tiles[0], tiles[1], s, nt, y, stats, cut_v, cut_i,
            tiles[2], batch.logprobs_n, *(ranking or (y, stats)), *dparts, ds, dstats,
            draft_kind, *pen_args, FILTERED=filtered, RANK=rank,
            NT_SORT=max(npad, triton.next_power_of_2(nt)), NPAD=npad, PEN=_pen_kind(plan, pen),
            S_MAX=S_MAX, TPC=PEN_TILES_PER_CHUNK if pen else TILES_PER_CHUNK, BLOCK=BLOCK,
            num_warps=STATS_NUM_WARPS if not interp else 1,
            **(PEN_OPTIONS if pen else {}))
    return (part_m, part_s, part_f), tiles, nt, y, stats, (cut_v, cut_i), ranking, False


def exact_rank_rows(plan: Plan, general: bool) -> torch.Tensor | None:
    """The rows processed top-n rank by on the general path: the raw logits when no request
    of the batch sets logit_bias or penalties (bans alone keep the logits' own order, which
    z' = (y - max) / T can round together; docs/semantics.md), else None (z' ranks)."""
    batch = plan.batch
    if general and not (batch.needs_bias or batch.needs_penalties):
        return plan.logits
    return None


def stats_logprobs(x: torch.Tensor, plan: Plan, temp: torch.Tensor, stats: torch.Tensor,
                   filtered: bool, cut_v: torch.Tensor, cut_i: torch.Tensor,
                   rank_rows: torch.Tensor | None = None):
    """The ``processed_logprobs`` callable of ``torch_backend.emitted_logprobs`` from the
    kernels' row statistics (:func:`draw_rows`): ``f(flat)`` gives ([R, V] processed logprobs
    of rows ``flat``, the rows' values masked to the survivors for ranking: ``x``'s, or
    ``rank_rows``' where given, see :func:`exact_rank_rows`), ``f(flat, tok)`` only the [R]
    logprobs at ``tok`` (one gathered logit per row)."""
    dev = x.device
    t_eff = torch.where(temp > 0, temp, torch.ones_like(temp))[plan.row_req]

    def processed(flat: torch.Tensor, tok: torch.Tensor | None = None):
        if tok is None:
            xf, ids = x[flat].float(), torch.arange(x.shape[1], device=dev)[None, :]
        else:
            xf, ids = x[flat, tok].float()[:, None], tok[:, None]
        m, logz = stats[flat, 0:1], stats[flat, 1:2]
        lp = (xf - m) / t_eff[flat, None] - logz
        rank = xf
        if rank_rows is not None and tok is None:
            rank = torch.where(xf == -math.inf, -math.inf, rank_rows[flat].float())
        if filtered:
            cv, ci = cut_v[flat, None], cut_i[flat, None]
            dropped = ~((xf > cv) | ((xf == cv) & (ids <= ci)))
            lp = lp.masked_fill(dropped, -math.inf)
            rank = xf.masked_fill(dropped, -math.inf)
        return (lp, rank) if tok is None else lp[:, 0]

    return processed


def run(plan: Plan, op: str) -> tuple[VerifyOutput, torch.Tensor]:
    """Run sample (op="sample") or verify (op="verify") for ``plan`` on the Triton kernels:
    the fused path (temperature, the filters, and logit_bias / penalties where
    :func:`fused_processing` says so), or the general path (:func:`route`).

    Returns (VerifyOutput, the [N] int64 error bitmask); for sample, its ``token_ids`` are
    [N] and its ``num_accepted`` a workspace tensor. No host synchronisation on the fused
    path. The bitmask is a workspace tensor (``workspace.scratch``) on the fused path: read
    it before the next call on the same stream and thread rewrites it.
    """
    batch = plan.batch
    dev = plan.logits.device
    n, k = plan.num_requests, plan.max_k
    pen = fused_processing(plan)
    general = batch.needs_general_path and not pen
    filtered = batch.needs_filter and not general
    if pen:
        paths.record("triton.processing.fused", plan.num_rows)
    if general:
        # PyTorch processing (float32 copy), with its own error bits: rows emptied by bans and
        # logits that bias / penalties overflowed are reported as such, not as bad raw logits.
        _, x, proc_err = processed_logits(plan)
        temp = torch.ones_like(batch.temperature)
    else:
        x = _contiguous_rows(plan.logits, "target")
        temp = batch.temperature
    req_temp = batch.temperature
    draft_ids = (plan.draft_token_ids if plan.draft_token_ids.numel()
                 else workspace.zeros((1,), torch.int64, dev))  # (read by no kernel)
    pen_args = _pen_args(plan, pen, draft_ids)
    fused_logprobs = batch.max_logprobs >= 0 and logprobs_kernels.supported(plan, general)
    if op == "sample":
        # sample() returns the [N] tokens (allocated as such, so that a replayed call returns
        # them without a view) and never num_accepted: scratch
        sampled = torch.empty(n, dtype=torch.int64, device=dev)
        token_ids = sampled.view(n, 1)
        num_accepted = workspace.scratch("sample.num_accepted", (n,), torch.int64, dev)
    else:
        token_ids = torch.empty(n, k + 1, dtype=torch.int64, device=dev)
        num_accepted = torch.empty(n, dtype=torch.int64, device=dev)
    # (the error bits are read only by the API's strict check, right after the call on the
    # same stream, before any later call's kernels: scratch, one allocation fewer per call)
    err = workspace.scratch("err", (n,), torch.int64, dev)
    invalid = torch.empty(n, dtype=torch.bool, device=dev)
    res_row = workspace.scratch("res_row", (n,), torch.int64, dev)
    # logprobs = 0 for everyone, from the statistics alone: the finish writes them with the
    # tokens (and the residual draw at a redrawn correction), no launch of their own
    lp0 = fused_logprobs and logprobs_kernels.in_finish(plan, general or pen, filtered)
    if lp0:
        lp_v = torch.empty(n, k + 1, 1, dtype=torch.float32, device=dev)
        lp_i = torch.empty(n, k + 1, 1, dtype=torch.int64, device=dev)
    else:  # (never written; typed as the real ones: one kernel variant)
        lp_v, lp_i = workspace.scratch("lp.unwritten", (1,), torch.float32, dev), token_ids
    lp_args = (batch.logprobs_processed.view(torch.uint8), lp_v, lp_i, int(lp0))
    # A call without filter kernels, draft distributions or top-n logprobs is one launch, which
    # also finishes the requests (``draw_rows``). Top-n logprobs and draft distributions keep
    # the separate launches: such a call is several launches anyway
    # (with draft logits the single launch saved no measurable host time), and their variants
    # of the single launch made warmup compile 212 variants instead of 192 (22.8 s on a fresh
    # cache, against issue 16's 15 s).
    draft = plan.draft_logits if plan.draft_logits is not None else plan.draft_probs
    is_probs = plan.draft_probs is not None
    draft_rows = None
    if draft is not None:
        # The draft rows' statistics in the target rows' launch; the sampling kernel
        # combines their splits into dstats, which the finish and the residual kernels read.
        draft = _contiguous_rows(draft, "draft")
        dstats = workspace.scratch("draft.stats", (max(plan.draft_token_ids.numel(), 1), 3),
                                   torch.float32, dev)
        draft_rows = (draft, is_probs, dstats)
        dstride, dv = draft.stride(0), draft.shape[1]
    (part_m, part_s, part_f), tiles, nt, y, stats, (cut_v, cut_i), ranking, finished = \
        draw_rows(x, plan, temp, draft_ids, filtered,
                  rank=0 if not (fused_logprobs and batch.max_logprobs > 0) else (
                      2 if pen and logprobs_kernels.ranks_by_z_prime(batch) else 1),
                  finish=None if plan.has_draft_dist or batch.max_logprobs > 0 else (
                      plan.row_start, token_ids, num_accepted, err, invalid, res_row,
                      k, *lp_args), draft=draft_rows, pen=pen, pen_args=pen_args)
    if draft is None:  # (never read: no draft distribution)
        draft, dstride, dv, dstats = part_m, 0, 1, stats

    rows = plan.num_rows
    warps = NUM_WARPS if not _interpreting(dev) else 1
    block = plan.has_draft_dist and plan.method == "block"
    # The kernels after the statistics that read target values beside the draft's (the
    # finish's p(d_j), the residual's masses and draw) process them too: PEN 2 serves
    # logit_bias alone as well (its penalties are skipped at run time), one variant fewer.
    # The finish gets the batch's arguments whenever the kernels process rows: its re-read
    # of a suspect raw row applies the bans at run time (ERR_BANS), whatever its PEN.
    dist_pen = 2 if pen and plan.has_draft_dist else 0
    dist_pen_args = (draft_ids, *(pen_args if pen else _pen_args(plan, False, draft_ids)))
    dist_options = PEN_OPTIONS if dist_pen else {}
    rho_row = bmass = part_m  # (not read unless block verification has drafts past the first)
    sb = 1

    def finish(rho_only: bool):
        launch(kernels.finish_kernel)[(n,)](
            x, x.stride(0), plan.vocab_size, temp, req_temp, batch.seed_lo, batch.seed_hi,
            plan.positions, plan.row_start, plan.draft_start, plan.k_given, draft_ids,
            y, stats, draft, dstride, dv, dstats,
            token_ids, num_accepted, err, invalid, res_row, k, cut_v, cut_i,
            rho_row, bmass, sb, int(filtered), *lp_args, *dist_pen_args[1:],
            HAS_DRAFT=plan.has_draft_dist, DRAFT_PROBS=is_probs, BLOCK_METHOD=block,
            RHO_ONLY=rho_only, PEN=dist_pen, S_MAX=S_MAX,
            num_warps=4 if not _interpreting(dev) else 1, **dist_options)

    n_drafts = plan.draft_token_ids.numel()
    # Greedy requests verify against the argmax (the finish alone): a batch without a sampled
    # request (from its parameters, on the host) launches neither masses nor a residual draw
    residual = plan.has_draft_dist and batch.any_sampled
    block_mass = residual and block and k > 1
    if block_mass:
        # Block verification's Z_j for every draft row at once: rho_j first (a pass over the
        # requests' scalars, which also marks the rows whose Z_j cannot change tau), then the
        # masses of the other rows in parallel over (draft row, split). Their tile masses
        # serve the residual draw at tau, so residual_kernel is not launched.
        rho_row = workspace.scratch("block.rho", (n_drafts,), torch.float32, dev)
        # Splits sized for one summed row per request (most draft rows are skipped, and a
        # skipping program costs next to nothing), but no coarser than for 32 draft rows:
        # H200, K = 4, B = 128 7 us faster than sizing for every draft row, B = 32 with draft
        # probabilities 3.5 us faster, with draft logits 2 us slower; B <= 8 keeps the split
        # count it had (BENCHMARKS.md, "The residual draw from block verification's masses").
        sb, bcps, _ = _splits(max(n, min(n_drafts, 32)), plan.vocab_size,
                              MASS_TILES_PER_CHUNK, dev)
        bmass = workspace.scratch("block.mass", (n_drafts, sb), torch.float32, dev)
        tile_mass = workspace.scratch("block.tile_mass", (n_drafts, nt), torch.float32, dev)
        finish(rho_only=True)
        launch(kernels.block_mass_kernel)[(n_drafts, sb)](
            x, x.stride(0), plan.vocab_size, temp, req_temp, stats, plan.row_start,
            plan.draft_start, plan.draft_req, plan.draft_j, plan.k_given, draft, dstride, dv,
            dstats, rho_row, bmass, tile_mass, nt, bcps, cut_v, cut_i, *dist_pen_args,
            DRAFT_PROBS=is_probs, FILTERED=filtered, PEN=dist_pen, TPC=MASS_TILES_PER_CHUNK,
            BLOCK=BLOCK, num_warps=warps, **dist_options)
    if not finished:
        finish(rho_only=False)

    if residual:
        if block_mass:
            # (block verification: rho_tau from rho_row at the draft row of tau, the value
            # the tile masses were summed with)
            launch(kernels.residual_draw_kernel)[(n,)](
                x, x.stride(0), plan.vocab_size, temp, req_temp, batch.seed_lo, batch.seed_hi,
                plan.positions, stats, tiles[0], tiles[1], plan.row_start, plan.draft_start,
                draft, dstride, dv, dstats, res_row, rho_row, tile_mass, nt,
                token_ids, k, cut_v, cut_i, int(filtered), *lp_args, *dist_pen_args,
                DRAFT_PROBS=is_probs, PEN=dist_pen, BLOCK=BLOCK, num_warps=warps,
                **dist_options)
        else:
            # The residual's tile masses and draw in one launch (rho_tau = 1). Uncapped, its
            # draw's 106-109 registers (ptxas, sm_90a) leave fewer mass programs per SM than
            # the separate mass kernel's 32-58, yet capped at 64 it was no faster (H100,
            # BENCHMARKS.md, "The residual's masses and draw in one launch")
            mass = workspace.scratch("residual.mass", (n, nt), torch.float32, dev)
            rs, rcps, _ = _splits(n, plan.vocab_size, 1, dev)
            launch(kernels.residual_kernel)[(n, rs)](
                x, x.stride(0), plan.vocab_size, temp, req_temp, batch.seed_lo, batch.seed_hi,
                plan.positions, stats, tiles[0], tiles[1], plan.row_start, plan.draft_start,
                draft, dstride, dv, dstats, res_row, mass, nt, rcps,
                workspace.counters("residual", (n,), dev),
                token_ids, k, cut_v, cut_i, *lp_args, *dist_pen_args, DRAFT_PROBS=is_probs,
                FILTERED=filtered, PEN=dist_pen, BLOCK=BLOCK, num_warps=warps,
                **dist_options)
    if general:
        err = torch.where(proc_err != 0, proc_err | (err & (ERR_DRAFT_ID | ERR_DRAFT_ROW)), err)
        # The processing sanitised the rows of requests it found invalid (NaN / inf logits,
        # overflow, bans that leave nothing), so the kernels saw finite rows: mark them here.
        bad = proc_err != 0
        invalid = invalid | bad
        token_ids = token_ids.masked_fill(bad[:, None], -1)
        num_accepted = num_accepted.masked_fill(bad, 0)
    logprobs = logprob_ids = None
    if lp0:
        paths.record("triton.logprobs.finish", rows)
        logprobs, logprob_ids = lp_v, lp_i
    elif fused_logprobs:
        paths.record("triton.logprobs.fused", rows)
        raw = _contiguous_rows(plan.logits, "target") if general else x
        logprobs, logprob_ids = logprobs_kernels.emitted_logprobs(
            plan, raw, x, temp, stats, filtered, general, cut_v, cut_i, token_ids,
            num_accepted, invalid, ranking, _splits(n, plan.vocab_size, 1, dev)[0], warps,
            4 * _num_programs_target(dev),
            pen=(_pen_kind(plan, pen), pen_args[:9] + (draft_ids, plan.draft_start)
                 + pen_args[9:]))
    elif batch.max_logprobs >= 0:
        paths.record("triton.logprobs.torch", rows)
        j = torch.arange(k + 1, device=dev)
        grid = (plan.row_start[:, None] + j).clamp_max(rows - 1)
        emitted = (j <= num_accepted[:, None]) & ~invalid[:, None]
        processed = stats_logprobs(x, plan, temp, stats, filtered, cut_v, cut_i,
                                   exact_rank_rows(plan, general))
        logprobs, logprob_ids = emitted_logprobs(plan, processed, grid, token_ids, emitted)
    out = VerifyOutput(token_ids=token_ids.view(n) if op == "sample" else token_ids,
                       num_accepted=num_accepted, logprobs=logprobs,
                       logprob_token_ids=logprob_ids, invalid=invalid)
    return out, err


# ---------------------------------------------------------------------------------------------
# Warmup and compile guard

_state = {"warmed": False, "mode": "warn", "compiles_after_warmup": []}


class CompilationAfterWarmupError(RuntimeError):
    """A Triton kernel compiled after :func:`specsample.warmup` (raised with on_compile="raise")."""


def _post_compile_hook(*args, **kwargs):
    # Every kernel of the package counts (the module of the jitted Python function: the
    # distributed kernels too), not a list of names that new kernels could miss. Triton
    # passes fn=JitFunctionInfo(module, name, jit_function) (reading fn.fn, as this did until
    # a review, matched nothing).
    fn = getattr(getattr(kwargs.get("fn"), "jit_function", None), "fn", None)
    name = getattr(fn, "__qualname__", None) or kwargs.get("repr", "?")
    if not _state["warmed"] or not _compile_pool._ours(getattr(fn, "__module__", "") or ""):
        return None
    _state["compiles_after_warmup"].append(str(kwargs.get("repr", name)))
    msg = f"specsample: Triton compiled {name} after warmup (a variant warmup did not cover)"
    if _state["mode"] == "raise":
        raise CompilationAfterWarmupError(msg)
    if _state["mode"] == "warn":
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return None


def warmup_report() -> dict:
    """What the last :func:`warmup` on CUDA did to compile in parallel: the variants it
    collected, how many were already in Triton's on-disk cache, compiled by workers, or
    failed there (then compiled serially as the calls launched them), and the seconds of
    each step (``compile_pool.last_report``). Empty if it did not run."""
    from . import compile_pool
    return compile_pool.last_report()


def compilations_after_warmup() -> list[str]:
    """Descriptions of every kernel compiled after warmup (empty when warmup covered all)."""
    return list(_state["compiles_after_warmup"])


def disarm_compile_guard() -> None:
    """Stop reporting compilations (for example before compiling for a new vocabulary size;
    call :func:`specsample.warmup` again to re-arm)."""
    _state["warmed"] = False


def install_compile_guard(on_compile: str = "warn") -> None:
    """Report Triton compilations of specsample kernels from now on.

    ``on_compile``: "warn" (RuntimeWarning), "raise" (CompilationAfterWarmupError) or "ignore"
    (only recorded in :func:`compilations_after_warmup`).

    Raises:
        ValueError: an unknown ``on_compile``.
    """
    if on_compile not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_compile must be 'warn', 'raise' or 'ignore', got {on_compile!r}")
    _state["mode"] = on_compile
    _state["warmed"] = True
    _state["compiles_after_warmup"].clear()
    previous = triton.knobs.runtime.jit_post_compile_hook
    if previous is not _post_compile_hook:
        triton.knobs.runtime.jit_post_compile_hook = _post_compile_hook


def _cpu_count() -> int:
    """The CPU cores this process may run on (its affinity, where the OS says)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # (no affinity on this OS)
        return os.cpu_count() or 1


def warmup(device="cuda", *, vocab_size: int, draft_vocab_size: int | None = None,
           dtypes=(torch.bfloat16, torch.float16, torch.float32),
           methods=("token", "block"), on_compile: str = "warn",
           workers: int | None = None) -> int:
    """Compile every kernel variant a deployment can need, then guard against later compiles.

    Runs sample() and verify() per (target dtype, draft kind, draft dtype, method) with
    greedy and sampled requests mixed, with min_p / top_k / top_p (the fused filter kernel),
    with logit_bias and penalties applied in the kernels, and on the general path (float32
    processed logits), and sample() with raw and processed
    logprobs on each of those paths (the logprob kernels), sample() and verify() with bans,
    logit_bias or penalties and raw / processed logprobs (the logprob kernels that process
    the rows), and the kernels of a device
    ``num_draft_tokens`` (``layout.warm``) and ``verify_tree()``'s walk (``tree.warm``), on
    ``device`` with vocabulary ``vocab_size`` (and ``draft_vocab_size``, default the same),
    and the calls that take the single launch (:func:`one_launch`) again with the separate
    launches that :func:`separate_launches` asks for.
    Then installs the compile guard
    (see :func:`install_compile_guard`). Returns the number of calls made.

    On CUDA the variants are compiled in ``workers`` processes first (default: one per CPU
    core this process may use, at most 32; 0 compiles them one by one as the calls launch
    them): the calls run once with every compile skipped to list the variants, the ones
    missing from Triton's on-disk cache are compiled in parallel, then the calls run for real
    and load them from the cache. A manifest beside the cache then lets the next warmup with
    the same arguments (and package, Triton, compiler, torch and GPU) skip straight to the
    calls (``compile_pool``; :func:`warmup_report` says what happened). One warmup runs at a
    time in a process.

    Raises:
        ValueError: an unknown ``on_compile`` or dtype.
    """
    from ..api import sample, select_backend, verify
    from ..params import SamplingBatch, SamplingParams

    device = torch.device(device)
    dv = draft_vocab_size or vocab_size
    # (random inputs made on the device: two passes of a fresh-cache warmup make a hundred)
    gen = torch.Generator(device=device).manual_seed(0)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)]
    filtered = [SamplingParams(temperature=0.0),
                SamplingParams(temperature=0.8, seed=1, top_k=5, top_p=0.9, min_p=0.01)]
    # (the general path on purpose, general_path(), whose kernels read float32 processed rows)
    general = [SamplingParams(temperature=0.0, logit_bias={0: 0.5}),
               SamplingParams(temperature=0.8, seed=1, top_k=5, top_p=0.9, min_p=0.01)]
    # bans, logit_bias and penalties in the kernels (fused_processing): with penalties (the
    # counts' row stride is V) and with bans and logit_bias alone (0), which key apart when 16
    # does not divide V; the bans with the ban table's kernel
    penalised = [[SamplingParams(temperature=0.0, repetition_penalty=1.1, logit_bias={0: 0.5}),
                  SamplingParams(temperature=0.8, seed=1, presence_penalty=0.5,
                                 frequency_penalty=0.2)],
                 [SamplingParams(temperature=0.0, logit_bias={0: 0.5},
                                 bad_words_token_ids=[[1], [2, 3]], min_tokens=2,
                                 stop_token_ids=[4]),
                  SamplingParams(temperature=0.8, seed=1, logit_bias={1: -0.5},
                                 allowed_token_ids=list(range(0, vocab_size, 3)))]]
    # and with min_p / top_k / top_p: the filter kernels on the processed rows
    penalised_filtered = [[p, dataclasses.replace(q, top_k=5, top_p=0.9, min_p=0.01)]
                          for p, q in penalised]
    # logprobs with the processing in the kernels: processed top-n ranked by z' (logit_bias,
    # penalties) or by z (bans alone), and raw top-n (raw_topn_kernel; a raw logprobs = 0
    # launches the same kernels without it)
    bans_only = [SamplingParams(temperature=0.0, bad_words_token_ids=[[1]]),
                 SamplingParams(temperature=0.8, seed=1, min_tokens=2, stop_token_ids=[4])]
    processed_lp = [[dataclasses.replace(p, logprobs=n_top, logprobs_mode=mode)
                     for p, mode in zip(plist, modes)]
                    for plist in (*penalised, bans_only, *penalised_filtered,
                                  [bans_only[0], dataclasses.replace(bans_only[1], top_k=5)])
                    for n_top, modes in ((2, ("processed", "processed")),
                                         (2, ("raw", "processed")))]
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    k = [2, 1]

    def run_calls() -> int:
        calls = every_kind()
        # The calls that took the single launch above (no filter kernels, draft distributions
        # or top-n logprobs) take separate launches with separate_launches().
        with separate_launches():
            for dtype in dtypes:
                target = torch.randn(2, vocab_size, generator=gen, device=device).to(dtype)
                rows = torch.randn(5, vocab_size, generator=gen, device=device).to(dtype)
                drafts = torch.randint(0, min(vocab_size, dv), (3,), generator=gen,
                                       device=device)
                for plist in (params, general, *penalised):  # (general: float32 rows)
                    with general_path() if plist is general else contextlib.nullcontext():
                        for lp in (None, 0) if plist in (params, general) else (None,):
                            batch = SamplingBatch.from_params(
                                [dataclasses.replace(p, logprobs=lp) for p in plist],
                                vocab_size=vocab_size, device=device)
                            sample(target, batch, positions=pos, strict=False)
                            verify(rows, drafts, k, batch, positions=pos, strict=False)
                            calls += 2
        # a device num_draft_tokens: the layout kernels (the rest of such a call launches the
        # variants of a host num_draft_tokens); not on the PyTorch backend (CPU tensors
        # without the interpreter), which has no kernel of its own
        if select_backend(device) == "triton":
            layout.warm(device)
        else:  # the PyTorch backend compiles a variant per logits dtype and tensor kind
            # (specsample.cpu_compile): an engine decoding under inference_mode passes
            # inference tensors
            with torch.inference_mode():
                batch = SamplingBatch.from_params(params, vocab_size=vocab_size, device=device)
                # (sampled requests with top_k / top_p alone: their one-hot verify draws from
                # the candidates and matches in one call)
                ranked = SamplingBatch.from_params(
                    [SamplingParams(temperature=0.8, seed=1, top_k=5, top_p=0.9),
                     SamplingParams(temperature=0.8, seed=2, top_p=0.9)],
                    vocab_size=vocab_size, device=device)
                for dtype in dtypes:
                    rows = torch.randn(5, vocab_size, generator=gen, device=device).to(dtype)
                    drafts = torch.randint(0, min(vocab_size, dv), (3,), generator=gen,
                                           device=device)
                    probs = torch.softmax(torch.randn(3, dv, generator=gen, device=device), -1)
                    verify(rows, drafts, k, batch, positions=pos, strict=False)
                    verify(rows, drafts, k, batch, draft_probs=probs, positions=pos,
                           strict=False)
                    verify(rows, drafts, k, ranked, positions=pos, strict=False)
                    calls += 3
        return calls

    def with_drafts(rows, drafts, batch, method: str) -> int:
        """verify() of ``batch`` with draft logits and draft probabilities of every dtype;
        the number of calls."""
        calls = 0
        for ddtype in dtypes:
            dl = torch.randn(3, dv, generator=gen, device=device).to(ddtype)
            probs = torch.softmax(dl.float(), -1).to(ddtype)
            for extra in (dict(draft_logits=dl), dict(draft_probs=probs)):
                verify(rows, drafts, k, batch, positions=pos, method=method, strict=False,
                       **extra)
                calls += 1
                if method == "block" and "token" not in methods:
                    # block calls whose k_i are all <= 1 draw their corrections from
                    # residual_kernel, as token level does
                    verify(rows[:4], drafts[:2], [1, 1], batch, positions=pos, method=method,
                           strict=False, **{key: v[:2] for key, v in extra.items()})
                    calls += 1
        return calls

    def every_kind() -> int:
        calls = 0
        for dtype in dtypes:
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"unsupported dtype {dtype}")
            target = torch.randn(2, vocab_size, generator=gen, device=device).to(dtype)
            rows = torch.randn(5, vocab_size, generator=gen, device=device).to(dtype)
            drafts = torch.randint(0, min(vocab_size, dv), (3,), generator=gen, device=device)
            for plist in (*penalised, *penalised_filtered):
                batch = SamplingBatch.from_params(plist, vocab_size=vocab_size, device=device)
                sample(target, batch, positions=pos, strict=False)
                verify(rows, drafts, k, batch, positions=pos, strict=False)
                calls += 2
                # with a draft distribution: the kernels after the statistics process the
                # target values they read (PEN 2 for bias and penalties alike)
                for method in methods:
                    calls += with_drafts(rows, drafts, batch, method)
            for plist in processed_lp:
                batch = SamplingBatch.from_params(plist, vocab_size=vocab_size, device=device)
                sample(target, batch, positions=pos, strict=False)
                verify(rows, drafts, k, batch, positions=pos, strict=False)
                calls += 2
            for plist in (params, filtered, general):
                with general_path() if plist is general else contextlib.nullcontext():
                    batch = SamplingBatch.from_params(plist, vocab_size=vocab_size, device=device)
                    sample(target, batch, positions=pos, strict=False)
                    # the logprob kernels: top-n (raw and processed; processed alone, which the
                    # general path serves on the kernels), and the raw normaliser alone
                    for n_top, modes in ((2, ("raw", "processed")), (2, ("processed", "processed")),
                                         (0, ("processed", "raw"))):
                        if plist is general and n_top and "raw" in modes:
                            # (the PyTorch path: no kernel of its own, and its gathers by token
                            # id must not meet compile_pool.collect's unwritten outputs)
                            continue
                        with_lp = [dataclasses.replace(p, logprobs=n_top, logprobs_mode=mode)
                                   for p, mode in zip(plist, modes)]
                        sample(target, SamplingBatch.from_params(with_lp, vocab_size=vocab_size,
                                                                 device=device),
                               positions=pos, strict=False)
                    calls += 4 - (plist is general)
                    for method in methods:
                        verify(rows, drafts, k, batch, positions=pos, method=method, strict=False)
                        calls += 1 + with_drafts(rows, drafts, batch, method)
                    if plist is general and methods:
                        # top-n processed logprobs on the general path with a draft distribution:
                        # the statistics pass of its float32 rows with tile maxima, in the launch
                        # the draft rows share (the method does not change that variant)
                        lp_batch = SamplingBatch.from_params(
                            [dataclasses.replace(p, logprobs=2, logprobs_mode="processed")
                             for p in plist], vocab_size=vocab_size, device=device)
                        for ddtype in dtypes:
                            dl = torch.randn(3, dv, generator=gen, device=device).to(ddtype)
                            dp = torch.softmax(dl.float(), -1).to(ddtype)
                            for extra in (dict(draft_logits=dl), dict(draft_probs=dp)):
                                verify(rows, drafts, k, lp_batch, positions=pos,
                                       method=methods[0], strict=False, **extra)
                            calls += 2
        from . import tree as tree_kernels  # (imports specsample.tree, which imports this)

        if select_backend(device) == "triton":
            tree_kernels.warm(device, vocab_size, dtypes[0] if dtypes else torch.float32)
        return calls

    from . import compile_pool

    with compile_pool.LOCK:  # (one warmup at a time: the parallel steps swap Triton's hooks)
        if device.type != "cuda" or workers == 0:
            compile_pool.reset_report(skipped="not CUDA" if device.type != "cuda"
                                      else "workers=0")
        else:
            from triton.runtime import driver

            try:
                config = dict(vocab_size=vocab_size, draft_vocab_size=dv,
                              methods=list(methods), dtypes=[str(d) for d in dtypes],
                              device=str(device), backend=select_backend(device),
                              pdl=PDL)
                compile_pool.parallel_warmup(
                    run_calls, driver.active.get_current_target(),
                    workers or min(_cpu_count(), compile_pool.MAX_WORKERS), config)
            except Exception as e:  # (the calls below still compile every variant, serially)
                compile_pool.record_failure(e)
                warnings.warn(f"specsample: parallel compilation failed ({e!r}); warmup "
                              "compiles serially", RuntimeWarning, stacklevel=2)
        start = time.perf_counter()
        with compile_pool.count_compiles() as seen:
            calls = run_calls()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            compile_pool.record_launches(seen, time.perf_counter() - start)
        install_compile_guard(on_compile)
    return calls


# (the kernels' on-disk cache keys, the same in every process: compile_pool.settle_cache_keys)
from . import compile_pool as _compile_pool  # noqa: E402

_compile_pool.settle_cache_keys()
