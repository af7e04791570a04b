"""Benchmark of specsample.distributed: sharded verify() against all_gather + verify().

Launch on the GPUs of one host (NCCL; NVLink multicast is switched off, ``NCCL_NVLS_ENABLE=0``)::

    torchrun --nproc-per-node 2 -m specsample.distributed_bench distributed_bench.json

Cases: V in 151,936 and 262,144, B in 1, 8, 32, 128 requests with K = 4 one-hot drafts each
(T = B (K + 1) rows), bf16 logits from ``bench.zipf_logits``, temperature 1 (and, at
V = 151,936, a filtered case: temperature 0.7, top_k 50, top_p 0.9). Each rank holds its
vocabulary shard [T, ceil(V / W)] as a vocabulary-parallel LM head leaves it. Timed per call
with CUDA events (median of ``--iters`` calls after ``--warmup`` calls; rank 0's figures):

* ``sharded_us``: ``specsample.distributed.verify`` on the shards;
* ``gather_us``: ``all_gather_into_tensor`` of the shards, the [W, T, S] -> [T, V] copy, then
  single-GPU ``specsample.verify`` (the Triton backend) on the whole rows;
* ``ratio`` = sharded / gather (the target is at most 0.25 at B = 128, V = 151,936);
* ``path``: the path the sharded call took (``distributed.verify.kernels``: the Triton
  launches of temperature-only calls; ``distributed.verify.torch``: the PyTorch path), and
  with ``--torch-path`` the PyTorch path's time where the launches serve the call.

With ``--nproc-per-node 1`` (one GPU) the collectives are trivial: the figures are the host
work and kernels of one rank holding the whole vocabulary.

Both paths are checked to emit the same tokens. One JSON line per case on stdout (rank 0) and
all of them in the JSON file given as the argument.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import distributed as sd
from . import paths, verify
from .bench import onehot_drafts, zipf_logits
from .params import SamplingBatch, SamplingParams

K = 4


def _time(fn, iters: int, warmup: int) -> float:
    """Median microseconds of ``fn()`` over ``iters`` calls (CUDA events), after warmup."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def run_case(vocab: int, b: int, filtered: bool, iters: int, warmup: int,
             torch_path: bool = False) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    s = -(-vocab // world)
    rows = b * (K + 1)
    gen = torch.Generator(device=dev).manual_seed(1234 + vocab + b)  # the same on every rank
    full = zipf_logits(rows, vocab, dtype=torch.bfloat16, device=dev, generator=gen)
    padded = torch.nn.functional.pad(full, (0, world * s - vocab))
    local = padded[:, rank * s:(rank + 1) * s].contiguous()
    draft_rows = full.view(b, K + 1, vocab)[:, :K].reshape(b * K, vocab)
    drafts = onehot_drafts(draft_rows, gen)
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=i) if filtered
              else SamplingParams(temperature=1.0, seed=i) for i in range(b)]
    batch = SamplingBatch.from_params(params, vocab_size=vocab, device=dev)
    num_draft = [K] * b
    positions = torch.arange(b, device=dev) * 64
    del full, padded, draft_rows

    def sharded():
        return sd.verify(local, drafts, num_draft, batch, positions=positions, strict=False)

    gathered = torch.empty((world, rows, s), dtype=local.dtype, device=dev)

    def gather_then_verify():
        dist.all_gather_into_tensor(gathered, local)
        whole = gathered.permute(1, 0, 2).reshape(rows, world * s)[:, :vocab]
        return verify(whole, drafts, num_draft, batch, positions=positions, strict=False)

    def sharded_torch():
        before = os.environ.get("SPECSAMPLE_BACKEND")
        os.environ["SPECSAMPLE_BACKEND"] = "torch"
        try:
            return sharded()
        finally:
            if before is None:
                del os.environ["SPECSAMPLE_BACKEND"]
            else:
                os.environ["SPECSAMPLE_BACKEND"] = before

    paths.reset()
    a, g = sharded(), gather_then_verify()
    path = next(p for p in paths.counts() if p.startswith("distributed."))
    same = bool(torch.equal(a.token_ids, g.token_ids))
    t_sharded = _time(sharded, iters, warmup)
    t_gather = _time(gather_then_verify, iters, warmup)
    res = {"vocab": vocab, "B": b, "K": K, "rows": rows, "world": world,
           "case": "filtered (T 0.7, top_k 50, top_p 0.9)" if filtered else "T 1.0",
           "path": path, "sharded_us": round(t_sharded, 1), "gather_us": round(t_gather, 1),
           "ratio": round(t_sharded / t_gather, 3), "same_tokens": same}
    if torch_path and path.endswith(".kernels"):
        t_torch = _time(sharded_torch, max(iters // 5, 3), 2)
        res["sharded_torch_path_us"] = round(t_torch, 1)
        res["same_tokens_torch_path"] = bool(torch.equal(sharded_torch().token_ids,
                                                         a.token_ids))
    return res


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specsample.distributed_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file to write the results to")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[151936, 262144])
    parser.add_argument("--torch-path", action="store_true",
                        help="also time the PyTorch path of the sharded call where the Triton "
                             "launches serve it (SPECSAMPLE_BACKEND=torch)")
    args = parser.parse_args(argv)
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast off
    if not torch.cuda.is_available():
        parser.error("needs CUDA devices (launch with torchrun --nproc-per-node N)")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    results = []
    try:
        cases = [(v, b, False) for v in args.vocabs for b in args.batches]
        cases += [(args.vocabs[0], b, True) for b in args.batches]
        for vocab, b, filtered in cases:
            res = run_case(vocab, b, filtered, args.iters, args.warmup, args.torch_path)
            if dist.get_rank() == 0:
                print(json.dumps(res), flush=True)
            results.append(res)
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "results": results}, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
