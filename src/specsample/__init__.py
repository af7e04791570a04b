"""specsample: exact sampling and speculative-decoding verification for LLM inference.

Public API (see docs/api.md and docs/semantics.md): :class:`SamplingParams`,
:class:`SamplingBatch`, :func:`sample`, :func:`verify`, :func:`probs`,
:class:`SamplingError`, and :mod:`specsample.paths` (which implementation ran, and forbidding
paths).
"""

from . import paths, rng
from .api import probs, sample, select_backend, verify, warmup
from .errors import SamplingError
from .outputs import SampleOutput, VerifyOutput
from .params import SamplingBatch, SamplingParams
from .tree import TreeVerifyOutput, verify_tree

__all__ = [
    "SampleOutput",
    "SamplingBatch",
    "SamplingError",
    "SamplingParams",
    "TreeVerifyOutput",
    "VerifyOutput",
    "paths",
    "probs",
    "rng",
    "sample",
    "select_backend",
    "verify",
    "verify_tree",
    "warmup",
]
__version__ = "0.1.0"
