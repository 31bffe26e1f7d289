"""The dynamic shared memory a compiled module launches with, read from its host IR
(kdagen.launch_config), and the compile record that carries it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen.launch_config import launch_dynamic_smem
from kdagen.serve.variant import Variant

CONFIG = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def _function(name: str, value: int, field: int = 2) -> str:
    return f"""
  llvm.func @{name}() {{
    %7 = llvm.mlir.constant({value} : i64) : i64
    %8 = llvm.mlir.constant(99 : i64) : i64
    %9 = llvm.getelementptr %1[0, {field}] : (!llvm.ptr) -> !llvm.ptr, {CONFIG}
    llvm.store %7, %9 : i64, !llvm.ptr
  }}"""


def test_the_shared_field_of_the_launch_configuration_is_read() -> None:
    assert launch_dynamic_smem("module {" + _function("launch", 112852) + "\n}") == 112852


def test_names_are_resolved_inside_their_own_function() -> None:
    """SSA names repeat across functions: %7 of another function is not this store's value."""
    other = _function("other", 5, field=3)  # a store to another field: no launch
    ir = "module {" + other + _function("launch", 4096) + "\n}"
    assert launch_dynamic_smem(ir) == 4096


def test_a_module_without_a_launch_gives_none() -> None:
    assert launch_dynamic_smem("module {" + _function("f", 7, field=3) + "\n}") is None


@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q8-i32-sm90_wgmma-t128-r1-c528-s1-pdl",
        "verify-h12-q16-tree-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c264-s1-pdl",
    ],
)
def test_the_record_carries_the_launched_shared_memory_within_its_bound(
    name: str, cache: Path
) -> None:
    """The launch asks for at most the template's SHARED_BYTES (its allocations plus 2 KiB
    of alignment slack) and no less than the allocations."""
    record = kcompile.compile_variant(Variant.parse(name), "sm_90a", cache)
    assert record.ok, record.error
    assert record.launch_smem_bytes is not None
    assert 0 < record.smem_bytes - record.launch_smem_bytes <= 2048
