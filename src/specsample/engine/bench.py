"""Tokens/s of n-gram speculation against plain decoding on a real model.

Usage::

    python -m specsample.engine.bench [--model default] [--repeats 3] [--max-new-tokens 128]
        [--temperatures 0 0.8] [-k 4] [--json PATH]

For each temperature it runs plain decoding (``--drafter none``) and n-gram speculation
(``--drafter ngram``, k drafts) on the same seeded, repetition-friendly prompt (the model is
asked to repeat a passage), interleaved ``--repeats`` times after one warm-up, and prints the
median decode tokens/s of each, the speed-up and whether the seeded outputs were identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch

BENCH_PROMPT = (
    "Repeat the following text exactly, word for word:\n\n"
    "The quick brown fox jumps over the lazy dog. The dog wakes up and chases the fox across "
    "the field, past the old barn and down to the river. The fox swims across the river and "
    "disappears into the forest, while the dog sits on the bank and barks at the water. When "
    "the sun goes down, the dog walks slowly back to the farm, where the farmer is waiting "
    "with a bowl of warm soup and a soft blanket by the fire."
)


def run_bench(model: str = "default", *, temperatures=(0.0, 0.8), k: int = 4,
              max_new_tokens: int = 128, repeats: int = 3, seed: int = 0,
              dtype: str = "float32", prompt: str = BENCH_PROMPT, log=None) -> dict:
    """Measure plain vs n-gram speculative decoding; returns a JSON-ready dict of results."""
    import specsample

    from .generate import SpeculativeEngine
    from .models import encode_prompt, load_model

    loaded = load_model(model, dtype=dtype)
    ids = encode_prompt(loaded.tokenizer, prompt)
    plain = SpeculativeEngine(loaded, "none")
    spec = SpeculativeEngine(loaded, "ngram", num_speculative_tokens=k)
    results = []
    for temperature in temperatures:
        params = specsample.SamplingParams(temperature=temperature, seed=seed)
        plain.generate([ids], params, max_new_tokens=4)  # warm-up
        spec.generate([ids], params, max_new_tokens=4)
        base_tps, spec_tps, identical, accept, mal, tokens = [], [], True, [], [], []
        for _ in range(repeats):
            a = plain.generate([ids], params, max_new_tokens=max_new_tokens)
            b = spec.generate([ids], params, max_new_tokens=max_new_tokens)
            base_tps.append(a.stats.tokens_per_s)
            spec_tps.append(b.stats.tokens_per_s)
            identical &= a.outputs[0].token_ids == b.outputs[0].token_ids
            accept.append(b.stats.total.acceptance_rate)
            mal.append(b.stats.total.mean_accepted_length)
            tokens.append(len(b.outputs[0].token_ids))
        row = {
            "temperature": temperature,
            "plain_tokens_per_s": statistics.median(base_tps),
            "ngram_tokens_per_s": statistics.median(spec_tps),
            "speedup": statistics.median(spec_tps) / statistics.median(base_tps),
            "acceptance_rate": statistics.median(accept),
            "mean_accepted_length": statistics.median(mal),
            "generated_tokens": tokens[0],
            "identical": identical,
            "runs_plain": base_tps,
            "runs_ngram": spec_tps,
        }
        results.append(row)
        if log is not None:
            log(f"T={temperature}: plain {row['plain_tokens_per_s']:.1f} tok/s, ngram k={k} "
                f"{row['ngram_tokens_per_s']:.1f} tok/s, speed-up {row['speedup']:.2f}x, "
                f"acceptance {row['acceptance_rate']:.2f}, mean accepted length "
                f"{row['mean_accepted_length']:.2f}, {row['generated_tokens']} tokens, "
                f"identical {identical}")
    return {
        "model": loaded.name,
        "dtype": dtype,
        "k": k,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "prompt_tokens": len(ids),
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "results": results,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m specsample.engine.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from ..cli import _quiet_transformers

    _quiet_transformers()
    out = run_bench(args.model, temperatures=args.temperatures, k=args.num_speculative_tokens,
                    max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed,
                    dtype=args.dtype, log=lambda s: print(s, flush=True))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
