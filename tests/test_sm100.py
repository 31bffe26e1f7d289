"""The Blackwell verify path (the seed as a template), verified statically: no sm_100 GPU is
available, so these tests read what the compiler emitted for sm_100a."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen.check import gpu_refusal
from kdagen.dsl.sm100 import INSTR_DESC, K, instr_desc
from kdagen.sass import disassemble, find_nvdisasm
from kdagen.serve.variant import Variant, VariantError
from kdagen.space import Space, default_variants

SM100 = Space.load("verify_sm100.yaml").expand().variants
SM_SHARED = 233472  # bytes of shared memory per SM
SMS_B200 = 148

# Representative variants for the PTX checks: no conv, and each conv layout / tap dtype.
REPRESENTATIVE = [
    "verify-h12-q8-i32-sm100_tcgen05-c740",
    "verify-h32-q1-conv-df-fp32-i64-sm100_tcgen05-c740",
    "verify-h12-q5-conv-tm-bf16-i32-sm100_tcgen05-c740",
    "verify-h96-q4-conv-tm-fp32-i32-sm100_tcgen05-c740",
]
# Past 8 tokens: a chain (3 resident CTAs) and a tree with the conv (2), N = 32; the softplus
# gate's two bands of log decay, a chain and a conv tree (2 resident CTAs).
WIDE = [
    "verify-h12-q16-i32-sm100_tcgen05-c444",
    "verify-h32-q11-tree-conv-tm-bf16-i64-sm100_tcgen05-c296",
    "verify-h16-q16-softplus-i32-sm100_tcgen05-c296",
    "verify-h16-q16-softplus-tree-conv-tm-bf16-i32-sm100_tcgen05-c296",
]
INSPECTED = REPRESENTATIVE + WIDE


def _ptx(name: str, cache: Path) -> str:
    return (kcompile.variant_dir(Variant.parse(name), cache) / "sm_100a" / "kernel.ptx").read_text()


def _record(records: list[kcompile.CompileRecord], name: str) -> kcompile.CompileRecord:
    return next(r for r in records if r.variant == name and r.arch == "sm_100a")


def test_space_covers_every_contract_variant() -> None:
    keys = {(v.gate, v.window, v.conv, v.conv_layout, v.conv_weight_dtype) for v in SM100}
    conv_settings = {(False, "token_major", "bf16")} | {
        (True, layout, dtype)
        for layout in ("token_major", "dim_first")
        for dtype in ("bf16", "fp32")
    }
    assert keys == {(g, q, *c) for g in ("kda", "softplus") for q in range(1, 9)
                    for c in conv_settings}  # fmt: skip
    assert all(v.ctas > 0 and v.spec.archs == ("sm_100a",) for v in SM100)


def test_every_compiled_sm100_variant_compiles_for_sm100a(records) -> None:
    mine = [r for r in records if "-sm100_tcgen05-" in r.variant and r.arch == "sm_100a"]
    assert mine and {r.variant for r in mine} <= {v.name for v in default_variants()}
    failed = [(r.variant, r.error) for r in mine if not r.ok]
    assert not failed, failed[:3]
    assert all(r.static_only for r in mine)
    skipped = [r for r in records if "-sm100_tcgen05-" in r.variant and r.arch == "sm_90a"]
    assert all(r.status == "skipped" for r in skipped)


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_tensor_core_path_is_the_seeds(name: str, records, cache: Path) -> None:
    """tcgen05.mma kind::f16, M = 128, N = 16, twice K/16 per item (high and low probe
    halves); one 32x32b TMEM load; TMEM allocated and freed once; TMA state loads on an
    mbarrier; PDL; no local memory; shared memory within the residency of ctas."""
    ptx = _ptx(name, cache)
    assert len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16 ", ptx)) == 2 * (K // 16)
    assert f"{INSTR_DESC};" in ptx or f", {INSTR_DESC}" in ptx  # M 128, N 16, bf16 -> fp32
    assert len(re.findall(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x16\.b32", ptx)) == 1
    assert ptx.count("tcgen05.wait::ld.sync.aligned") == 1
    assert ptx.count("tcgen05.alloc.cta_group::1") == 1
    assert ptx.count("tcgen05.dealloc.cta_group::1") == 1
    assert ptx.count("tcgen05.relinquish_alloc_permit") == 1
    assert ptx.count("tcgen05.commit.cta_group::1.mbarrier::arrive::one") == 1
    tma = re.findall(
        r"cp\.async\.bulk\.tensor\.\w+\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes",
        ptx,
    )
    assert tma, "state loads are TMA copies completing on an mbarrier"
    assert "mbarrier.try_wait.parity" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert ptx.count("griddepcontrol.wait") == 1
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert "atom.global.add.u32" in ptx  # the work ticket
    assert "ld.local" not in ptx and "st.local" not in ptx
    record = _record(records, name)
    assert record.frame_bytes == 0, "registers spilled to local memory"
    per_sm = -(-Variant.parse(name).ctas // SMS_B200)
    assert record.smem_bytes and record.smem_bytes * per_sm <= SM_SHARED


@pytest.mark.parametrize("name", WIDE)
def test_wide_windows_take_a_32_column_probe_tile(name: str, records, cache: Path) -> None:
    """Past 8 tokens: the same tensor-core path with N = 32 (the instruction descriptor's N
    field, one 32x32b.x32 TMEM load), no local memory, and shared memory and registers within
    the resident CTAs of ``ctas`` on a B200."""
    ptx = _ptx(name, cache)
    assert len(re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16 ", ptx)) == 2 * (K // 16)
    assert f"{instr_desc(32)};" in ptx or f", {instr_desc(32)}" in ptx
    assert f"{INSTR_DESC};" not in ptx and f", {INSTR_DESC}" not in ptx
    assert len(re.findall(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", ptx)) == 1
    assert "ld.local" not in ptx and "st.local" not in ptx
    record = _record(records, name)
    per_sm = -(-Variant.parse(name).ctas // SMS_B200)
    assert record.frame_bytes == 0 and record.registers * K * per_sm <= 65536
    assert record.smem_bytes and record.smem_bytes * per_sm <= SM_SHARED


def test_conv_tap_loads_follow_the_weight_dtype(records, cache: Path) -> None:
    bf16_taps = _ptx("verify-h12-q5-conv-tm-bf16-i32-sm100_tcgen05-c740", cache)
    fp32_taps = _ptx("verify-h96-q4-conv-tm-fp32-i32-sm100_tcgen05-c740", cache)
    assert "ld.global.nc.v2.b32" in bf16_taps  # 4 bf16 taps as two packed words
    assert "ld.global.nc.v2.b32" not in fp32_taps


def test_descriptor_helpers_match_the_dsl_primitives(tmp_path: Path) -> None:
    """smem_desc and the instruction descriptors (N 16 and 32) against
    cutlass.experimental.primitives, compared in the PTX
    of a kernel that stores both (the values fold to constants)."""
    import subprocess
    import sys

    script = tmp_path / "desc.py"
    script.write_text(DESCRIPTOR_PROBE)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    stores = re.findall(r"st\.global\.b64\s+\[%rd\d+(?:\+\d+)?\],\s*(\d+);", done.stdout)
    expected = (0x1230 >> 4) | (2048 >> 4) << 16 | (128 >> 4) << 32 | 1 << 46
    assert [int(s) for s in stores] == [expected, expected, INSTR_DESC, instr_desc(32)]


DESCRIPTOR_PROBE = """
import os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
import cuda.bindings.driver as cuda
import cutlass, cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
from cutlass.experimental import primitives as prims
from kdagen.dsl.sm100 import A_KGROUP_BYTES, smem_desc

@cute.kernel
def probe(out: cute.Tensor):
    out[0] = smem_desc(Int32(0x1230), A_KGROUP_BYTES, 128)
    out[1] = Int64(prims.Tcgen05SmemDesc.build(
        Int32(0x1230), leading_byte_offset=A_KGROUP_BYTES, stride_byte_offset=128,
        layout=prims.Tcgen05SmemSwizzle.NONE))
    out[2] = Int64(prims.Tcgen05InstrDesc.build(
        c_dtype=cutlass.Float32, a_dtype=cutlass.BFloat16, b_dtype=cutlass.BFloat16,
        m_dim=128, n_dim=16))
    out[3] = Int64(prims.Tcgen05InstrDesc.build(
        c_dtype=cutlass.Float32, a_dtype=cutlass.BFloat16, b_dtype=cutlass.BFloat16,
        m_dim=128, n_dim=32))

@cute.jit
def host(out: cute.Tensor, stream: cuda.CUstream):
    probe(out).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

dump = sys.argv[1]
f = cute.compile(host, make_fake_compact_tensor(Int64, (4,)), make_fake_stream(),
                 options=f"--gpu-arch sm_100a --keep-ptx --dump-dir {dump}")
ptx = f.artifacts.PTX
print(open(ptx).read() if os.path.exists(str(ptx)) else ptx)
"""


def test_sm100_variants_are_refused_on_other_gpus() -> None:
    why = gpu_refusal(SM100[0], "sm_90a")
    assert why and "targets sm_100a, this GPU is sm_90a" in why
    assert "statically verified" in why and "untuned" in why


def test_verify_paths_are_arch_specific() -> None:
    with pytest.raises(VariantError, match="path='bulk' has no template for kernel 'verify'"):
        Variant(kernel="verify", heads=12, window=8, path="bulk")
    assert Variant(kernel="verify", heads=12, window=8).path == "sm100_tcgen05"


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize("name", REPRESENTATIVE[:2])
def test_sass_has_the_tensor_core_path_and_no_spills(name: str, records, cache: Path) -> None:
    """The SASS sm_100a runs: 16 UTCHMMA (tcgen05.mma), one LDTM (tcgen05.ld), TMA loads
    (UTMALDG), and no local-memory loads or stores."""
    cubin = kcompile.variant_dir(Variant.parse(name), cache) / "sm_100a" / "kernel.cubin"
    sass = disassemble(cubin)
    assert len(re.findall(r"\bUTCHMMA\b", sass)) == 2 * (K // 16)
    assert len(re.findall(r"\bLDTM\b", sass)) == 1
    assert re.search(r"\bUTMALDG\.\w+", sass)
    assert not re.search(r"\b(LDL|STL)\b", sass)
