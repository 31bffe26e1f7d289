"""The GPU fingerprint that names a folder of ``generated/``: ``nvidia-h200-sm90-132sm``, and
the DSL version a table and its compiled kernels were made with.

Tuning results hold for one GPU model: its name, compute capability and SM count go into the
folder name (two SKUs of one chip with different SM counts tune differently). Driver and CUDA
versions are recorded in the table but do not split folders: they rarely move the winners,
and a table per driver would never be reused.
"""

from __future__ import annotations

import functools
import re
from importlib import metadata
from typing import Any


def slug(text: str) -> str:
    """Lower case, runs of anything but letters and digits as one dash: a folder-safe name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def fingerprint_of(name: str, major: int, minor: int, sms: int) -> str:
    """``NVIDIA H200``, (9, 0), 132 -> ``nvidia-h200-sm90-132sm``."""
    return f"{slug(name)}-sm{major}{minor}-{sms}sm"


def device_info(device: Any = None) -> dict[str, Any]:
    """What identifies the current (or given) CUDA device; initialises CUDA in this process."""
    import torch

    index = torch.cuda.current_device() if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return {
        "fingerprint": fingerprint_of(
            props.name, props.major, props.minor, props.multi_processor_count
        ),
        "name": props.name,
        "compute_capability": f"{props.major}.{props.minor}",
        "sms": props.multi_processor_count,
        "l2_bytes": getattr(props, "L2_cache_size", None),
        "memory_bytes": props.total_memory,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
    }


def gpu_fingerprint(device: Any = None) -> str:
    return str(device_info(device)["fingerprint"])


@functools.cache
def dsl_version() -> str:
    """The installed nvidia-cutlass-dsl version (tables and exported kernels record it)."""
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # the GPU host's devkit unpacks without metadata
        import cutlass

        return str(getattr(cutlass, "__version__", "unknown"))
