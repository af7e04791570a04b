"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import tiny_llama


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and do not suffer from a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def target_model():
    return tiny_llama(0)


@pytest.fixture(scope="session")
def draft_model():
    return tiny_llama(1)
