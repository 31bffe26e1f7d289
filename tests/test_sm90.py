"""The Hopper verify path (sm90_wgmma), checked on the CPU: the space covers the contract,
every compiled variant (the covering, tests/conftest.py) fits without spills into a budget
that keeps CTAs resident, the PTX has the instructions the design relies on, and the rendered
source carries no other variant's code. The GPU checks (``kdagen check``,
tests/test_gpu_verify.py) run on the H200 for every variant."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen.render import render
from kdagen.serve.variant import Variant, VariantError
from kdagen.space import Space, default_variants

SM90 = Space.load("verify_sm90.yaml").expand().variants
SM_SHARED = 232448  # bytes of shared memory per H100/H200 SM usable by CTAs
REGISTERS = 65536  # per SM

# Variants whose PTX the tests below read: name, N of the wgmma, 64-row tiles per warpgroup.
DESIGNED = [
    ("verify-h12-q8-i32-sm90_wgmma-t128-r1-c528-s1-pdl", 32, 2),
    ("verify-h12-q8-i32-sm90_wgmma-t128-r2-c528-s2-pdl", 32, 1),
    ("verify-h32-q1-conv-df-fp32-i64-sm90_wgmma-t128-r1-c396-s1-pdl", 8, 2),
    ("verify-h96-q3-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c396-s1-pdl", 16, 2),
    ("verify-h12-q8-i32-sm90_wgmma-t256-r1-c264-s1-pdl", 32, 1),
    ("verify-h32-q2-i32-sm90_wgmma-t256-r1-c396-s1-pdl", 8, 1),
]
CONV = [
    "verify-h12-q8-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
    "verify-h96-q5-conv-tm-fp32-i64-sm90_wgmma-t128-r1-c396-s1-pdl",
]
INSPECTED = [name for name, _, _ in DESIGNED] + CONV


def _ptx(name: str, cache: Path) -> str:
    return (kcompile.variant_dir(Variant.parse(name), cache) / "sm_90a" / "kernel.ptx").read_text()


def test_space_covers_every_contract_variant() -> None:
    keys = {(v.gate, v.heads, v.window, v.conv, v.conv_layout, v.conv_weight_dtype,
             v.slot_dtype) for v in SM90}  # fmt: skip
    conv = [(False, "token_major", "bf16")] + [
        (True, layout, dtype)
        for layout in ("token_major", "dim_first")
        for dtype in ("bf16", "fp32")
    ]
    heads = {"kda": (12, 32, 96), "softplus": (4, 8, 16, 32)}  # Kimi-K3's, Kimi-Linear's
    expected = {(g, h, q, *c, s) for g in heads for h in heads[g] for q in range(1, 9)
                for c in conv for s in ("int32", "int64")}  # fmt: skip
    assert keys == expected
    assert all(v.path == "sm90_wgmma" and v.spec.archs == ("sm_90a",) for v in SM90)
    assert not any(v.conv and v.row_split > 1 for v in SM90)


def _mine(records: list[kcompile.CompileRecord]) -> list[kcompile.CompileRecord]:
    return [r for r in records if "-sm90_wgmma-" in r.variant and r.arch == "sm_90a"]


def test_every_compiled_sm90_variant_compiles_without_spills(records) -> None:
    mine = _mine(records)
    assert mine and {r.variant for r in mine} <= {v.name for v in default_variants()}
    assert not [(r.variant, r.error) for r in mine if not r.ok][:3]
    # Past 8 tokens (255 registers) trees and the conv park a few words (test_compile.py).
    spilled = [r.variant for r in mine if r.frame_bytes and Variant.parse(r.variant).window <= 8]
    assert not spilled, spilled
    skipped = [r for r in records if "-sm90_wgmma-" in r.variant and r.arch == "sm_100a"]
    assert skipped and all(r.status == "skipped" for r in skipped)


def _resident(r: kcompile.CompileRecord, threads: int) -> int:
    """CTAs one SM holds by registers and shared memory (+1 KiB reserved)."""
    return min(REGISTERS // (threads * r.registers), SM_SHARED // (r.launch_smem_bytes + 1024))


def test_residency_the_grid_bound_assumes(records) -> None:
    """ctas = resident CTAs x 132 SMs, and the launch's min_blocks_per_mp makes ptxas fit
    them: single-buffered variants hold ctas / 132 CTAs per SM. A second 32 KiB state buffer
    costs residency (2 per SM at 128 rows): CTAs beyond it start late and take fewer items.
    Two-warpgroup CTAs (256 threads) always hold ctas / 132."""
    for r in _mine(records):
        v = Variant.parse(r.variant)
        resident = _resident(r, v.threads)
        if v.stages == 1 or v.threads == 256:
            assert resident >= v.ctas // 132, (v.name, resident)
        else:
            assert resident >= (2 if v.row_split == 1 else 3), (v.name, resident)


@pytest.mark.parametrize(("name", "n_cols", "m_tiles"), DESIGNED)
def test_ptx_has_the_designed_instructions(
    records, cache: Path, name: str, n_cols: int, m_tiles: int
) -> None:
    """K / 16 wgmma steps per 64-row tile a warpgroup multiplies, with N = the (hi, lo) probe
    columns; the state by TMA on an mbarrier; PDL; the work ticket; the coupling scalars on
    mma.sync."""
    ptx = _ptx(name, cache)
    mma = f"wgmma.mma_async.sync.aligned.m64n{n_cols}k16.f32.bf16.bf16"
    assert ptx.count(mma) == 8 * m_tiles
    assert "cp.async.bulk.tensor" in ptx and "mbarrier::complete_tx::bytes" in ptx
    assert "wgmma.wait_group.sync.aligned" in ptx and "fence.proxy.async" in ptx
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert "atom.global.add.u32" in ptx
    assert ".minnctapersm" in ptx  # the residency the grid bound assumes, asked of ptxas
    assert "mma.sync.aligned.m16n8k16" in ptx


@pytest.mark.parametrize("name", CONV)
def test_conv_settles_with_one_exact_silu_per_block(records, cache: Path, name: str) -> None:
    """The doubted SiLU roundings are settled by one exact SiLU (its IEEE division) per
    channel block, in a loop: one copy per output (Q per block) cost 7 % (perf notes, v9)."""
    assert _ptx(name, cache).count("div.rn.f32") == 3


def test_rendered_source_has_only_its_variant() -> None:
    plain = render(Variant.parse("verify-h12-q8-i32-sm90_wgmma-t128-r1-c528-s1-nopdl"))
    assert "conv_state" not in plain and "SPLIT" not in plain and "use_stage" not in plain
    assert "griddepcontrol" not in plain and "use_pdl=False" in plain
    split = render(Variant.parse("verify-h12-q8-i32-sm90_wgmma-t128-r2-c528-s2-pdl"))
    assert "SPLIT = 2" in split and "use_stage" in split and "conv_state" not in split
    conv = render(Variant.parse("verify-h12-q4-conv-df-fp32-i32-sm90_wgmma-t128-r1-c396-s1-pdl"))
    assert "dim_first=True" in conv and "taps = cute.make_rmem_tensor((3, 4), Float32)" in conv
    assert "THREADS = 128" in plain and "OWN" not in plain and "barrier_id" not in plain
    two = render(Variant.parse("verify-h12-q8-i32-sm90_wgmma-t256-r1-c264-s1-pdl"))
    assert "THREADS = 256" in two and "OWN = 4" in two and "partial" not in two
    assert "if t < Q:" not in two  # the guarded last slot is only for odd windows
    odd = render(Variant.parse("verify-h12-q7-i32-sm90_wgmma-t256-r1-c264-s1-pdl"))
    assert "if t < Q:" in odd
    # One kernel each: the one-warpgroup kernel has no two-warpgroup code and vice versa.
    assert "wg ==" not in plain and "wg = " not in plain
    assert "tensors[" not in plain + two + conv  # tensors are named, not indexed


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"row_split": 4}, "row_split=4 is not allowed for path 'sm90_wgmma'"),
        ({"conv": True, "row_split": 2}, "row_split=2 is not allowed with conv=True"),
        ({"stages": 3}, "stages=3 is not allowed"),
        ({"threads": 512}, "threads=512 is not allowed for path 'sm90_wgmma'"),
        ({"threads": 256, "row_split": 2}, "threads=256 needs row_split=1"),
        ({"threads": 256, "conv": True}, "threads=256 needs row_split=1"),
    ],
)
def test_variant_rules_name_the_field(fields: dict, message: str) -> None:
    with pytest.raises(VariantError, match=message):
        Variant(kernel="verify", heads=12, window=8, path="sm90_wgmma", **fields)


def test_names_round_trip() -> None:
    for v in SM90[::37]:
        assert Variant.parse(v.name) == v
