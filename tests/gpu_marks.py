"""Module marks of the GPU tests: ``gpu``, and skipped without the GPU they need."""

from __future__ import annotations

import os

import pytest
import torch

ANY_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
HOPPER = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a Hopper (sm_90) GPU",
    ),
]


def skip_without_peer(note: str) -> None:
    """Skip a test whose peer (``.peers``, ``python -m kdagen.peers fetch``) is not here; fail
    instead where ``$KDAGEN_REQUIRE_PEERS`` is set (scripts/gpu_session.sh sets it), so a GPU
    run that was meant to compare against the peers cannot pass without them."""
    if os.environ.get("KDAGEN_REQUIRE_PEERS"):
        pytest.fail(f"{note} (KDAGEN_REQUIRE_PEERS is set)")
    pytest.skip(note)
