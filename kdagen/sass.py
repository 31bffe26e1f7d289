"""SASS of a compiled cubin, through ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel or a
CUDA toolkit on PATH), for tests that check what the hardware will execute."""

from __future__ import annotations

import shutil
import subprocess
from importlib import util
from pathlib import Path


def find_nvdisasm() -> Path | None:
    found = shutil.which("nvdisasm")
    if found:
        return Path(found)
    spec = util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("cu*/bin/nvdisasm")):
            return candidate
    return None


def disassemble(cubin: Path) -> str:
    """The cubin's SASS as text; raises FileNotFoundError without nvdisasm."""
    tool = find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    done = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True, check=True)
    return done.stdout
