"""Speculative generation on Hugging Face transformers models (``specsample generate``).

* :mod:`~specsample.engine.models`: loading (the embedded SmolLM2 GGUF, .gguf files, local
  directories; never the network).
* :mod:`~specsample.engine.drafters`: ``ngram`` (prompt lookup), ``model`` and ``none``;
  their tree forms for ``tree=True`` (:class:`NgramTreeDrafter`, :class:`ModelTreeDrafter`).
* :mod:`~specsample.engine.generate`: the step loop (:class:`SpeculativeEngine`).
* :mod:`~specsample.engine.stats`: per-request and total statistics.
"""

from .drafters import (
    DRAFTERS,
    Draft,
    DraftContext,
    Drafter,
    ModelDrafter,
    ModelTreeDrafter,
    NgramDrafter,
    NgramTreeDrafter,
    NoDrafter,
    TreeDraft,
    make_drafter,
    ngram_lookup,
    ngram_tree,
)
from .generate import (
    GenerationInterrupted,
    GenerationResult,
    RequestOutput,
    SpeculativeEngine,
    generate,
)
from .models import LoadedModel, ModelNotFoundError, default_gguf_path, encode_prompt, load_model
from .stats import GenerationStats, RequestStats

__all__ = [
    "DRAFTERS",
    "Draft",
    "DraftContext",
    "Drafter",
    "GenerationInterrupted",
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "ModelDrafter",
    "ModelNotFoundError",
    "ModelTreeDrafter",
    "NgramDrafter",
    "NgramTreeDrafter",
    "NoDrafter",
    "RequestOutput",
    "RequestStats",
    "SpeculativeEngine",
    "TreeDraft",
    "default_gguf_path",
    "encode_prompt",
    "generate",
    "load_model",
    "make_drafter",
    "ngram_lookup",
    "ngram_tree",
]
