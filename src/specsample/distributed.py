"""Vocabulary-parallel sample() and verify() on torch.distributed (docs/api.md).

The logits of one call are sharded by vocabulary over the ranks of a process group, as a
vocabulary-parallel LM head leaves them: rank r holds the contiguous columns
``[r * S, (r + 1) * S)`` with ``S = ceil(V / world size)``; columns at or beyond V (padding of
the last shards) are never read. Every rank returns the same outputs, the function of
docs/semantics.md on the whole rows: the torch backend (``specsample.torch_backend``) is the
specification mirrored here shard by shard. Only O(rows x world size) values travel, in a
small fixed number of ``all_gather`` collectives (plus one ``broadcast`` of the random keys),
never the logits:

1. handshake: every rank validates its arguments locally, then all exchange a small
   descriptor + status tensor; all raise the same ``ValueError`` if any rank failed or the
   descriptors disagree (no rank is left waiting in a later collective);
2. keys: ``seed_lo`` / ``seed_hi`` (and the positions when ``positions=None``) of rank 0;
3. per row the shard's max and first argmax (greedy rows pick the lowest id attaining the
   global max: z' = y - m is exactly 0 there and only there), with the error flags of the
   shard's draft rows;
4. per row the shard's mass ``sum exp(z')`` (float64, the global normaliser is their sum in
   rank order) and the partial masses of its first and last ``rng.TILE`` tile (tiles may
   straddle shards), with the values at the draft tokens for verification;
5. the three-level Gumbel-max draw of ``torch_backend.tiled_gumbel_argmax`` (``rng.TILE`` tile,
   ``rng.SUBTILE`` sub-tile, token) with the noise keyed by global tile / sub-tile / token
   ids: each rank keys the tiles that start in its shard (straddling tiles get the other
   ranks' partial masses from step 4), the best (key, tile) of every rank is gathered with
   the sub-tile masses of that tile, every rank then picks the same tile and sub-tile (the
   other ranks' parts of a straddling tile come from step 4), and the best (key, id) of each
   rank inside the sub-tile decides the token (largest key, lowest id).

On the Triton backend (CUDA, or Triton's interpreter on CPU tensors), calls with temperature
only (no bans, bias, penalties or filters), one-hot drafts and no logprobs run steps 3-5 as
two Triton launches around one all_gather of a per-row payload: the ranks exchange the
maxima, their own best tile with its sub-tile masses and per-sub-tile best tokens, and their
parts of the tiles they share, so that every rank finishes the same draw (``_run_kernels``,
``_distributed_kernels``; path ``distributed.<op>.kernels``; no host synchronisation after
the handshake except strict's check). Every other call runs the PyTorch steps below (path
``distributed.<op>.torch``).

Filters (min_p, top_k, top_p) are decided on the shard's own values with cuts found from
gathered per-shard candidate lists (``_filter_drop``), logprobs' top-n by merging per-shard
top-n lists. Bans, logit_bias and penalties reuse ``specsample.processing`` on a full-width
float32 scratch [T, V] holding this rank's shard at its global columns (the general path
only, as the single-device general path also builds a float32 [T, V]); the fast path
(temperature and filters) allocates nothing of width V.

Papers: Gumbel-max (Gumbel 1954); token-level verification (Leviathan et al. 2023,
arXiv 2211.17192, Alg. 1; Chen et al. 2023, arXiv 2302.01318, Alg. 2); block verification
(Sun et al. 2024, arXiv 2403.10444, Alg. 2).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import paths, rng, torch_backend, workspace
from .errors import SamplingError
from .outputs import SampleOutput, VerifyOutput
from .params import SamplingBatch
from .plan import FLOAT_DTYPES, METHODS, Plan, build_plan, fresh_positions
from .processing import apply_bans, apply_bias_and_penalties, filter_settings
from .torch_backend import (
    ERR_BANS,
    ERR_DRAFT_ID,
    ERR_DRAFT_ROW,
    ERR_LOGITS_NAN,
    ERR_LOGITS_NO_FINITE,
    ERR_PROCESSED_OVERFLOW,
    accepted_grid,
    top_n_logprobs,
)

F64 = torch.float64
NONE_ID = float(2**52)  # "no candidate" id in gathered (key, id) pairs: larger than any id
_MAGIC = 0x5350_4453  # first descriptor word: "SPDS"
_DESCRIPTOR = ("magic", "status", "vocab_size", "rows", "local columns", "requests",
               "sum(num_draft_tokens)", "num_draft_tokens", "method", "draft kind",
               "logits dtype", "draft dtype", "sampling params", "positions given", "strict",
               "device type", "path (Triton launches, PyTorch, PyTorch general)",
               "draft columns")
_DTYPES = {dt: i + 1 for i, dt in enumerate(FLOAT_DTYPES)}
_PATH_KERNELS, _PATH_TORCH, _PATH_GENERAL = 0, 1, 2


# ----------------------------------------------------------------------------- geometry


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Which global columns each rank holds: [r * S, r * S + width(r)), width <= S."""

    vocab: int
    world: int
    rank: int

    @property
    def shard(self) -> int:
        return -(-self.vocab // self.world)

    def offset(self, r: int | None = None) -> int:
        return (self.rank if r is None else r) * self.shard

    def width(self, r: int | None = None, vocab: int | None = None) -> int:
        v = self.vocab if vocab is None else vocab
        return max(0, min(self.shard, v - self.offset(r)))

    def tiles(self, r: int | None = None, size: int = rng.TILE) -> tuple[int, int]:
        """(first, count) of the global ``size``-wide blocks meeting rank r's columns."""
        o, w = self.offset(r), self.width(r)
        if w == 0:
            return 0, 0
        return o // size, (o + w - 1) // size - o // size + 1


# ------------------------------------------------------------------------ communication


class _Comm:
    """all_gather / broadcast on one group, every payload flattened into one float64 tensor
    (ids are exact in float64: below 2**53). NCCL moves CUDA tensors, other backends (gloo)
    host tensors; results come back on ``home``, the logits' device."""

    def __init__(self, group, home: torch.device) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.nccl = dist.get_backend(group) == "nccl"
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.nccl
                       else torch.device("cpu"))
        self.home = home

    def _all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        flat = flat.to(self.device)
        out = flat.new_empty((self.world, flat.numel()))
        if self.nccl:
            dist.all_gather_into_tensor(out, flat, group=self.group)
        else:
            dist.all_gather(list(out.unbind(0)), flat, group=self.group)
        return out.to(self.home)

    def gather_ints(self, values: torch.Tensor) -> torch.Tensor:
        return self._all_gather(values.to(torch.int64))

    def gather(self, pieces: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """[W, *shape] float64 of every piece, from one all_gather."""
        if not pieces:
            return []
        flat = torch.cat([p.reshape(-1).to(device=self.home, dtype=F64) for p in pieces])
        out = self._all_gather(flat)
        res, at = [], 0
        for p in pieces:
            res.append(out[:, at:at + p.numel()].reshape(self.world, *p.shape))
            at += p.numel()
        return res

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[W, *t.shape] of every rank's ``t`` (one all_gather, no dtype change)."""
        return self._all_gather(t.reshape(-1)).view(self.world, *t.shape)

    def broadcast_from_first(self, t: torch.Tensor) -> torch.Tensor:
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        t = t.to(self.device)
        dist.broadcast(t, src=src, group=self.group)
        return t.to(self.home)


def _pick_max(keys: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over dim 0 ([W, ...]): the largest key, the lowest id among equal keys (NaN keys count
    as -inf); returns (key, id) with the id as int64 (NONE_ID when no rank had one)."""
    keys = torch.where(torch.isnan(keys), -math.inf, keys)
    best = keys.amax(0)
    cand = torch.where(keys == best, ids, NONE_ID)
    return best, cand.amin(0).to(torch.int64)


def _rowmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, first argmax) per row of ``t`` [R, w] as float64 with NaN -> +inf (NaN and +inf
    both mean "invalid"); -inf / 0 for w = 0."""
    if t.shape[1] == 0:
        r = t.shape[0]
        return (torch.full((r,), -math.inf, dtype=F64, device=t.device),
                torch.zeros(r, dtype=torch.int64, device=t.device))
    v, i = torch.max(t, dim=-1)
    v = v.to(F64)
    return torch.where(torch.isnan(v), math.inf, v), i


# ---------------------------------------------------------------------------- handshake


def _crc(obj) -> int:
    return zlib.crc32(repr(obj).encode())


_PARAMS_CRC: dict[int, tuple[weakref.ref, int]] = {}


def _batch_crc(batch: SamplingBatch) -> int:
    """CRC of the parameters every rank's batch must agree on (cached per batch object: the
    repr costs host time per call; the token state of a persistent batch is not covered)."""
    hit = _PARAMS_CRC.get(id(batch))
    if hit is not None and hit[0]() is batch:
        return hit[1]
    crc = _crc((batch.params, batch.eos_token_ids, batch.vocab_size))
    if len(_PARAMS_CRC) > 64:
        _PARAMS_CRC.clear()
    _PARAMS_CRC[id(batch)] = (weakref.ref(batch), crc)
    return crc


def _handshake(comm: _Comm, desc: list[int] | None, error: str | None,
               exc: Exception | None = None) -> list[list[int]]:
    """Exchange descriptors; raise the same ValueError on every rank if a rank failed or they
    disagree (a rank whose validation raised something other than ValueError, ``exc``,
    re-raises that after the exchange, so the others are not left waiting). Returns the W
    descriptors (compared as host lists: one read of the gathered tensor)."""
    ok = error is None
    row = [_MAGIC, 0 if ok else 1] + (desc if ok else [0] * (len(_DESCRIPTOR) - 2))
    got = comm.gather_ints(torch.tensor(row, dtype=torch.int64)).tolist()
    failed = [r for r in range(comm.world) if got[r][1] != 0]
    if failed:
        msgs = [None] * comm.world
        dist.all_gather_object(msgs, error, group=comm.group)
        if exc is not None and not isinstance(exc, ValueError):
            raise exc
        if not ok:
            same = [r for r in failed if msgs[r] == error]
            other = "; ".join(f"rank {r}: {msgs[r]}" for r in failed if msgs[r] != error)
            raise ValueError(f"{error} (on rank(s) {same}" + (f"; {other})" if other else ")"))
        detail = "; ".join(f"rank {r}: {msgs[r]}" for r in failed)
        raise ValueError(f"specsample.distributed: invalid arguments on another rank: {detail}")
    if any(r[0] != _MAGIC for r in got):
        raise ValueError("specsample.distributed: ranks called different collectives")
    for f, name in enumerate(_DESCRIPTOR[:-1]):
        col = [r[f] for r in got]
        if col.count(col[0]) != len(col):
            raise ValueError(f"specsample.distributed: the ranks disagree on {name}: "
                             f"{col} (rank 0 .. {comm.world - 1})")
    return got


def _draft_vocab(geo: _Geometry, widths: list[int]) -> int:
    """The draft vocabulary V' from the ranks' draft column counts (see verify())."""
    s, v = geo.shard, geo.vocab
    if all(w == s for w in widths):
        return v
    vd = sum(widths)
    expect = [geo.width(r, vd) for r in range(geo.world)]
    if not 1 <= vd <= v or widths != expect:
        raise ValueError(
            "specsample.distributed: the draft shards must hold the draft vocabulary's columns "
            f"[r * S, min((r + 1) * S, V')) (S = {s}) with V' <= V = {v}, or S columns on every "
            f"rank (V' = V); got {widths} columns on ranks 0 .. {geo.world - 1}")
    return vd


# -------------------------------------------------------------------------- local pieces


def _tile_partials(e: torch.Tensor, off: int, size: int = rng.TILE) -> torch.Tensor:
    """[R, nb] float64 sums of the nonnegative ``e`` [R, w] (global columns off..off+w-1)
    over each global ``size``-wide block they meet (partial blocks at both ends)."""
    r, w = e.shape
    if w == 0:
        return e.new_zeros((r, 0), dtype=F64)
    first = min(w, (-off) % size)
    parts = [e[:, :first].sum(-1, keepdim=True, dtype=F64)] if first else []
    nfull = (w - first) // size
    if nfull:
        parts.append(e[:, first:first + nfull * size].reshape(r, nfull, size).sum(-1, dtype=F64))
    if w - first - nfull * size:
        parts.append(e[:, first + nfull * size:].sum(-1, keepdim=True, dtype=F64))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _gumbel(seed_lo, seed_hi, pos, counter, stream: int) -> torch.Tensor:
    """``rng.gumbel`` for keys [R] and counters [R, c]: on CUDA the 52-bit uniforms come from
    one Triton launch (the same integers), then the same float64 logs."""
    if counter.is_cuda and counter.numel():
        from ._distributed_kernels import uniform

        u = uniform(seed_lo, seed_hi, pos, counter, stream)
        return -torch.log(-torch.log(u))
    return rng.gumbel(seed_lo[:, None], seed_hi[:, None], pos[:, None], counter, stream)


def _exp_mass(src: torch.Tensor, m: torch.Tensor | None, t: torch.Tensor | None,
              off: int) -> torch.Tensor:
    """[R, nb] float64 tile partial masses of exp((src - m) / t) (or exp(src) with m None)."""
    if src.shape[1] and src.is_cuda:
        from ._distributed_kernels import tile_mass

        return tile_mass(src, m, t, off)
    z = src.float() if m is None else torch.sub(src.float(), m[:, None]).div_(t[:, None])
    return _tile_partials(torch.exp(z), off)


@dataclasses.dataclass
class _Source:
    """Local processed values of some rows: ``z[i, c] = (src[rows[i], c] - m[i]) / t[i]``
    (or ``src[rows[i], c]`` itself when ``m`` is None), c a local column < width."""

    src: torch.Tensor
    rows: torch.Tensor
    m: torch.Tensor | None = None
    t: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.src.shape[1]

    def at(self, cols: torch.Tensor) -> torch.Tensor:
        """float32 [R, c] values at local columns ``cols`` [R, c] (-inf where out of range)."""
        ok = (cols >= 0) & (cols < self.width)
        if self.width == 0:
            return torch.full(cols.shape, -math.inf, dtype=torch.float32, device=cols.device)
        v = self.src[self.rows[:, None], cols.clamp(0, self.width - 1)].float()
        if self.m is not None:
            v = torch.sub(v, self.m[:, None]).div_(self.t[:, None])
        return torch.where(ok, v, -math.inf)

    def full(self) -> torch.Tensor:
        """float32 [R, w] values of every local column."""
        v = self.src[self.rows].float()
        return v if self.m is None else torch.sub(v, self.m[:, None]).div_(self.t[:, None])

    def block_values(self, geo: _Geometry, block: torch.Tensor, size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [R, size] of global block ``block`` [R] in this shard (-inf elsewhere),
        global ids [R, size])."""
        ids = block[:, None] * size + torch.arange(size, device=block.device)[None, :]
        return self.at(ids - geo.offset()), ids


@dataclasses.dataclass
class _Part:
    """Rows drawn together: their values, tile masses and random keys (one stream set)."""

    source: _Source
    mass: torch.Tensor  # [R, n local tiles] float64
    seed_lo: torch.Tensor
    seed_hi: torch.Tensor
    pos: torch.Tensor
    token_stream: int
    tile_stream: int
    boundary: torch.Tensor | None = None  # gathered boundary payload [W, R, P]

    def sub_masses(self, geo: _Geometry, tile: torch.Tensor) -> torch.Tensor:
        """[R, TILE / SUBTILE] float64 local partial masses of the sub-tiles of ``tile``."""
        vals, _ = self.source.block_values(geo, tile, rng.TILE)
        return torch.exp(vals).view(vals.shape[0], -1, rng.SUBTILE).sum(-1, dtype=F64)

    def boundary_payload(self, geo: _Geometry) -> torch.Tensor:
        """[R, 2 + 2 TILE / SUBTILE]: partial masses of this shard's first and last tile,
        then of their sub-tiles, for the ranks that key or split a straddling tile."""
        r = self.mass.shape[0]
        first, count = geo.tiles()
        if count == 0:
            edge = self.mass.new_zeros((r, 2))
        else:
            edge = torch.stack([self.mass[:, 0], self.mass[:, -1]], dim=1)
        dev = self.mass.device
        ends = [torch.full((r,), first + j, dtype=torch.int64, device=dev)
                for j in (0, max(count - 1, 0))]
        return torch.cat([edge] + [self.sub_masses(geo, t) for t in ends], dim=1)


def _straddle_extra(geo: _Geometry, boundary: torch.Tensor, tile: int,
                    after: int) -> torch.Tensor | float:
    """Sum, over ranks r > ``after`` (in rank order) whose first tile is ``tile``, of their
    first-tile partial mass (column 0 of the boundary payload [W, R, P])."""
    extra = 0.0
    for r in range(after + 1, geo.world):
        first, count = geo.tiles(r)
        if count and first == tile:
            extra = extra + boundary[r, :, 0]
    return extra


def _draw(comm: _Comm, geo: _Geometry, parts: list[_Part]) -> list[torch.Tensor]:
    """The exact multi-level Gumbel-max draw of ``torch_backend.tiled_gumbel_argmax`` for
    every part's rows (their boundary payloads already gathered): two all_gathers.
    Returns [R] int64 global token ids per part."""
    dev = comm.home
    first, count = geo.tiles()
    own0 = 0 if geo.offset() % rng.TILE == 0 else 1  # the first tile starts on another rank
    # Level 1: every rank keys the tiles that start in its shard.
    pieces = []
    for part in parts:
        r = part.mass.shape[0]
        mass = part.mass[:, own0:].clone()
        if mass.shape[1]:
            last = first + count - 1
            extra = _straddle_extra(geo, part.boundary, last, geo.rank)
            mass[:, -1] += extra
            tiles = torch.arange(first + own0, first + count, device=dev)
            keys = torch.log(mass).float().double() + _gumbel(
                part.seed_lo, part.seed_hi, part.pos, tiles[None, :].expand(r, -1),
                part.tile_stream)
            keys = torch.where(torch.isnan(keys), -math.inf, keys)
            k, j = keys.max(dim=-1)
            best = tiles[j]
        else:
            k = torch.full((r,), -math.inf, dtype=F64, device=dev)
            best = torch.full((r,), first, dtype=torch.int64, device=dev)
        tid = best.to(F64) if mass.shape[1] else torch.full_like(k, NONE_ID)
        pieces += [torch.stack([k, tid], 0), part.sub_masses(geo, best).T]
    got = comm.gather(pieces)
    # Level 2 (sub-tiles of the chosen tile, where the draw has them), then tokens.
    chosen_block = []
    nsub = rng.TILE // rng.SUBTILE
    for p, part in enumerate(parts):
        kt = got[2 * p]
        _, tile = _pick_max(kt[:, 0], kt[:, 1])
        tile = tile.clamp(0, max(-(-geo.vocab // rng.TILE) - 1, 0))
        subs = got[2 * p + 1].permute(0, 2, 1)  # [W, R, nsub]
        owner = (kt[:, 1] == tile.to(F64)[None, :]) & (kt[:, 0] == kt[:, 0].amax(0))
        owner_rank = torch.where(owner, torch.arange(geo.world, device=dev)[:, None],
                                 geo.world).amin(0)
        sm = subs.gather(0, owner_rank.clamp_max(geo.world - 1)[None, :, None].expand(
            1, -1, nsub))[0]
        for r in range(geo.world):
            fr, cr = geo.tiles(r)
            if cr:
                add = (owner_rank < r) & (tile == fr)
                sm = sm + torch.where(add[:, None], part.boundary[r, :, 2:2 + nsub], 0.0)
        ids = tile[:, None] * nsub + torch.arange(nsub, device=dev)[None, :]
        keys = torch.log(sm).float().double() + _gumbel(
            part.seed_lo, part.seed_hi, part.pos, ids, rng.sub_stream(part.tile_stream))
        keys = torch.where(torch.isnan(keys), -math.inf, keys)
        chosen_block.append(ids.gather(1, keys.argmax(dim=-1, keepdim=True))[:, 0])
    size = rng.SUBTILE
    pieces = []
    for part, block in zip(parts, chosen_block):
        vals, ids = part.source.block_values(geo, block, size)
        keys = vals.double() + _gumbel(part.seed_lo, part.seed_hi, part.pos, ids,
                                       part.token_stream)
        keys = torch.where(vals > -math.inf, keys, -math.inf)
        mine = (ids >= geo.offset()) & (ids < geo.offset() + geo.width())
        keys = torch.where(torch.isnan(keys), -math.inf, keys)
        k, j = keys.max(dim=-1)
        tok = ids.gather(1, j[:, None])[:, 0].to(F64)
        has = mine.any(-1)
        # A shard whose tokens in the block are all -inf still offers its lowest one: the
        # single-device draw returns the block's first id for an all -inf block.
        first_mine = torch.where(mine, ids, geo.vocab + size).amin(-1).to(F64)
        tok = torch.where(k > -math.inf, tok, first_mine)
        pieces.append(torch.stack([torch.where(has, k, -math.inf),
                                   torch.where(has, tok, NONE_ID)], 0))
    got = comm.gather(pieces)
    out = []
    for g, block in zip(got, chosen_block):
        _, tok = _pick_max(g[:, 0], g[:, 1])
        out.append(torch.where(tok < geo.vocab, tok, block * size).clamp(0, geo.vocab - 1))
    return out


# ------------------------------------------------------------------------------ filters


def _local_top(vals: torch.Tensor, c: int, off: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This shard's top-c (value desc, lower id first) of ``vals`` [R, w]: float64 values
    and global ids [R, c], padded with (-inf, NONE_ID)."""
    r, w = vals.shape
    if w == 0:
        return (torch.full((r, c), -math.inf, dtype=F64, device=vals.device),
                torch.full((r, c), NONE_ID, dtype=F64, device=vals.device))
    v, i = top_n_logprobs(vals, c)
    return v.to(F64), torch.where(i >= 0, (i + off).to(F64), NONE_ID)


def _merge(vals: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, R, c] per-shard candidates -> [R, W * c] in rank order (value desc, id asc)."""
    w, r, c = vals.shape
    v = vals.permute(1, 0, 2).reshape(r, w * c)
    i = ids.permute(1, 0, 2).reshape(r, w * c)
    o = torch.sort(i, dim=-1, stable=True).indices
    v, i = v.gather(1, o), i.gather(1, o)
    o = torch.sort(v, dim=-1, descending=True, stable=True).indices
    return v.gather(1, o), i.gather(1, o)


def _filter_drop(comm: _Comm, geo: _Geometry, y: torch.Tensor, m: torch.Tensor,
                 plan: Plan) -> torch.Tensor | None:
    """[T, w] bool: this shard's tokens that min_p -> top_k -> top_p drop, exactly as
    ``processing.filter_drop`` on the whole rows, or None (see the module docstring).

    top_k: the k-th entry of the merged per-shard top-k lists is the global k-th (every
    global top-k entry is in its shard's top-k). top_p: the survivors' mass is the sum of the
    shards' float64 masses; the merged candidates are in exact global rank order down to F,
    the best-ranked c-th candidate of any shard holding more survivors than it sent; the
    nucleus boundary counts only when the first token it excludes ranks at or before F, else
    c grows fourfold for the rows not found (every rank decides alike from the gathered lists).
    """
    v, off, w = geo.vocab, geo.offset(), y.shape[1]
    drop, t64, k, k_on, top_p, p_on = filter_settings(y, m, plan, v)
    rows = k_on | p_on
    if not bool(rows.any()):
        return drop
    idx = rows.nonzero().squeeze(1)
    sub = y[idx].float()
    if drop is not None:
        sub = sub.masked_fill(drop[idx], -math.inf)
    keep = sub > -math.inf
    kk = torch.where(k_on[idx], k[idx].clamp(1, v), 0)
    mi, ti = m[idx].double(), t64[idx]
    pi = top_p[idx]
    e_local = torch.where(keep, torch.exp((sub.double() - mi[:, None]) / ti[:, None]), 0.0).sum(-1)
    widths = torch.tensor([geo.width(r) for r in range(geo.world)], device=y.device)
    bound_v = torch.full((idx.numel(),), -math.inf, dtype=F64, device=y.device)
    bound_i = torch.full((idx.numel(),), NONE_ID, dtype=F64, device=y.device)
    todo = torch.arange(idx.numel(), device=y.device)
    c = max(int(kk.max()), min(256, v))
    first = True
    while todo.numel():
        cv, ci = _local_top(sub[todo], c, off)  # a narrow shard pads its list
        pieces = [cv, ci] + ([e_local] if first else [])
        got = comm.gather(pieces)
        if first:
            total = got[2].sum(0)  # rank order: the same float64 sum on every rank
        mv, mid = _merge(got[0], got[1])
        j = torch.arange(mv.shape[1], device=y.device)[None, :]
        kt, pt = kk[todo][:, None], pi[todo][:, None]
        ce = torch.where(mv > -math.inf, torch.exp((mv - mi[todo, None]) / ti[todo, None]), 0.0)
        in_k = (kt == 0) | (j < kt)
        ce = torch.where(in_k, ce, 0.0)
        tot = torch.where(kt[:, 0] > 0, ce.sum(-1), total[todo])
        goal = pt * tot[:, None]
        alive = (mv > -math.inf) & in_k
        n_keep = ((torch.cumsum(ce, dim=-1) - ce < goal) & alive).sum(-1)
        # Exact prefix: entries ranked at or before F (the best c-th candidate of a shard
        # that may hold more survivors than it sent).
        last_v, last_i = got[0][:, :, -1], got[1][:, :, -1]
        trunc = (widths[:, None] > c) & (last_v > -math.inf)
        fv = torch.where(trunc, last_v, -math.inf).amax(0)
        fi = torch.where(trunc & (last_v == fv), last_i, NONE_ID).amin(0)
        any_trunc = trunc.any(0)
        valid = torch.where(any_trunc, ((mv > fv[:, None]) | ((mv == fv[:, None]) & (
            mid <= fi[:, None]))).sum(-1), mv.shape[1])
        p_row = pt[:, 0] < 1
        found = ~p_row | (kt[:, 0] > 0) | ~any_trunc | (n_keep < valid)
        # Boundary: the last kept entry (top_k only: the k-th, survivors or not).
        bidx = torch.where(p_row, n_keep.clamp_min(1), kt[:, 0].clamp_min(1)) - 1
        bv = mv.gather(1, bidx[:, None])[:, 0]
        bi = mid.gather(1, bidx[:, None])[:, 0]
        done = todo[found]
        bound_v[done], bound_i[done] = bv[found], bi[found]
        todo = todo[~found]
        first = False
        c *= 4
    ids = torch.arange(off, off + w, device=y.device)[None, :]
    bv32 = bound_v.float()[:, None]
    keep &= (sub > bv32) | ((sub == bv32) & (ids <= bound_i[:, None]))
    if drop is None:
        drop = torch.zeros(y.shape, dtype=torch.bool, device=y.device)
    drop[idx] = ~keep
    return drop


# ------------------------------------------------------------------------- verification


@dataclasses.dataclass
class _Call:
    """One validated call on this rank."""

    comm: _Comm
    geo: _Geometry
    plan: Plan  # logits: a [T, V] stride-0 placeholder (layout and processing only)
    x: torch.Tensor  # [T, w] this shard's valid columns of the raw target logits
    draft: torch.Tensor | None  # [S, w'] this shard's valid draft columns (w' <= w)
    draft_vocab: int
    path: int  # _PATH_KERNELS, _PATH_TORCH or _PATH_GENERAL (agreed in the handshake)


def _errors(call: _Call, got: list[torch.Tensor], general: bool) -> tuple[torch.Tensor, ...]:
    """(err [N] int64, processed max m [T] float64, greedy ids [T]) from the gathered row
    maxima, the rules of ``torch_backend.processed_logits``."""
    plan, batch = call.plan, call.plan.batch
    n, req, live = plan.num_requests, plan.row_req, plan.row_live
    orq = torch_backend._or_per_request
    raw_max = got[0].amax(0)
    err = orq(torch.isposinf(raw_max) & live, req, n, ERR_LOGITS_NAN)
    err |= orq(torch.isneginf(raw_max) & live, req, n, ERR_LOGITS_NO_FINITE)
    at = 2
    if general:
        ban_max, proc_max, proc_arg = got[2], got[3], got[4]
        at = 5
    else:
        proc_max, proc_arg = got[0], got[1]
    if plan.draft_token_ids.numel():
        d, dlive = plan.draft_token_ids, plan.draft_live
        err |= orq(dlive & ((d < 0) | (d >= plan.vocab_size)), plan.draft_req, n, ERR_DRAFT_ID)
        if plan.draft_logits is not None:
            bad = torch.isinf(got[at].amax(0))
        elif plan.draft_probs is not None:
            bad = (got[at].amax(0) > 0) | (got[at + 1].amax(0) == 0)
        else:
            bad = None
        if bad is not None:
            err |= orq(bad & dlive, plan.draft_req, n, ERR_DRAFT_ROW)
    if general:
        if batch.needs_bans:
            ok = live & (err == 0)[req]
            err |= orq(torch.isneginf(ban_max.amax(0)) & ok, req, n, ERR_BANS)
        if batch.needs_bias or batch.needs_penalties:
            ok = live & (err == 0)[req]
            err |= orq(~torch.isfinite(proc_max.amax(0)) & ok, req, n, ERR_PROCESSED_OVERFLOW)
    m, greedy = _pick_max(proc_max, proc_arg)
    return err, m, greedy.clamp(0, call.geo.vocab - 1)


def _draft_q(call: _Call, dmax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q numerators [S, w'] float32 of this shard, their float64 row sums [S]): draft_logits
    give exp((l - max) / T) (softmax's numerator: the sum over the ranks normalises),
    draft_probs the probabilities themselves."""
    plan = call.plan
    if plan.draft_logits is None:
        q = call.draft.float()
    else:
        t = plan.batch.temperature[plan.draft_req]
        t = torch.where(t > 0, t, torch.ones_like(t))
        mx = torch.where(torch.isfinite(dmax), dmax, 0.0).float()
        q = torch.exp(torch.sub(call.draft.float(), mx[:, None]).div_(t[:, None]))
    return q, q.sum(-1, dtype=F64)


def _q_rows(call: _Call, q: torch.Tensor, qsum: torch.Tensor | None,
            didx: torch.Tensor) -> torch.Tensor:
    """[M, w] float32 draft probabilities of drafts ``didx`` on this shard's columns (0 past
    the draft vocabulary)."""
    rows = q[didx]
    if qsum is not None:
        rows = rows / qsum[didx].float()[:, None]
    pad = call.x.shape[1] - rows.shape[1]
    return torch.nn.functional.pad(rows, (0, pad)) if pad else rows


def _owned_values(call: _Call, values, ids: torch.Tensor, width: int) -> torch.Tensor:
    """float32 values at global ``ids`` held in this shard's first ``width`` columns (0
    elsewhere: summing the gathered values over the ranks gives the owner's).
    ``values(cols)`` reads local columns."""
    off = call.geo.offset()
    own = (ids >= off) & (ids < off + width)
    if width == 0:
        return torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
    v = values((ids - off).clamp(0, width - 1))
    return torch.where(own, v, 0.0)


def _block_tau(call: _Call, p_x, q_x, z_rows, lse, q, qsum, rows, didx, sampled_dist):
    """Block verification (Sun et al. 2024, Alg. 2) as ``torch_backend._block_tau``: rho from
    the gathered p_j(d_j), q_j(d_j); every Z_j from one local pass and one all_gather."""
    plan, batch = call.plan, call.plan.batch
    n, k = p_x.shape
    dev = p_x.device
    k_eff = plan.k_eff
    rho = torch.ones(n, k + 1, dtype=torch.float32, device=dev)
    for j in range(k):
        live = (j < k_eff) & sampled_dist
        px, qx = p_x[:, j], q_x[:, j]
        ratio = torch.where(qx > 0, px / torch.where(qx > 0, qx, 1.0),
                            torch.where(px > 0, math.inf, 0.0))
        nxt = torch.where(rho[:, j] > 0, torch.clamp(rho[:, j] * ratio, max=1.0), 0.0)
        rho[:, j + 1] = torch.where(live, nxt, rho[:, j])
    local = torch.zeros(n, k, dtype=F64, device=dev)
    for j in range(1, k):
        r = rows[:, j]
        p_row = torch.exp(z_rows(r) - lse[r, None])
        q_row = _q_rows(call, q, qsum, didx[:, j])
        local[:, j] = torch.clamp(rho[:, j, None] * p_row - q_row, min=0).sum(-1, dtype=F64)
    mass = call.comm.gather([local])[0].sum(0).float()
    h = torch.zeros(n, k + 1, dtype=torch.float32, device=dev)
    denom = mass + (1 - rho[:, :k])
    h[:, :k] = torch.where(mass > 0, mass / torch.where(denom > 0, denom, 1.0), 0.0)
    h[:, 0] = 0.0
    jj = torch.arange(k + 1, device=dev)
    h = torch.where(jj[None, :] == k_eff[:, None], rho, h)
    ju = jj[1:].expand(n, k)
    u = rng.uniform(batch.seed_lo[:, None], batch.seed_hi[:, None],
                    plan.positions[:, None] + ju - 1, ju, rng.STREAM_BLOCK_ACCEPT)
    acc = (u <= h[:, 1:]) & (ju <= k_eff[:, None])
    tau = (acc * ju).amax(dim=1) if k else torch.zeros(n, dtype=torch.int64, device=dev)
    return tau, rho.gather(1, tau[:, None]).squeeze(1)


def _choose_path(plan: Plan, vocab: int, device: torch.device) -> int:
    """_PATH_KERNELS when the call runs as the Triton launches of ``_run_kernels`` (the
    Triton backend for the logits' device: CUDA, or Triton's interpreter; temperature only,
    no bans, bias, penalties or filters; one-hot drafts; no logprobs; ids exact in float32),
    else _PATH_GENERAL (processors on a float32 scratch) or _PATH_TORCH. Decided before the
    handshake, which checks that every rank decided the same (the paths run different
    collectives)."""
    from .api import select_backend

    batch = plan.batch
    if batch.needs_general_path:
        return _PATH_GENERAL
    if (not batch.needs_filter and not plan.has_draft_dist and batch.max_logprobs < 0
            and vocab < 2**24 and select_backend(device) == "triton"):
        return _PATH_KERNELS
    return _PATH_TORCH


def _empty_safe(t: torch.Tensor) -> torch.Tensor:
    """``t``, or the workspace's one-element zeros of its dtype when it is empty (never
    read: a kernel argument needs an address)."""
    return t if t.numel() else workspace.zeros((1,), t.dtype, t.device)


def _run_kernels(call: _Call) -> tuple[VerifyOutput, torch.Tensor]:
    """The call as two Triton launches around one all_gather of a per-row payload (no host
    synchronisation; ``_distributed_kernels``): the same outputs as :func:`_run`."""
    from . import _distributed_kernels as dk
    from .triton_backend.launch import launch

    comm, geo, plan = call.comm, call.geo, call.plan
    batch = plan.batch
    x = call.x if call.x.stride(1) == 1 or call.x.shape[1] <= 1 else call.x.contiguous()
    rows, n, k = plan.num_rows, plan.num_requests, plan.max_k
    dev = x.device
    nt = geo.tiles()[1]
    consts = dict(TILE=rng.TILE, SUB=rng.SUBTILE, P=dk.PAYLOAD, SLOT_W=dk.SLOT)
    keys = (batch.seed_lo, batch.seed_hi, plan.positions)
    payload = torch.empty((rows, dk.PAYLOAD), dtype=torch.float32, device=dev)
    if rows:
        scratch = torch.empty(rows * max(nt, 1) * (2 + dk.NSUB), dtype=torch.float32,
                              device=dev)  # (per local tile: max, sum, sub-tile sums)
        launch(dk.shard_pass_kernel)[(rows,)](
            x, x.stride(0), geo.width(), geo.offset(), nt, geo.vocab, plan.row_req,
            plan.row_j, batch.temperature, *keys, scratch, payload, rows, CH=64, **consts)
    gathered = comm.gather_rows(payload)
    tokens = torch.empty((n, k + 1), dtype=torch.int64, device=dev)
    num_accepted = torch.empty(n, dtype=torch.int64, device=dev)
    err = torch.empty(n, dtype=torch.int64, device=dev)
    invalid = torch.empty(n, dtype=torch.int8, device=dev)
    if n:  # (the layout comes from host k_i: distributed calls have no plan.layout_err)
        launch(dk.shard_final_kernel)[(n,)](
            gathered, batch.temperature, *keys, plan.row_start, plan.draft_start,
            plan.k_given, _empty_safe(plan.draft_token_ids), tokens, num_accepted, err,
            invalid, rows, k, comm.world, geo.shard, geo.vocab,
            WB=1 << (comm.world - 1).bit_length(), **consts)
    return VerifyOutput(token_ids=tokens, num_accepted=num_accepted, logprobs=None,
                        logprob_token_ids=None, invalid=invalid.view(torch.bool)), err


def _run(call: _Call) -> tuple[VerifyOutput, torch.Tensor]:
    """The whole call on this rank (every rank runs the same collectives in the same order).
    Mirrors ``torch_backend.verify``."""
    comm, geo, plan = call.comm, call.geo, call.plan
    batch = plan.batch
    n, k, req = plan.num_requests, plan.max_k, plan.row_req
    off, w = geo.offset(), geo.width()
    x = call.x
    dev = x.device
    general = call.path == _PATH_GENERAL  # (agreed by every rank in the handshake)
    # 1. Row maxima, first argmax, draft row flags (one all_gather).
    rmax, rarg = _rowmax(x)
    pieces = [rmax, rarg + off]
    y = x
    if general:
        # (a float32 [T, V] scratch holding this shard at its global columns: the
        # processors of specsample.processing work on whole rows)
        scratch = x.new_zeros((plan.num_rows, geo.vocab), dtype=torch.float32)
        scratch[:, off:off + w] = x
        apply_bans(scratch, plan)
        ban_max, _ = _rowmax(scratch[:, off:off + w])
        apply_bias_and_penalties(scratch, plan)
        y = scratch[:, off:off + w]
        pmax, parg = _rowmax(y)
        pieces += [ban_max, pmax, parg + off]
    if plan.draft_logits is not None:
        pieces.append(_rowmax(call.draft)[0])
    elif plan.draft_probs is not None:
        qd = call.draft
        pieces += [(~torch.isfinite(qd) | (qd < 0)).any(-1), (qd > 0).any(-1)]
    got = comm.gather(pieces)
    err, m64, greedy_ids = _errors(call, got, general)
    dmax = got[-1].amax(0) if plan.draft_logits is not None else None
    invalid = err != 0
    bad_rows = invalid[req] | ~plan.row_live
    m = torch.where(torch.isfinite(m64), m64, 0.0).float()
    if bool(bad_rows.any()):  # (as processed_logits: such rows are read, never used)
        y = y.masked_fill(bad_rows[:, None], 0.0)
        m = torch.where(bad_rows, 0.0, m)
    t = batch.temperature[req]
    t = torch.where(t > 0, t, torch.ones_like(t))
    drop = _filter_drop(comm, geo, y, m, plan) if batch.needs_filter else None
    all_rows = torch.arange(plan.num_rows, device=dev)
    if general or drop is not None:
        z = torch.sub(y, m[:, None]).div_(t[:, None])
        if drop is not None:
            z.masked_fill_(drop, -math.inf)
        source = _Source(z, all_rows)
    else:
        source = _Source(y, all_rows, m, t)

    def z_rows(r: torch.Tensor) -> torch.Tensor:
        return _Source(source.src, r, None if source.m is None else m[r],
                       None if source.t is None else t[r]).full()

    greedy_req = batch.temperature == 0
    sampled_rows = (~greedy_req[req]).nonzero().squeeze(1)
    sampled_dist = ~greedy_req & plan.has_draft_dist
    any_dist = plan.has_draft_dist and bool(sampled_dist.any())
    modes = {p.logprobs_mode for p in batch.params} if batch.max_logprobs >= 0 else set()
    need_lse = sampled_rows.numel() > 0 or "processed" in modes or any_dist
    rows, d, didx = torch_backend._grid(plan)
    # 2. Row masses (the normaliser), boundary tiles, values at the drafts (one all_gather).
    target = None
    lse = None
    if need_lse:
        mass = _exp_mass(source.src, source.m, source.t, off)
        pieces = [mass.sum(-1)]
        if sampled_rows.numel():
            sub_src = _Source(source.src, sampled_rows,
                              None if source.m is None else m[sampled_rows],
                              None if source.t is None else t[sampled_rows])
            target = _Part(sub_src, mass[sampled_rows], batch.seed_lo[req][sampled_rows],
                           batch.seed_hi[req][sampled_rows], plan.row_pos[sampled_rows],
                           rng.STREAM_SAMPLE, rng.STREAM_SAMPLE_TILE)
            pieces.append(target.boundary_payload(geo))
        if any_dist:
            dsafe = d.clamp(0, geo.vocab - 1)
            rk = rows[:, :k]
            zsrc = _Source(source.src, rk.reshape(-1),
                           None if source.m is None else m[rk.reshape(-1)],
                           None if source.t is None else t[rk.reshape(-1)])
            zx = _owned_values(call, lambda c: zsrc.at(c.reshape(-1, 1))[:, 0].view(n, k),
                               dsafe, w)
            q, qsum = _draft_q(call, dmax)
            dq = q.shape[1]
            qx = _owned_values(call, lambda c: q[didx, c], dsafe, dq)
            pieces += [zx, qx] + ([qsum] if plan.draft_logits is not None else [])
        g1 = comm.gather(pieces)
        lse = torch.log(g1[0].sum(0)).float()
        if target is not None:
            target.boundary = g1[1]
    greedy_mask = greedy_req[req]
    y_tok = greedy_ids.clone()
    accept = d == y_tok[rows][:, :k]
    parts = [target] if target is not None else []
    res_info = None
    if any_dist:
        at = 2 if target is not None else 1
        zx, qx = g1[at].sum(0).float(), g1[at + 1].sum(0).float()
        qsum_all = g1[at + 2].sum(0) if plan.draft_logits is not None else None
        p_x = torch.exp(zx - lse[rows[:, :k]])
        q_x = qx if qsum_all is None else qx / qsum_all.float()[didx]
        k_eff = plan.k_eff
        if plan.method == "block":
            n_acc_dist, rho_tau = _block_tau(call, p_x, q_x, z_rows, lse, q, qsum_all, rows,
                                             didx, sampled_dist)
        else:
            ju = torch.arange(k, device=dev)
            u = rng.uniform(batch.seed_lo[:, None], batch.seed_hi[:, None],
                            plan.positions[:, None] + ju, torch.zeros_like(ju),
                            rng.STREAM_ACCEPT)
            acc_dist = (u * q_x < p_x) & (ju < k_eff[:, None])
            n_acc_dist = torch.cumprod(acc_dist.to(torch.int64), dim=1).sum(1)
            rho_tau = torch.ones(n, dtype=torch.float32, device=dev)
        accept = torch.where(sampled_dist[:, None],
                             torch.arange(k, device=dev) < n_acc_dist[:, None], accept)
        a = n_acc_dist
        need = sampled_dist & (a < k_eff)
        if bool(need.any()):
            ridx = need.nonzero().squeeze(1)
            ar = a[ridx]
            r = plan.row_start[ridx] + ar
            p_row = torch.exp(z_rows(r) - lse[r, None])
            q_row = _q_rows(call, q, qsum_all, plan.draft_start[ridx] + ar)
            wres = torch.clamp(rho_tau[ridx, None] * p_row - q_row, min=0)
            rmass = _tile_partials(wres, off)
            res = _Part(_Source(torch.log(wres), torch.arange(ridx.numel(), device=dev)),
                        rmass, batch.seed_lo[ridx], batch.seed_hi[ridx],
                        plan.positions[ridx] + ar, rng.STREAM_RESIDUAL,
                        rng.STREAM_RESIDUAL_TILE)
            g = comm.gather([res.boundary_payload(geo), rmass.sum(-1)])
            res.boundary = g[0]
            parts.append(res)
            res_info = (ridx, ar, r, g[1].sum(0) > 0)
    # 3. The draws (two all_gathers for every part together).
    drawn = _draw(comm, geo, parts) if parts else []
    if target is not None:
        y_tok[sampled_rows] = drawn[0]
    y_tok = torch.where(greedy_mask, greedy_ids, y_tok)
    y_grid = y_tok[rows]
    if not any_dist:
        accept = d == y_grid[:, :k]
    emit = y_grid
    if res_info is not None:
        ridx, ar, r, nonzero = res_info
        emit = emit.clone()
        emit[ridx, ar] = torch.where(nonzero, drawn[-1], y_tok[r])
    num_accepted, token_ids, emitted = accepted_grid(accept, d, emit, plan.k_eff, invalid)
    logprobs = logprob_ids = None
    if batch.max_logprobs >= 0:
        logprobs, logprob_ids = _logprobs(call, z_rows, lse, got[0].amax(0), rows, token_ids,
                                          emitted, modes)
    return VerifyOutput(token_ids=token_ids, num_accepted=num_accepted, logprobs=logprobs,
                        logprob_token_ids=logprob_ids, invalid=invalid), err


def _logprobs(call: _Call, z_rows, lse, raw_max, rows, tokens, emitted, modes):
    """Logprobs [N, K+1, 1+n] and ids as ``torch_backend.emitted_logprobs``: the normalisers
    by gathered float64 masses, column 0 from the token's owner, the top-n by merging every
    shard's top-n (value, then lower id): one all_gather."""
    batch, geo = call.plan.batch, call.geo
    n = batch.max_logprobs
    off, w = geo.offset(), geo.width()
    flat = rows.reshape(-1)
    tok = tokens.reshape(-1).clamp_min(0)
    processed = batch.logprobs_processed[:, None].expand_as(rows).reshape(-1)
    any_proc, all_proc = "processed" in modes, modes == {"processed"}
    mraw = torch.where(torch.isfinite(raw_max), raw_max, 0.0).float()[flat]
    xr = call.x[flat].float() if not all_proc else None
    zr = z_rows(flat) if any_proc else None
    pieces = []
    if xr is not None:
        pieces.append(torch.exp(xr - mraw[:, None]).sum(-1, dtype=F64))
    rank = xr if zr is None else zr if xr is None else torch.where(processed[:, None], zr, xr)
    pieces.append(_owned_values(call, lambda c: rank.gather(1, c[:, None])[:, 0], tok, w))
    if n:
        cv, ci = _local_top(rank, n, off)
        pieces += [cv, ci]
    got = call.comm.gather(pieces)
    if xr is not None:
        raw_lse = torch.log(got[0].sum(0)).float()
        got = got[1:]

    def normalise(v: torch.Tensor) -> torch.Tensor:
        """Logprobs of ranked values v [R, c]: z - lse or log_softmax of the raw row."""
        v = v.float()
        proc = v - lse[flat][:, None] if any_proc else None
        if xr is None:
            return proc
        raw = (v - mraw[:, None]) - raw_lse[:, None]
        return raw if proc is None else torch.where(processed[:, None], proc, raw)

    col0 = normalise(got[0].sum(0)[:, None])
    vals, ids = col0, tok[:, None]
    if n:
        mv, mid = _merge(got[1], got[2])
        mv, mid = mv[:, :n], mid[:, :n]
        real = mid < NONE_ID
        vals = torch.cat([col0, torch.where(real, normalise(mv), -math.inf)], dim=1)
        ids = torch.cat([ids, torch.where(real, mid, -1).to(torch.int64)], dim=1)
    vals = vals.reshape(*rows.shape, n + 1)
    ids = ids.reshape(*rows.shape, n + 1)
    col = torch.arange(n + 1, device=rows.device)
    want = batch.logprobs_n.clamp_min(0)[:, None, None]
    keep = emitted[:, :, None] & ((col == 0) | (col <= want))
    vals = torch.where(keep, vals, torch.full_like(vals, -math.inf))
    ids = torch.where(keep, ids, torch.full_like(ids, -1))
    return vals, ids


# ---------------------------------------------------------------------------- the calls


def _placeholder(t: torch.Tensor, width: int) -> torch.Tensor:
    """A stride-0 [rows, width] view standing for the whole rows (validation, layout)."""
    col = t[:, :1] if t.shape[1] else t.new_zeros((t.shape[0], 1))
    return col.expand(t.shape[0], width)


def _prepare(op: str, local_logits, batch, group, *, draft_token_ids, num_draft_tokens,
             local_draft_logits, local_draft_probs, positions, method, strict) -> _Call:
    """Validate locally, handshake, share rank 0's random keys; a ValueError on every rank
    if any rank's arguments are wrong or the ranks disagree."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"specsample.distributed.{op}(): torch.distributed is not initialised "
                         "(call torch.distributed.init_process_group first)")
    home = local_logits.device if isinstance(local_logits, torch.Tensor) else torch.device("cpu")
    comm = _Comm(group, home)
    error = desc = exc = None
    try:
        from .api import _check_not_capturing

        _check_not_capturing(strict, op)
        if not isinstance(batch, SamplingBatch):
            raise ValueError(f"batch must be a SamplingBatch, got {type(batch).__name__}")
        geo = _Geometry(batch.vocab_size, comm.world, comm.rank)
        name = "local_logits" if op == "sample" else "local_target_logits"
        if not isinstance(local_logits, torch.Tensor) or local_logits.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [rows, S], got "
                             f"{getattr(local_logits, 'shape', type(local_logits).__name__)}")
        if local_logits.shape[1] != geo.shard:
            raise ValueError(
                f"{name} has {local_logits.shape[1]} columns; the shard width is S = "
                f"ceil(V / world size) = ceil({geo.vocab} / {comm.world}) = {geo.shard}")
        draft = local_draft_logits if local_draft_logits is not None else local_draft_probs
        dname = "local_draft_logits" if local_draft_logits is not None else "local_draft_probs"
        if draft is not None and local_draft_logits is not None and (
                local_draft_probs is not None):
            raise ValueError("give local_draft_logits or local_draft_probs, not both")
        if draft is not None:
            if not isinstance(draft, torch.Tensor) or draft.dim() != 2:
                raise ValueError(f"{dname} must be a 2-D tensor")
            if draft.shape[1] > geo.shard:
                raise ValueError(f"{dname} has {draft.shape[1]} columns; at most S = "
                                 f"{geo.shard} (the shard width)")
        if positions is None and batch.user_seeded:
            raise ValueError("positions is required when a request has a user-given seed")
        ph = None if draft is None else _placeholder(draft, geo.vocab)
        plan = build_plan(
            _placeholder(local_logits, geo.vocab), batch, draft_token_ids=draft_token_ids,
            num_draft_tokens=num_draft_tokens,
            draft_logits=ph if local_draft_logits is not None else None,
            draft_probs=ph if local_draft_probs is not None else None,
            positions=(torch.zeros(batch.num_requests, dtype=torch.int64)
                       if positions is None else positions),
            method=method, logits_name=name)
        desc = [geo.vocab, plan.num_rows, local_logits.shape[1], plan.num_requests,
                int(plan.draft_token_ids.numel()), _crc(plan.num_draft), METHODS.index(method),
                0 if draft is None else 1 if local_draft_logits is not None else 2,
                _DTYPES[local_logits.dtype], 0 if draft is None else _DTYPES[draft.dtype],
                _batch_crc(batch),
                int(positions is None), int(strict), int(local_logits.is_cuda),
                _choose_path(plan, geo.vocab, local_logits.device),
                0 if draft is None else draft.shape[1]]
    except Exception as e:  # noqa: BLE001 - every rank must reach the handshake
        exc, error = e, f"specsample.distributed.{op}(): {e}"
    got = _handshake(comm, desc, error, exc)
    vd = geo.vocab
    xd = None
    if draft is not None:
        vd = _draft_vocab(geo, [r[-1] for r in got])
        xd = draft[:, :geo.width(vocab=vd)]
    dev = local_logits.device
    pos = fresh_positions(batch, dev) if positions is None else plan.positions
    if positions is None or any(p.seed is None for p in batch.params):
        # ([3, N] padded to an even N: each row starts 16-byte aligned, as the Triton
        # kernels were compiled for at warmup)
        keys = torch.stack([batch.seed_lo.to(dev), batch.seed_hi.to(dev), pos])
        nreq = batch.num_requests
        if nreq % 2:
            keys = torch.nn.functional.pad(keys, (0, 1))
        keys = comm.broadcast_from_first(keys)[:, :nreq]
        batch = dataclasses.replace(batch, seed_lo=keys[0], seed_hi=keys[1])
        pos = keys[2]
    plan = dataclasses.replace(plan, batch=batch, positions=pos)
    return _Call(comm, geo, plan, local_logits[:, :geo.width()], xd, vd, got[0][-2])


def _finish(call: _Call, op: str, strict: bool) -> VerifyOutput:
    from .api import _current_device

    kernels = call.path == _PATH_KERNELS
    paths.record(f"distributed.{op}.{'kernels' if kernels else 'torch'}", call.plan.num_rows)
    with _current_device(call.x):  # (the Triton launches address the current CUDA device)
        out, err = _run_kernels(call) if kernels else _run(call)
    if strict and bool((err != 0).any()):
        codes = err.tolist()
        raise SamplingError([i for i, c in enumerate(codes) if c],
                            torch_backend.describe_errors(codes))
    return out


def sample(local_logits: torch.Tensor, batch: SamplingBatch, *, group=None, positions=None,
           strict: bool = True) -> SampleOutput:
    """:func:`specsample.sample` on vocabulary-sharded logits; every rank of ``group`` calls it.

    Args:
        local_logits: [N, S] float32 / float16 / bfloat16, this rank's columns
            ``[rank * S, (rank + 1) * S)`` of the raw logits, S = ceil(V / world size)
            (V = ``batch.vocab_size``); columns at or beyond V are padding, never read.
        batch: the same SamplingBatch on every rank (built with the global V); requests
            without a seed use rank 0's random seeds.
        group: the torch.distributed process group (None: the default group); NCCL with CUDA
            tensors, gloo with CPU tensors.
        positions: as in :func:`specsample.sample`; with None, rank 0's ``fresh_counter``
            decides (every rank advances its own).
        strict: as in :func:`specsample.sample`.

    Returns:
        SampleOutput, the same on every rank and equal to ``specsample.sample`` on the whole
        rows (up to float rounding of the masses, which only matters at near-ties).

    Raises:
        ValueError: on every rank, when any rank's arguments are invalid (as
            :func:`specsample.sample`, or a width other than S) or the ranks disagree on
            shapes, vocabulary, dtypes, parameters or positions=None.
        SamplingError: with strict=True, on every rank, for invalid data on any shard.
    """
    n = batch.num_requests if isinstance(batch, SamplingBatch) else 0
    call = _prepare("sample", local_logits, batch, group, draft_token_ids=None,
                    num_draft_tokens=[0] * n, local_draft_logits=None, local_draft_probs=None,
                    positions=positions, method="token", strict=strict)
    out = _finish(call, "sample", strict)
    lp = None if out.logprobs is None else out.logprobs[:, 0]
    lp_ids = None if out.logprob_token_ids is None else out.logprob_token_ids[:, 0]
    return SampleOutput(token_ids=out.token_ids[:, 0], logprobs=lp, logprob_token_ids=lp_ids,
                        invalid=out.invalid)


def verify(local_target_logits: torch.Tensor, draft_token_ids, num_draft_tokens,
           batch: SamplingBatch, *, group=None, local_draft_logits: torch.Tensor | None = None,
           local_draft_probs: torch.Tensor | None = None, positions=None,
           method: str = "token", strict: bool = True) -> VerifyOutput:
    """:func:`specsample.verify` on vocabulary-sharded logits; every rank of ``group`` calls it.

    Args:
        local_target_logits: [T, S] this rank's columns ``[rank * S, (rank + 1) * S)`` of the
            raw target logits (T = N + sum k_i, S = ceil(V / world size)); padding columns at
            or beyond V are never read.
        draft_token_ids, num_draft_tokens, batch, positions, method, strict: as in
            :func:`specsample.verify`, the same on every rank.
        group: the process group (None: the default group).
        local_draft_logits / local_draft_probs: [sum k_i, S'] this rank's columns of the
            drafter's logits / probabilities, sharded like the target's: rank r holds the
            draft-vocabulary columns ``[r * S, r * S + S')``. Either every rank passes S
            columns (V' = V; padding past V is never read), or each rank passes exactly its
            columns below V' (S on the first ranks, then the remainder, then 0 columns), so
            V' is the sum of the widths.

    Returns:
        VerifyOutput, the same on every rank and equal to ``specsample.verify`` on the whole
        rows (up to float rounding of the masses, which only matters at near-ties).

    Raises:
        ValueError: on every rank, for invalid arguments on any rank or ranks that disagree.
        SamplingError: with strict=True, on every rank, for invalid data on any shard.
    """
    call = _prepare("verify", local_target_logits, batch, group,
                    draft_token_ids=draft_token_ids, num_draft_tokens=num_draft_tokens,
                    local_draft_logits=local_draft_logits, local_draft_probs=local_draft_probs,
                    positions=positions, method=method, strict=strict)
    return _finish(call, "verify", strict)


def warmup(vocab_size: int, *, group=None, device=None, draft_vocab_size: int | None = None,
           dtypes=(torch.bfloat16, torch.float16, torch.float32), methods=("token", "block"),
           on_compile: str = "warn") -> int:
    """:func:`specsample.warmup` for the vocabulary-parallel entry points; every rank of
    ``group`` calls it. Runs :func:`sample` and :func:`verify` once per target dtype, draft
    kind (one-hot, draft_logits, draft_probs) and method, with greedy and sampled requests,
    min_p / top_k / top_p, the general path (logit bias) and logprobs (raw and processed,
    top-n), on shards of ``vocab_size`` (``draft_vocab_size``: the drafter's, default the
    same) on ``device`` (default: the current CUDA device with NCCL, else the CPU). On CUDA
    this compiles the Triton kernels these calls launch; then the compile guard is armed as
    by :func:`specsample.warmup` (``on_compile``; on CPU tensors nothing is compiled and no
    guard is armed). Returns the number of calls.

    Raises:
        ValueError: an unknown ``on_compile`` or dtype, or a vocabulary below 1.
    """
    import dataclasses as _dc

    from .params import SamplingParams as P

    if on_compile not in ("warn", "raise", "ignore"):
        raise ValueError(f"on_compile must be 'warn', 'raise' or 'ignore', got {on_compile!r}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    for dtype in dtypes:
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"unsupported dtype {dtype}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if device is None:
        nccl = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    device = torch.device(device)
    dv = draft_vocab_size or vocab_size
    s = -(-vocab_size // world)
    # the drafter's columns [rank * s, rank * s + w): all s with the target's vocabulary, else
    # exactly those below its own (see verify)
    dw = s if dv == vocab_size else max(0, min(s, dv - rank * s))
    gen = torch.Generator(device="cpu").manual_seed(0)  # (the same values on every rank)
    mixes = [
        [P(temperature=0.0), P(temperature=0.8, seed=1)],
        [P(temperature=0.0), P(temperature=0.8, seed=1, top_k=5, top_p=0.9, min_p=0.01)],
        [P(temperature=0.0, logit_bias={0: 0.5}), P(temperature=0.8, seed=1, top_p=0.9)],
    ]
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    k = [2, 1]

    def shard(full: torch.Tensor, width: int, dtype) -> torch.Tensor:
        """This rank's columns of rows ``full`` [R, world * s]."""
        return full[:, rank * s:rank * s + width].to(device=device, dtype=dtype).contiguous()

    def logits(rows: int, cols: int) -> torch.Tensor:
        full = torch.randn(rows, world * s, generator=gen)
        full[:, cols:] = 0.0  # (padding past the vocabulary, never read)
        return full

    calls = 0
    for dtype in dtypes:
        for plist in mixes:
            with_lp = [[_dc.replace(p, logprobs=n, logprobs_mode=mode) for p in plist]
                       for n, mode in ((0, "raw"), (2, "processed"), (2, "raw"))]
            for params in [plist] + with_lp:
                batch = SamplingBatch.from_params(params, vocab_size=vocab_size, device=device)
                sample(shard(logits(2, vocab_size), s, dtype), batch, group=group,
                       positions=pos, strict=False)
                calls += 1
            batch = SamplingBatch.from_params(plist, vocab_size=vocab_size, device=device)
            drafts = torch.randint(0, min(vocab_size, dv), (3,), generator=gen).to(device)
            rows = shard(logits(5, vocab_size), s, dtype)
            for method in methods:
                verify(rows, drafts, k, batch, group=group, positions=pos, method=method,
                       strict=False)
                full = logits(3, dv)
                verify(rows, drafts, k, batch, group=group,
                       local_draft_logits=shard(full, dw, dtype), positions=pos,
                       method=method, strict=False)
                probs = torch.softmax(full[:, :dv], -1)
                verify(rows, drafts, k, batch, group=group,
                       local_draft_probs=shard(torch.cat(
                           [probs, torch.zeros(3, world * s - dv)], 1), dw, dtype),
                       positions=pos, method=method, strict=False)
                calls += 3
    if device.type == "cuda":
        from . import triton_backend

        torch.cuda.synchronize(device)
        triton_backend.install_compile_guard(on_compile)
    return calls
