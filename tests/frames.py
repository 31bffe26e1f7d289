"""The commit kernels' compile rule shared by their tests: every arch a variant targets, no
stack frame (a commit spill would sit on its streaming path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen.sass import disassemble, find_nvdisasm
from kdagen.serve.variant import Variant


def compile_without_frame(variant: Variant, cache: Path) -> list[kcompile.CompileRecord]:
    """Compile ``variant`` for each arch it targets; each must build without a stack frame."""
    records = []
    for arch in variant.spec.archs:
        record = kcompile.compile_variant(variant, arch, cache)
        assert record.ok and record.frame_bytes == 0, (arch, record.error, record.frame_bytes)
        records.append(record)
    return records


def sm90_sass_without_frame(variant: Variant, cache: Path) -> str:
    """``compile_without_frame``, then the sm_90a SASS (the test skips without nvdisasm)."""
    compile_without_frame(variant, cache)
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    return disassemble(kcompile.variant_dir(variant, cache) / "sm_90a" / "kernel.cubin")
