"""Float64 reference implementation: the executable specification every backend is tested against.

Everything here is written for clarity, one request and one row at a time, in float64 numpy,
and independently of ``torch_backend`` / ``processing`` (it shares only the scalar RNG of
``specsample.rng``, the parameter types and the output dataclasses). It computes the function
of docs/semantics.md with the same random keys, so on the same inputs it emits the same tokens
as every backend, except where two candidates are within float32 rounding of each other. To let
tests tell such a near-tie from a bug, every discrete decision can be recorded in a
:class:`RequestTrace` (``return_traces=True``): a request is *fragile* when some decision it
actually took (an argmax, a filter boundary, an acceptance test, a residual draw) lies within the
float32 error bound of this module's error model (see ``REL_TOL``) of going the other way.

Algorithms and where they come from:

* Gumbel-max (Gumbel 1954; e.g. Maddison et al. 2014): ``argmax_x z'_x + G_x`` with
  ``G = -log(-log U)`` i.i.d. is an exact draw from ``softmax(z')``. Rows are drawn in three
  levels (docs/semantics.md): a tile of ``rng.TILE`` tokens by Gumbel-max over the tiles'
  log-masses, a sub-tile of ``rng.SUBTILE`` tokens of it the same way, then a token inside it
  by Gumbel-max; P(tile) P(sub-tile | tile) P(token | sub-tile) = p(token).
* Token-level speculative sampling (Leviathan et al. 2023, arXiv 2211.17192, Alg. 1; Chen et
  al. 2023, arXiv 2302.01318, Alg. 2): accept draft ``x_j ~ q_j`` with probability
  ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection emit from
  ``r_j = max(p_j - q_j, 0) / sum max(p_j - q_j, 0)``; after k accepts emit the bonus from
  ``p_{k}`` (Leviathan et al., Alg. 1 lines 6-9; Chen et al., Alg. 2).
* One-hot drafts (q_j a point mass): the same rule reads "accept with probability p_j(x_j),
  else emit from p_j without x_j", which is exactly "draw y_j ~ p_j, accept while y_j == x_j,
  emit the first mismatching y_j" (sample-and-match).
* Block verification (Sun et al. 2024, arXiv 2403.10444, Alg. 2): ``rho_0 = 1``,
  ``rho_j = min(1, rho_{j-1} p_{j-1}(x_{j-1}) / q_{j-1}(x_{j-1}))``,
  ``h_j = Z_j / (Z_j + 1 - rho_j)`` with ``Z_j = sum_x max(rho_j p_j(x) - q_j(x), 0)`` for
  ``j < k``, ``h_k = rho_k``; with ``eta_j ~ U(0, 1)`` accept ``tau = max{j : eta_j <= h_j}``
  (0 if none) and emit from ``max(rho_tau p_tau - q_tau, 0)`` normalised, or the bonus from
  ``p_k`` when ``tau = k``.

Besides ``sample`` / ``verify`` (same signatures and outputs as the public API, minus
dispatch), the module gives the exact laws used by the statistical tests:
:func:`exact_step_law` (the distribution of what one verification step emits, by enumerating
every draft sequence and integrating the verification randomness analytically),
:func:`exact_multistep_law` (its composition over steps) and :func:`exact_target_law` (the
autoregressive law under the target alone). Guarantee 1 of API.md is the identity
``exact_multistep_law(...) == exact_target_law(...)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import SamplingError
from .outputs import SampleOutput, VerifyOutput
from .params import SamplingBatch, SamplingParams
from .plan import fresh_positions
from .rng import (
    STREAM_ACCEPT,
    STREAM_BLOCK_ACCEPT,
    STREAM_RESIDUAL,
    STREAM_RESIDUAL_TILE,
    STREAM_SAMPLE,
    STREAM_SAMPLE_TILE,
    SUBTILE,
    TILE,
    gumbel_scalar,
    sub_stream,
    uniform_scalar,
)

__all__ = [
    "REL_TOL",
    "banned_tokens",
    "ProcessedRow",
    "RequestTrace",
    "exact_multistep_law",
    "exact_step_law",
    "exact_target_law",
    "exact_tree_step_law",
    "process_row",
    "processed_probs",
    "sample",
    "verify",
    "verify_tree",
]

#: Error model for float32 backends: a processed logit ``z'_x`` of a row may differ from its
#: float64 value by ``ProcessedRow.err + REL_TOL * |z'_x|``, where ``err = REL_TOL * (1 + s / T)``
#: and ``s`` is the largest magnitude among the entries that bias or penalties changed (the
#: only inexact steps before the max subtraction; raw float16/bfloat16/float32 logits are exact
#: in both precisions); T = 1 for greedy rows. REL_TOL is about 60 float32 ulps, some 10x the
#: roundings that produce z'. Probabilities, Gumbel keys, sums and ratios get bounds derived from
#: it (``_value_bounds``).
REL_TOL = 4e-6
#: float32 absolute resolution near 0 (the smallest denormal) and its smallest normal number.
_F32_DENORM = 1.5e-45
_F32_TINY = 1.2e-38

METHODS = ("token", "block")
DRAFT_KINDS = ("onehot", "logits", "probs")


# --------------------------------------------------------------------------------------------
# Traces (near-tie bookkeeping for tests)
# --------------------------------------------------------------------------------------------


@dataclass
class RequestTrace:
    """How close a request's decisions came to flipping under float32 rounding.

    ``fragile`` is True when at least one decision the reference took for this request was
    within the error bound of going the other way; ``reasons`` says which (for test messages).
    """

    fragile: bool = False
    reasons: list[str] = field(default_factory=list)

    def flag(self, reason: str) -> None:
        self.fragile = True
        self.reasons.append(reason)


def _value_bounds(v: float, rel: float) -> tuple[float, float]:
    """Interval holding the float32 evaluation of a probability-like value ``v >= 0``."""
    if v <= 0.0:
        return 0.0, 0.0
    lo = max(v * math.exp(-rel) - _F32_DENORM, 0.0)
    if lo < _F32_TINY:  # denormal range: relative precision is lost; may flush to 0
        lo = 0.0
    return lo, v * math.exp(rel) + _F32_DENORM


# --------------------------------------------------------------------------------------------
# Processing one row (docs/semantics.md, "Processing a row")
# --------------------------------------------------------------------------------------------


@dataclass
class ProcessedRow:
    """The processed logits ``z'`` of one row (float64) and what the tests need about them.

    ``z``: processed logits (-inf where a filter dropped the token); ``lse``: logsumexp of z;
    ``err``: the row part of the float32 error bound of a finite ``z'_x`` (``REL_TOL``).
    """

    z: np.ndarray
    lse: float
    err: float

    def z_err(self, x: int) -> float:
        """Bound on the float32 error of ``z'_x`` (finite entries)."""
        return self.err + REL_TOL * abs(float(self.z[x]))

    def logp_err(self, x: int) -> float:
        """Bound on the float32 error of ``log p_x = z'_x - lse`` (finite entries)."""
        if not math.isfinite(self.z[x]):
            return 0.0
        return 2 * self.err + REL_TOL * (2 + abs(float(self.z[x])) + abs(self.lse))

    @property
    def logp(self) -> np.ndarray:
        """log of the processed distribution ``z' - lse``."""
        return self.z - self.lse

    @property
    def probs(self) -> np.ndarray:
        """The processed distribution ``p = exp(z' - lse)`` (float64)."""
        return np.exp(self.z - self.lse)


def _as_f64(row) -> np.ndarray:
    if isinstance(row, torch.Tensor):
        return row.detach().to("cpu", torch.float64).numpy()
    return np.asarray(row, dtype=np.float64)


def _argsort_desc(z: np.ndarray) -> np.ndarray:
    """Indices by decreasing value, lower id first among equal values (stable)."""
    return np.argsort(-z, kind="stable")


def _logsumexp(z: np.ndarray) -> float:
    m = np.max(z)
    if not math.isfinite(m):
        return m
    return float(m + math.log(np.sum(np.exp(z - m))))


def banned_tokens(params: SamplingParams, vocab: int, *, context_token_ids: Sequence[int] = (),
                  num_output_tokens: int = 0, eos_token_ids: Sequence[int] = ()) -> np.ndarray:
    """[V] bool: the tokens a row bans (docs/semantics.md, "Bans").

    ``context_token_ids``: the tokens before the row (prompt + outputs + drafts before it; only
    its end matters, for bad words); ``num_output_tokens``: outputs + drafts before the row
    (min_tokens); ``eos_token_ids``: the batch's ids that join the request's stop tokens.
    """
    banned = np.zeros(vocab, dtype=bool)
    if params.allowed_token_ids is not None:
        banned[:] = True
        banned[list(params.allowed_token_ids)] = False
    context = tuple(context_token_ids)
    for word in params.bad_words_token_ids or ():
        prefix = tuple(word[:-1])
        if not prefix or context[len(context) - len(prefix):] == prefix:
            banned[word[-1]] = True
    if num_output_tokens < params.min_tokens:
        banned[list(params.stop_token_ids or ()) + list(eos_token_ids)] = True
    return banned


def process_row(raw, params: SamplingParams, *, prompt_token_ids: Sequence[int] = (),
                output_token_ids: Sequence[int] = (), trace: RequestTrace | None = None,
                context_token_ids: Sequence[int] = (), num_output_tokens: int = 0,
                eos_token_ids: Sequence[int] = ()) -> ProcessedRow:
    """The processed logits of one raw row (docs/semantics.md steps 0-5), in float64.

    ``output_token_ids``: every token counted by the penalties of this row: the request's
    output tokens followed by its drafts before this row. ``prompt_token_ids``: the prompt
    (repetition penalty only). ``context_token_ids``, ``num_output_tokens``,
    ``eos_token_ids``: what the bans need (:func:`banned_tokens`). The row must be valid
    (some finite logit, no NaN / +inf); if the bans leave no finite logit the result is all
    -inf with ``lse = -inf`` (the request is invalid).
    """
    x = _as_f64(raw)
    v = x.shape[0]
    z = x.copy()
    # 0. bans: -inf before anything else.
    z[banned_tokens(params, v, context_token_ids=context_token_ids,
                    num_output_tokens=num_output_tokens, eos_token_ids=eos_token_ids)] = -math.inf
    if not np.any(np.isfinite(z)):
        return ProcessedRow(z=np.full(v, -math.inf), lse=-math.inf, err=0.0)
    # 1. logit_bias: a sparse add on the raw logits.
    for tok, bias in (params.logit_bias or {}).items():
        z[tok] += bias
    # 2. penalties (repetition CTRL, then frequency, then presence; OpenAI semantics).
    counts = np.zeros(v)
    for t in output_token_ids:
        counts[t] += 1
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[list(prompt_token_ids)] = True
        r = params.repetition_penalty
        z = np.where(seen, np.where(z > 0, z / r, z * r), z)
    if params.frequency_penalty != 0.0:
        z = z - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        z = z - params.presence_penalty * (counts > 0)
    finite = np.isfinite(z)
    changed = finite & (z != x)
    scale = float(np.max(np.abs(np.concatenate([z[changed], x[changed]])))) if np.any(
        changed) else 0.0
    t = params.temperature
    t_eff = t if t > 0 else 1.0
    err = REL_TOL * (1.0 + scale / t_eff)
    # 3. temperature after subtracting the maximum (the maximum maps to exactly 0).
    zp = (z - np.max(z[finite])) / t_eff
    if t > 0:
        # 4a. min_p: drop z' < log(min_p) (p < min_p * max p).
        if params.min_p > 0:
            thr = math.log(params.min_p)
            fin = np.isfinite(zp)
            if trace is not None and np.any(
                    np.abs(zp[fin] - thr) <= err + REL_TOL * (1 + np.abs(zp[fin]))):
                trace.flag("min_p boundary")
            zp[zp < thr] = -math.inf
        # 4b. top_k: keep the top_k largest survivors, lower ids first among equal values.
        k = params.top_k
        if 0 < k < v:
            order = _argsort_desc(zp)
            kth, nxt = zp[order[k - 1]], zp[order[k]]
            if trace is not None and math.isfinite(nxt) and (
                    0 < kth - nxt <= 2 * err + REL_TOL * (abs(kth) + abs(nxt))):
                trace.flag("top_k boundary")
            zp[order[k:]] = -math.inf
        # 4c. top_p: keep a survivor iff the renormalised mass ranked before it is < top_p.
        if params.top_p < 1.0:
            order = [i for i in _argsort_desc(zp) if zp[i] > -math.inf]
            vals = zp[order]
            probs = np.exp(vals - _logsumexp(vals))
            # relative error of a survivor's probability (z' and the normaliser)
            rel = math.expm1(min(1.0, 2 * err + 2 * REL_TOL * (1 + abs(vals[-1])))) if len(
                vals) else 0.0
            before = 0.0
            for rank, (i, pi) in enumerate(zip(order, probs)):
                if trace is not None and rank > 0:
                    tol = rel * before + 1e-7 * (1 + rank)
                    prev = vals[rank - 1]
                    near_rank = 0 < prev - vals[rank] <= 2 * err + REL_TOL * (
                        abs(prev) + abs(vals[rank]))
                    if abs(before - params.top_p) <= tol or (
                            near_rank and (before < params.top_p) != (before - probs[rank - 1]
                                                                       < params.top_p)):
                        trace.flag("top_p boundary")
                if not before < params.top_p:
                    zp[i] = -math.inf
                before += pi
    # 5. normaliser.
    return ProcessedRow(z=zp, lse=_logsumexp(zp), err=err)


def processed_probs(raw, params: SamplingParams, *, prompt_token_ids: Sequence[int] = (),
                    output_token_ids: Sequence[int] = (), context_token_ids: Sequence[int] = (),
                    num_output_tokens: int = 0, eos_token_ids: Sequence[int] = ()
                    ) -> np.ndarray:
    """The processed target distribution of one row, float64 numpy ``[V]``.

    For greedy params (temperature 0) this is softmax of the biased, penalised logits at
    temperature 1 (what "processed" logprobs report); the greedy *law* is the point mass at
    its argmax (see :func:`exact_target_law`). Arguments as in :func:`process_row`.
    """
    return process_row(raw, params, prompt_token_ids=prompt_token_ids,
                       output_token_ids=output_token_ids, context_token_ids=context_token_ids,
                       num_output_tokens=num_output_tokens, eos_token_ids=eos_token_ids).probs


# --------------------------------------------------------------------------------------------
# Drawing from one row
# --------------------------------------------------------------------------------------------


def _greedy(row: ProcessedRow, trace: RequestTrace | None) -> int:
    """argmax z' (lowest id on exact ties)."""
    best = int(np.argmax(row.z))
    if trace is not None:
        others = row.z[row.z < row.z[best]]
        if others.size:
            second = float(np.max(others))
            if row.z[best] - second <= 2 * row.err + REL_TOL * (abs(row.z[best]) + abs(second)):
                trace.flag("greedy near-tie")
    return best


def _gumbel_max(z: np.ndarray, err: float, seed: int, pos: int, stream: int,
                trace: RequestTrace | None, what: str, offset: int = 0) -> int:
    """``argmax_x z_x + G(seed, pos, offset + x, stream)`` over the finite z (Gumbel-max)."""
    keys = np.full(z.shape, -math.inf)
    noise = np.zeros(z.shape)
    for x in np.flatnonzero(np.isfinite(z)):
        noise[x] = gumbel_scalar(seed, pos, offset + int(x), stream)
        keys[x] = z[x] + noise[x]
    best = int(np.argmax(keys))
    if trace is not None:
        for x in np.flatnonzero(np.isfinite(keys)):
            if x == best:
                continue
            tol = 2 * err + REL_TOL * (1 + abs(z[best]) + abs(z[x]) + abs(noise[best])
                                       + abs(noise[x]))
            if keys[best] - keys[x] <= tol:
                trace.flag(f"{what} near-tie")
                break
    return best


def _block_draw(z: np.ndarray, err: float, seed: int, pos: int, lo: int, hi: int, size: int,
                stream: int, trace: RequestTrace | None, what: str,
                w_bounds: tuple[np.ndarray, np.ndarray] | None) -> tuple[int, int]:
    """One level of the draw: the block of ``size`` ids of ``[lo, hi)`` (``lo`` a multiple of
    ``size``) drawn with keys ``logsumexp_{x in block} z_x + G(seed, pos, block, stream)``,
    ``block`` its global index ``start // size``; lowest index on exact ties. Returns the
    block's ``(start, end)``. ``w_bounds``: optional bounds of the float32 weights ``exp z``
    (residual draws) for the near-tie check, else the log-masses are taken to be within
    ``2 err`` (+ relative rounding)."""
    nb = -(-(hi - lo) // size)
    if nb == 1:
        return lo, hi
    starts = [lo + b * size for b in range(nb)]
    log_mass = np.array([_logsumexp(z[s0:min(s0 + size, hi)]) for s0 in starts])
    base = lo // size
    best = _gumbel_max(log_mass, 2 * err, seed, pos, stream, None, what, offset=base)
    if trace is not None:
        def bounds(b: int) -> tuple[float, float]:
            s0, s1 = starts[b], min(starts[b] + size, hi)
            return (float(w_bounds[0][s0:s1].sum()) * (1 - 1e-6),
                    float(w_bounds[1][s0:s1].sum()) * (1 + 1e-6))

        key_best = log_mass[best] + gumbel_scalar(seed, pos, base + best, stream)
        for b in range(nb):
            if b == best or not math.isfinite(log_mass[b]):
                continue
            key_b = log_mass[b] + gumbel_scalar(seed, pos, base + b, stream)
            if w_bounds is not None:
                lo_best, hi_b = bounds(best)[0], bounds(b)[1]
                gap = ((math.log(lo_best) if lo_best > 0 else -math.inf) - math.log(hi_b)
                       + key_best - log_mass[best] - (key_b - log_mass[b]))
                near = gap <= REL_TOL
            else:
                near = key_best - key_b <= 4 * err + REL_TOL * (
                    2 + abs(log_mass[best]) + abs(log_mass[b]))
            if near:
                trace.flag(f"{what} {'tile' if size == TILE else 'sub-tile'} near-tie")
                break
    return starts[best], min(starts[best] + size, hi)


def _three_level(z: np.ndarray, err: float, seed: int, pos: int, tile_stream: int,
                 token_stream: int, trace: RequestTrace | None, what: str,
                 w_bounds: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """Three-level Gumbel-max draw from softmax(z) (docs/semantics.md, "Sampling one row").

    Tile t (ids ``TILE t .. TILE t + TILE - 1``) is drawn with keys
    ``logsumexp_{x in t} z_x + G(seed, pos, t, tile_stream)``, then a sub-tile s of it (ids
    ``SUBTILE s ..``) with keys ``logsumexp_{x in s} z_x + G(seed, pos, s, sub_stream)``, then a
    token of it with keys ``z_x + G(seed, pos, x, token_stream)``; lowest index on exact ties
    at every level. ``w_bounds``: see :func:`_block_draw`.
    """
    lo, hi = _block_draw(z, err, seed, pos, 0, z.shape[0], TILE, tile_stream, trace, what,
                         w_bounds)
    lo, hi = _block_draw(z, err, seed, pos, lo, hi, SUBTILE, sub_stream(tile_stream), trace,
                         what, w_bounds)
    return lo + _gumbel_max(z[lo:hi], err, seed, pos, token_stream, trace, what, offset=lo)


def _target_sample(row: ProcessedRow, greedy: bool, seed: int, pos: int,
                   trace: RequestTrace | None) -> int:
    """The row's target token y: argmax (greedy) or a three-level draw (STREAM_SAMPLE*)."""
    if greedy:
        return _greedy(row, trace)
    return _three_level(row.z, row.err, seed, pos, STREAM_SAMPLE_TILE, STREAM_SAMPLE, trace,
                      "sample")


def _residual_draw(p_row: ProcessedRow, q: np.ndarray, q_err: float, rho: float,
                   rho_bounds: tuple[float, float], seed: int, pos: int,
                   trace: RequestTrace | None) -> int | None:
    """Gumbel-max draw from ``max(rho p - q, 0)`` with STREAM_RESIDUAL; None if all zero.

    The residual of Leviathan et al. (Alg. 1, line 8) for rho = 1; Sun et al.'s block residual
    ``p_res^tau`` (Alg. 2) otherwise.
    """
    p = p_row.probs
    w = np.maximum(rho * p - q, 0.0)
    if trace is not None:  # intervals of the float32 weights
        w_lo = np.zeros_like(w)
        w_hi = np.zeros_like(w)
        for x in range(w.shape[0]):
            plo, phi = _value_bounds(p[x], p_row.logp_err(x))
            qlo, qhi = _value_bounds(q[x], q_err)
            w_lo[x] = max(rho_bounds[0] * plo - qhi - 1e-7 * (p[x] + q[x]), 0.0)
            w_hi[x] = max(rho_bounds[1] * phi - qlo + 1e-7 * (p[x] + q[x]), 0.0)
    if not np.any(w > 0):
        if trace is not None and np.any(w_hi > 0):
            trace.flag("residual degenerate (near-zero)")
        return None
    with np.errstate(divide="ignore"):
        logw = np.log(w)
    best = _three_level(logw, 0.0, seed, pos, STREAM_RESIDUAL_TILE, STREAM_RESIDUAL, trace,
                        "residual", None if trace is None else (w_lo, w_hi))
    if trace is not None:
        if not np.any(w_lo > 0):
            trace.flag("residual possibly degenerate")
        g_best = gumbel_scalar(seed, pos, best, STREAM_RESIDUAL)
        lo_best = (math.log(w_lo[best]) if w_lo[best] > 0 else -math.inf) + g_best
        sub = best // SUBTILE
        for x in np.flatnonzero(w_hi[sub * SUBTILE:(sub + 1) * SUBTILE] > 0) + sub * SUBTILE:
            if x == best:
                continue
            hi_x = math.log(w_hi[x]) + gumbel_scalar(seed, pos, int(x), STREAM_RESIDUAL)
            if lo_best - hi_x <= REL_TOL * (1 + abs(lo_best)):
                trace.flag("residual near-tie")
                break
    return best


# --------------------------------------------------------------------------------------------
# Draft distributions
# --------------------------------------------------------------------------------------------


def _draft_q(row, kind: str, params: SamplingParams, vocab: int) -> tuple[np.ndarray, float]:
    """The drafter's distribution q over the target vocabulary (0 beyond V') and its error.

    ``kind="logits"``: softmax(l / T) after subtracting the maximum (T = 1 for greedy
    requests); ``kind="probs"``: the row as given (not renormalised).
    """
    x = _as_f64(row)
    if kind == "logits":
        t_eff = params.temperature if params.temperature > 0 else 1.0
        fin = np.isfinite(x)
        z = (x - np.max(x[fin])) / t_eff
        q = np.exp(z - _logsumexp(z))
        err = 2 * REL_TOL * (1 + float(np.max(np.abs(x[fin]))) / t_eff)
    else:
        q = x.copy()
        err = REL_TOL
    out = np.zeros(vocab)
    out[: q.shape[0]] = q
    return out, err


# --------------------------------------------------------------------------------------------
# Verification of one request (docs/semantics.md, "Verification of request i")
# --------------------------------------------------------------------------------------------


def _rho_next(rho: float, p: float, q: float) -> float:
    """``min(1, rho * p / q)`` with q = 0 -> ratio +inf if p > 0 else 0, and rho = 0 -> 0."""
    if q > 0:
        ratio = p / q
    else:
        ratio = math.inf if p > 0 else 0.0
    if rho <= 0:
        return 0.0
    return min(1.0, rho * ratio)


def _h(z_mass: float, rho: float) -> float:
    """Sun et al.'s ``h_j = Z_j / (Z_j + 1 - rho_j)``, 0 when ``Z_j = 0``."""
    if z_mass <= 0:
        return 0.0
    return z_mass / (z_mass + (1.0 - rho))


def _verify_one(rows: list[ProcessedRow], drafts: list[int], qs: list[tuple[np.ndarray, float]]
                | None, greedy: bool, seed: int, pos: int, method: str,
                trace: RequestTrace | None) -> tuple[list[int], int]:
    """Emitted tokens (accepted drafts + one) and the number of accepted drafts of a request.

    ``rows``: the k + 1 processed target rows; ``drafts``: the k live drafts; ``qs``: the k
    draft distributions (None for one-hot drafts).
    """
    k = len(drafts)

    def y(j: int) -> int:
        return _target_sample(rows[j], greedy, seed, pos + j, trace)

    if greedy or qs is None:
        # Greedy: accept while d_j == argmax. One-hot, sampled: sample-and-match, the same
        # noise as sample() at position pos + j (the point-mass case of Leviathan et al.).
        a = 0
        while a < k:
            yj = y(a)
            if drafts[a] != yj:
                return drafts[:a] + [yj], a
            a += 1
        return drafts + [y(k)], k

    def p_and_bounds(j: int, x: int) -> tuple[float, tuple[float, float]]:
        p = float(math.exp(rows[j].z[x] - rows[j].lse))
        return p, _value_bounds(p, rows[j].logp_err(x))

    if method == "token":
        # Leviathan et al. Alg. 1: accept x_j iff u_j * q_j(x_j) < p_j(x_j).
        a = 0
        while a < k:
            d = drafts[a]
            u = uniform_scalar(seed, pos + a, 0, STREAM_ACCEPT)
            p, (plo, phi) = p_and_bounds(a, d)
            q, qerr = qs[a][0][d], qs[a][1]
            if trace is not None and p > 0:
                qlo, qhi = _value_bounds(u * q, qerr)
                if plo <= qhi and qlo <= phi:
                    trace.flag("token acceptance near-tie")
            if not u * q < p:
                break
            a += 1
        rho, rho_bounds = 1.0, (1.0, 1.0)
    else:
        # Sun et al. Alg. 2: rho_j, h_j, eta_j; tau = max{j : eta_j <= h_j}.
        rho_list = [1.0]
        bounds = [(1.0, 1.0)]
        for j in range(1, k + 1):
            d = drafts[j - 1]
            p, (plo, phi) = p_and_bounds(j - 1, d)
            q, qerr = qs[j - 1][0][d], qs[j - 1][1]
            qlo, qhi = _value_bounds(q, qerr)
            rho_list.append(_rho_next(rho_list[-1], p, q))
            lo, hi = bounds[-1]
            bounds.append((_rho_next(lo, plo, qhi) * (1 - 1e-6),
                           min(1.0, _rho_next(hi, phi, qlo) * (1 + 1e-6))))
        tau = 0
        for j in range(1, k + 1):
            if j < k:
                p_row = rows[j].probs
                q_row, qerr = qs[j]
                # min(): h_j <= rho_j in real numbers; the same rounding in every backend
                h = min(_h(float(np.sum(np.maximum(rho_list[j] * p_row - q_row, 0.0))),
                           rho_list[j]), rho_list[j])
            else:
                h = rho_list[k]
            u = uniform_scalar(seed, pos + j - 1, j, STREAM_BLOCK_ACCEPT)
            if trace is not None:
                if j < k:
                    z_lo = z_hi = 0.0
                    for x in range(p_row.shape[0]):
                        plo, phi = _value_bounds(p_row[x], rows[j].logp_err(x))
                        qlo, qhi = _value_bounds(q_row[x], qerr)
                        z_lo += max(bounds[j][0] * plo - qhi, 0.0)
                        z_hi += max(bounds[j][1] * phi - qlo, 0.0)
                    slack = 1e-6 + 1e-8 * p_row.shape[0]
                    h_lo = _h(z_lo - slack, bounds[j][0])
                    h_hi = _h(z_hi + slack, bounds[j][1])
                else:
                    h_lo, h_hi = bounds[k]
                if h_lo - 1e-6 <= u <= h_hi + 1e-6:
                    trace.flag(f"block h_{j} near-tie")
            if u <= h:
                tau = j
        a = tau
        rho, rho_bounds = rho_list[tau], bounds[tau]
    if a == k:
        return drafts + [y(k)], k
    q_row, qerr = qs[a]
    res = _residual_draw(rows[a], q_row, qerr, rho, rho_bounds, seed, pos + a, trace)
    if res is None:  # degenerate residual (p and q agree to rounding): the row's sample
        res = y(a)
    return drafts[:a] + [res], a


# --------------------------------------------------------------------------------------------
# Batched entry points (same contract as specsample.sample / specsample.verify)
# --------------------------------------------------------------------------------------------


def _request_context(batch: SamplingBatch, positions, n: int) -> tuple[list, ...]:
    """Per request, on the host: (positions, 64-bit seeds, prompt tokens, output tokens,
    context tail, output count). ``positions=None`` takes the batch's fresh positions, as the
    public functions do (advancing its counter)."""
    if positions is None:
        positions = fresh_positions(batch)
    pos_all = [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor)
                                else positions)]
    seeds = [lo | (hi << 32) for lo, hi in zip(batch.seed_lo.tolist(), batch.seed_hi.tolist())]
    prompts = _per_request_tokens(batch.prompt_req, batch.prompt_ids, n)
    outputs = _per_request_tokens(batch.output_req, batch.output_ids, n)
    tails = [[t for t in row if t >= 0] for row in batch.context_tail.tolist()]
    return pos_all, seeds, prompts, outputs, tails, batch.num_output.tolist()


def _per_request_tokens(req: torch.Tensor, ids: torch.Tensor, n: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(n)]
    for r, t in zip(req.tolist(), ids.tolist()):
        out[r].append(t)
    return out


def _row_invalid(x: np.ndarray) -> bool:
    """A NaN or +inf logit, or no finite logit."""
    return bool(np.any(np.isnan(x)) or np.any(np.isposinf(x)) or not np.any(np.isfinite(x)))


def _draft_row_invalid(x: np.ndarray, kind: str) -> bool:
    if kind == "logits":
        return _row_invalid(x)
    return bool(not np.all(np.isfinite(x)) or np.any(x < 0) or not np.sum(x) > 0)


def _logprob_entries(raw: np.ndarray, row: ProcessedRow, mode: str, token: int, n: int
                     ) -> tuple[list[float], list[int]]:
    """Column 0: the emitted token's logprob; columns 1..n: the top-n (lower id first on ties)."""
    if mode == "processed":
        lp = row.logp
    else:
        lp = raw - _logsumexp(raw)
    order = _argsort_desc(lp)[:n]
    return [float(lp[token])] + [float(lp[i]) for i in order], [token] + [int(i) for i in order]


def verify(target_logits: torch.Tensor, draft_token_ids, num_draft_tokens,
           batch: SamplingBatch, draft_logits: torch.Tensor | None = None,
           draft_probs: torch.Tensor | None = None, positions=None, method: str = "token",
           *, strict: bool = False, return_traces: bool = False):
    """Reference ``specsample.verify`` (docs/semantics.md), one request at a time in float64.

    Same arguments and output as the public function, except: ``strict`` defaults to False
    (invalid requests are marked, as the backends do with ``strict=False``); logprobs are
    float64; with ``return_traces=True`` returns ``(VerifyOutput, [RequestTrace] * N)``.
    ``positions=None`` (only allowed without user seeds) takes the positions the public
    functions take, :func:`specsample.plan.fresh_positions`, and advances
    ``batch.fresh_counter`` likewise.
    """
    if method not in METHODS:
        raise ValueError(f"method must be 'token' or 'block', got {method!r}")
    if draft_logits is not None and draft_probs is not None:
        raise ValueError("give draft_logits or draft_probs, not both")
    n = batch.num_requests
    ks = [int(k) for k in (num_draft_tokens.tolist() if isinstance(num_draft_tokens,
                                                                   torch.Tensor)
                           else num_draft_tokens)]
    if len(ks) != n or any(k < 0 for k in ks):
        raise ValueError("num_draft_tokens must hold N entries >= 0")
    x_all = _as_f64(target_logits)
    v = x_all.shape[1]
    if x_all.shape[0] != n + sum(ks) or v != batch.vocab_size:
        raise ValueError(f"target_logits has shape {tuple(x_all.shape)}")
    drafts_all = [int(d) for d in (draft_token_ids.tolist() if isinstance(
        draft_token_ids, torch.Tensor) else (draft_token_ids or []))]
    if len(drafts_all) != sum(ks):
        raise ValueError("draft_token_ids must hold sum(num_draft_tokens) entries")
    kind, dist = "onehot", None
    if draft_logits is not None:
        kind, dist = "logits", _as_f64(draft_logits)
    elif draft_probs is not None:
        kind, dist = "probs", _as_f64(draft_probs)
    if dist is not None and (dist.shape[0] != sum(ks) or not 1 <= dist.shape[1] <= v):
        raise ValueError(f"draft distribution has shape {tuple(dist.shape)}")
    pos_all, seeds, prompts, outputs, tails, num_outputs = _request_context(batch, positions, n)

    kmax = max(ks) if ks else 0
    nlp = batch.max_logprobs
    token_ids = torch.full((n, kmax + 1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(n, dtype=torch.int64)
    invalid = torch.zeros(n, dtype=torch.bool)
    lp_vals = lp_ids = None
    if nlp >= 0:
        lp_vals = torch.full((n, kmax + 1, nlp + 1), -math.inf, dtype=torch.float64)
        lp_ids = torch.full((n, kmax + 1, nlp + 1), -1, dtype=torch.int64)
    traces = [RequestTrace() for _ in range(n)]
    row0 = d0 = 0
    for i, (params, k) in enumerate(zip(batch.params, ks)):
        trace = traces[i] if return_traces else None
        drafts = drafts_all[d0:d0 + k]
        k_eff = drafts.index(-1) if -1 in drafts else k  # placeholders
        raws = [x_all[row0 + j] for j in range(k_eff + 1)]
        live = drafts[:k_eff]
        bad = any(_row_invalid(r) for r in raws) or any(not 0 <= d < v for d in live)
        if dist is not None:
            bad = bad or any(_draft_row_invalid(dist[d0 + j], kind) for j in range(k_eff))
        row0 += k + 1
        d0_i, d0 = d0, d0 + k
        if bad:
            invalid[i] = True
            continue
        rows = [process_row(raws[j], params, prompt_token_ids=prompts[i],
                            output_token_ids=outputs[i] + live[:j], trace=trace,
                            context_token_ids=tails[i] + live[:j],
                            num_output_tokens=num_outputs[i] + j,
                            eos_token_ids=batch.eos_token_ids)
                for j in range(k_eff + 1)]
        if any(not math.isfinite(r.lse) for r in rows):  # bans leave no token
            invalid[i] = True
            continue
        qs = None
        if dist is not None:
            qs = [_draft_q(dist[d0_i + j], kind, params, v) for j in range(k_eff)]
        emitted, a = _verify_one(rows, live, qs, params.greedy, seeds[i], pos_all[i], method,
                                 trace)
        token_ids[i, : a + 1] = torch.tensor(emitted)
        num_accepted[i] = a
        if nlp >= 0:
            want = params.logprobs if params.logprobs is not None else 0
            for j, tok in enumerate(emitted):
                vals, ids = _logprob_entries(raws[j], rows[j], params.logprobs_mode, tok,
                                             min(want, nlp))
                lp_vals[i, j, : len(vals)] = torch.tensor(vals, dtype=torch.float64)
                lp_ids[i, j, : len(ids)] = torch.tensor(ids)
    if strict and bool(invalid.any()):
        raise SamplingError(invalid.nonzero().squeeze(1).tolist(), "invalid input data")
    out = VerifyOutput(token_ids=token_ids, num_accepted=num_accepted, logprobs=lp_vals,
                       logprob_token_ids=lp_ids, invalid=invalid)
    return (out, traces) if return_traces else out


def sample(logits: torch.Tensor, batch: SamplingBatch, positions=None, *, strict: bool = False,
           return_traces: bool = False):
    """Reference ``specsample.sample``: :func:`verify` with no drafts (one row per request)."""
    res = verify(logits, [], [0] * batch.num_requests, batch, positions=positions,
                 strict=strict, return_traces=return_traces)
    out, traces = res if return_traces else (res, None)
    s = SampleOutput(
        token_ids=out.token_ids[:, 0],
        logprobs=None if out.logprobs is None else out.logprobs[:, 0],
        logprob_token_ids=None if out.logprob_token_ids is None else out.logprob_token_ids[:, 0],
        invalid=out.invalid)
    return (s, traces) if return_traces else s


# --------------------------------------------------------------------------------------------
# Exact laws (for the exactness tests)
# --------------------------------------------------------------------------------------------

TargetFn = Callable[[tuple], Sequence[float]]
DraftFn = Callable[[tuple], object]


def _target_law_row(target_fn: TargetFn, ctx: tuple, params: SamplingParams,
                    prompt: Sequence[int], cache: dict, eos: Sequence[int] = ()
                    ) -> tuple[ProcessedRow, np.ndarray]:
    """Processed row at output context ``ctx`` and the law of the emitted token there (bans
    see the context ``prompt + ctx`` and ``len(ctx)`` output tokens)."""
    if ctx not in cache:
        row = process_row(target_fn(ctx), params, prompt_token_ids=prompt, output_token_ids=ctx,
                          context_token_ids=tuple(prompt) + ctx, num_output_tokens=len(ctx),
                          eos_token_ids=eos)
        if params.greedy:
            law = np.zeros(row.z.shape[0])
            law[int(np.argmax(row.z))] = 1.0
        else:
            law = row.probs
        cache[ctx] = (row, law)
    return cache[ctx]


def exact_target_law(target_fn: TargetFn, params: SamplingParams, length: int, *,
                     context: tuple = (), prompt_token_ids: Sequence[int] = (),
                     eos_token_ids: Sequence[int] = ()) -> dict[tuple, float]:
    """Exact law of the next ``length`` tokens sampled token by token from the target.

    ``target_fn(ctx)``: raw target logits ``[V]`` of the next token after the output tokens
    ``ctx`` (a tuple: ``context`` followed by the tokens generated so far). The law of each
    token is the processed distribution (point mass at the argmax for temperature 0), with
    penalties counting ``ctx`` as the output tokens and bans seeing ``prompt_token_ids + ctx``
    (``len(ctx)`` output tokens for min_tokens; ``eos_token_ids`` join the stop tokens).
    Returns {token tuple: probability}.
    """
    cache: dict = {}
    law: dict[tuple, float] = {}

    def rec(ctx: tuple, emitted: tuple, prob: float) -> None:
        if len(emitted) == length:
            law[emitted] = law.get(emitted, 0.0) + prob
            return
        _, pl = _target_law_row(target_fn, ctx, params, prompt_token_ids, cache, eos_token_ids)
        for x in np.flatnonzero(pl > 0):
            rec(ctx + (int(x),), emitted + (int(x),), prob * float(pl[x]))

    rec(tuple(context), (), 1.0)
    return law


def _drafter(draft_fn: DraftFn, ctx: tuple, kind: str, params: SamplingParams, vocab: int
             ) -> tuple[np.ndarray, np.ndarray | None]:
    """(law of the proposed draft token, q used by verification or None for one-hot)."""
    out = draft_fn(ctx)
    if kind == "onehot":
        if isinstance(out, (int, np.integer)):
            law = np.zeros(vocab)
            law[int(out)] = 1.0
        else:
            law = np.zeros(vocab)
            r = _as_f64(out)
            law[: r.shape[0]] = r
        return law, None
    q, _ = _draft_q(out, kind, params, vocab)
    return q, q


def _step_given_drafts(rows: list[np.ndarray], laws: list[np.ndarray], drafts: tuple,
                       qs: list[np.ndarray] | None, params: SamplingParams, method: str
                       ) -> dict[tuple, float]:
    """Exact law of the emitted tokens given the drafts (verification randomness integrated).

    ``rows``: processed target probabilities p_0..p_k; ``laws``: law of the target token at each
    row (point mass for greedy); ``qs``: draft distributions (None: one-hot drafts).
    """
    k = len(drafts)
    out: dict[tuple, float] = {}

    def add(tokens: tuple, prob: float) -> None:
        if prob > 0:
            out[tokens] = out.get(tokens, 0.0) + prob

    def emit_from(prefix: tuple, law: np.ndarray, prob: float) -> None:
        for x in np.flatnonzero(law > 0):
            add(prefix + (int(x),), prob * float(law[x]))

    if params.greedy or qs is None:
        # P(accept d_j) = law_j(d_j); on mismatch emit y_j ~ law_j conditioned on y_j != d_j.
        prob = 1.0
        for j, d in enumerate(drafts):
            miss = laws[j].copy()
            miss[d] = 0.0
            emit_from(drafts[:j], miss, prob)
            prob *= float(laws[j][d])
        emit_from(drafts, laws[k], prob)
        return out

    def residual(j: int, rho: float) -> np.ndarray:
        w = np.maximum(rho * rows[j] - qs[j], 0.0)
        s = w.sum()
        return w / s if s > 0 else rows[j]

    if method == "token":
        prob = 1.0
        for j, d in enumerate(drafts):
            q = qs[j][d]
            acc = 1.0 if q <= 0 and rows[j][d] > 0 else (
                0.0 if q <= 0 else min(1.0, rows[j][d] / q))
            emit_from(drafts[:j], residual(j, 1.0), prob * (1.0 - acc))
            prob *= acc
        emit_from(drafts, laws[k], prob)
        return out

    # Block verification: P(tau = j) = h_j prod_{i > j} (1 - h_i), P(tau = 0) = prod (1 - h_i).
    rho = [1.0]
    for j in range(1, k + 1):
        rho.append(_rho_next(rho[-1], rows[j - 1][drafts[j - 1]], qs[j - 1][drafts[j - 1]]))
    h = [0.0] * (k + 1)
    for j in range(1, k):
        h[j] = _h(float(np.sum(np.maximum(rho[j] * rows[j] - qs[j], 0.0))), rho[j])
    if k:
        h[k] = rho[k]
    for tau in range(k + 1):
        p_tau = h[tau] if tau > 0 else 1.0
        for i in range(tau + 1, k + 1):
            p_tau *= 1.0 - h[i]
        if tau == k:
            emit_from(drafts, laws[k], p_tau)
        else:
            emit_from(drafts[:tau], residual(tau, rho[tau]), p_tau)
    return out


def exact_step_law(target_fn: TargetFn, draft_fn: DraftFn, k: int, params: SamplingParams,
                   method: str = "token", draft_kind: str = "onehot", *, context: tuple = (),
                   prompt_token_ids: Sequence[int] = (), eos_token_ids: Sequence[int] = ()
                   ) -> dict[tuple, float]:
    """Exact law of what one verification step with ``k`` drafts emits.

    ``target_fn(ctx)`` gives the raw target logits of the token after output context ``ctx``
    (``context`` + drafts so far); penalties and bans see ``ctx`` as output tokens (as in
    :func:`exact_target_law`, with ``eos_token_ids``). ``draft_fn(ctx)``
    describes the drafter at that context, by ``draft_kind``:

    * ``"onehot"``: the law of the one-hot drafter's proposal: an int (a deterministic drafter
      such as n-gram lookup or a greedy draft model) or a probability vector ``[V']`` (a random
      one-hot drafter whose distribution is not reported to the verifier). Verification sees
      only the token (sample-and-match).
    * ``"logits"``: the drafter's raw logits ``[V']``; it samples from softmax(l / T) and the
      verifier is given those logits.
    * ``"probs"``: the drafter's distribution ``[V']``, which it samples from and reports.

    Every draft sequence is enumerated with its drafter probability, and the verification
    randomness is integrated analytically: acceptance ``min(1, p/q)`` and the residual
    ``max(p - q, 0)`` (token); ``h_j`` and ``max(rho_tau p - q, 0)`` (block); ``p(d)`` and ``p``
    without ``d`` (one-hot); the argmax (temperature 0). Returns {emitted tokens: probability}.
    """
    if method not in METHODS or draft_kind not in DRAFT_KINDS:
        raise ValueError(f"bad method {method!r} or draft_kind {draft_kind!r}")
    cache: dict = {}
    context = tuple(context)
    law: dict[tuple, float] = {}

    def rec(drafts: tuple, prob: float, qs: list) -> None:
        if len(drafts) == k:
            rows, laws = [], []
            for j in range(k + 1):
                row, pl = _target_law_row(target_fn, context + drafts[:j], params,
                                          prompt_token_ids, cache, eos_token_ids)
                rows.append(row.probs)
                laws.append(pl)
            qs_or_none = None if draft_kind == "onehot" else qs
            for toks, pr in _step_given_drafts(rows, laws, drafts, qs_or_none, params,
                                               method).items():
                law[toks] = law.get(toks, 0.0) + prob * pr
            return
        row, _ = _target_law_row(target_fn, context + drafts, params, prompt_token_ids, cache,
                                 eos_token_ids)
        dlaw, q = _drafter(draft_fn, context + drafts, draft_kind, params, row.z.shape[0])
        for x in np.flatnonzero(dlaw > 0):
            rec(drafts + (int(x),), prob * float(dlaw[x]), qs + [q])

    rec((), 1.0, [])
    return law


def exact_multistep_law(target_fn: TargetFn, draft_fn: DraftFn, k: int, params: SamplingParams,
                        method: str, draft_kind: str, length: int, *, context: tuple = (),
                        prompt_token_ids: Sequence[int] = (),
                        eos_token_ids: Sequence[int] = ()) -> dict[tuple, float]:
    """Exact law of the first ``length`` tokens when generating by repeated verification steps.

    Composes :func:`exact_step_law`: each step starts after the tokens emitted so far; tokens
    past ``length`` are dropped. Guarantee 1 (exactness) says this equals
    :func:`exact_target_law` with the same arguments.
    """
    memo: dict = {}

    def rec(ctx: tuple, remaining: int) -> dict[tuple, float]:
        key = (ctx, remaining)
        if key in memo:
            return memo[key]
        out: dict[tuple, float] = {}
        step = exact_step_law(target_fn, draft_fn, k, params, method, draft_kind, context=ctx,
                              prompt_token_ids=prompt_token_ids, eos_token_ids=eos_token_ids)
        for toks, pr in step.items():
            if len(toks) >= remaining:
                t = toks[:remaining]
                out[t] = out.get(t, 0.0) + pr
            else:
                for rest, pr2 in rec(ctx + toks, remaining - len(toks)).items():
                    t = toks + rest
                    out[t] = out.get(t, 0.0) + pr * pr2
        memo[key] = out
        return out

    return rec(tuple(context), length)


# --------------------------------------------------------------------------------------------
# Tree verification (docs/semantics.md, "Tree verification"; specsample.verify_tree)
# --------------------------------------------------------------------------------------------


def _tree_of(parents: Sequence[int], tokens: Sequence[int] | None, request: int = 0
             ) -> tuple[list[list[int]], list[int]]:
    """(children of each node 0..m in node-number order, depth of each node) of one tree.

    ``parents[n - 1]`` is node n's parent. Raises ValueError for a parent outside
    [0, n - 1] or, when ``tokens`` is given, two siblings with the same token (other than
    the placeholder -1)."""
    m = len(parents)
    children: list[list[int]] = [[] for _ in range(m + 1)]
    depth = [0] * (m + 1)
    for n, par in enumerate(parents, start=1):
        if not 0 <= par < n:
            raise ValueError(f"request {request}: node {n} has parent {par}, outside [0, {n - 1}]")
        if tokens is not None and tokens[n - 1] != -1 and any(
                tokens[c - 1] == tokens[n - 1] for c in children[par]):
            raise ValueError(f"request {request}: two children of node {par} hold the token "
                             f"{tokens[n - 1]}")
        children[par].append(n)
        depth[n] = depth[par] + 1
    return children, depth


def _tree_residual(w: np.ndarray, w_lo: np.ndarray, w_hi: np.ndarray, seed: int, pos: int,
                   trace: RequestTrace | None) -> int | None:
    """Three-level Gumbel-max draw from the weights ``w`` (STREAM_RESIDUAL*), None when they
    are all 0. ``w_lo`` / ``w_hi`` bound the float32 weights (near-tie bookkeeping)."""
    if not np.any(w > 0):
        if trace is not None and np.any(w_hi > 0):
            trace.flag("tree residual degenerate (near-zero)")
        return None
    with np.errstate(divide="ignore"):
        best = _three_level(np.log(w), 0.0, seed, pos, STREAM_RESIDUAL_TILE, STREAM_RESIDUAL,
                            trace, "tree residual", None if trace is None else (w_lo, w_hi))
        if trace is not None:
            if not np.any(w_lo > 0):
                trace.flag("tree residual possibly degenerate")
            ids = np.arange(best // SUBTILE * SUBTILE, min(best // SUBTILE * SUBTILE + SUBTILE,
                                                           w.shape[0]))
            noise = np.array([gumbel_scalar(seed, pos, int(x), STREAM_RESIDUAL) for x in ids])
            key_hi = np.log(w_hi[ids]) + noise
            key_lo = math.log(w_lo[best]) + noise[best - ids[0]] if w_lo[best] > 0 else -math.inf
            rivals = (ids != best) & (w_hi[ids] > 0)
            if np.any(key_lo - key_hi[rivals] <= REL_TOL * (1 + abs(key_lo))):
                trace.flag("tree residual near-tie")
    return best


def _rrs_node(row: ProcessedRow, q: np.ndarray, q_err: float, child_tokens: list[int],
              seed: int, pos: int, trace: RequestTrace | None) -> tuple[int | None, int | None]:
    """Recursive rejection sampling at one node (Jeon et al. 2024, arXiv 2402.14160, Alg. 1).

    ``row``: the node's processed target row (p); ``q``: the drafter's distribution there,
    from which ``child_tokens`` (node-number order) were drawn without replacement. Child k
    (0-based) is accepted iff ``U(seed, pos, k, STREAM_ACCEPT) q^k(c) < p^k(c)``; on rejection
    ``p^{k+1} = norm(max(p^k - q^k, 0))`` (kept if that mass is 0) and ``q^{k+1}`` is ``q^k``
    without c, renormalised. Returns (index of the accepted child, None) or (None, the token
    drawn from ``max(p^m - q^m, 0)``, or None when that mass is 0). Float32 error intervals
    of p^k and q^k are carried along for the trace.
    """
    p = row.probs
    bounds = [_value_bounds(float(p[x]), row.logp_err(x)) for x in range(p.shape[0])]
    p_lo, p_hi = np.array([b[0] for b in bounds]), np.array([b[1] for b in bounds])
    q = q.copy()
    q_lo = np.array([_value_bounds(float(v), q_err)[0] for v in q])
    q_hi = np.array([_value_bounds(float(v), q_err)[1] for v in q])
    for k, c in enumerate(child_tokens):
        u = uniform_scalar(seed, pos, k, STREAM_ACCEPT)
        if trace is not None and p[c] > 0 and p_lo[c] <= u * q_hi[c] * (1 + 1e-6) and (
                u * q_lo[c] * (1 - 1e-6) <= p_hi[c]):
            trace.flag(f"tree acceptance near-tie (child {k})")
        if u * q[c] < p[c]:
            return k, None
        slack = 1e-7 * (p + q)
        w = np.maximum(p - q, 0.0)
        w_lo, w_hi = np.maximum(p_lo - q_hi - slack, 0.0), np.maximum(p_hi - q_lo + slack, 0.0)
        if k == len(child_tokens) - 1:
            return None, _tree_residual(w, w_lo, w_hi, seed, pos, trace)
        s = w.sum()
        if s > 0:
            s_lo, s_hi = w_lo.sum() * (1 - 1e-6), w_hi.sum() * (1 + 1e-6)
            p = w / s
            p_lo = w_lo / s_hi
            p_hi = np.minimum(w_hi / s_lo, 1.0) if s_lo > 0 else np.ones_like(p)
        for arr in (q, q_lo, q_hi):
            arr[c] = 0.0
        t, t_lo, t_hi = q.sum(), q_lo.sum() * (1 - 1e-6), q_hi.sum() * (1 + 1e-6)
        if t > 0:
            q = q / t
            q_lo = q_lo / t_hi
            q_hi = q_hi / t_lo if t_lo > 0 else np.ones_like(q)
    raise AssertionError("unreachable: a node with children returns inside the loop")


def verify_tree(target_logits: torch.Tensor, draft_token_ids, parents, num_nodes,
                batch: SamplingBatch, *, draft_probs: torch.Tensor | None = None,
                positions=None, strict: bool = False, return_traces: bool = False):
    """Reference ``specsample.verify_tree`` (docs/semantics.md, "Tree verification"), one
    request and one node at a time in float64.

    Same arguments and output as the public function, except: ``strict`` defaults to False;
    logprobs are float64; with ``return_traces=True`` returns
    ``(TreeVerifyOutput, [RequestTrace] * N)``; ``positions=None`` takes
    :func:`specsample.plan.fresh_positions` as the public function does.

    Deterministic trees (``draft_probs=None``) and greedy requests: at the node at depth d
    the target token is the row's ``sample()`` draw at ``pos + d`` (argmax for greedy
    requests); the walk descends to the child holding it, else emits it. ``draft_probs``
    trees: :func:`_rrs_node` at each node; a leaf emits its row's draw (the bonus token).
    A node holding the placeholder -1 is pruned: it and every node below it are treated as
    absent (not checked, not walked; siblings after it keep their order).
    """
    from .outputs import TreeVerifyOutput

    n = batch.num_requests
    ms = [int(v) for v in (num_nodes.tolist() if isinstance(num_nodes, torch.Tensor)
                           else num_nodes)]
    if len(ms) != n or any(v < 0 for v in ms):
        raise ValueError("num_nodes must hold N entries >= 0")
    x_all = _as_f64(target_logits)
    v = x_all.shape[1]
    total = sum(ms)
    if x_all.shape[0] != n + total or v != batch.vocab_size:
        raise ValueError(f"target_logits has shape {tuple(x_all.shape)}")
    toks_all = [int(t) for t in (draft_token_ids.tolist() if isinstance(
        draft_token_ids, torch.Tensor) else draft_token_ids)]
    par_all = [int(t) for t in (parents.tolist() if isinstance(parents, torch.Tensor)
                                else parents)]
    if len(toks_all) != total or len(par_all) != total:
        raise ValueError("draft_token_ids and parents must hold sum(num_nodes) entries")
    dist = None if draft_probs is None else _as_f64(draft_probs)
    if dist is not None and (dist.shape[0] != n + total or not 1 <= dist.shape[1] <= v):
        raise ValueError(f"draft_probs has shape {tuple(dist.shape)}")
    trees = []
    s0 = 0
    for i, m in enumerate(ms):
        trees.append(_tree_of(par_all[s0:s0 + m], toks_all[s0:s0 + m], i))
        s0 += m
    pos_all, seeds, prompts, outputs, tails, num_outputs = _request_context(batch, positions, n)
    dmax = max((max(depth) for _, depth in trees), default=0)
    nlp = batch.max_logprobs
    lp_shape = (n, dmax + 1, max(nlp, 0) + 1)
    lp_vals, lp_ids = (torch.full(lp_shape, -math.inf, dtype=torch.float64),
                       torch.full(lp_shape, -1, dtype=torch.int64)) if nlp >= 0 else (None, None)
    token_ids, node_ids = (torch.full((n, w), -1, dtype=torch.int64) for w in (dmax + 1, dmax))
    num_accepted, invalid = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.bool)
    traces = [RequestTrace() for _ in range(n)]
    row0 = s0 = 0
    for i, (params, m) in enumerate(zip(batch.params, ms)):
        trace = traces[i] if return_traces else None
        children, depth = trees[i]
        toks = [-1] + toks_all[s0:s0 + m]  # toks[node]
        raws = [x_all[row0 + node] for node in range(m + 1)]
        qrows = None if dist is None else [dist[row0 + node] for node in range(m + 1)]
        paths_of, live = [[]], [True]
        for node in range(1, m + 1):
            parent = par_all[s0 + node - 1]
            paths_of.append(paths_of[parent] + [toks[node]])
            live.append(live[parent] and toks[node] != -1)  # (-1: pruned, and all below)
        children = [[c for c in kids if live[c]] for kids in children]
        row0 += m + 1
        s0 += m

        def process(node: int, tr: RequestTrace | None, i=i, params=params, paths_of=paths_of,
                    raws=raws, depth=depth) -> ProcessedRow:
            path = paths_of[node]
            return process_row(raws[node], params, prompt_token_ids=prompts[i],
                               output_token_ids=outputs[i] + path, trace=tr,
                               context_token_ids=tails[i] + path,
                               num_output_tokens=num_outputs[i] + depth[node],
                               eos_token_ids=batch.eos_token_ids)

        nodes = [node for node in range(m + 1) if live[node]]
        bad = any(_row_invalid(raws[node]) for node in nodes) or any(
            not 0 <= toks[node] < v for node in nodes[1:])
        if qrows is not None:
            bad = bad or any(_draft_row_invalid(qrows[node], "probs")
                             for node in nodes if children[node])
        if bad or any(not math.isfinite(process(node, None).lse) for node in nodes):
            invalid[i] = True
            continue
        node, rows_on_path = 0, []
        while True:
            row = process(node, trace)
            rows_on_path.append((node, row))
            pos = pos_all[i] + depth[node]
            kids = children[node]
            if qrows is None or params.greedy or not kids:
                y = _target_sample(row, params.greedy, seeds[i], pos, trace)
                nxt = next((c for c in kids if toks[c] == y), None)
                if nxt is None:
                    emitted = y
                    break
                node = nxt
                continue
            q, q_err = _draft_q(qrows[node], "probs", params, v)
            k, res = _rrs_node(row, q, q_err, [toks[c] for c in kids], seeds[i], pos, trace)
            if k is not None:
                node = kids[k]
                continue
            emitted = res if res is not None else _target_sample(row, False, seeds[i], pos,
                                                                 trace)
            break
        a = depth[node]
        path = paths_of[node]
        token_ids[i, : a + 1] = torch.tensor(path + [emitted])
        num_accepted[i] = a
        chain = [nd for nd, _ in rows_on_path]
        if a:
            node_ids[i, :a] = torch.tensor(chain[1:])
        if nlp >= 0:
            want = params.logprobs if params.logprobs is not None else 0
            for j, (nd, row) in enumerate(rows_on_path):
                vals, ids = _logprob_entries(raws[nd], row, params.logprobs_mode,
                                             int(token_ids[i, j]), min(want, nlp))
                lp_vals[i, j, : len(vals)] = torch.tensor(vals, dtype=torch.float64)
                lp_ids[i, j, : len(ids)] = torch.tensor(ids)
    if strict and bool(invalid.any()):
        raise SamplingError(invalid.nonzero().squeeze(1).tolist(), "invalid input data")
    out = TreeVerifyOutput(token_ids=token_ids, num_accepted=num_accepted,
                           accepted_node_ids=node_ids, logprobs=lp_vals,
                           logprob_token_ids=lp_ids, invalid=invalid)
    return (out, traces) if return_traces else out


def _draws_without_replacement(q: np.ndarray, m: int):
    """Every ordered draw of ``m`` distinct tokens from ``q`` without replacement, with its
    probability ``prod_k q(c_k) / (1 - sum_{j < k} q(c_j))`` (yields (tokens, prob))."""
    def rec(prefix: tuple, prob: float, left: float):
        if len(prefix) == m:
            yield prefix, prob
            return
        for x in np.flatnonzero(q > 0):
            if int(x) not in prefix and left > 0:
                yield from rec(prefix + (int(x),), prob * float(q[x]) / left, left - float(q[x]))

    yield from rec((), 1.0, float(q.sum()))


def exact_tree_step_law(target_fn: TargetFn, parents: Sequence[int], params: SamplingParams,
                        *, tokens: Sequence[int] | None = None, draft_fn: DraftFn | None = None,
                        context: tuple = (), prompt_token_ids: Sequence[int] = (),
                        eos_token_ids: Sequence[int] = ()) -> dict[tuple, float]:
    """Exact law of what one :func:`specsample.verify_tree` step emits, by enumeration.

    The tree's shape is ``parents`` (node n's parent at ``parents[n - 1]``). Either
    ``tokens`` (a deterministic tree: node n holds ``tokens[n - 1]``; the walk descends with
    probability ``p(child token)`` and otherwise emits a token of p that no child holds) or
    ``draft_fn(ctx)`` (the drafter's distribution ``[V']`` after output context ``ctx``; each
    node's children are drawn from it without replacement in node-number order, every
    ordered draw enumerated with its probability, and recursive rejection sampling
    integrated analytically: child k accepted with ``min(1, p^k(c_k) / q^k(c_k))``, then
    ``p^{k+1} = norm(max(p^k - q^k, 0))``, ``q^{k+1}`` = q^k without c_k renormalised; the
    correction from ``p^{m+1}``). Greedy params: the argmax walk. ``target_fn``, ``context``,
    ``prompt_token_ids``, ``eos_token_ids`` as in :func:`exact_step_law`. Returns
    {emitted tokens: probability}; composed with :func:`exact_target_law` for the tokens
    after it, it gives the target's law (the exactness identity the tests check).
    """
    if (tokens is None) == (draft_fn is None):
        raise ValueError("give tokens (a deterministic tree) or draft_fn, not both or neither")
    children, _ = _tree_of(parents, tokens)
    cache: dict = {}
    memo: dict = {}

    def add(out: dict, key: tuple, prob: float) -> None:
        if prob > 0:
            out[key] = out.get(key, 0.0) + prob

    def walk_to(out: dict, ctx: tuple, tok: int, child: int, prob: float) -> None:
        for seq, pr in node_law(ctx + (tok,), child).items():
            add(out, (tok,) + seq, prob * pr)

    def node_law(ctx: tuple, node: int) -> dict[tuple, float]:
        if (ctx, node) in memo:
            return memo[ctx, node]
        row, law = _target_law_row(target_fn, ctx, params, prompt_token_ids, cache,
                                   eos_token_ids)
        kids = children[node]
        out: dict[tuple, float] = {}
        if tokens is not None or not kids:
            held = {tokens[c - 1]: c for c in kids} if tokens is not None else {}
            for x in np.flatnonzero(law > 0):
                if int(x) in held:
                    walk_to(out, ctx, int(x), held[int(x)], float(law[x]))
                else:
                    add(out, (int(x),), float(law[x]))
            memo[ctx, node] = out
            return out
        q0, _ = _draft_q(draft_fn(ctx), "probs", params, row.z.shape[0])
        for drawn, pdraw in _draws_without_replacement(q0, len(kids)):
            if params.greedy:
                y = int(np.argmax(law))
                if y in drawn:
                    walk_to(out, ctx, y, kids[drawn.index(y)], pdraw)
                else:
                    add(out, (y,), pdraw)
                continue
            p, q, reach = row.probs, q0.copy(), pdraw
            for k, c in enumerate(drawn):
                acc = (1.0 if p[c] > 0 else 0.0) if q[c] <= 0 else min(1.0, p[c] / q[c])
                walk_to(out, ctx, c, kids[k], reach * acc)
                reach *= 1.0 - acc
                w = np.maximum(p - q, 0.0)
                p = w / w.sum() if w.sum() > 0 else p
                q = q.copy()
                q[c] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
            for x in np.flatnonzero(p > 0):
                add(out, (int(x),), reach * float(p[x]))
        memo[ctx, node] = out
        return out

    return node_law(tuple(context), 0)
