"""Time :func:`specsample.warmup` as a server start pays it (needs CUDA): on a fresh Triton
cache, then again on the cache it filled (a restart), each in a new process.

``python -m specsample.warmup_bench [--vocab V] [--repeats N] [--serial] [--out FILE]``
prints one JSON line per run: the cache (fresh / warm), the seconds of ``warmup()`` and of the
process's imports, and :func:`specsample.triton_backend.warmup_report`. ``--serial`` adds a
fresh-cache run with ``workers=0`` (every variant compiled as its call launches it). Needs a
CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
import torch
import specsample
from specsample import triton_backend
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t1 = time.perf_counter()
workers = None if sys.argv[2] == "default" else int(sys.argv[2])
specsample.warmup("cuda", vocab_size=int(sys.argv[1]), workers=workers, on_compile="raise")
torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"import_s": round(t1 - t0, 2), "warmup_s": round(t2 - t1, 2),
                  "report": triton_backend.warmup_report()}))
'''


def _run(vocab: int, cache: str, workers: str) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=cache)
    run = subprocess.run([sys.executable, "-c", _CHILD, str(vocab), workers], env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"warmup run failed: {run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specsample.warmup_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (151936)")
    p.add_argument("--repeats", type=int, default=3, help="warm-cache runs (3)")
    p.add_argument("--serial", action="store_true",
                   help="also a fresh-cache run compiling serially (workers=0)")
    p.add_argument("--out", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA device (torch.cuda.is_available() is False): warmup() compiles "
                "the Triton kernels for one")
    results = []
    with tempfile.TemporaryDirectory() as cache:
        runs = [("fresh", "default")] + [("warm", "default")] * args.repeats
        for kind, workers in runs:
            results.append(dict(cache=kind, workers=workers, **_run(args.vocab, cache, workers)))
            print(json.dumps(results[-1]), flush=True)
    if args.serial:
        with tempfile.TemporaryDirectory() as cache:
            results.append(dict(cache="fresh", workers="0", **_run(args.vocab, cache, "0")))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab": args.vocab, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
