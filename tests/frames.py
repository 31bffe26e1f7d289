"""The commit kernels' compile rule shared by their tests: every arch a variant targets, no
stack frame (a commit spill would sit on its streaming path)."""

from __future__ import annotations

from pathlib import Path

from kdagen import compile as kcompile
from kdagen.serve.variant import Variant


def compile_without_frame(variant: Variant, cache: Path) -> list[kcompile.CompileRecord]:
    """Compile ``variant`` for each arch it targets; each must build without a stack frame."""
    records = []
    for arch in variant.spec.archs:
        record = kcompile.compile_variant(variant, arch, cache)
        assert record.ok and record.frame_bytes == 0, (arch, record.error, record.frame_bytes)
        records.append(record)
    return records
