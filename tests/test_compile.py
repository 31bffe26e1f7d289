"""GPU-less compile of the shipped variants' branch covering (tests/conftest.py) for both
archs, the cache, and failures."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kdagen import compile as kcompile
from kdagen import first_use
from kdagen import render as krender
from kdagen.cubin import kernel_resources
from kdagen.sass import disassemble, find_nvdisasm
from kdagen.serve.variant import Variant

# The commit variant whose PTX, SASS and cache entry the tests below read.
COMMIT = Variant(kernel="commit", heads=12, window=8, threads=128, vec=8, row_split=1)
INSPECTED = [COMMIT.name]
WIDE_FRAME_BYTES = 40  # stack bytes the Hopper verify may park past 8 tokens


def test_every_covered_variant_compiles_for_each_arch_it_targets(records, covered) -> None:
    failed = [(r.variant, r.arch, r.error) for r in records if r.failed]
    assert not failed, failed[:3]
    assert len(records) == 2 * len(covered)
    compiled = {(r.variant, r.arch) for r in records if r.ok}
    for v in covered:
        for arch in kcompile.ARCHS:
            assert ((v.name, arch) in compiled) == (arch in v.spec.archs), (v.name, arch)
    commit = [v for v in covered if v.kernel == "commit"]
    assert commit and all(set(v.spec.archs) == {"sm_90a", "sm_100a"} for v in commit)


def test_no_variant_spills_or_uses_local_memory(records) -> None:
    """No compiled commit variant has a stack frame. The sm100 verify may: ptxas parks a value
    or two that live across the whole item loop (read once before, once after) in local memory
    even well under the register limit (seen: 8 bytes at 72 and 128 registers). Bound that at
    two words, so a real register blow-up still fails; tests/test_sm100.py requires the
    representative sm100 variants to have none, in the cubin and in the SASS. The Hopper
    verify past 8 tokens runs at the 255-register ceiling: its trees park up to 16 bytes, its
    conv chains up to 32 (H 16 Q 15 softplus, dim-first fp32 taps) and its conv trees up to 40
    (H 16 Q 16 softplus, dim-first fp32 taps, lags from records; the trees parked 88
    before their root paths moved to shared memory), bounded at WIDE_FRAME_BYTES."""
    commit = [
        (r.variant, r.arch, r.frame_bytes)
        for r in records
        if r.ok and r.variant.startswith("commit")
    ]
    assert commit and not [c for c in commit if c[2]], [c for c in commit if c[2]][:3]
    verify = [
        (r.variant, r.frame_bytes) for r in records if r.ok and r.variant.startswith("verify")
    ]
    over = [(name, frame) for name, frame in verify
            if frame > (WIDE_FRAME_BYTES if Variant.parse(name).window > 8 else 8)]  # fmt: skip
    assert verify and not over, over
    assert all(r.registers and 0 < r.registers <= 255 for r in records if r.ok)


def test_cache_holds_source_ptx_and_an_exported_object(records, cache: Path) -> None:
    base = kcompile.variant_dir(COMMIT, cache)
    source = (base / "kernel.py").read_text()
    assert source.startswith('"""KDA commit kernel, variant ' + COMMIT.name)
    for arch in COMMIT.spec.archs:
        out = base / arch
        assert (out / "record.json").exists() and (out / "kernel.o").stat().st_size > 0
        ptx = (out / "kernel.ptx").read_text()
        assert f".target {arch}" in ptx
        resources = kernel_resources((out / "kernel.cubin").read_bytes())
        assert resources.registers > 0


def test_second_compile_is_a_cache_hit(records, cache: Path) -> None:
    again = kcompile.compile_variant(COMMIT, "sm_90a", cache)
    assert again.ok and again.cached


def test_commit_ptx_has_the_intended_memory_path(records, cache: Path) -> None:
    """Bulk copies on mbarriers in (the state in 4 pieces, Q corr and Q kg rows), 16-byte
    shared loads and global stores out (16 chunks of 8 bf16 per thread for the final state,
    16 more for the prefix-caching boundary state, 2 + 2 pieces of the conv history), 16-byte
    conv history loads, PDL, no local memory."""
    ptx = (kcompile.variant_dir(COMMIT, cache) / "sm_90a" / "kernel.ptx").read_text()
    bulk = re.findall(
        r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes", ptx
    )
    assert len(bulk) == 2 * 8 + 4
    assert len(re.findall(r"mbarrier\.try_wait\.parity", ptx)) >= 1 + 4
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 2 * 16 + 2 * 2
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) == 2 * 2
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


def test_the_machine_digest_sees_code_not_renders(tmp_path: Path, monkeypatch) -> None:
    """A comment changes the render (its digest, its symbol names) but not the machine code;
    a changed constant that the kernel uses changes both (what lets the tuner keep a
    refactored kernel's study)."""
    source = Path(kcompile.__file__).parent.parent / "templates"
    variant = Variant(kernel="commit", heads=2, window=1, threads=128, vec=8)
    records = []
    edits = [("", ""), ("K = 128", "# a reworded comment\nK = 128"),
             ("PIECES = min(4, CHUNKS)", "PIECES = min(2, CHUNKS)")]  # fmt: skip
    for n, (old, new) in enumerate(edits):
        templates = tmp_path / f"templates{n}"
        shutil.copytree(source, templates)
        path = templates / "commit" / "bulk.py.j2"
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new, 1))
        monkeypatch.setenv("KDAGEN_TEMPLATES", str(templates))  # the compiling process's
        monkeypatch.setattr(krender, "TEMPLATE_DIR", templates)  # this one's (the digest)
        krender.environment.cache_clear()
        krender.render.cache_clear()
        [record] = kcompile.compile_many([variant], ["sm_90a"], jobs=1, root=tmp_path / "cache")
        records.append(record)
    krender.environment.cache_clear()
    krender.render.cache_clear()
    plain, reworded, changed = records
    assert all(r.ok and r.machine for r in records)
    assert plain.digest != reworded.digest and plain.machine == reworded.machine
    assert changed.machine != plain.machine


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
def test_commit_sass_uses_bulk_copies_and_wide_accesses(records, cache: Path) -> None:
    """What sm_90a executes: UBLKCP bulk copies, 16-byte shared loads and global stores, no
    local memory."""
    sass = disassemble(kcompile.variant_dir(COMMIT, cache) / "sm_90a" / "kernel.cubin")
    assert len(re.findall(r"\bUBLKCP\.S\.G\b", sass)) == 2 * 8 + 4
    assert re.search(r"\bLDS\.128\b", sass) and re.search(r"\bSTG\.E\.128\b", sass)
    assert not re.search(r"\b(LDL|STL)\b", sass)


@pytest.fixture
def crashing_templates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Variant]:
    """Templates whose Q = 1 module exits its process at import (a compiler crash), and three
    variants, Q = 1 among them."""
    templates = tmp_path / "templates"
    shutil.copytree(kcompile.__file__.rsplit("/kdagen/", 1)[0] + "/templates", templates)
    path = templates / "commit" / "bulk.py.j2"
    crash = "{% if variant.window == 1 %}\nimport os\nos._exit(3)\n{% endif %}\n"
    path.write_text(path.read_text().replace("\nK = 128", "\n" + crash + "K = 128", 1))
    monkeypatch.setenv("KDAGEN_TEMPLATES", str(templates))
    return [Variant(kernel="commit", heads=2, window=q, row_split=4) for q in (1, 2, 3)]


def _compile_many(variants: list[Variant], root: Path) -> list[kcompile.CompileRecord]:
    return kcompile.compile_many(variants, ["sm_90a"], jobs=2, root=root)


def _tuner_threads(variants: list[Variant], root: Path) -> list[kcompile.CompileRecord]:
    """As the tuner does: every variant submitted early, the results read by a thread each
    (one per GPU) from one shared pool."""
    with kcompile.CompilePool("sm_90a", jobs=2, root=root) as pool:
        for v in variants:
            pool.submit(v)
        with ThreadPoolExecutor(len(variants)) as threads:
            return list(threads.map(pool.result, variants))


@pytest.mark.parametrize("driver", [_compile_many, _tuner_threads])
def test_a_crashing_compiler_process_costs_only_its_variant(
    driver, crashing_templates: list[Variant], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that dies mid-compile breaks its pool; the other variants still compile.
    ``kdagen compile`` (compile_many) and the tuner go through the one crash-retry routine."""
    retried: list[str] = []
    after_crash = kcompile.CompilePool._after_crash

    def spy(self, variant, *args):
        retried.append(variant.name)
        return after_crash(self, variant, *args)

    monkeypatch.setattr(kcompile.CompilePool, "_after_crash", spy)
    records = driver(crashing_templates, tmp_path / "cache")
    status = {r.variant.split("-")[2]: (r.status, r.error or "") for r in records}
    assert status["q1"][0] == "error" and "process died" in status["q1"][1]
    assert status["q2"][0] == "ok" and status["q3"][0] == "ok"
    assert crashing_templates[0].name in retried


def test_first_use_loads_what_kdagen_compile_wrote(tmp_path: Path, monkeypatch) -> None:
    """Compile-on-first-use reads the cache entry ``compile_many`` wrote: no compile again."""
    import cutlass.cute as cute

    monkeypatch.setenv("KDAGEN_CACHE", str(tmp_path))
    variant = Variant(kernel="commit", heads=2, window=2, row_split=4)
    [record] = kcompile.compile_many([variant], ["sm_90a"], jobs=1)
    assert record.ok and kcompile.object_path(variant, "sm_90a", tmp_path).exists()

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(cute, "compile", no_compile)
    kernel = first_use.SOURCE.load(variant, "sm_90a")
    assert callable(kernel)


def test_first_use_compiles_a_missing_kernel_into_the_same_cache(tmp_path: Path) -> None:
    """Where the cache has no object, first use compiles in this process and writes the entry
    ``kdagen compile`` then reads as cached."""
    variant = Variant(kernel="commit", heads=2, window=3, row_split=4)
    assert callable(kcompile.load_kernel(variant, "sm_90a", tmp_path))
    [record] = kcompile.compile_many([variant], ["sm_90a"], jobs=1, root=tmp_path)
    assert record.ok and record.cached


_SHARED_CACHE_CHILD = """
import sys
from pathlib import Path
from kdagen import compile as kcompile
from kdagen.serve.variant import Variant

compiles = []
build = kcompile._compile
kcompile._compile = lambda *args: compiles.append(1) or build(*args)
variant, root = Variant(kernel="commit", heads=2, window=5, row_split=4), Path(sys.argv[2])
if sys.argv[1] == "first-use":
    assert callable(kcompile.load_kernel(variant, "sm_90a", root))
else:
    assert kcompile.compile_variant(variant, "sm_90a", root, force=True).ok
print("compiles", len(compiles))
"""


def test_processes_sharing_the_cache_compile_one_variant_at_once(tmp_path: Path) -> None:
    """Test workers or a server's ranks that need one variant at once: every process gets
    it, first uses compile it once between them, and no half-built folder is left."""
    modes = ["first-use", "first-use", "first-use", "compile", "compile"]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _SHARED_CACHE_CHILD, mode, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for mode in modes
    ]
    outputs = [child.communicate(timeout=600)[0] for child in children]
    assert all(child.returncode == 0 for child in children), outputs
    compiles = [int(out.split("compiles ")[-1]) for out in outputs]
    assert sum(compiles[:3]) <= 1 and compiles[3:] == [1, 1], compiles
    variant = Variant(kernel="commit", heads=2, window=5, row_split=4)
    entry = kcompile.variant_dir(variant, tmp_path)
    assert sorted(p.name for p in entry.iterdir() if not p.name.endswith(".lock")) == [
        "kernel.py", "sm_90a"]  # fmt: skip
    assert {"kernel.o", "kernel.cubin", "record.json"} <= {
        p.name for p in (entry / "sm_90a").iterdir()
    }
    assert kcompile.cached_record(variant, "sm_90a", tmp_path).ok


@pytest.mark.parametrize("name", ["commit-h12-q8-i32-bulk-t256-v4-r1-pdl",
                                  "commit-h32-q8-softplus-tree-i64-bulk-t128-v4-r2-pdl"])  # fmt: skip
def test_the_commit_without_prefix_caching_frees_registers(name: str, cache: Path) -> None:
    """Compiling vLLM's block tables and the boundary fold out of the commit (the
    ``noprefix`` build) lets a 256-thread CTA fit four to an SM (at most 64 registers; the
    general build takes 75) with no stack frame."""
    general = Variant.parse(name)
    lean = general.replace(prefix_caching=False)
    records = [kcompile.compile_variant(v, "sm_90a", cache) for v in (general, lean)]
    assert all(r.ok for r in records), [r.error for r in records]
    assert records[1].registers < records[0].registers
    assert records[1].registers <= 64 and records[1].frame_bytes == 0


@pytest.mark.parametrize(
    ("name", "helper", "frame"),
    [
        ("verify-h12-q8-tree-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c396-s1-pdl", "staged", 8),
        ("verify-h8-q8-softplus-tree-conv-df-fp32-i32-sm90_wgmma-t128-r1-c396-s1-pdl", "staged", 8),
        ("verify-h12-q5-tree-conv-tm-bf16-i64-sm90_wgmma-t128-r1-c396-s1-pdl", "staged", 8),
        ("verify-h12-q16-tree-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c264-s1-pdl", "records", WIDE_FRAME_BYTES),
        ("verify-h12-q9-tree-conv-df-fp32-i32-sm90_wgmma-t128-r1-c264-s1-pdl", "records", WIDE_FRAME_BYTES),
    ],
)  # fmt: skip
def test_the_conv_trees_without_selects_compile(
    name: str, helper: str, frame: int, cache: Path
) -> None:
    """The conv trees whose lags are loaded, not selected: staged in shared memory at 5 to 8
    tokens (the 8 stack bytes a verify may park), from records that name their parents past 8
    (the wide verify's stack bound); either way the grid bound's resident CTAs fit an SM's
    registers and shared memory. Each tap dtype's kernel takes its helper and compiles."""
    variant = Variant.parse(name)
    source = krender.render(variant)
    assert f"from kdagen.dsl.tree_conv_{helper} import conv_silu_tree_{helper}" in source
    assert "kdagen.dsl.tree_conv import" not in source
    record = kcompile.compile_variant(variant, "sm_90a", cache)
    assert record.ok, record.error
    resident = variant.ctas // 132
    assert resident * 128 * record.registers <= 65536 and record.frame_bytes <= frame
    assert resident * (record.launch_smem_bytes + 1024) <= 232448


@pytest.fixture
def fresh_renders():
    """Renders cached neither before nor after the test (it changes a knob of kdagen.render)."""
    krender.render.cache_clear()
    yield
    krender.render.cache_clear()


@pytest.fixture
def switched_on(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The switches ``request.param`` of ``kdagen.render`` (one name, or names joined by "+")
    on for one test (renders cached both sides)."""
    for name in request.param.split("+"):
        monkeypatch.setattr(krender, name, True)
    krender.render.cache_clear()
    yield
    krender.render.cache_clear()


@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q16-i32-sm90_wgmma-t128-r1-c264-s1-pdl",
        "verify-h12-q12-tree-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c264-s1-pdl",
    ],
)
def test_the_bounded_gate_past_8_rebases_on_demand_and_compiles(name: str, tmp_path: Path) -> None:
    """The bounded gate past 8 tokens writes its second coupling tile only in a warp whose
    windows leave the range of 8 tokens: one vote, the tile's stores behind it, and the kernel
    within the wide verify's stack bound. The softplus gate past 8 keeps its two bands."""
    variant = Variant.parse(name)
    source = krender.render(variant)
    assert "rebased = cute.arch.vote_any_sync(" in source and "if rebased:" in source
    assert ("deepest = cutlass.min(deepest, nears[t])" in source) == variant.tree
    banded = krender.render(variant.replace(gate="softplus"))
    assert "vote_any_sync(far_bits" in banded and "if rebased:" not in banded
    record = kcompile.compile_variant(variant, "sm_90a", tmp_path)
    assert record.ok, record.error
    assert record.frame_bytes <= WIDE_FRAME_BYTES


def test_only_the_kernels_that_rebase_on_demand_get_the_bounded_edge_case() -> None:
    """The check's `bounded-edge` case (quarters of both kinds in one CTA) goes to every kernel
    that rebases on demand: softplus chains of up to 8 tokens and the bounded gate past 8;
    never to trees of up to 8 tokens or the softplus gate past 8."""
    from kdagen.check_verify import cases_for

    def edge(name: str) -> bool:
        return "bounded-edge" in {c.name for c in cases_for(Variant.parse(name))}

    chain8 = "verify-h16-q8-softplus-i32-sm90_wgmma-t128-r1-c396-s1-pdl"
    tree8 = "verify-h16-q8-softplus-tree-i32-sm90_wgmma-t128-r1-c396-s1-pdl"
    wide = "verify-h12-q16-i32-sm90_wgmma-t128-r1-c264-s1-pdl"
    wide_softplus = "verify-h16-q16-softplus-i32-sm90_wgmma-t128-r1-c264-s1-pdl"
    assert edge(chain8) and edge(wide) and not edge(tree8) and not edge(wide_softplus)


def _sass_lines(variant: Variant, root: Path) -> list[str]:
    """The instructions of ``variant``'s kernel for its arch, compiled into ``root``."""
    arch = "sm_100a" if variant.path == "sm100_tcgen05" else "sm_90a"
    record = kcompile.compile_variant(variant, arch, root)
    assert record.ok, record.error
    sass = disassemble(kcompile.variant_dir(variant, root) / arch / "kernel.cubin")
    return [line for line in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", line)]


def _first_ops(variant: Variant, root: Path, ops: tuple[str, ...]) -> dict[str, int]:
    """Where each SASS opcode of ``ops`` first occurs in ``variant``'s kernel for its arch."""
    lines = _sass_lines(variant, root)
    first = {op: next((i for i, line in enumerate(lines) if re.search(rf"\b{op}\b", line)), -1)
             for op in ops}  # fmt: skip
    assert min(first.values()) >= 0, f"{variant.name} lacks an opcode: {first}"
    return first


PREFETCHING_COMMITS = (
    "commit-h12-q8-noprefix-i32-bulk-t256-v4-r1-f8-pdl",
    "commit-h32-q8-softplus-tree-i64-bulk-t128-v4-r4-pdl",
)


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize(
    ("switched_on", "name"),
    [("COMMIT_STATE_PREFETCH", name) for name in PREFETCHING_COMMITS],
    indirect=["switched_on"],
)
def test_a_pdl_commit_fetches_its_state_into_l2_before_the_wait(
    name: str, tmp_path: Path, switched_on
) -> None:
    """Switched on (until a GPU has measured it), a PDL commit reads its slot and fetches the
    slot's state into L2 before griddepcontrol.wait, and copies it into shared memory only
    after the wait; a commit without PDL, or on the ring, renders as before."""
    variant = Variant.parse(name)
    first = _first_ops(variant, tmp_path, ("LDG", "UBLKPF", "ACQBULK", "UBLKCP"))
    assert first["LDG"] < first["UBLKPF"] < first["ACQBULK"] < first["UBLKCP"], first
    assert "prefetch_l2(" not in krender.render(variant.replace(pdl=False))
    ring = Variant.parse("commit-h12-q8-noprefix-i32-bulk_ring-t128-v4-r1-f8-pdl")
    assert "prefetch_l2(" not in krender.render(ring)


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize("switched_on", ["COMMIT_EARLY_READS"], indirect=True)
@pytest.mark.parametrize(
    ("name", "records_first"),
    [
        ("commit-h12-q8-noprefix-i32-bulk-t256-v4-r1-f8-pdl", True),
        ("commit-h12-q8-noprefix-i32-bulk_ring-t128-v4-r1-f8-pdl", False),
        ("commit-h32-q8-softplus-tree-i64-bulk-t128-v4-r4-pdl", False),
    ],
)
def test_a_commit_reads_its_gates_and_records_early(
    name: str, records_first: bool, tmp_path: Path, switched_on
) -> None:
    """Switched on (off in the product until the H200 commit studies are re-timed), a commit
    that folds on the CUDA cores loads a_log and its channels' dt_bias before
    griddepcontrol.wait, where a plain load would be sunk to the factors; the bulk path without
    prefix caching copies the records before the state. The tensor-core path keeps its own
    order."""
    variant = Variant.parse(name)
    first = _first_ops(variant, tmp_path, ("LDG.E.CONSTANT", "ACQBULK"))
    assert first["LDG.E.CONSTANT"] < first["ACQBULK"], first
    source = krender.render(variant)
    records, state = source.index("cute.copy(corr_copy"), source.index("if source_ok:")
    assert (records < state) == records_first, (records, state)
    mma = Variant.parse("commit-h12-q8-noprefix-i32-bulk_mma-t128-r1-pdl")
    assert "load_weight(" not in krender.render(mma)


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize(
    "switched_on", ["COMMIT_PIECES_EARLY", "COMMIT_PIECES_EARLY+COMMIT_EARLY_READS"], indirect=True
)
def test_the_ring_copies_its_first_pieces_before_the_wait(tmp_path: Path, switched_on) -> None:
    """Switched on (until a GPU has measured it), the PDL ring issues its first RING pieces'
    bulk copies before griddepcontrol.wait (after the early gate weights, which stay before
    it); the ring without PDL and the bulk path render as before."""
    ring = Variant.parse("commit-h12-q8-noprefix-i32-bulk_ring-t128-v4-r1-f8-pdl")
    ops = ("UBLKCP", "ACQBULK") + (("LDG.E.CONSTANT",) if krender.COMMIT_EARLY_READS else ())
    first = _first_ops(ring, tmp_path, ops)
    assert first.get("LDG.E.CONSTANT", -1) < first["UBLKCP"] < first["ACQBULK"], first
    source = krender.render(ring)
    assert source.index("self.copy_piece(") < source.index("cute.arch.griddepcontrol_wait()")
    for other in (ring.replace(pdl=False),
                  Variant.parse("commit-h12-q8-noprefix-i32-bulk-t256-v4-r1-f8-pdl")):  # fmt: skip
        assert "The ring's first pieces under" not in krender.render(other)


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize(
    "switched_on", ["VERIFY_ROW_BOUNDS+VERIFY_STATE_AFTER_WAIT"], indirect=True
)
@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q8-i32-sm90_wgmma-t128-r1-c396-s2-pdl",
        "verify-h32-q4-i32-sm90_wgmma-t128-r2-c528-s1-pdl",
        "verify-h16-q16-softplus-tree-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c264-s1-pdl",
        "verify-h12-q2-tree-conv-tm-bf16-i32-sm100_tcgen05-c740",
    ],
)
def test_a_pdl_verify_copies_its_first_state_into_shared_memory_only_after_the_wait(
    name: str, tmp_path: Path, switched_on
) -> None:
    """Switched on (until a GPU has checked every verify render), a PDL verify fetches its
    first state only into L2 before griddepcontrol.wait (UTMAPF) and issues every TMA load of a
    state after it, so a commit launched right before it cannot hand it an old state; and it
    cuts its windows to the token rows."""
    variant = Variant.parse(name)
    assert "window_rows(query_start, request," in krender.render(variant)
    first = _first_ops(variant, tmp_path, ("UTMAPF", "ACQBULK", "UTMALDG"))
    assert -1 < first["UTMAPF"] < first["ACQBULK"] < first["UTMALDG"], first


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
def test_the_shipped_verify_copies_its_first_state_before_the_wait(tmp_path: Path) -> None:
    """What the test above guards against: switched off (the shipped render), the early CTAs'
    TMA load of their first state precedes griddepcontrol.wait."""
    variant = Variant.parse("verify-h12-q8-i32-sm90_wgmma-t128-r1-c396-s2-pdl")
    first = _first_ops(variant, tmp_path, ("ACQBULK", "UTMALDG"))
    assert -1 < first["UTMALDG"] < first["ACQBULK"], first


@pytest.mark.parametrize("switched_on", ["SOFTPLUS_ONE_TILE"], indirect=True)
@pytest.mark.parametrize(
    "name",
    [
        "verify-h32-q8-softplus-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
        "verify-h16-q3-softplus-conv-df-fp32-i64-sm90_wgmma-t128-r1-c396-s2-pdl",
    ],
)
def test_the_one_warpgroup_softplus_chain_couples_without_a_second_tile(
    name: str, tmp_path: Path, switched_on
) -> None:
    """Switched on (until a GPU has checked it), a one-warpgroup softplus chain of up to 8
    tokens takes the shared memory of its bounded twin: a warp that needs the rebased probes
    writes them into the state's probe tile and writes the state's probes over them after its
    coupling MMAs. The two-warpgroup kernel, whose coupling runs beside the wgmma, keeps its
    second tile."""
    variant = Variant.parse(name)
    source = krender.render(variant)
    assert "s_couple" not in source and "if rebased:" in source
    record = kcompile.compile_variant(variant, "sm_90a", tmp_path / "softplus")
    bounded = kcompile.compile_variant(variant.replace(gate="kda"), "sm_90a", tmp_path / "kda")
    assert record.ok and bounded.ok, (record.error, bounded.error)
    assert record.smem_bytes == bounded.smem_bytes and record.frame_bytes == 0
    two = "verify-h32-q8-softplus-i32-sm90_wgmma-t256-r1-c264-s1-pdl"
    assert "s_couple" in krender.render(Variant.parse(two))


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize(
    ("name", "staged_from", "resident", "fewer"),
    [
        ("verify-h12-q16-i32-sm90_wgmma-t128-r1-c264-s1-pdl", 9, 2, 0.95),
        ("verify-h16-q13-softplus-tree-i64-sm90_wgmma-t128-r1-c264-s1-pdl", 9, 2, 0.95),
        ("verify-h12-q8-tree-i32-sm90_wgmma-t128-r1-c396-s1-pdl", 5, 3, 0.95),
        ("verify-h16-q6-softplus-i64-sm90_wgmma-t128-r1-c396-s1-pdl", 5, 3, 0.97),
    ],
)
def test_the_verify_stages_its_next_window_by_cp_async(
    name: str, staged_from: int, resident: int, fewer: float, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, fresh_renders,
) -> None:  # fmt: skip
    """A one-warpgroup verify without the conv of at least render.STAGED_WINDOW_FROM tokens
    copies its next window into shared memory with cp.async instead of loading it into
    registers: fewer instructions than the register look-ahead, no more registers, no stack,
    as many resident CTAs an SM (shared memory and registers). The shipped knob stages the
    wide kernels (9 tokens up); 5 widens it to the three-CTA kernels of 5-8 tokens. The conv
    kernels (behind render.STAGED_WINDOW_CONV, off here), the shorter windows and the
    four-CTA grid keep the register look-ahead."""
    monkeypatch.setattr(krender, "STAGED_WINDOW_FROM", staged_from)  # before any render
    monkeypatch.setattr(krender, "STAGED_WINDOW_CONV", False)
    variant = Variant.parse(name)
    assert "stage_window(" in krender.render(variant)
    staged = _sass_lines(variant, tmp_path / "staged")
    staged_record = kcompile.compile_variant(variant, "sm_90a", tmp_path / "staged")
    assert any("LDGSTS" in line for line in staged)
    assert staged_record.frame_bytes == 0
    launched = staged_record.launch_smem_bytes
    assert resident * (launched + 1024) <= 232448, launched
    assert resident * 128 * staged_record.registers <= 65536, staged_record.registers
    shorter = variant.replace(window=staged_from - 1)
    for other in (shorter, variant.replace(conv=True), variant.replace(ctas=528)):
        assert "stage_window(" not in krender.render(other), other.name
    monkeypatch.setattr(krender, "STAGED_WINDOW_FROM", 17)
    krender.render.cache_clear()
    loaded = _sass_lines(variant, tmp_path / "loaded")
    loaded_record = kcompile.compile_variant(variant, "sm_90a", tmp_path / "loaded")
    assert len(staged) < fewer * len(loaded), (len(staged), len(loaded))
    assert staged_record.registers <= loaded_record.registers


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q16-tree-conv-tm-bf16-i32-sm90_wgmma-t128-r1-c264-s1-pdl",
        "verify-h8-q9-softplus-conv-df-fp32-i32-sm90_wgmma-t128-r1-c264-s1-pdl",
    ],
)
def test_the_wide_conv_verify_stages_its_window_behind_its_switch(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_renders
) -> None:
    """With render.STAGED_WINDOW_CONV the wide conv chains and trees stage their window by
    cp.async too: fewer instructions, no more registers, no stack, still two CTAs an SM by
    the shared memory their launch asks (the largest, the conv tree of 16 tokens, included:
    its SHARED_BYTES bound alone would not fit two). Off, the conv kernels load their window
    into registers."""
    variant = Variant.parse(name)
    monkeypatch.setattr(krender, "STAGED_WINDOW_CONV", False)
    assert "stage_window(" not in krender.render(variant)
    loaded = _sass_lines(variant, tmp_path / "loaded")
    loaded_record = kcompile.compile_variant(variant, "sm_90a", tmp_path / "loaded")
    monkeypatch.setattr(krender, "STAGED_WINDOW_CONV", True)
    krender.render.cache_clear()
    assert "stage_window(" in krender.render(variant)
    assert "stage_window(" not in krender.render(variant.replace(window=8))
    staged = _sass_lines(variant, tmp_path / "staged")
    staged_record = kcompile.compile_variant(variant, "sm_90a", tmp_path / "staged")
    assert any("LDGSTS" in line for line in staged)
    assert staged_record.frame_bytes == 0
    assert kcompile.load_module(variant, tmp_path / "staged").RESIDENT == 2
    assert 2 * 128 * staged_record.registers <= 65536, staged_record.registers
    launched = staged_record.launch_smem_bytes
    assert launched <= staged_record.smem_bytes and 2 * (launched + 1024) <= 232448, launched
    assert staged_record.registers <= loaded_record.registers
    assert len(staged) < 0.98 * len(loaded), (len(staged), len(loaded))


@pytest.mark.skipif(find_nvdisasm() is None, reason="nvdisasm not installed")
@pytest.mark.parametrize(
    ("name", "wide_stores", "transposed_loads"),
    [
        ("verify-h12-q16-i32-sm90_wgmma-t128-r1-c264-s1-pdl", 8 + 8 + 4, 8 + 4),
        ("verify-h32-q13-tree-conv-tm-bf16-i64-sm90_wgmma-t128-r1-c264-s1-pdl", 8 + 8 + 4, 8 + 4),
        ("verify-h16-q14-softplus-tree-i64-sm90_wgmma-t128-r1-c264-s1-pdl", 2 * (8 + 8 + 4) - 8,
         2 * (8 + 4)),
    ],
)  # fmt: skip
def test_the_wide_verify_writes_its_probes_a_channel_row_at_a_time(
    name: str, wide_stores: int, transposed_loads: int, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, fresh_renders,
) -> None:  # fmt: skip
    """With render.PROBE_ROWS the kernels of 13-16 tokens write their probe and w tiles a
    channel row at a time (16-byte stores, no two-byte ones: the bounded gate's probes, rebased
    probes and w; the softplus gate's probes, both bands' coupling probes and w) and the
    coupling MMAs read them transposed: fewer instructions, no more registers, no stack, the
    same shared memory. The three-CTA build and the shorter windows keep the K-major tiles."""
    variant = Variant.parse(name)
    monkeypatch.setattr(krender, "PROBE_ROWS", False)
    columns = _sass_lines(variant, tmp_path / "columns")
    columns_record = kcompile.compile_variant(variant, "sm_90a", tmp_path / "columns")
    monkeypatch.setattr(krender, "PROBE_ROWS", True)
    krender.render.cache_clear()
    assert "store_ready_chunks(" in krender.render(variant)
    for other in (variant.replace(window=12),
                  variant.replace(gate="kda", ctas=396, conv=False, tree=False)):  # fmt: skip
        assert not krender.probe_rows(other), other.name
    rows = _sass_lines(variant, tmp_path / "rows")
    rows_record = kcompile.compile_variant(variant, "sm_90a", tmp_path / "rows")
    assert not any("STS.U16" in line for line in rows)
    assert sum("STS.128" in line for line in rows) == wide_stores
    assert sum("LDSM.16.MT88.4" in line for line in rows) == transposed_loads
    assert rows_record.frame_bytes <= columns_record.frame_bytes
    assert rows_record.registers <= columns_record.registers + 2
    assert rows_record.launch_smem_bytes == columns_record.launch_smem_bytes
    assert len(rows) < 0.97 * len(columns), (len(rows), len(columns))


@pytest.mark.parametrize(
    "name",
    [
        "verify-h12-q16-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
        "verify-h96-q13-i64-sm90_wgmma-t128-r1-c396-s1-pdl",
        "verify-h12-q16-tree-i32-sm90_wgmma-t128-r1-c396-s1-pdl",
    ],
)
def test_the_wide_bounded_gate_fits_three_ctas_an_sm(name: str, tmp_path: Path) -> None:
    """Not yet in a shipped space (no GPU has checked or timed it): at a grid bound of 3 x 132
    the bounded-gate chains and trees past 8 tokens drop their second coupling tile and their
    partials' buffer and hold the look-ahead window a channel pair to a register, so three
    CTAs fit an SM's shared memory and registers with at most 32 stack bytes. The 2-CTA twin
    keeps the shipped form."""
    variant = Variant.parse(name)
    source = krender.render(variant)
    assert krender.three_ctas_wide(variant) and "if rebased:" in source
    assert "s_couple" not in source and "load_window_pairs(" in source
    record = kcompile.compile_variant(variant, "sm_90a", tmp_path)
    assert record.ok, record.error
    assert 3 * 128 * record.registers <= 65536 and 3 * (record.launch_smem_bytes + 1024) <= 232448
    assert record.frame_bytes <= 32
    twin = variant.replace(ctas=264)
    assert not krender.three_ctas_wide(twin) and "s_couple" in krender.render(twin)


def test_the_general_commit_folds_its_boundary_state_on_one_path(tmp_path: Path) -> None:
    """Not yet in a shipped space (no GPU has timed it): the commit with prefix caching and 8
    update paths unrolls only its final fold per count (the boundary state folds on one path),
    with no more registers than its one-path twin and no stack."""
    variant = Variant.parse("commit-h12-q8-i32-bulk-t256-v4-r1-f8-pdl")
    source = krender.render(variant)
    assert "boundary_count, boundary, 1)" in source and "count, final, FOLD_PATHS)" in source
    counted = kcompile.compile_variant(variant, "sm_90a", tmp_path / "counted")
    single = kcompile.compile_variant(variant.replace(fold_paths=1), "sm_90a", tmp_path / "one")
    assert counted.ok and single.ok, (counted.error, single.error)
    assert counted.registers <= single.registers and counted.frame_bytes == 0
