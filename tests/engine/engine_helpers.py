"""Helpers of the engine tests: tiny randomly initialised Llama models (no download)."""

from __future__ import annotations

import torch


def tiny_llama(seed: int = 0, *, vocab_size: int = 64, dtype: torch.dtype = torch.float64,
               init: float = 0.3, hidden: int = 32, layers: int = 2):
    """A tiny random transformers Llama (eager attention), in eval mode.

    float64 by default: its one-token and (k+1)-token forwards then agree to ~1e-16, so the
    float32 logits the engine hands to the core are bit-identical (speculation invariance).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, attn_implementation="eager",
                      initializer_range=init, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return model


@torch.inference_mode()
def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Reference greedy decoding: full forward over the whole sequence each step, argmax."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1].float()
        seq.append(int(torch.argmax(logits)))
    return seq[len(prompt):]
