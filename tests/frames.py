"""The commit kernels' compile rules shared by their tests: every arch a variant targets, no
stack frame (a commit spill would sit on its streaming path); the CTAs an SM holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen.sass import disassemble, find_nvdisasm
from kdagen.serve.variant import Variant

SM_REGISTERS, SM_SHARED, CTA_RESERVED = 65536, 232448, 1024  # sm_90a


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


def resident_ctas(record: kcompile.CompileRecord, threads: int) -> int:
    """CTAs of ``threads`` threads an SM holds by ``record``'s registers (allocated 256 a warp
    at a time) and shared memory."""
    per_warp = -(-record.registers * 32 // 256) * 256
    by_registers = SM_REGISTERS // (per_warp * threads // 32)
    return min(by_registers, SM_SHARED // (record.smem_bytes + CTA_RESERVED))
