"""Test configuration: Triton's interpreter on machines without CUDA.

The Triton backend's kernels run on CPU tensors through Triton's interpreter, which must be
switched on before triton is first imported; on a CUDA machine the kernels compile for real.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
