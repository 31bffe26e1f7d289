"""Module marks of the GPU tests: ``gpu``, and skipped without the GPU they need."""

from __future__ import annotations

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
