"""Tokens/s of n-gram speculation against plain decoding on a real model.

Usage::

    python -m specsample.engine.bench [--model default] [--repeats 3] [--max-new-tokens 128]
        [--temperatures 0 0.8] [-k 4] [--json PATH]

For each temperature it runs plain decoding (``--drafter none``) and n-gram speculation
(``--drafter ngram``, k drafts) on the same seeded, repetition-friendly prompt (the model is
asked to repeat a passage), interleaved ``--repeats`` times after one warm-up, and prints the
median decode tokens/s of each, the speed-up and whether the seeded outputs were identical.

With ``--tree-nodes K [K ...]`` it compares tree speculation with the chain engine at the same
node budget instead (n-gram drafter; :func:`run_tree_bench`): per prompt (the repeat-a-passage
prompt, or the ``--prompt-file`` ones instead, then a code-editing prompt) and temperature,
plain decoding,
a chain of K drafts and a tree of K nodes (depth K), and the default ``--tree`` (its default
node budget, depth ``-k``), interleaved ``--repeats`` times::

    python -m specsample.engine.bench --threads 1 --tree-nodes 4 8 16 \\
        --prompt-file examples/repeat_passage.txt
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


CODE_PROMPT = (
    "Add type hints to this Python code and return the whole code:\n\n"
    "def mean(values):\n"
    "    total = 0\n"
    "    for value in values:\n"
    "        total = total + value\n"
    "    return total / len(values)\n\n"
    "def variance(values):\n"
    "    m = mean(values)\n"
    "    total = 0\n"
    "    for value in values:\n"
    "        total = total + (value - m) ** 2\n"
    "    return total / len(values)\n"
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


def run_tree_bench(model: str = "default", *, prompts: dict[str, str] | None = None,
                   temperatures=(0.0, 0.8), budgets=(4, 8, 16), default_depth: int = 4,
                   max_new_tokens: int = 128, repeats: int = 3, seed: int = 0,
                   dtype: str = "float32", log=None) -> dict:
    """Tree vs chain speculation (n-gram drafter) at the same node budget.

    For each prompt (name -> text; default: the repeat-a-passage and code-editing prompts)
    and temperature: plain decoding, ``chain k=K`` (K drafts) and ``tree K`` (K nodes, depth
    K) for each K in ``budgets``, and a tree of ``DEFAULT_TREE_NODES`` nodes and depth
    ``default_depth`` (the default ``--tree``),
    run interleaved ``repeats`` times after one warm-up each. Returns a JSON-ready dict:
    per configuration the median decode tokens/s, the speed-up over plain decoding, the mean
    accepted length and acceptance rate (accepted / drafted nodes), and whether every seeded
    output equalled plain decoding's.
    """
    import specsample

    from .generate import DEFAULT_TREE_NODES, SpeculativeEngine
    from .models import encode_prompt, load_model

    loaded = load_model(model, dtype=dtype)
    if prompts is None:
        prompts = {"repeat passage": BENCH_PROMPT, "code edit": CODE_PROMPT}
    engines = {"plain": SpeculativeEngine(loaded, "none")}
    for k in budgets:
        engines[f"chain k={k}"] = SpeculativeEngine(loaded, "ngram", num_speculative_tokens=k)
        engines[f"tree {k} d={k}"] = SpeculativeEngine(loaded, "ngram", num_speculative_tokens=k,
                                                     tree=True, tree_nodes=k)
    engines[f"tree {DEFAULT_TREE_NODES} d={default_depth}"] = SpeculativeEngine(
        loaded, "ngram", num_speculative_tokens=default_depth, tree=True,
        tree_nodes=DEFAULT_TREE_NODES)
    results = []
    for name, text in prompts.items():
        ids = encode_prompt(loaded.tokenizer, text)
        for temperature in temperatures:
            params = specsample.SamplingParams(temperature=temperature, seed=seed)
            runs: dict[str, list] = {label: [] for label in engines}
            for engine in engines.values():
                engine.generate([ids], params, max_new_tokens=4)  # warm-up
            for _ in range(repeats):
                for label, engine in engines.items():
                    runs[label].append(engine.generate([ids], params,
                                                       max_new_tokens=max_new_tokens))
            plain_ids = runs["plain"][0].outputs[0].token_ids
            base = statistics.median(r.stats.tokens_per_s for r in runs["plain"])
            for label, rs in runs.items():
                tps = statistics.median(r.stats.tokens_per_s for r in rs)
                total = rs[0].stats.total
                row = {
                    "prompt": name, "temperature": temperature, "config": label,
                    "tokens_per_s": tps, "speedup": tps / base if base > 0 else None,
                    "mean_accepted_length": total.mean_accepted_length,
                    "acceptance_rate": total.acceptance_rate,
                    "generated_tokens": total.emitted,
                    "identical": all(r.outputs[0].token_ids == plain_ids for r in rs),
                    "runs_tokens_per_s": [r.stats.tokens_per_s for r in rs],
                }
                results.append(row)
                if log is not None:
                    log(f"{name}, T={temperature}, {label}: {tps:.1f} tok/s "
                        f"({row['speedup']:.2f}x), mean accepted length "
                        f"{row['mean_accepted_length']:.2f}, acceptance "
                        f"{row['acceptance_rate']:.2f}, {total.emitted} tokens, identical "
                        f"{row['identical']}")
    return {
        "model": loaded.name, "dtype": dtype, "max_new_tokens": max_new_tokens,
        "repeats": repeats, "torch_threads": torch.get_num_threads(),
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
    p.add_argument("--tree-nodes", type=int, nargs="+", default=None, metavar="K",
                   help="compare trees of K nodes with chains of K drafts (n-gram) instead")
    p.add_argument("--prompt-file", action="append", default=[], metavar="PATH",
                   help="with --tree-nodes: prompts to use instead of the built-in "
                        "repeat-a-passage one (the code-editing prompt follows them)")
    args = p.parse_args(argv)
    if args.prompt_file and args.tree_nodes is None:
        p.error("--prompt-file is only used with --tree-nodes")
    if args.tree_nodes is not None and min(args.tree_nodes) < 1:
        p.error(f"--tree-nodes must be >= 1, got {min(args.tree_nodes)}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from ..cli import _quiet_transformers

    _quiet_transformers()
    def log(line: str) -> None:
        print(line, flush=True)

    if args.tree_nodes is not None:
        prompts = None
        if args.prompt_file:
            prompts = {}
            for path in args.prompt_file:
                with open(path, encoding="utf-8") as f:
                    prompts[path] = f.read()
            prompts["code edit"] = CODE_PROMPT
        out = run_tree_bench(args.model, prompts=prompts, temperatures=args.temperatures,
                             budgets=args.tree_nodes, default_depth=args.num_speculative_tokens,
                             max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                             seed=args.seed, dtype=args.dtype, log=log)
    else:
        out = run_bench(args.model, temperatures=args.temperatures,
                        k=args.num_speculative_tokens, max_new_tokens=args.max_new_tokens,
                        repeats=args.repeats, seed=args.seed, dtype=args.dtype, log=log)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
