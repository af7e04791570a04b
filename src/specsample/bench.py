"""Benchmark harness: verify() and sample() against the memory-bandwidth floor.

Run ``python -m specsample.bench --out DIR`` (or ``specsample bench``). For every case it
measures our call (the fused path; on a GPU the general path and the PyTorch backend are
forbidden, see :mod:`specsample.paths`) and our own unfused baseline (an FP32 copy of the target
logits, then the general path), and writes a table to stdout, ``bench.json`` and ``bench.png``
into the output directory.

Protocol (the reference measurement of docs/design.md):

* verify(): V = 151,936, K = 4, B in 1, 8, 32, 128, bf16 target logits [B (K+1), V], one-hot
  drafts and draft logits [B K, V], temperatures 0.7, 1.0 and "mix" (requests alternate 0.0 and
  1.0; at B = 1 that is a single greedy request). sample(): V = 248,320, B in 1, 128.
* Inputs are realistic (see :func:`zipf_logits`) and drafts give mixed acceptance (see
  :func:`onehot_drafts`, :func:`perturbed_draft_logits`); seeds and positions are fixed and
  calls use ``strict=False`` (no host synchronisation).
* Time: the median of ``triton.testing.do_bench`` eagerly and of ``CUDAGraph.replay()``.
  do_bench clears the L2 cache (writes a 256 MB buffer) before every timed call, so every
  measurement is cold-L2 even at B = 1, where the inputs would fit in L2: the figures are
  upper bounds for a kernel that runs right after the LM head wrote the logits.
* Floor: the bytes of logits read once divided by the device-to-device copy bandwidth measured
  in the same run (``dst.copy_(src)`` of 2 GiB, read + written bytes over the median time).
  For draft logits the target adds the unavoidable second read of each rejected (target, draft)
  row pair: 2 V bytes-per-element for every sampled request that rejected a draft, counted
  from the run's own ``num_accepted``.
* Peak temporary memory: ``max_memory_allocated`` during one eager call minus what was
  allocated before it (inputs excluded, outputs included).
* Host time (column ``host``, CUDA only): the median wall time of one eager call until it
  returns, with the device idle before it: the Python work and launches an engine pays per
  call (compare with eager minus graph replay); column ``cpu`` (``host_cpu_us`` in
  bench.json): the calling thread's CPU time in the same calls. The harness repeats each
  call with the same batch and inputs, so eager calls are replayed
  (``specsample.call_cache``) as an engine's steps are; run with ``SPECSAMPLE_CALL_CACHE=0``
  for the host time without replay.

Extra cases: ``--block`` adds token-level verification with draft probabilities and block
verification with draft logits and draft probabilities; ``--draft-counts varying,device`` adds
one-hot cases whose requests draft i mod (K + 1) tokens, or whose ``num_draft_tokens`` is a
device tensor with ``max_num_draft_tokens=K``; ``--options`` adds filter and logprob cases,
and the logprob ones are timed beside the PyTorch code a caller would write instead
(``log_softmax`` in float32, ``topk``, a gather; column ``base graph``). ``--trees [M,...]``
(default 16,64) adds ``verify_tree()`` of one-hot (deterministic) trees of M nodes per request
(:func:`tree_shape`, children from :func:`tree_tokens`), T = 1, and beside each the same target
rows verified as one chain (``verify()`` with k = M drafts: M + 1 rows per request, the same
bytes); floor: the node rows read once. Both are timed eagerly and under graph replay (the
tree's structure is laid out by the first, eager call; the captured call reads the node
tokens on the device).

On a CPU (no CUDA) the harness runs the PyTorch backend with ``time.perf_counter`` medians and
no graph replay (``--quick`` gives smoke-test sizes); without ``--device cpu``, ``--quick`` or
a size it refuses (exit status 2), since the full sizes take minutes per case there.
``--cpu-check`` times the CPU path per option instead (:data:`CPU_CASES`), each against one
``torch.softmax`` over the same rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import paths
from .api import sample, select_backend, verify
from .params import SamplingBatch, SamplingParams
from .tree import verify_tree

TEMPERATURE_LABELS = ("0.7", "1.0", "mix")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
COPY_BYTES = 2 * 2**30  # size of the bandwidth-measuring copy on a GPU
COPY_BYTES_CPU = 256 * 2**20
ONEHOT_TOP_PROB = 0.7  # a one-hot draft is the row's top token with this probability
DRAFT_NOISE = 1.0  # std of the Gaussian noise added to target logits to make draft logits
NOOP_BIAS = {0: 0.0}  # a logit_bias that changes no logit (the unfused baseline's batch)
HISTORY = 2048  # output tokens per request of the penalty and ban cases (random ids)
#: Option cases (label -> temperature and SamplingParams fields): the filters of common open
#: models' generation configs, and the logprobs that API servers and RL rollouts ask for.
OPTION_CASES = {
    "T0.7+k20+p0.8": (0.7, dict(top_k=20, top_p=0.8)),
    "T0.6+p0.9": (0.6, dict(top_p=0.9)),
    "T1.0+minp0.1": (1.0, dict(min_p=0.1)),
    "T1.0+k50": (1.0, dict(top_k=50)),
    "T1.0+p0.9": (1.0, dict(top_p=0.9)),  # (a nucleus of thousands of tokens on these rows)
    "lp0-raw": (1.0, dict(logprobs=0)),
    "lp0-processed": (1.0, dict(logprobs=0, logprobs_mode="processed")),
    "lp5-raw": (1.0, dict(logprobs=5)),
    "lp20-processed": (1.0, dict(logprobs=20, logprobs_mode="processed")),
    # logit_bias / penalties: HISTORY output tokens per request; BIAS_TOKENS biased ids each
    "T1.0+rep1.1+pres0.5": (1.0, dict(repetition_penalty=1.1, presence_penalty=0.5)),
    "T1.0+bias16": (1.0, dict(logit_bias="random")),
    # penalties with the filters: Qwen2.5's generation config, and top_p with presence
    "T0.7+k20+p0.8+rep1.05": (0.7, dict(top_k=20, top_p=0.8, repetition_penalty=1.05)),
    "T0.6+p0.9+pres0.5": (0.6, dict(top_p=0.9, presence_penalty=0.5)),
    # bans: BAD_WORDS random bad words of 1-3 tokens and min_tokens (2 random stop tokens,
    # banned at rows 0-7: HISTORY outputs so far); ALLOWED random allowed ids per request
    "T1.0+bans": (1.0, dict(bad_words_token_ids="random", min_tokens=HISTORY + 8,
                            stop_token_ids="random")),
    "T1.0+allowed1024": (1.0, dict(allowed_token_ids="random")),
    # penalties and filters with logprobs: an API server's logprobs = 0 (raw, the default)
    # under Qwen2.5's defaults and its top-5 (raw) with penalties, and an RL rollout's
    # processed top-5 with penalties
    "T0.7+k20+p0.8+rep1.05+lp0": (0.7, dict(top_k=20, top_p=0.8, repetition_penalty=1.05,
                                           logprobs=0)),
    "T1.0+rep1.1+pres0.5+lp5-raw": (1.0, dict(repetition_penalty=1.1, presence_penalty=0.5,
                                              logprobs=5)),
    "T1.0+rep1.1+pres0.5+lp5-processed": (1.0, dict(repetition_penalty=1.1, presence_penalty=0.5,
                                                    logprobs=5, logprobs_mode="processed")),
}
BIAS_TOKENS = 16  # logit_bias entries per request of the bias case (random ids, |bias| <= 2)
BAD_WORDS = 8  # bad words per request of the ban case (random ids)
ALLOWED = 1024  # allowed ids per request of the allowed_token_ids case (random ids)

# Performance targets (GPU, graph replay; docs/design.md).
VERIFY_FLOOR_RATIO = 1.25  # at B = 128
VERIFY_B1_US = 8.0
PEAK_TEMP_MIB = 0.5  # at B = 128
SAMPLE_B1_US = 10.0
SAMPLE_FLOOR_RATIO = 1.5  # at B = 128
TREE_FLOOR_RATIO = 1.5  # verify_tree, 64 nodes per request at B = 32 (issue 10)
TREE_BRANCHING = (4, 2)  # --trees: 4 children at the root, then 2 per node (last repeats)
CPU_CHECK_RATIO = 2.0


# --------------------------------------------------------------------------- inputs


def zipf_logits(rows: int, vocab: int, *, dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> torch.Tensor:
    """[rows, vocab] realistic raw logits: a peaked, Zipf-like profile in a random order.

    Row r: the token of rank i (a random permutation of the vocabulary) gets
    ``a_r - b_r * log(1 + i) + 0.25 * N(0, 1)`` with ``a_r ~ U(10, 25)`` and ``b_r ~ U(1.5, 3)``,
    so at temperature 1 the top token has probability about 1 / zeta(b_r), 0.38 to 0.83, and
    the tail falls off like ``(1 + i) ** -b_r`` (about ``b_r * 12`` nats below the top at the
    end of a 151,936-wide row). Generated in float32 on ``device``, returned in ``dtype``.
    """
    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(rows, 1, device=device, generator=generator)

    rank = torch.arange(vocab, device=device, dtype=torch.float32)
    profile = uniform(10.0, 25.0) - uniform(1.5, 3.0) * torch.log1p(rank)
    profile += 0.25 * torch.randn(rows, vocab, device=device, generator=generator)
    order = torch.rand(rows, vocab, device=device, generator=generator).argsort(dim=1)
    return torch.empty_like(profile).scatter_(1, order, profile).to(dtype)


def onehot_drafts(draft_rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[R] int64 one-hot drafts for target rows ``draft_rows`` [R, V]: the row's top token with
    probability ``ONEHOT_TOP_PROB``, else a uniformly random token (mixed acceptance)."""
    r, v = draft_rows.shape
    dev = draft_rows.device
    top = draft_rows.argmax(dim=1)
    other = torch.randint(0, v, (r,), device=dev, generator=generator)
    pick_top = torch.rand(r, device=dev, generator=generator) < ONEHOT_TOP_PROB
    return torch.where(pick_top, top, other)


def perturbed_draft_logits(draft_rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[R, V] draft logits close to, not equal to, the target rows: ``z + DRAFT_NOISE * N(0, 1)``
    in the target's dtype (a drafter that mostly agrees with the target on the top tokens)."""
    noise = torch.randn(draft_rows.shape, device=draft_rows.device, generator=generator)
    return (draft_rows.float() + DRAFT_NOISE * noise).to(draft_rows.dtype)


def drafter_samples(draft_logits: torch.Tensor, temperatures: torch.Tensor,
                    generator: torch.Generator) -> torch.Tensor:
    """[R] int64 drafts drawn as the drafter would: from softmax(draft_logits / T) per row
    (Gumbel-max), argmax where T = 0. ``temperatures``: [R] float32."""
    z = draft_logits.float()
    u = torch.rand(z.shape, device=z.device, generator=generator).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(u))
    t = temperatures[:, None]
    keys = torch.where(t > 0, z / t.clamp_min(1e-6) + gumbel, z)
    return keys.argmax(dim=1)


def request_temperatures(label: str, n: int) -> list[float]:
    """Per-request temperatures: every request at ``float(label)``, or "mix": 0.0, 1.0, 0.0, ..."""
    if label == "mix":
        return [float(i % 2) for i in range(n)]
    return [float(label)] * n


def tree_shape(nodes: int, branching: Sequence[int] = TREE_BRANCHING) -> list[int]:
    """Parents (node numbers, 0 = the root) of the ``--trees`` tree of ``nodes`` nodes: built
    breadth-first, a node at depth d gets ``branching[d]`` children (the last entry repeats),
    in node order until ``nodes`` are placed. 16 nodes: 4, 8, then 4 at depth 3 (two under
    each of the first two depth-2 nodes); 64: 4, 8, 16, 32, then 4 at depth 5."""
    parents: list[int] = []
    level, depth = [0], 0
    while len(parents) < nodes:
        width = branching[min(depth, len(branching) - 1)]
        nxt = []
        for node in level:
            for _ in range(width):
                if len(parents) == nodes:
                    break
                parents.append(node)
                nxt.append(len(parents))
        level, depth = nxt, depth + 1
    return parents


def tree_tokens(logits: torch.Tensor, nodes: int, parents: Sequence[int],
                generator: torch.Generator) -> torch.Tensor:
    """[N * nodes] int64 node tokens of N requests' trees of shape ``parents`` (request i's
    rows are ``logits[i (nodes + 1): (i + 1)(nodes + 1)]``, node n's row at offset n): the
    children of a node are the top tokens, in order, of the node's row perturbed by
    ``DRAFT_NOISE`` Gaussian noise (a top-b drafter that mostly agrees with the target), so
    siblings are distinct."""
    v = logits.shape[1]
    n = logits.shape[0] // (nodes + 1)
    ranks: list[int] = []
    seen: dict[int, int] = {}
    for p in parents:  # a child's rank among its siblings
        ranks.append(seen.get(p, 0))
        seen[p] = ranks[-1] + 1
    width = max(seen.values(), default=1)
    par = torch.tensor(parents, dtype=torch.int64, device=logits.device)
    rank = torch.tensor(ranks, dtype=torch.int64, device=logits.device)
    rows = logits.float().view(n, nodes + 1, v)
    noisy = rows + DRAFT_NOISE * torch.randn(rows.shape, device=logits.device,
                                             generator=generator)
    top = noisy.topk(width, dim=-1).indices  # [N, nodes + 1, width]
    tok = top[:, par, rank]  # [N, nodes]
    return tok.reshape(-1).cpu()


@dataclass
class Inputs:
    """Everything one timed call needs (all on the benchmark device)."""

    logits: torch.Tensor  # [T, V] target logits (sample: [N, V])
    batch: SamplingBatch  # the case's requests (fused path)
    general_batch: SamplingBatch  # same requests plus a no-op logit_bias (general path)
    positions: torch.Tensor  # [N] int64
    num_draft: list[int] | torch.Tensor  # [N] k_i (a list, or a device tensor: "device")
    drafts: torch.Tensor | None  # [S] int64
    draft_logits: torch.Tensor | None  # [S, V]
    draft_probs: torch.Tensor | None = None  # [S, V] float32
    max_num_draft_tokens: int | None = None  # with a device num_draft ("device" counts)
    parents: torch.Tensor | None = None  # verify_tree: [N * M] int64 on the host


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One benchmark case: ``op`` "verify" (with ``draft`` "onehot" / "draft_logits" /
    "draft_probs") or "sample" (``draft`` None), a temperature label, batch size, drafts per
    request, vocab. ``counts``: "fixed" (k drafts each, a host list), "varying" (request i has
    i mod (k + 1) drafts) or "device" (fixed k, ``num_draft_tokens`` a device tensor with
    ``max_num_draft_tokens=k``: no host read). ``shape``: "tree" (op "verify_tree": a
    one-hot tree of k nodes per request, :func:`tree_shape`) or "chain" (its comparison: one
    chain of k drafts, the same rows); "" otherwise."""

    op: str
    draft: str | None
    temperature: str
    batch: int
    k: int
    vocab: int
    dtype: str
    options: str = ""  # an OPTION_CASES label (its temperature replaces ``temperature``)
    method: str = "token"  # verify(): "token" or "block"
    counts: str = "fixed"
    shape: str = ""

    @property
    def name(self) -> str:
        kind = (self.draft or "sample") + ("+block" if self.method == "block" else "")
        if self.counts != "fixed":
            kind += f"+{self.counts}-k"
        if self.shape:
            kind += f"+{self.shape}{self.k}"
        setting = self.options or f"T={self.temperature}"
        return f"{self.op}/{kind}/{setting}/B={self.batch}"


def build_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    """Generate a case's inputs deterministically (``seed``) on ``device``.

    Requests get seeds 1000 + i and positions 4096 + 64 i. The general-path batch adds
    ``logit_bias={0: 0.0}`` to every request without a logit_bias: adding 0.0 changes no
    logit, but any logit_bias makes ``SamplingBatch.needs_general_path`` true (and
    :func:`make_call`'s "unfused" variant runs inside ``triton_backend.general_path()``), so
    the call takes the general path. The penalty and ban cases give every request HISTORY
    random output tokens; "T1.0+bias16" BIAS_TOKENS random ids biased by U(-2, 2) each, the ban
    cases random words, stop tokens and allowed ids (``OPTION_CASES``).
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    n, k = case.batch, (case.k if case.op in ("verify", "verify_tree") else 0)
    ks = [i % (k + 1) for i in range(n)] if case.counts == "varying" else [k] * n
    extra = {}
    if case.options:
        t_case, extra = OPTION_CASES[case.options]
        temps = [t_case] * n
    else:
        temps = request_temperatures(case.temperature, n)
    history = None
    if any(key.endswith("_penalty") or key in ("min_tokens", "bad_words_token_ids")
           for key in extra):
        history = torch.randint(0, case.vocab, (n, HISTORY), generator=gen, device=device)
        history = history.tolist()
    own = [{} for _ in range(n)]  # (the per-request random fields of the ban cases)
    extra = dict(extra)
    sizes = {"bad_words_token_ids": BAD_WORDS * 2, "stop_token_ids": 2,
             "allowed_token_ids": ALLOWED}
    for key in [key for key, v in extra.items() if v == "random" and key in sizes]:
        ids = torch.rand(n, case.vocab, generator=gen, device=device).argsort(1)[:, :sizes[key]]
        for i, row in enumerate(ids.tolist()):
            # (bad words of 1, 2, 3, 1, 2, ... tokens from the row's ids)
            own[i][key] = (row if key != "bad_words_token_ids" else
                           [row[2 * w:2 * w + 1 + w % 3] for w in range(BAD_WORDS)])
        del extra[key]
    biases = [NOOP_BIAS] * n
    if extra.get("logit_bias") == "random":  # (distinct ids: the first of a random order)
        ids = torch.rand(n, case.vocab, generator=gen, device=device).argsort(1)[:, :BIAS_TOKENS]
        vals = 4 * torch.rand(n, BIAS_TOKENS, generator=gen, device=device) - 2
        biases = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        extra = {key: v for key, v in extra.items() if key != "logit_bias"}
    params = [SamplingParams(temperature=t, seed=1000 + i, **extra, **own[i],
                             **({} if biases[i] is NOOP_BIAS else {"logit_bias": biases[i]}))
              for i, t in enumerate(temps)]
    general = [SamplingParams(temperature=t, seed=1000 + i, logit_bias=biases[i], **extra,
                              **own[i]) for i, t in enumerate(temps)]
    logits = zipf_logits(sum(ks) + n, case.vocab, dtype=DTYPES[case.dtype], device=device,
                         generator=gen)
    drafts = draft_logits = draft_probs = parents = None
    if case.op == "verify_tree":
        shape = tree_shape(k)
        drafts = tree_tokens(logits, k, shape, gen).to(device)  # (captured: read on the device)
        parents = torch.tensor(shape * n, dtype=torch.int64)
    elif sum(ks):
        is_draft = torch.ones(logits.shape[0], dtype=torch.bool, device=device)
        is_draft[torch.tensor(ks, device=device).cumsum(0) + torch.arange(n, device=device)] = (
            False)  # (each request's last row is its bonus row)
        draft_rows = logits[is_draft]
        if case.draft == "onehot":
            drafts = onehot_drafts(draft_rows, gen)
        else:
            draft_logits = perturbed_draft_logits(draft_rows, gen)
            row_t = torch.tensor(temps, device=device).repeat_interleave(
                torch.tensor(ks, device=device))
            drafts = drafter_samples(draft_logits, row_t, gen)
            if case.draft == "draft_probs":  # the drafter's exact distribution, float32
                t = row_t[:, None]
                z = draft_logits.float()
                onehot = torch.zeros_like(z).scatter_(1, z.argmax(1, keepdim=True), 1.0)
                draft_probs = torch.where(t > 0, torch.softmax(z / t.clamp_min(1e-6), -1),
                                          onehot)
                draft_logits = None
    num_draft, max_k = ks, None
    if case.counts == "device":
        num_draft, max_k = torch.tensor(ks, dtype=torch.int64, device=device), k
    return Inputs(
        logits=logits,
        batch=SamplingBatch.from_params(params, vocab_size=case.vocab, device=device,
                                        output_token_ids=history),
        general_batch=SamplingBatch.from_params(general, vocab_size=case.vocab, device=device,
                                                output_token_ids=history),
        positions=4096 + 64 * torch.arange(n, dtype=torch.int64, device=device),
        num_draft=num_draft, drafts=drafts, draft_logits=draft_logits, draft_probs=draft_probs,
        max_num_draft_tokens=max_k, parents=parents,
    )


def make_call(case: Case, inp: Inputs, variant: str) -> Callable[[], object]:
    """The timed callable. "fused": our call as a user makes it. "unfused": ``logits.float()``
    (FP32 materialisation, timed) then the same call with the general-path batch, inside
    ``triton_backend.general_path()`` (logit_bias and penalties take the general path too)."""
    if variant == "fused":
        def prepare():
            return inp.logits, inp.batch
    else:
        def prepare():
            return inp.logits.float(), inp.general_batch

    if case.op == "sample":
        def call():
            logits, batch = prepare()
            return sample(logits, batch, positions=inp.positions, strict=False)
    elif case.op == "verify_tree":
        def call():
            logits, batch = prepare()
            return verify_tree(logits, inp.drafts, inp.parents, inp.num_draft, batch,
                               positions=inp.positions, strict=False)
    else:
        def call():
            logits, batch = prepare()
            kw = {} if inp.max_num_draft_tokens is None else {
                "max_num_draft_tokens": inp.max_num_draft_tokens}
            return verify(logits, inp.drafts, inp.num_draft, batch,
                          draft_logits=inp.draft_logits, draft_probs=inp.draft_probs,
                          positions=inp.positions, method=case.method, strict=False, **kw)
    if variant == "fused":
        return call
    from . import triton_backend

    def unfused():
        with triton_backend.general_path():
            return call()

    return unfused


def forbidden_paths(backend: str, variant: str) -> tuple[str, ...]:
    """Path patterns forbidden while measuring ``variant`` (only the Triton backend has a
    fused / general split; the PyTorch backend always runs its one path). The general path
    may compute its logprobs in the kernels (``triton.logprobs.fused``)."""
    if backend != "triton":
        return ()
    if variant == "fused":
        return ("triton.*.general", "torch.*")
    return ("triton.sample.fused", "triton.verify.fused", "triton.sample.filtered",
            "triton.verify.filtered", "triton.processing.fused", "torch.*")


# --------------------------------------------------------------------------- timing


def _cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def time_us(fn: Callable[[], object], device: torch.device, *, warmup_ms: int, rep_ms: int,
            cpu_repeats: int) -> float:
    """Median time of ``fn`` in microseconds: ``triton.testing.do_bench`` on CUDA, else the
    median of ``cpu_repeats`` ``time.perf_counter`` runs after one warm-up call."""
    if _cuda(device):
        import triton.testing

        return 1e3 * triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                             return_mode="median")
    fn()
    times = []
    for _ in range(cpu_repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def host_us(fn: Callable[[], object], device: torch.device,
            calls: int = 50) -> tuple[float | None, float | None]:
    """Median host time of one call in microseconds on CUDA ((None, None) elsewhere): the
    Python work and kernel launches until ``fn`` returns, the device idle before each call
    (synchronised), so no call waits for an earlier one's kernels. Returns (wall-clock time,
    the calling thread's CPU time): the host overhead an engine pays per eager call; compare
    with eager minus graph-replay time."""
    if not _cuda(device):
        return None, None
    wall, cpu = [], []
    for _ in range(calls):
        torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(wall), 1e6 * statistics.median(cpu)


def logprob_baseline(case: Case, inp: Inputs) -> Callable[[], object] | None:
    """What a caller would write instead of asking for logprobs (None for cases without
    logprobs): ``torch.log_softmax`` of every row in float32, ``topk(n)`` and the gathered
    logprob of one token per row."""
    n = OPTION_CASES[case.options][1].get("logprobs") if case.options else None
    if n is None:
        return None
    rows = inp.logits
    tok = rows.argmax(-1, keepdim=True)

    def call():
        lp = torch.log_softmax(rows.float(), dim=-1)
        top = lp.topk(n, dim=-1) if n else None
        return lp.gather(1, tok), top
    return call


def capture_graph(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn`` up on a side stream (as the PyTorch docs prescribe), then capture one call.

    Returns the graph and the captured call's output (its tensors are rewritten by every
    replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def kernel_profile(fn: Callable[[], object], device: torch.device, calls: int = 50,
                   top: int = 25) -> dict[str, float]:
    """Mean microseconds per call of ``fn`` spent in each kernel (CUDA: device time of each
    kernel, with ``fn`` typically a graph's replay) or each operator (CPU: its own CPU time),
    over ``calls`` calls under torch.profiler; the ``top`` largest, largest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = _cuda(device)
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    times: dict[str, float] = {}
    for evt in prof.key_averages():
        total = (getattr(evt, "self_device_time_total", 0) if cuda
                 else evt.self_cpu_time_total) or 0
        if total > 0:
            times[evt.key] = times.get(evt.key, 0.0) + total / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:top])


def peak_temp_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory one call of ``fn`` allocates beyond what was allocated before it (MiB);
    None off CUDA."""
    if not _cuda(device):
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def copy_bandwidth(device: torch.device, *, warmup_ms: int, rep_ms: int,
                   cpu_repeats: int) -> float:
    """Device-to-device copy bandwidth in bytes / s: ``dst.copy_(src)`` of 2 GiB (256 MiB on
    CPU), read + written bytes over the median time."""
    nbytes = COPY_BYTES if _cuda(device) else COPY_BYTES_CPU
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, warmup_ms=warmup_ms, rep_ms=rep_ms,
                 cpu_repeats=cpu_repeats)
    return 2 * nbytes / (us * 1e-6)


# --------------------------------------------------------------------------- measuring


@dataclass
class Settings:
    """How to measure: device, do_bench warm-up / repetition (ms), CPU repeats, graphs."""

    device: torch.device
    backend: str
    warmup_ms: int
    rep_ms: int
    cpu_repeats: int
    graphs: bool
    unfused: bool
    profile: bool = False


def measure_variant(case: Case, inp: Inputs, variant: str, cfg: Settings) -> dict:
    """Time one variant eagerly and under graph replay, measure its peak temporary memory, and
    record the paths it ran. Errors (a forbidden path, a failed capture) are recorded, not
    raised. The first eager call's output is kept under "output" for acceptance statistics."""
    fn = make_call(case, inp, variant)
    res: dict = {"eager_us": None, "graph_us": None, "host_us": None, "host_cpu_us": None,
                 "peak_temp_mib": None,
                 "paths": {},
                 "error": None, "graph_error": None, "filter_serial_rows": None,
                 "filter_histogram_rows": None}
    paths.reset()
    with paths.forbid(*forbidden_paths(cfg.backend, variant)):
        try:
            res["output"] = fn()
            if cfg.backend == "triton" and case.options:
                # rows of one call whose candidates overflowed the filter kernels' buffer:
                # the histogram search, or the serial one (the fallbacks)
                from . import triton_backend

                counters = (triton_backend.filter_serial_rows, triton_backend.filter_histogram_rows)
                before = [c(cfg.device) for c in counters]
                fn()
                for c, b in zip(counters, before):
                    res[c.__name__] = c(cfg.device) - b
            res["peak_temp_mib"] = peak_temp_mib(fn, cfg.device)
            res["eager_us"] = time_us(fn, cfg.device, warmup_ms=cfg.warmup_ms,
                                      rep_ms=cfg.rep_ms, cpu_repeats=cfg.cpu_repeats)
            res["host_us"], res["host_cpu_us"] = host_us(fn, cfg.device)
        except Exception as exc:  # recorded in the report; the other cases still run
            res["error"] = f"{type(exc).__name__}: {exc}"
        if res["error"] is None and cfg.graphs:
            try:
                graph, _ = capture_graph(fn)
                res["graph_us"] = time_us(graph.replay, cfg.device, warmup_ms=cfg.warmup_ms,
                                          rep_ms=cfg.rep_ms, cpu_repeats=cfg.cpu_repeats)
                if cfg.profile:
                    res["kernel_us"] = kernel_profile(graph.replay, cfg.device)
                del graph
            except Exception as exc:
                res["graph_error"] = f"{type(exc).__name__}: {exc}"
        if cfg.profile and res["error"] is None and "kernel_us" not in res:
            res["kernel_us"] = kernel_profile(fn, cfg.device)  # (eager: no graph replay)
    res["paths"] = paths.counts()
    return res


def measure_plain(fn: Callable[[], object], cfg: Settings) -> dict:
    """Eager and graph-replay time of a plain PyTorch callable (the logprob baseline)."""
    res: dict = {"eager_us": None, "graph_us": None, "error": None, "graph_error": None}
    try:
        res["eager_us"] = time_us(fn, cfg.device, warmup_ms=cfg.warmup_ms, rep_ms=cfg.rep_ms,
                                  cpu_repeats=cfg.cpu_repeats)
        if cfg.graphs:
            graph, _ = capture_graph(fn)
            res["graph_us"] = time_us(graph.replay, cfg.device, warmup_ms=cfg.warmup_ms,
                                      rep_ms=cfg.rep_ms, cpu_repeats=cfg.cpu_repeats)
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
    return res


def best_us(variant: dict) -> float | None:
    """The figure targets are judged on: graph replay when measured, else eager."""
    return variant["graph_us"] if variant["graph_us"] is not None else variant["eager_us"]


def acceptance(case: Case, inp: Inputs, output) -> dict:
    """Mean accepted drafts and the number of sampled requests that rejected a draft (each
    needs a second read of its rejected (target, draft) row pair when drafts carry logits)."""
    if case.op not in ("verify", "verify_tree") or output is None:
        return {"mean_accepted": None, "rejected_sampled": 0}
    acc = output.num_accepted
    sampled = inp.batch.temperature > 0
    ks = torch.as_tensor(inp.num_draft, device=acc.device)
    rejected = int(((acc < ks) & sampled).sum())
    return {"mean_accepted": float(acc.float().mean()), "rejected_sampled": rejected}


def floor_bytes(case: Case, inp: Inputs, rejected_sampled: int) -> tuple[int, int]:
    """(bytes of logits read once, extra bytes of the unavoidable second reads).

    Read once: target logits, plus draft logits / probs when given. Second reads (draft
    distributions only): one target row and one draft row per sampled request that rejected
    a draft.
    """
    elt = inp.logits.element_size()
    once = inp.logits.numel() * elt
    extra = 0
    draft = inp.draft_logits if inp.draft_logits is not None else inp.draft_probs
    if draft is not None:
        once += draft.numel() * draft.element_size()
        extra = rejected_sampled * case.vocab * (elt + draft.element_size())
    return once, extra


def check_targets(case: Case, fused: dict, floor_target_us: float, cuda: bool,
                  protocol_vocab: bool) -> list[dict]:
    """The performance targets that apply to ``case`` (GPU runs at the protocol vocabulary only)."""
    if not cuda or not protocol_vocab:
        return []
    t = best_us(fused)
    out = []

    def add(name: str, value: float | None, limit: float) -> None:
        out.append({"name": name, "value": value, "limit": limit,
                    "met": value is not None and value <= limit})

    if case.op == "verify" and case.batch == 128:
        ratio = None if t is None else t / floor_target_us
        add("time / floor (+ second reads)", ratio, VERIFY_FLOOR_RATIO)
        add("peak temporary MiB", fused["peak_temp_mib"], PEAK_TEMP_MIB)
    if case.op == "verify" and case.batch == 1:
        add("graph replay us", fused["graph_us"], VERIFY_B1_US)
    if case.op == "sample" and case.batch == 1:
        add("graph replay us", fused["graph_us"], SAMPLE_B1_US)
    if case.op == "sample" and case.batch == 128:
        ratio = None if fused["graph_us"] is None else fused["graph_us"] / floor_target_us
        add("graph time / floor", ratio, SAMPLE_FLOOR_RATIO)
    if case.op == "verify_tree" and case.batch == 32 and case.k == 64:
        add("time / floor", None if t is None else t / floor_target_us, TREE_FLOOR_RATIO)
    return out


def run_case(case: Case, cfg: Settings, bandwidth: float, protocol_vocab: bool) -> dict:
    """Measure one case (fused, and unfused unless disabled) and derive floors and ratios."""
    inp = build_inputs(case, cfg.device)
    variants = {"fused": measure_variant(case, inp, "fused", cfg)}
    if cfg.unfused:
        variants["unfused"] = measure_variant(case, inp, "unfused", cfg)
    baseline = logprob_baseline(case, inp)
    if baseline is not None:  # (the same rows, in the same run)
        variants["baseline"] = measure_plain(baseline, cfg)
    outputs = [v.pop("output", None) for v in variants.values()]
    stats = acceptance(case, inp, next((o for o in outputs if o is not None), None))
    once, extra = floor_bytes(case, inp, stats["rejected_sampled"])
    floor_us = 1e6 * once / bandwidth
    floor_target_us = 1e6 * (once + extra) / bandwidth
    fused_t = best_us(variants["fused"])
    unfused_t = best_us(variants["unfused"]) if cfg.unfused else None
    result = {
        **asdict(case), "case": case.name, "rows": inp.logits.shape[0],
        "bytes_read_once": once, "second_read_bytes": extra,
        "floor_us": floor_us, "floor_target_us": floor_target_us, **stats,
        "ratio_to_floor": None if fused_t is None else fused_t / floor_target_us,
        "speedup_vs_unfused": None if fused_t is None or unfused_t is None
        else unfused_t / fused_t,
        **variants,
    }
    result["targets"] = check_targets(case, variants["fused"], floor_target_us,
                                      _cuda(cfg.device), protocol_vocab)
    del inp
    if _cuda(cfg.device):
        torch.cuda.empty_cache()
    return result


def protocol_cases(args: argparse.Namespace) -> list[Case]:
    """verify() over (draft kind x temperature x batch size), then sample() cases."""
    cases = [Case("verify", draft, t, b, args.k, args.vocab, args.dtype)
             for draft in ("onehot", "draft_logits") for t in args.temperatures
             for b in args.batch_sizes]
    cases += [Case("sample", None, t, b, 0, args.sample_vocab, args.dtype)
              for t in args.temperatures for b in args.sample_batch_sizes]
    if args.block:  # block beside token-level, draft logits and draft probabilities
        cases += [Case("verify", "draft_probs", t, b, args.k, args.vocab, args.dtype)
                  for t in args.temperatures for b in args.batch_sizes]
        cases += [Case("verify", draft, t, b, args.k, args.vocab, args.dtype, method="block")
                  for draft in ("draft_logits", "draft_probs") for t in args.temperatures
                  for b in args.batch_sizes]
    cases += [Case("verify", "onehot", "1.0", b, args.k, args.vocab, args.dtype, counts=c)
              for c in args.draft_counts for b in args.batch_sizes]
    cases += [Case("verify", draft, "", b, args.k, args.vocab, args.dtype, f, method)
              for draft in args.option_drafts
              for method in (("token", "block") if args.block and draft != "onehot"
                             else ("token",))
              for f in args.options for b in args.batch_sizes]
    cases += [Case("sample", None, "", b, 0, args.sample_vocab, args.dtype, f)
              for f in args.options for b in args.sample_batch_sizes]
    for m in args.trees:  # each tree beside the same rows verified as one chain
        for b in args.batch_sizes:
            cases += [Case(op, "onehot", "1.0", b, m, args.vocab, args.dtype, shape=shape)
                      for op, shape in (("verify_tree", "tree"), ("verify", "chain"))]
    return cases


# --------------------------------------------------------------------------- reporting


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(results: list[dict]) -> str:
    """A plain-text table: one line per case, times in us, ratios, memory and targets."""
    head = ("case", "floor", "eager", "graph", "host", "cpu", "x floor", "unf eager", "unf graph",
            "speedup", "base graph", "MiB", "acc", "targets")
    rows = [head]
    for r in results:
        f, u, b = r["fused"], r.get("unfused", {}), r.get("baseline", {})
        if f["error"]:
            verdict = "ERROR"
        elif r["targets"]:
            verdict = " ".join("met" if t["met"] else "MISSED" for t in r["targets"])
        else:
            verdict = ""
        rows.append((r["case"], _fmt(r["floor_target_us"]), _fmt(f["eager_us"]),
                     _fmt(f["graph_us"]), _fmt(f.get("host_us")), _fmt(f.get("host_cpu_us")),
                     _fmt(r["ratio_to_floor"], ".2f"), _fmt(u.get("eager_us")),
                     _fmt(u.get("graph_us")), _fmt(r["speedup_vs_unfused"], ".2f"),
                     _fmt(best_us(b) if b else None), _fmt(f["peak_temp_mib"], ".3f"),
                     _fmt(r["mean_accepted"], ".2f"), verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(row, widths, strict=True))).rstrip() for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_profiles(results: list[dict]) -> str:
    """Per case, the fused call's time in each kernel / operator (``--profile``)."""
    lines = []
    for r in results:
        prof = r["fused"].get("kernel_us")
        if prof:
            lines.append(f"{r['case']} ({_fmt(best_us(r['fused']))} us per call)")
            lines += [f"  {us:9.2f} us  {name}" for name, us in prof.items()]
    return "\n".join(lines) + "\n"


def write_profiles(results: list[dict], out: Path) -> None:
    """kernel_profile.txt in ``out`` (:func:`format_profiles`) when any case was profiled."""
    if any(r["fused"].get("kernel_us") for r in results):
        (out / "kernel_profile.txt").write_text(format_profiles(results))
        print(f"wrote {out / 'kernel_profile.txt'}")


def format_problems(results: list[dict]) -> str:
    """Errors, failed graph captures and missed targets, one line each ('' when none)."""
    lines = []
    for r in results:
        for variant in ("fused", "unfused", "baseline"):
            v = r.get(variant)
            if v is None:
                continue
            for key in ("error", "graph_error"):
                if v[key]:
                    lines.append(f"{r['case']} [{variant}] {key}: {v[key]}")
        for t in r["targets"]:
            if not t["met"]:
                lines.append(f"{r['case']} target missed: {t['name']} = {_fmt(t['value'], '.3f')}"
                             f" > {t['limit']}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> bool:
    """PNG of time against batch size per variant with the floor (and the target band); one
    panel per (op / draft kind, temperature). Returns False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullLocator
    except ImportError:
        return False
    def kind(r: dict) -> tuple:
        tag = f"{r['shape']}{r['k']}" if r.get("shape") else ""
        return r["op"], r["draft"], r.get("method", "token"), tag

    def setting(r: dict) -> str:
        return r.get("options") or f"T={r['temperature']}"

    kinds = list(dict.fromkeys(kind(r) for r in results))
    temps = list(dict.fromkeys(setting(r) for r in results))
    fig, axes = plt.subplots(len(kinds), len(temps), figsize=(4.5 * len(temps),
                             3.6 * len(kinds)), squeeze=False)
    lines = (("fused", "eager_us", "o-", "fused eager"), ("fused", "graph_us", "s-",
             "fused graph"), ("unfused", "eager_us", "o--", "unfused eager"),
             ("unfused", "graph_us", "s--", "unfused graph"))
    for (op, draft, method, tag), row in zip(kinds, axes, strict=True):
        for temp, ax in zip(temps, row, strict=True):
            sel = sorted((r for r in results if (*kind(r), setting(r)) ==
                          (op, draft, method, tag, temp)), key=lambda r: r["batch"])
            if not sel:
                ax.axis("off")
                continue
            bs = [r["batch"] for r in sel]
            for variant, key, style, label in lines:
                ys = [r.get(variant, {}).get(key) for r in sel]
                if any(y is not None for y in ys):
                    ax.plot(bs, [math.nan if y is None else y for y in ys], style, label=label)
            ax.plot(bs, [r["floor_target_us"] for r in sel], "k:", label="floor")
            ratio = SAMPLE_FLOOR_RATIO if op == "sample" else VERIFY_FLOOR_RATIO
            ax.plot(bs, [ratio * r["floor_target_us"] for r in sel], color="0.6", lw=0.8,
                    label=f"{ratio}x floor")
            name = " ".join(x for x in (op, draft, "block" if method == "block" else "", tag,
                                        temp) if x)
            ax.set(xscale="log", yscale="log", xlabel="batch size B", ylabel="time (us)",
                   title=name)
            ax.set_xticks(bs, [str(b) for b in bs])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def environment(device: torch.device, backend: str) -> dict:
    """Versions and device of this run, and ``pdl``: whether the Triton kernels were
    programmatic dependent launches (``triton_backend.launch``; ``SPECSAMPLE_PDL``)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    pdl = False
    if _cuda(device) and backend == "triton":
        from .triton_backend.launch import pdl_enabled

        with torch.cuda.device(device):
            pdl = pdl_enabled(torch.cuda.current_device())
    return {
        "device": torch.cuda.get_device_name(device) if _cuda(device) else platform.processor()
        or platform.machine(),
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "backend": backend, "pdl": pdl, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# --------------------------------------------------------------------------- CPU check


#: The CPU check's cases: (label, B, V, sampled with sample() instead of verify(), the
#: request's options, limit on the ratio to one softmax of the same rows). K = 4 for verify().
CPU_CASES = (
    ("greedy", 1, 49152, False, {"temperature": 0.0}, 3.0),
    ("T0.8", 1, 49152, False, {"temperature": 0.8}, 3.0),
    ("T0.8 top_p0.9", 1, 49152, False, {"temperature": 0.8, "top_p": 0.9}, 5.0),
    # near-uniform rows (a random-weight model's; a nucleus of 40,000 tokens)
    ("T0.8 top_p0.9 flat", 1, 49152, False, {"temperature": 0.8, "top_p": 0.9}, 5.0, "flat"),
    ("T0.8 top_k50", 1, 49152, False, {"temperature": 0.8, "top_k": 50}, 5.0),
    ("T0.8 min_p0.1", 1, 49152, False, {"temperature": 0.8, "min_p": 0.1}, 5.0),
    ("T0.8 repetition1.1", 1, 49152, False,
     {"temperature": 0.8, "repetition_penalty": 1.1}, 5.0),
    ("sample() T0.8", 1, 49152, True, {"temperature": 0.8}, None),
    ("T0.7", 8, 151936, False, {"temperature": 0.7}, CPU_CHECK_RATIO),
)
#: sample() at B = 1, V = 49,152 on one thread: at most this many milliseconds.
CPU_SAMPLE_LIMIT_MS = 0.3


def cpu_check(repeats: int, *, k: int = 4, cases=CPU_CASES) -> list[dict]:
    """The CPU check: verify() (float32 logits, one-hot drafts, seeded) or sample() for each
    case of ``cases`` against one ``torch.softmax`` over the same rows ([B (K + 1), V], or
    [B, V] for sample(); Zipf-like rows, or near-uniform ones where a case ends with "flat");
    medians of ``repeats`` runs after one warm-up each. Requests carry
    one prompt and two output tokens (for the penalties)."""
    cpu = torch.device("cpu")
    kw = {"warmup_ms": 0, "rep_ms": 0, "cpu_repeats": repeats}
    rows_out = []
    for label, n, vocab, is_sample, options, limit, *rows in cases:
        kk = 0 if is_sample else k
        gen = torch.Generator().manual_seed(0)
        if rows == ["flat"]:  # N(0, 0.05^2): near-uniform
            logits = 0.05 * torch.randn(n * (kk + 1), vocab, generator=gen)
        else:
            logits = zipf_logits(n * (kk + 1), vocab, dtype=torch.float32, device=cpu,
                                 generator=gen)
        params = [SamplingParams(seed=1000 + i, **options) for i in range(n)]
        batch = SamplingBatch.from_params(params, vocab_size=vocab,
                                          prompt_token_ids=[[1, 2, 3]] * n,
                                          output_token_ids=[[4, 5]] * n)
        positions = torch.arange(n)
        if is_sample:
            call = functools.partial(sample, logits, batch, positions=positions)
        else:
            drafts = logits.view(n, kk + 1, vocab)[:, :kk].argmax(-1).reshape(-1)
            call = functools.partial(verify, logits, drafts, [kk] * n, batch,
                                     positions=positions)
        ms = time_us(call, cpu, **kw) / 1e3
        softmax_ms = time_us(functools.partial(torch.softmax, logits, dim=-1), cpu, **kw) / 1e3
        ratio = ms / softmax_ms
        met = ratio <= limit if limit is not None else ms <= CPU_SAMPLE_LIMIT_MS
        rows_out.append({"case": label, "op": "sample" if is_sample else "verify",
                         "shape": list(logits.shape), "ms": ms, "softmax_ms": softmax_ms,
                         "ratio": ratio, "limit": limit, "limit_ms": (
                             None if limit is not None else CPU_SAMPLE_LIMIT_MS), "met": met,
                         "threads": torch.get_num_threads(), "repeats": repeats})
    return rows_out


# --------------------------------------------------------------------------- command line


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _temp_list(text: str) -> list[str]:
    labels = [x.strip() for x in text.split(",") if x.strip()]
    for label in labels:
        if label != "mix":
            float(label)
    return labels


def _kinds(what: str, allowed: tuple[str, ...], *, empty: bool) -> Callable[[str], list[str]]:
    """The argparse type of a comma-separated list of ``allowed`` labels (``what`` names them
    in the error; an empty list only where ``empty``)."""
    def parse(text: str) -> list[str]:
        labels = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in labels if x not in allowed] or ([] if labels or empty else [text])
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0]!r}; choose from "
                                             + ", ".join(allowed))
        return labels

    return parse


_counts_list = _kinds("draft-count kind", ("varying", "device"), empty=True)
_draft_list = _kinds("draft kind", ("onehot", "draft_logits", "draft_probs"), empty=False)


def _option_list(text: str) -> list[str]:
    labels = [] if text == "none" else [x for x in text.split(",") if x]
    bad = [x for x in labels if x not in OPTION_CASES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown option case {bad[0]!r}; choose from "
                                         + ", ".join(OPTION_CASES))
    return labels


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``specsample bench`` / ``python -m specsample.bench``."""
    p.add_argument("--out", default="bench_out", metavar="DIR",
                   help="directory for bench.json and bench.png, or cpu_check.json with "
                   "--cpu-check (default: bench_out)")
    p.add_argument("--device", default=None,
                   help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--batch-sizes", type=_int_list, default=None, metavar="B,B,...",
                   help="verify() batch sizes (default 1,8,32,128)")
    p.add_argument("--vocab", type=int, default=None, help="verify() vocabulary (151936)")
    p.add_argument("--k", type=int, default=4, help="drafts per request (4)")
    p.add_argument("--sample-batch-sizes", type=_int_list, default=None, metavar="B,B,...",
                   help="sample() batch sizes (default 1,128)")
    p.add_argument("--sample-vocab", type=int, default=None,
                   help="sample() vocabulary (248320)")
    p.add_argument("--temperatures", type=_temp_list, default=list(TEMPERATURE_LABELS),
                   metavar="T,T,...", help="temperatures; 'mix' = alternating 0 and 1 "
                   "(default 0.7,1.0,mix)")
    p.add_argument("--block", action="store_true",
                   help="also block verification (Sun et al. 2024) with draft logits and draft "
                   "probabilities, and token-level with draft probabilities")
    p.add_argument("--draft-counts", type=_counts_list, default=[], metavar="KIND,...",
                   help="extra one-hot T=1 cases by draft counts: 'varying' (request i drafts "
                   "i mod (K+1)), 'device' (num_draft_tokens a device tensor with "
                   "max_num_draft_tokens=K)")
    p.add_argument("--options", type=_option_list, default=list(OPTION_CASES),
                   metavar="LABEL,...", help="option cases (one-hot verify and sample): "
                   + ", ".join(OPTION_CASES) + " (default: all; 'none' for none)")
    p.add_argument("--option-drafts", type=_draft_list, default=["onehot"],
                   metavar="KIND,...", help="draft kinds of the option cases' verify(): "
                   "onehot, draft_logits, draft_probs (default onehot; with --block, draft "
                   "distributions also by block verification)")
    p.add_argument("--trees", type=_int_list, nargs="?", const=[16, 64], default=[],
                   metavar="M,M,...", help="also verify_tree() of one-hot trees of M nodes per "
                   "request (default 16,64; 4 children at the root, then 2 per node, "
                   "breadth-first), T=1, each beside one chain of M drafts (the same rows)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="dtype of the target and draft logits (bfloat16)")
    p.add_argument("--quick", action="store_true",
                   help="smoke-test sizes: B 1,4, V 2048 (sample: V 4096, B 1,4)")
    p.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time (ms)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs per measurement on CPU (median)")
    p.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph replay")
    p.add_argument("--no-unfused", action="store_true", help="skip the unfused baseline")
    p.add_argument("--profile", action="store_true",
                   help="also profile each case's fused call (torch.profiler, 50 calls: each "
                        "kernel's device time under graph replay on CUDA, each operator's CPU "
                        "time on CPU) into kernel_profile.txt and bench.json")
    p.add_argument("--cpu-check", action="store_true",
                   help="CPU check only: the CPU path per option (verify() at B=1, K=4, "
                        "V=49152 per option, sample() at B=1, verify() at B=8, V=151936) "
                        "against one torch.softmax of the same rows, with the CPU targets of "
                        "BENCHMARKS.md")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="measure nothing: print the table and draw bench.png of a saved "
                        "bench.json into --out")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (torch.set_num_threads; default: torch's)")


#: Size arguments left unset take the protocol's sizes (or, with --quick, smoke-test ones).
PROTOCOL_SIZES = {"batch_sizes": [1, 8, 32, 128], "vocab": 151936,
                  "sample_batch_sizes": [1, 128], "sample_vocab": 248320}
QUICK_SIZES = {"batch_sizes": [1, 4], "vocab": 2048, "sample_batch_sizes": [1, 4],
               "sample_vocab": 4096}


def _resolve_sizes(args: argparse.Namespace) -> None:
    """Fill size arguments left unset from the protocol (or the --quick sizes)."""
    for key, value in (QUICK_SIZES if args.quick else PROTOCOL_SIZES).items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, list) else value)


def resolve_device(name: str | None) -> torch.device:
    """``name`` as a device (default: cuda when available); a bare "cuda" gets the current
    device's index, which becomes the current device for the run."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if _cuda(device):
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def report_from_json(path: Path, out: Path) -> int:
    """``--from-json``: print the table and draw the plot of a saved bench.json into ``out``
    (for a device run where matplotlib was missing)."""
    results = json.loads(path.read_text())["cases"]
    print(format_table(results))
    write_profiles(results, out)
    problems = format_problems(results)
    if problems:
        print("\nProblems:\n" + problems)
    if not plot(results, out / "bench.png"):
        print("matplotlib is not installed: no plot")
        return 1
    print(f"\nwrote {out / 'bench.png'}")
    return 0


def run_cpu_check(args: argparse.Namespace, out: Path) -> int:
    """``--cpu-check``: print and save (cpu_check.json) each case's time and its ratio to one
    softmax of the same rows."""
    res = cpu_check(max(args.repeats, 5))
    print(f"CPU check, {res[0]['threads']} thread(s), median of {res[0]['repeats']} runs")
    print(f"{'case':22s} {'op':7s} {'rows x V':>14s} {'ms':>8s} {'softmax':>8s} "
          f"{'ratio':>6s}  target")
    for r in res:
        target = (f"<= {r['limit']:g}x" if r["limit"] is not None
                  else f"<= {r['limit_ms']:g} ms")
        shape = f"{r['shape'][0]} x {r['shape'][1]}"
        print(f"{r['case']:22s} {r['op']:7s} {shape:>14s} {r['ms']:8.3f} "
              f"{r['softmax_ms']:8.3f} {r['ratio']:6.1f}  {target} "
              f"{'met' if r['met'] else 'MISSED'}")
    (out / "cpu_check.json").write_text(json.dumps(res, indent=2))
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; write the report into ``args.out``.
    Returns the exit status: 0, or 2 (nothing run, nothing written) when there is no CUDA
    device and neither ``--device``, ``--quick`` nor a size was given: the full sizes take
    minutes per case on a CPU."""
    if not (args.cpu_check or args.from_json) and args.device is None and not args.quick and (
            not torch.cuda.is_available()) and all(getattr(args, k) is None
                                                   for k in PROTOCOL_SIZES):
        print("specsample bench: no CUDA device here, and the protocol's full-size cases take "
              "minutes each on a CPU. Run `specsample bench --cpu-check --threads 1` (the CPU "
              "path per option against softmax), `--quick --threads 1` (smoke-test sizes), or "
              "`--device cpu` to run the full sizes anyway (on a small or busy machine, "
              "--threads 1: torch's default threads can make the timings far too high).",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_check:
        return run_cpu_check(args, out)
    if args.from_json:
        return report_from_json(Path(args.from_json), out)
    _resolve_sizes(args)
    device = resolve_device(args.device)
    cfg = Settings(device=device, backend=select_backend(device), warmup_ms=args.warmup_ms,
                   rep_ms=args.rep_ms, cpu_repeats=args.repeats,
                   graphs=_cuda(device) and not args.no_graphs, unfused=not args.no_unfused,
                   profile=args.profile)
    bandwidth = copy_bandwidth(device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                               cpu_repeats=args.repeats)
    print(f"device {device} ({cfg.backend} backend), copy bandwidth {bandwidth / 1e12:.3f} TB/s",
          flush=True)
    if not _cuda(device) and not args.quick:
        print("note: no CUDA device; these sizes on the CPU can take minutes per case "
              "(--quick: smoke-test sizes; --cpu-check: the CPU path against softmax)",
              flush=True)
    report = {"environment": environment(device, cfg.backend), "args": {
        k: v for k, v in vars(args).items() if not callable(v)},
        "copy_bandwidth_bytes_per_s": bandwidth, "cases": []}
    results = report["cases"]
    for case in protocol_cases(args):
        protocol_vocab = case.vocab == (248320 if case.op == "sample" else 151936)
        results.append(run_case(case, cfg, bandwidth, protocol_vocab))
        # Rewritten after every case, so an interrupted run still leaves its results.
        (out / "bench.json").write_text(json.dumps(report, indent=2))
        r = results[-1]
        print(f"  {case.name}: {_fmt(best_us(r['fused']))} us "
              f"({_fmt(r['ratio_to_floor'], '.2f')}x floor)", flush=True)
    print(format_table(results))
    write_profiles(results, out)
    problems = format_problems(results)
    if problems:
        print("\nProblems:\n" + problems)
    png = plot(results, out / "bench.png")
    print(f"\nwrote {out / 'bench.json'}" + (f" and {out / 'bench.png'}" if png else
                                               " (no matplotlib: no plot)"))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specsample.bench [options]``."""
    parser = argparse.ArgumentParser(prog="python -m specsample.bench",
                                     description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
