"""GPU-less compile of every shipped variant for both archs, the cache, and failures."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen.cubin import kernel_resources
from kdagen.space import default_variants
from kdagen.variant import Variant

VARIANTS = default_variants()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kdagen-cache")


@pytest.fixture(scope="module")
def records(cache: Path) -> list[kcompile.CompileRecord]:
    return kcompile.compile_many(VARIANTS, kcompile.ARCHS, jobs=2, root=cache)


def test_every_shipped_variant_compiles_for_both_archs(records) -> None:
    failed = [(r.variant, r.arch, r.error) for r in records if not r.ok]
    assert not failed, failed[:3]
    assert len(records) == 2 * len(VARIANTS)
    assert {r.arch for r in records} == {"sm_90a", "sm_100a"}


def test_no_variant_spills_or_uses_local_memory(records) -> None:
    spilled = [(r.variant, r.arch, r.frame_bytes) for r in records if r.frame_bytes]
    assert not spilled, spilled[:3]
    assert all(r.registers and 0 < r.registers <= 255 for r in records)


def test_cache_holds_source_ptx_and_an_exported_object(records, cache: Path) -> None:
    v = VARIANTS[0]
    base = kcompile.variant_dir(v, cache)
    assert (base / "kernel.py").read_text().startswith('"""KDA commit kernel, variant ' + v.name)
    for arch in kcompile.ARCHS:
        out = base / arch
        assert (out / "record.json").exists() and (out / "kernel.o").stat().st_size > 0
        ptx = (out / "kernel.ptx").read_text()
        assert f".target {arch}" in ptx
        resources = kernel_resources((out / "kernel.cubin").read_bytes())
        assert resources.registers > 0


def test_second_compile_is_a_cache_hit(records, cache: Path) -> None:
    again = kcompile.compile_variant(VARIANTS[0], "sm_90a", cache)
    assert again.ok and again.cached


def test_commit_ptx_has_the_intended_memory_path(records, cache: Path) -> None:
    """Bulk copies on mbarriers in (Q corr and Q kg rows, then the state in 4 pieces),
    16-byte shared loads and global stores out, PDL, no local memory."""
    v = Variant(kernel="commit", heads=12, window=8, threads=128, vec=8, row_split=1)
    ptx = (kcompile.variant_dir(v, cache) / "sm_90a" / "kernel.ptx").read_text()
    bulk = re.findall(
        r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes", ptx
    )
    assert len(bulk) == 2 * 8 + 4
    assert len(re.findall(r"mbarrier\.try_wait\.parity", ptx)) >= 1 + 4
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 16  # 16 chunks of 8 bf16 per thread
    assert len(re.findall(r"ld\.shared\.v4\.b32", ptx)) >= 16
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_a_failing_compile_is_a_result_not_a_crash(tmp_path: Path, monkeypatch) -> None:
    templates = tmp_path / "templates"
    shutil.copytree(kcompile.__file__.rsplit("/kdagen/", 1)[0] + "/templates", templates)
    path = templates / "commit" / "bulk.py.j2"
    path.write_text(path.read_text().replace("cute.arch.thread_idx()", "cute.arch.no_such_op()"))
    monkeypatch.setenv("KDAGEN_TEMPLATES", str(templates))
    variants = [
        Variant(kernel="commit", heads=2, window=1),
        Variant(kernel="commit", heads=2, window=2),
    ]
    records = kcompile.compile_many(variants, ["sm_90a"], jobs=1, root=tmp_path / "cache")
    assert [r.status for r in records] == ["error", "error"]
    assert all("no_such_op" in (r.error or "") for r in records)
