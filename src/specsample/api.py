"""Public entry points: sample() and verify(), validation and backend dispatch."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Sequence

import torch

from . import call_cache, paths, torch_backend, workspace
from .errors import SamplingError
from .outputs import SampleOutput, VerifyOutput
from .params import SamplingBatch
from .plan import ERR_NUM_DRAFT_TOKENS, ERR_NUM_DRAFT_TOKENS_TEXT, Plan, build_plan

BACKENDS = ("torch", "triton")


def select_backend(device: torch.device | str) -> str:
    """The backend for tensors on ``device``: ``$SPECSAMPLE_BACKEND`` if set, else triton on
    CUDA and torch elsewhere. Triton on CPU tensors runs Triton's interpreter, which has to be
    switched on (``TRITON_INTERPRET=1``) before triton is first imported: this sets it when
    triton is not imported yet.

    Raises:
        ValueError: ``SPECSAMPLE_BACKEND`` is set to something other than torch / triton, or
            to triton for CPU tensors after triton was imported without ``TRITON_INTERPRET=1``.
    """
    device = torch.device(device)
    forced = os.environ.get("SPECSAMPLE_BACKEND", "").strip().lower()
    if not forced:
        return "triton" if device.type == "cuda" else "torch"
    if forced not in BACKENDS:
        raise ValueError(f"SPECSAMPLE_BACKEND must be 'torch' or 'triton', got {forced!r}")
    if forced == "triton" and device.type != "cuda" and (
            os.environ.get("TRITON_INTERPRET") != "1"):
        if "triton" in sys.modules:
            raise ValueError("SPECSAMPLE_BACKEND=triton on CPU tensors runs Triton's "
                             "interpreter, which must be on before triton is imported: set "
                             "TRITON_INTERPRET=1 in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    return forced


def warmup(device="cuda", *, vocab_size: int, draft_vocab_size: int | None = None,
           dtypes=(torch.bfloat16, torch.float16, torch.float32), methods=("token", "block"),
           on_compile: str = "warn", workers: int | None = None) -> int:
    """Compile every Triton kernel variant a deployment can need, then report later compiles.

    Covers target dtypes x draft kinds (one-hot, draft_logits, draft_probs) x draft dtypes x
    methods, greedy and sampled requests, the filters, logit_bias and penalties applied in the
    kernels, and the general (float32) path. Afterwards any
    compilation of a specsample kernel warns (``on_compile="warn"``), raises
    ``CompilationAfterWarmupError`` (``"raise"``) or is only recorded (``"ignore"``); see
    ``specsample.triton_backend.compilations_after_warmup()``. Returns the number of calls.
    On CUDA the variants missing from Triton's on-disk cache are compiled in ``workers``
    processes (default one per CPU core this process may use, at most 32; 0: one by one as
    the calls launch them), and a manifest beside the cache lets the next warmup of the same
    deployment skip straight to loading them; see
    ``specsample.triton_backend.warmup_report()``.

    Raises:
        ValueError: an unknown ``on_compile`` or dtype, or a CUDA ``device`` on a machine
            without one (``device="cpu"`` compiles no Triton kernel: it runs the calls on the
            CPU path, which compiles that path's functions, ``specsample.cpu_compile``).
    """
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"warmup(device={str(device)!r}) needs a CUDA device, and "
                         "torch.cuda.is_available() is False (device='cpu' runs the calls "
                         "on the CPU path, which compiles that path's functions)")
    from . import triton_backend

    # (the layout and tree kernels it launches itself address the current device)
    with _current_device(torch.device(device)):
        return triton_backend.warmup(device, vocab_size=vocab_size,
                                     draft_vocab_size=draft_vocab_size, dtypes=dtypes,
                                     methods=methods, on_compile=on_compile, workers=workers)


def _draft_kind(plan: Plan) -> str:
    if plan.draft_logits is not None:
        return "draft_logits"
    if plan.draft_probs is not None:
        return "draft_probs"
    return "onehot"


def _refuse_uncapturable(backend: str, plan: Plan, op: str, device: torch.device) -> None:
    """ValueError when a call on ``device`` that synchronises with the host runs inside
    CUDA-graph capture (the capture would fail later with an opaque CUDA error)."""
    if not (workspace.capturing(device) if device.type == "cuda" else _capturing()):
        return
    if backend == "torch":
        raise ValueError(f"{op}() on the torch backend synchronises with the host and cannot "
                         "run inside CUDA-graph capture; use the triton backend on CUDA")
    from . import triton_backend

    if triton_backend.route(plan) == "general":
        raise ValueError(f"{op}(): bans, logit_bias or penalties together with more than "
                         "32 top-n logprobs take the general path (PyTorch processing with "
                         "host synchronisation), which cannot run inside CUDA-graph capture; "
                         "temperature, min_p, top_k, top_p, bans, logit_bias, penalties and "
                         "logprobs up to 32 top-n can")


def _current_device(t) -> contextlib.AbstractContextManager:
    """A block with the CUDA device of ``t`` (a tensor or a torch.device; anything else, or
    a device without an index, is taken as current) made current. The Triton launches (the
    plan's too) and the workspace address the current device and its stream; the call cache
    never replays a call whose logits are elsewhere (its key needs their device current).
    ValueError while the current stream captures a CUDA graph on another device (the call
    could not be part of it)."""
    dev = t.device if isinstance(t, torch.Tensor) else t
    if (isinstance(dev, torch.device) and dev.type == "cuda" and dev.index is not None
            and dev.index != torch._C._cuda_getDevice()):
        if torch.cuda.is_current_stream_capturing():
            raise ValueError(f"the logits are on {dev} but the CUDA graph being captured "
                             f"is on cuda:{torch._C._cuda_getDevice()}; capture on the logits' "
                             "device (torch.cuda.device)")
        return torch.cuda.device(dev)
    return contextlib.nullcontext()


def _run(plan: Plan, op: str) -> tuple[VerifyOutput, torch.Tensor]:
    # (one look-up of the capture state and stream for the whole call: workspace.call)
    with workspace.call(plan.logits.device):
        return _run_in_call(plan, op)


def _run_in_call(plan: Plan, op: str) -> tuple[VerifyOutput, torch.Tensor]:
    backend = select_backend(plan.logits.device)
    batch = plan.batch
    _refuse_uncapturable(backend, plan, op, plan.logits.device)
    n_greedy = batch.num_greedy
    # Recorded before running, so that a forbidden path raises before doing any work.
    if backend == "triton":
        from . import triton_backend

        paths.record(f"triton.{op}.{triton_backend.route(plan)}", plan.num_rows)
        out, err = triton_backend.run(plan, op)
    else:
        paths.record(f"torch.{op}" if op == "sample" else f"torch.verify.{_draft_kind(plan)}",
                     plan.num_rows)
        out, err = torch_backend.verify(plan)
    if plan.layout_err is not None:
        if backend == "triton":
            from .triton_backend.layout import mark_layout_errors
            out, err = mark_layout_errors(out, err, plan.layout_err)
        else:
            out, err = _mark_layout_errors(out, err, plan.layout_err)
    if n_greedy:
        paths.record("requests.greedy", n_greedy)
    if n_greedy < batch.num_requests:
        paths.record("requests.sampled", batch.num_requests - n_greedy)
    return out, err


def _triton_plan_hooks(logits, positions, max_num_draft_tokens) -> dict:
    """``build_plan``'s ``device_layout`` and ``fresh`` for a call on the Triton backend: its
    one-launch device layout (with ``max_num_draft_tokens``) and fresh positions (with
    ``positions=None``), so that such a call is only launches (``call_cache``); {} else."""
    if not isinstance(logits, torch.Tensor) or select_backend(logits.device) != "triton":
        return {}
    from .triton_backend import layout
    return {"device_layout": layout.device_layout if max_num_draft_tokens is not None else None,
            "fresh": layout.fresh_positions if positions is None else None}


def _flat(out: VerifyOutput, err: torch.Tensor) -> tuple:
    """(out, err) as the tuple of tensors ``call_cache`` records and replays."""
    return (out.token_ids, out.num_accepted, out.logprobs, out.logprob_token_ids, out.invalid,
            err)


def _unflat(t: tuple) -> tuple[VerifyOutput, torch.Tensor]:
    return VerifyOutput(*t[:5]), t[5]


def _mark_layout_errors(out: VerifyOutput, err: torch.Tensor, layout_err: torch.Tensor
                        ) -> tuple[VerifyOutput, torch.Tensor]:
    """Requests whose device-resident num_draft_tokens entry could not be laid out (the
    plan's ``layout_err``): invalid, token ids -1, num_accepted 0, logprobs -inf / ids -1.
    Device ops only (no host read)."""
    bad = layout_err != 0
    lp = ids = None
    if out.logprobs is not None:
        lp = out.logprobs.masked_fill(bad[:, None, None], -math.inf)
        ids = out.logprob_token_ids.masked_fill(bad[:, None, None], -1)
    out = VerifyOutput(token_ids=out.token_ids.masked_fill(bad[:, None], -1),
                       num_accepted=out.num_accepted.masked_fill(bad, 0), logprobs=lp,
                       logprob_token_ids=ids, invalid=out.invalid | bad)
    return out, err | layout_err


def _describe_errors(codes: list[int]) -> str:
    """torch_backend.describe_errors plus the bit only the API sets (ERR_NUM_DRAFT_TOKENS)."""
    text = torch_backend.describe_errors([c & ~ERR_NUM_DRAFT_TOKENS for c in codes])
    extra = "; ".join(f"request {i}: {ERR_NUM_DRAFT_TOKENS_TEXT}"
                      for i, c in enumerate(codes) if c & ERR_NUM_DRAFT_TOKENS)
    return "; ".join(t for t in (text, extra) if t)


def _raise_if_invalid(err: torch.Tensor) -> None:
    if bool(err.any()):
        codes = err.tolist()
        raise SamplingError([i for i, c in enumerate(codes) if c], _describe_errors(codes))


def _capturing() -> bool:
    """True while the current CUDA stream captures a graph (creates no CUDA context)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_not_capturing(strict: bool, name: str) -> None:
    """ValueError when ``strict`` is not a bool, or is true while the current CUDA stream is
    capturing a graph (strict=True reads the error flags on the host, a synchronisation
    capture forbids)."""
    if not isinstance(strict, bool):
        raise ValueError(f"{name}(): strict must be True or False, got {strict!r}")
    if strict and _capturing():
        raise ValueError(f"{name}(strict=True) needs a host synchronisation and cannot run "
                         "inside CUDA-graph capture; pass strict=False and read out.invalid")


def _check_batch(batch) -> None:
    if not isinstance(batch, SamplingBatch):
        raise ValueError(f"batch must be a SamplingBatch, got {type(batch).__name__}; build it "
                         "with SamplingBatch.from_params(params, vocab_size=V, device=...)")


def _check_logits_rows(logits, n: int) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != n:
        got = (f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise ValueError(f"logits must be a 2-D tensor [N, V] with one row per request "
                         f"(N = {n} rows), got {got}")


def _gather_rows(logits, logits_index, n: int) -> torch.Tensor:
    """``logits[logits_index]`` ([N, V]) after validating ``logits_index`` (see sample())."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        got = (f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
               else type(logits).__name__)
        raise ValueError(f"logits must be a 2-D tensor [R, V] when logits_index is given, "
                         f"got {got}")
    if not isinstance(logits_index, torch.Tensor):
        try:
            logits_index = torch.as_tensor(list(logits_index))  # floats are refused below
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"logits_index must be a [N] int64 tensor or a list of ints, got "
                             f"{type(logits_index).__name__}") from None
    if logits_index.dim() != 1 or logits_index.shape[0] != n:
        raise ValueError(f"logits_index must have shape [{n}] (one entry per request), got "
                         f"{tuple(logits_index.shape)}")
    if logits_index.dtype.is_floating_point or logits_index.dtype.is_complex or (
            logits_index.dtype == torch.bool):
        raise ValueError(f"logits_index must be an integer tensor, got {logits_index.dtype}")
    rows = logits.shape[0]
    paths.record(f"{select_backend(logits.device)}.copy.logits_index", n)
    idx = logits_index.to(device=logits.device, dtype=torch.int64)
    if logits_index.device.type == "cpu":
        bad = (logits_index < 0) | (logits_index >= rows)
        if bool(bad.any()):
            raise ValueError(f"logits_index entries must be in [0, {rows}) (the rows of "
                             f"logits), got {logits_index[bad][:5].tolist()}")
        return logits.index_select(0, idx)
    # A device index is not read on the host (no synchronisation): an out-of-range entry
    # makes its request invalid by reading a NaN row.
    if rows == 0:
        return logits.new_full((n, logits.shape[1]), math.nan)
    out = logits.index_select(0, idx.clamp(0, rows - 1))
    return out.masked_fill(((idx < 0) | (idx >= rows))[:, None], math.nan)


def sample(logits: torch.Tensor, batch: SamplingBatch, *, positions=None,
           strict: bool = True, logits_index=None) -> SampleOutput:
    """Sample one token per request from its processed distribution.

    Args:
        logits: [N, V] float32 / float16 / bfloat16 raw logits (the request's params are applied
            inside, in float32: bans, logit_bias, penalties, temperature, min_p, top_k, top_p);
            with ``logits_index``, [R, V] for any R >= 1.
        batch: the requests' SamplingBatch (N requests, vocab_size V, same device).
        positions: [N] int64 absolute position of the token being sampled; keys the
            counter-based RNG (``specsample.rng``). Required when a request has a user seed;
            when omitted, every request gets position ``2**31 * (c mod 2**31)``, c the batch's
            ``fresh_counter``, which the call then advances by 1 in place (a device op: calls
            and CUDA-graph replays never reuse noise; docs/semantics.md).
        strict: raise SamplingError for invalid data; with False, invalid requests get
            token id -1 and ``invalid[i] = True``, and no host synchronisation is needed.
            strict=True reads the errors on the host, so it cannot run inside CUDA-graph
            capture (ValueError).
        logits_index: None, or [N] int64 (a tensor or a list of ints): request i reads row
            ``logits_index[i]`` of ``logits``, so several requests (n > 1 samples of one
            prompt, each with its own seed or position) share one row. Both backends gather
            the rows first (``logits.index_select``: one [N, V] copy, counted as the path
            ``"torch.copy.logits_index"`` / ``"triton.copy.logits_index"``). Host (CPU)
            indices are range-checked (ValueError); a CUDA index tensor is not read on the
            host: an out-of-range entry makes its request invalid (reported as a NaN logit).

    Returns:
        SampleOutput with token_ids [N] int64, logprobs / logprob_token_ids [N, 1 + n] (or
        None when no request asked for logprobs) and invalid [N] bool.

    Temperature 0 is greedy (argmax, lowest id on ties); T > 0 is an exact Gumbel-max draw
    from softmax(z / T) (Gumbel 1954; see docs/semantics.md).

    Raises:
        ValueError: ``batch`` is not a SamplingBatch, ``logits`` is not [N, V], invalid
            dtypes or devices, missing positions with user seeds, a ``logits_index`` of
            the wrong shape / dtype / with a host entry outside [0, R), or strict=True while
            the current CUDA stream is capturing a graph (checked first, before any work).
        SamplingError: with strict=True, NaN / +inf logits, a row with no finite logit,
            logit_bias / penalties that overflow a finite logit, or bans that leave no token.
    """
    _check_not_capturing(strict, "sample")
    _check_batch(batch)
    n = batch.num_requests
    if logits_index is not None:
        logits = _gather_rows(logits, logits_index, n)
    _check_logits_rows(logits, n)

    def call() -> tuple:
        with _current_device(logits):
            plan = build_plan(logits, batch, draft_token_ids=None, num_draft_tokens=[0] * n,
                              draft_logits=None, draft_probs=None, positions=positions,
                              method="token", logits_name="logits",
                              **_triton_plan_hooks(logits, positions, None))
            return _flat(*_run(plan, "sample"))

    keyed = call_cache.call_key("sample", logits, batch, None, None, None, None, positions,
                                "token", None)
    # (the error bits and the unused accepted counts may be the backend's workspace tensors)
    out, err = _unflat(call_cache.run(keyed, batch, call, kept=(1, 5)))
    if strict:
        _raise_if_invalid(err)
    lp = None if out.logprobs is None else out.logprobs[:, 0]
    lp_ids = None if out.logprob_token_ids is None else out.logprob_token_ids[:, 0]
    tok = out.token_ids  # ([N] from the Triton backend, [N, 1] from the torch backend)
    return SampleOutput(token_ids=tok if tok.dim() == 1 else tok[:, 0], logprobs=lp,
                        logprob_token_ids=lp_ids, invalid=out.invalid)


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor | Sequence[int],
    num_draft_tokens: torch.Tensor | Sequence[int],
    batch: SamplingBatch,
    *,
    draft_logits: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    positions=None,
    method: str = "token",
    strict: bool = True,
    max_num_draft_tokens: int | None = None,
) -> VerifyOutput:
    """Verify draft tokens against the target by rejection sampling; never changes the law.

    Args:
        target_logits: [T, V] float32 / float16 / bfloat16 raw target logits, T = N + sum k_i;
            request i owns k_i + 1 contiguous rows (its draft rows, then its bonus row).
        draft_token_ids: [sum k_i] int64 drafts in request order; -1 is a placeholder that
            makes the request behave as if its drafts ended there.
        num_draft_tokens: [N] ints >= 0 (a list, or an integer tensor on any device). A
            list / CPU tensor is checked on the host (ValueError). A device (CUDA) tensor
            is read on the host (one synchronisation) unless ``max_num_draft_tokens`` is
            given: then the row layout is derived on the device (no synchronisation; CUDA
            graphs can capture the call), with S = ``draft_token_ids.shape[0]``; an entry
            > max_num_draft_tokens makes that request invalid, a negative entry or entries
            that do not sum to S make every request invalid (error bit
            ``specsample.plan.ERR_NUM_DRAFT_TOKENS``).
        batch: SamplingBatch of the N requests.
        draft_logits: [sum k_i, V'] raw logits of a drafter that sampled from
            softmax(draft_logits / T_i); V' <= V.
        draft_probs: [sum k_i, V'] the drafter's exact sampling distribution.
            Neither given: one-hot drafts (n-gram, prompt lookup, greedy drafters).
        positions: [N] int64 absolute position of each request's first verified token.
            Required when a request has a user seed; when omitted, as in :func:`sample` (the
            batch's ``fresh_counter``, advanced by 1 per call).
        method: "token" (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1; Chen et al. 2023,
            arXiv 2302.01318, Alg. 2) or "block" (Sun et al. 2024, arXiv 2403.10444, Alg. 2).
        strict: as in :func:`sample`.
        max_num_draft_tokens: None, or K >= every k_i: fixes the output width K + 1 (without
            it K = max k_i). Host entries above it raise ValueError.

    Returns:
        VerifyOutput: token_ids [N, K+1] int64 (accepted drafts, then the correction or bonus
        token, then -1), num_accepted [N] int64, logprobs / logprob_token_ids
        [N, K+1, 1+n] or None, invalid [N] bool.

    Temperature-0 requests are verified greedily whatever the draft kind; one-hot drafts of
    sampled requests are verified by sampling every row with the same noise as sample() and
    matching the drafts by prefix (exact, and speculation-invariant for seeded requests).

    Raises:
        ValueError: invalid shapes, dtypes, devices, method, missing positions with seeds,
            host num_draft_tokens entries < 0 or > max_num_draft_tokens, a
            max_num_draft_tokens that is not an int >= 0, or strict=True while the current
            CUDA stream is capturing a graph (checked first).
        SamplingError: with strict=True, invalid data (NaN / +inf logits, a row with no finite
            logit, a draft id outside [0, V) other than -1, an invalid draft row, bans that
            leave no token, a device num_draft_tokens that does not fit).
    """
    _check_not_capturing(strict, "verify")
    if not isinstance(batch, SamplingBatch) and isinstance(num_draft_tokens, SamplingBatch):
        raise ValueError("verify(): batch must be a SamplingBatch, got "
                         f"{type(batch).__name__}, and num_draft_tokens is a SamplingBatch: the "
                         "order is verify(target_logits, draft_token_ids, num_draft_tokens, "
                         "batch, ...)")
    _check_batch(batch)

    def call() -> tuple:
        with _current_device(target_logits):
            plan = build_plan(target_logits, batch, draft_token_ids=draft_token_ids,
                              num_draft_tokens=num_draft_tokens, draft_logits=draft_logits,
                              draft_probs=draft_probs, positions=positions, method=method,
                              max_num_draft_tokens=max_num_draft_tokens,
                              **_triton_plan_hooks(target_logits, positions,
                                                   max_num_draft_tokens))
            return _flat(*_run(plan, "verify"))

    keyed = call_cache.call_key("verify", target_logits, batch, draft_token_ids,
                                num_draft_tokens, draft_logits, draft_probs, positions, method,
                                max_num_draft_tokens)
    out, err = _unflat(call_cache.run(keyed, batch, call, kept=(5,)))  # (err)
    if strict:
        _raise_if_invalid(err)
    return out


def probs(logits: torch.Tensor, batch: SamplingBatch, *, strict: bool = True) -> torch.Tensor:
    """The processed distribution that :func:`sample` draws from, one row per request.

    For drafters that sample with the request's filters and pass the result to
    :func:`verify` as ``draft_probs``. Computed with PyTorch on either backend
    (``specsample.processing``, the same float32 processing as the general path; counted as
    the path ``"torch.probs"``).

    Args:
        logits: [N, V] float32 / float16 / bfloat16 raw logits.
        batch: the requests' SamplingBatch (N requests, vocab_size V, same device).
        strict: raise SamplingError for invalid data; with False, the rows of invalid
            requests are all zeros (never NaN).

    Returns:
        [N, V] float32: sampled requests (T > 0) softmax of the processed logits z' (bans,
        logit_bias, penalties, temperature, min_p, top_k, top_p), rows summing to 1 up to
        float32 rounding; greedy requests (T = 0) one-hot at the argmax of z' (lowest id on
        ties); invalid requests zeros.

    Raises:
        ValueError: as :func:`sample` (shapes, dtypes, devices), or a call inside CUDA-graph
            capture (probs() reads error flags on the host whatever ``strict``).
        SamplingError: with strict=True, NaN / +inf logits, a row with no finite logit,
            logit_bias / penalties that overflow a finite logit, or bans that leave no token.
    """
    if not isinstance(strict, bool):
        raise ValueError(f"probs(): strict must be True or False, got {strict!r}")
    if _capturing():
        raise ValueError("probs() reads error flags on the host and cannot run inside "
                         "CUDA-graph capture; call it outside the graph")
    _check_batch(batch)
    n = batch.num_requests
    _check_logits_rows(logits, n)
    positions = torch.zeros(n, dtype=torch.int64, device=logits.device)  # no noise is drawn
    plan = build_plan(logits, batch, draft_token_ids=None, num_draft_tokens=[0] * n,
                      draft_logits=None, draft_probs=None, positions=positions, method="token",
                      logits_name="logits")
    paths.record("torch.probs", n)
    p, err = torch_backend.processed_distribution(plan)
    if strict:
        _raise_if_invalid(err)
    return p
