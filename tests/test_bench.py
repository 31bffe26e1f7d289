"""The benchmark: byte counts against the anchors' floors, result files, the peers loader,
the `bench` command's plumbing (CPU), and a tiny verify sweep with FlashInfer (GPU)."""

from __future__ import annotations

import csv
import json
import math
import sys
import types
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gpu_marks import skip_without_peer
from typer.testing import CliRunner

from kdagen import bench as kbench
from kdagen import peers
from kdagen.bench import VerifyBenchRow, verify_bytes, verify_footprint
from kdagen.serve.variant import Variant

ANCHOR_BW = 4.224e12  # the copy bandwidth docs/anchors.md states

# (H, Q) -> [(B, floor us)] copied from the floor columns of docs/anchors.md
ANCHOR_FLOORS = {
    (12, 8): [(1, 0.15), (4, 0.58), (16, 2.33), (64, 9.31), (256, 37.25), (512, 74.49)],
    (32, 4): [(1, 0.32), (4, 1.29), (16, 5.16), (64, 20.65), (256, 82.61), (512, 165.23)],
    (96, 8): [(1, 1.18), (8, 9.40), (64, 75.22), (256, 300.89)],
    (12, 2): [(1, 0.11), (16, 1.70), (256, 27.16)],
}


def test_verify_bytes_by_hand() -> None:
    # H=12, Q=8, B=512: T = 4096 tokens, HK = 1536
    state = 512 * 12 * 128 * 128 * 2
    reads = 4096 * (3 * 1536 + 1536 + 12) * 2 + 12 * 4 + 1536 * 4 + 513 * 4 + 512 * 4
    writes = 512 * 12 * 8 * (128 * 4 + 256 * 2) + 4096 * 1536 * 2
    assert verify_bytes(512, 12, 8) == state + reads + writes == 314_681_396
    assert verify_footprint(512, 12, 8) == verify_bytes(512, 12, 8)
    assert verify_bytes(1, 12, 8, slot_bytes=8) == verify_bytes(1, 12, 8) + 4


def test_verify_bytes_with_conv_by_hand() -> None:
    # per request: 3 history rows read + (Q + 2) rows written, 3HK = 4608 bf16 channels a row,
    # accepted (int32); per launch: the [4608, 4] taps
    extra = 1 * ((3 + 8 + 2) * 4608 * 2 + 4) + 4608 * 4 * 2
    assert verify_bytes(1, 12, 8, conv=True) == verify_bytes(1, 12, 8) + extra
    fp32_taps = verify_bytes(1, 12, 8, conv=True, conv_weight_bytes=4)
    assert fp32_taps - verify_bytes(1, 12, 8, conv=True) == 4608 * 4 * 2
    # the history rows lie among the rows rewritten in place: touched once
    assert verify_footprint(3, 12, 8, conv=True) == verify_bytes(3, 12, 8, conv=True) - 3 * (
        3 * 4608 * 2
    )


@pytest.mark.parametrize(("heads", "window"), [(12, 8), (12, 2)])
def test_floor_matches_the_anchors_at_their_bandwidth(heads: int, window: int) -> None:
    for batch, floor in ANCHOR_FLOORS[heads, window]:
        ours = verify_bytes(batch, heads, window) / ANCHOR_BW * 1e6
        # the anchors print two decimals: half a unit of rounding, plus 0.5 %
        assert abs(ours - floor) <= 0.005 + 0.005 * floor, (batch, ours, floor)
    assert math.isclose(verify_bytes(512, 12, 8) / ANCHOR_BW * 1e6, 74.49, rel_tol=5e-3)


@pytest.mark.parametrize(("heads", "window"), list(ANCHOR_FLOORS))
def test_floor_scales_like_the_anchors_in_every_table(heads: int, window: int) -> None:
    """Within each table the anchors' floors imply one bandwidth for our byte counts. The
    H=32 and H=96 tables imply 4.16 and 4.18 TB/s, not 4.224: no byte count linear in B*H
    fits all tables at one bandwidth (at Q=8, H=12 and H=96 would need different bytes per
    request-head), so those floors were divided by the copy bandwidth of their own runs."""
    implied = [
        verify_bytes(b, heads, window) / (floor * 1e-6)
        for b, floor in ANCHOR_FLOORS[heads, window]
        if floor >= 5  # two printed decimals pin the bandwidth to 0.1 % from here up
    ]
    if heads == 12 and window == 2:  # one row above 5 us: only the bandwidth below is checked
        assert len(implied) == 1
    else:
        assert len(implied) >= 2, "each table has rows above 5 us"
        assert max(implied) / min(implied) - 1 < 2e-3
    assert all(abs(bw / ANCHOR_BW - 1) < 0.02 for bw in implied)


def test_floor_us_of_a_variant() -> None:
    verify = Variant(kernel="verify", heads=12, window=8, path="sm100_tcgen05")
    assert kbench.floor_us(verify, 512, ANCHOR_BW) == pytest.approx(314_681_396 / ANCHOR_BW * 1e6)
    conv = verify.replace(conv=True, conv_weight_dtype="fp32")
    assert kbench.moved_bytes(conv, 4) == verify_bytes(4, 12, 8, conv=True, conv_weight_bytes=4)
    commit = Variant(kernel="commit", heads=12, window=8)
    assert kbench.moved_bytes(commit, 64) == kbench.commit_bytes(64, 12, 8)


def _rows() -> list[VerifyBenchRow]:
    """Made-up rows (not measurements) for the file and table plumbing."""
    out = []
    for batch, ours, fi in [(1, 6.0, 7.32), (512, 90.0, None)]:
        for name, slower in [("verify-h12-q8-i32-a", 1.0), ("verify-h12-q8-i32-b", 1.5)]:
            floor = verify_bytes(batch, 12, 8) / ANCHOR_BW * 1e6
            median = ours * slower
            out.append(
                VerifyBenchRow(
                    12, 8, False, batch, name, median, median * 0.98, median * 1.03, 3,
                    round(floor, 3), round(100 * floor / median, 1), fi,
                    None if fi is None else 1.5, None if fi is None else 2e-3, None if fi is None else 1e-3,
                )
            )  # fmt: skip
    return out


def test_results_as_json_csv_and_plot(tmp_path: Path) -> None:
    rows = _rows()
    json_path, csv_path = kbench.write_results(tmp_path / "r" / "b.json", {"kernel": "x"}, rows)
    data = json.loads(json_path.read_text())
    assert data["kernel"] == "x" and len(data["rows"]) == 4
    assert data["rows"][3]["flashinfer_us"] is None
    with csv_path.open() as fh:
        table = list(csv.DictReader(fh))
    assert csv_path == tmp_path / "r" / "b.csv"
    assert [r["variant"] for r in table][:2] == ["verify-h12-q8-i32-a", "verify-h12-q8-i32-b"]
    assert table[0]["flashinfer_us"] == "7.32" and table[2]["flashinfer_us"] == ""
    best = kbench.best_per_batch(list(reversed(rows)))
    assert [b for b in best] == [1, 512] and best[512].variant.endswith("-a")
    series = kbench.latency_series(rows, kbench.PEER_FIELDS["verify"])
    assert series["flashinfer"] == [(1.0, 7.32)]  # not measured at 512: no point
    assert [y for _, y in series["kdagen (best variant)"]] == [6.0, 90.0]
    svg = kbench.plot_results(rows, "verify", "t", tmp_path / "r" / "b.svg")
    ET.parse(svg)


def test_fetch_flashinfer_from_a_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "flashinfer_python-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name in peers.FLASHINFER_FILES:
            zf.writestr(name, f"# {name}\n")
        zf.writestr("flashinfer_python-0.0.1.dist-info/METADATA", "Name: x\nVersion: 0.0.1\n")
        zf.writestr("flashinfer_python-0.0.1.dist-info/licenses/LICENSE", "licence\n")
        zf.writestr("flashinfer/other.py", "not copied\n")
    dest = tmp_path / "peers"
    written = peers.fetch_flashinfer(dest, wheel)
    assert all(p.exists() for p in written)
    assert (dest / "flashinfer/__init__.py").read_text() == '__version__ = "0.0.1"\n'
    assert (dest / "flashinfer/kda_kernels/__init__.py").read_text() == ""
    assert (dest / "flashinfer/licenses/LICENSE").exists()
    assert not (dest / "flashinfer/other.py").exists()
    broken = tmp_path / "broken.whl"
    with zipfile.ZipFile(broken, "w") as zf:
        zf.writestr(peers.FLASHINFER_FILES[0], "")
    with pytest.raises(FileNotFoundError, match="lacks"):
        peers.fetch_flashinfer(tmp_path / "p2", broken)


def _vllm_wheel(folder: Path, version: str = peers.VLLM_VERSION, stub: str | None = None) -> Path:
    """A fake vllm wheel: METADATA, a licence and a recoverssm.py (``stub``, by default one
    importing what 0.33.0's does; "": none)."""
    wheel = folder / f"vllm-{version}-cp38-abi3-manylinux1_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\n")
        zf.writestr(f"vllm-{version}.dist-info/licenses/LICENSE", "licence\n")
        zf.writestr("vllm/other.py", "not copied\n")
        if stub != "":
            zf.writestr(peers.VLLM_FILE, VLLM_STUB if stub is None else stub)
    return wheel


VLLM_STUB = """\
from typing import Literal

from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.models.kimi_k3.nvidia.recoverssm.kernels import cute_recoverssm_commit
from vllm.triton_utils import tl, triton
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID


def kda_recoverssm_verify(*args):
    return "verify"


class KDARecoverSSMCommitContext:
    backend: Literal["cute", "triton"] = "triton"
"""  # the imports of 0.33.0's recoverssm.py


@pytest.fixture
def fake_triton(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A stand-in ``triton`` (with ``triton.language``) for the shims to import, whether or
    not the real one is installed; sys.path and the ``vllm`` modules are put back after."""
    triton = types.ModuleType("triton")
    triton.language = types.ModuleType("triton.language")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.language", triton.language)  # type: ignore[attr-defined]
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = {k: m for k, m in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    for name in saved:
        del sys.modules[name]
    yield triton
    for name in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
        del sys.modules[name]
    sys.modules.update(saved)


def test_peers_fetch_vllm_from_a_wheel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_triton: types.ModuleType
) -> None:
    wheel = _vllm_wheel(tmp_path)
    dest = tmp_path / "peers"
    args = ["fetch", "--only", "vllm", "--vllm-wheel", str(wheel), "--dest", str(dest)]
    assert peers.main(args) == 0
    assert not (dest / "flashinfer").exists() and not (dest / "vllm/other.py").exists()
    assert (dest / peers.VLLM_FILE).read_text() == VLLM_STUB
    assert (dest / "vllm/__init__.py").read_text() == '__version__ = "0.33.0"\n'
    for package in ("vllm/models/kimi_k3/nvidia/ops", "vllm/models/kimi_k3/nvidia/recoverssm",
                    "vllm/model_executor/layers/mamba", "vllm/v1/attention/backends"):  # fmt: skip
        parts = package.split("/")
        for depth in range(2, len(parts) + 1):
            assert (dest / "/".join(parts[:depth]) / "__init__.py").read_text() == ""
    assert (dest / "vllm/licenses/LICENSE").read_text() == "licence\n"

    monkeypatch.syspath_prepend(str(dest))
    import importlib

    importlib.invalidate_caches()
    stub = importlib.import_module(peers.VLLM_MODULE)
    assert Path(stub.__file__) == dest / peers.VLLM_FILE
    assert stub.triton is fake_triton and stub.tl is fake_triton.language
    assert stub.NULL_BLOCK_ID == 0
    with pytest.raises(NotImplementedError, match="Triton commit only"):
        stub.cute_recoverssm_commit(None, None, 1, align=False)
    monkeypatch.delenv(peers.VLLM_CONV_ENV, raising=False)
    assert stub.is_conv_state_dim_first() is False
    monkeypatch.setenv(peers.VLLM_CONV_ENV, "1")
    assert stub.is_conv_state_dim_first() is True
    monkeypatch.setenv(peers.VLLM_CONV_ENV, "0")
    assert stub.is_conv_state_dim_first() is False

    monkeypatch.setenv(peers.PEERS_ENV, str(dest))
    for load, name in ((peers.vllm_commit(), "KDARecoverSSMCommitContext"),
                       (peers.vllm_verify(), "kda_recoverssm_verify")):  # fmt: skip
        assert "\n" not in load.note
        if torch.cuda.is_available():
            assert load.fn is getattr(stub, name) and "vllm 0.33.0" in load.note
        else:
            assert load.fn is None and "CUDA GPU; none is visible" in load.note


def test_peers_vllm_fetch_refuses_other_wheels(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is vllm 0.32.0; the peer is vllm 0.33.0"):
        peers.fetch_vllm(tmp_path / "p1", _vllm_wheel(tmp_path, version="0.32.0"))
    with pytest.raises(FileNotFoundError, match="lacks"):
        peers.fetch_vllm(tmp_path / "p2", _vllm_wheel(tmp_path, stub=""))
    no_metadata = tmp_path / "bare.whl"
    with zipfile.ZipFile(no_metadata, "w") as zf:
        zf.writestr(peers.VLLM_FILE, VLLM_STUB)
    with pytest.raises(ValueError, match="of no version"):
        peers.fetch_vllm(tmp_path / "p3", no_metadata)
    more = _vllm_wheel(tmp_path, stub=VLLM_STUB + "from vllm.envs import VLLM_X\n")
    with pytest.raises(ValueError, match=r"imports vllm.envs \(VLLM_X\), which kdagen's shims"):
        peers.fetch_vllm(tmp_path / "p4", more)
    fewer = _vllm_wheel(tmp_path, stub=VLLM_STUB + "from vllm.triton_utils import tldevice\n")
    with pytest.raises(ValueError, match=r"vllm.triton_utils \(tldevice\)"):
        peers.fetch_vllm(tmp_path / "p5", fewer)
    assert not any((tmp_path / p).exists() for p in ("p1", "p2", "p3", "p4", "p5"))


def test_peers_vllm_loader_names_a_missing_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_triton: types.ModuleType
) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("a vllm is installed: it would be found without a copy")
    monkeypatch.setenv(peers.PEERS_ENV, str(tmp_path / "empty"))
    for load in (peers.vllm_commit(), peers.vllm_verify()):
        assert load.fn is None and "no copy in" in load.note and "--only vllm" in load.note


def test_peers_vllm_loader_says_why_not_here() -> None:
    """Whatever this machine has (a copy or not, triton or not, a GPU or not): one line."""
    for load in (peers.vllm_commit(), peers.vllm_verify()):
        assert load.note and "\n" not in load.note
        assert (load.fn is None) == (
            "not importable" in load.note or "CUDA GPU; none is visible" in load.note
        )


def test_flashinfer_args_view_our_inputs_and_index_outputs_by_slot() -> None:
    from kdagen import reference
    from kdagen.testing import verify_args

    variant = Variant(kernel="verify", heads=2, window=4, path="sm100_tcgen05")
    inputs = kbench.verify_inputs(variant, 3, seed=1, device="cpu")
    args = kbench.flashinfer_args(inputs)
    q, k, v, raw_g, raw_beta, _, _, lower_bound, state, corr, kg, _, slots, window, out = args
    qkv = inputs["qkv"]
    assert q.shape == k.shape == v.shape == raw_g.shape == out.shape == (1, 12, 2, 128)
    assert raw_beta.shape == (1, 12, 2) and window == 4 and lower_bound == -5.0
    assert [t.data_ptr() - qkv.data_ptr() for t in (q, k, v)] == [0, 512, 1024]  # no copies
    assert q.stride() == (12 * 768, 768, 128, 1)
    assert state is inputs["state"] and state.stride(0) == 2 * 128 * 128 + 512
    assert sorted(slots.tolist()) == [1, 2, 3] and slots.dtype == torch.int32
    assert corr.shape == (4, 2, 4, 128) and kg.shape == (4, 2, 4, 256)  # one row per pool slot

    reference.verify(verify_args(inputs))
    assert all(math.isnan(d) for d in kbench.peer_distance(inputs, args).values())
    rows = slots.long()
    out.view_as(inputs["out"]).copy_(inputs["out"])
    corr[rows], kg[rows] = inputs["corr"][:3], inputs["kg"][:3]
    assert kbench.peer_distance(inputs, args) == {"out": 0.0, "corr": 0.0, "kg": 0.0}


def test_bench_verify_loop_with_cpu_stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's bookkeeping, GPU parts replaced: the reference stands in for our kernel and,
    scattering corr/kg to slot rows, for FlashInfer; each 'timing' runs every launch once."""
    from functools import partial

    from kdagen import reference
    from kdagen.bench import Timing
    from kdagen.serve.contract import VerifyArgs
    from kdagen.testing import verify_args

    def fake_time(launches):  # type: ignore[no-untyped-def]
        for launch in launches:
            launch()
        return Timing(10.0, 9.5, 11.0, len(launches))

    def fake_flashinfer(
        q, k, v, g, beta, a_log, dt_bias, lb, state, corr, kg, qsl, slots, window, out
    ):  # type: ignore[no-untyped-def]
        tokens, heads, batch = q.shape[1], q.shape[2], slots.shape[0]
        o = torch.empty(tokens, heads * 128, dtype=torch.bfloat16)
        c = torch.empty(batch, heads, window, 128)
        kk = torch.empty(batch, heads, window, 256, dtype=torch.bfloat16)
        q, k, v = (t[0].flatten(1) for t in (q, k, v))
        args = VerifyArgs(q, k, v, g[0].flatten(1), beta[0], a_log, dt_bias, state, qsl, slots,
                          o, c, kk, lower_bound=lb, null_slot=0)  # fmt: skip
        reference.verify(args)
        out.copy_(o.view_as(out))
        corr[slots.long()], kg[slots.long()] = c, kk

    monkeypatch.setattr(kbench, "sets_for", lambda size: 2)
    monkeypatch.setattr(kbench, "verify_inputs", partial(kbench.verify_inputs, device="cpu"))
    monkeypatch.setattr(
        kbench, "verify_launch", lambda s, v: lambda: reference.verify(verify_args(s))
    )
    monkeypatch.setattr(kbench, "time_graph", fake_time)
    monkeypatch.setattr(peers, "flashinfer_verify", lambda: peers.PeerLoad(fake_flashinfer, "x"))
    variant = Variant(kernel="verify", heads=2, window=2, path="sm100_tcgen05")
    rows = kbench.bench_verify([variant, variant.replace(ctas=64)], [1, 3], 4e12, seed=5)
    assert [(r.batch, r.variant[-3:]) for r in rows] == [
        (1, "740"), (1, "c64"), (3, "740"), (3, "c64")
    ]  # fmt: skip
    for r in rows:
        assert (r.median_us, r.p10_us, r.p90_us, r.sets) == (10.0, 9.5, 11.0, 2)
        assert r.floor_us == round(verify_bytes(r.batch, 2, 2) / 4e12 * 1e6, 3)
        assert r.flashinfer_us == 10.0 and r.flashinfer_spread_pct == 15.0
        assert r.flashinfer_rel_l2 == 0.0 and r.flashinfer_corr_rel_l2 == 0.0
    no_peer = kbench.bench_verify([variant], [2], 4e12, peers=False)
    assert no_peer[0].flashinfer_us is None and no_peer[0].flashinfer_rel_l2 is None
    assert no_peer[0].flashinfer_corr_rel_l2 is None

    def broken(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("no kernel image for this device\nmore")

    monkeypatch.setattr(peers, "flashinfer_verify", lambda: peers.PeerLoad(broken, "x"))
    with pytest.warns(UserWarning, match="left out from B=2 on: RuntimeError: no kernel image"):
        failed = kbench.bench_verify([variant], [2, 3], 4e12)
    assert [r.flashinfer_us for r in failed] == [None, None]


def test_tree_twins_share_inputs_and_the_chain_drops_the_parents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kdagen bench --tree both``: a tree variant and its chain twin on the same input sets
    (built for the tree: with parents), the chain launched without them."""
    from functools import partial

    from kdagen.bench import Timing
    from kdagen.serve import runtime

    launched: list[tuple[bool, object]] = []

    def fake_time(launches):  # type: ignore[no-untyped-def]
        for launch in launches:
            launch()
        return Timing(10.0, 9.5, 11.0, len(launches))

    monkeypatch.setattr(runtime, "run_verify",
                        lambda args, variant: launched.append((variant.tree, args.parents)))  # fmt: skip
    monkeypatch.setattr(kbench, "sets_for", lambda size: 1)
    monkeypatch.setattr(kbench, "verify_inputs", partial(kbench.verify_inputs, device="cpu"))
    monkeypatch.setattr(kbench, "time_graph", fake_time)
    tree = Variant.parse("verify-h12-q4-tree-i32-sm90_wgmma-t128-r1-c396-s1-pdl")
    rows = kbench.bench_verify([tree.replace(tree=False), tree], [2], 4e12, peers=False)
    assert [r.variant for r in rows] == [tree.replace(tree=False).name, tree.name]
    (chain_tree, chain_parents), (tree_tree, tree_parents) = launched
    assert (chain_tree, chain_parents, tree_tree) == (False, None, True)
    assert isinstance(tree_parents, torch.Tensor) and tree_parents.dtype == torch.int32


def test_flashinfer_accepts_the_layout() -> None:
    """FlashInfer's own argument checks (they run before any GPU call) pass on our args."""
    try:
        fn = peers.import_flashinfer_verify()
    except Exception as err:
        skip_without_peer(f"flashinfer not importable here ({err})")
    variant = Variant(kernel="verify", heads=2, window=4, path="sm100_tcgen05")
    inputs = kbench.verify_inputs(variant, 3, seed=1, device="cpu")
    args = kbench.flashinfer_args(inputs)
    with pytest.raises(ValueError, match="correction buffer shape"):  # the checks do run
        fn(*args[:9], args[9][:3], *args[10:])
    if torch.cuda.is_available():
        return
    with pytest.raises(Exception) as info:  # past the checks: the first CUDA call fails here
        fn(*args)
    assert "RecoverSSM" not in str(info.value) and "requires" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_flashinfer_loader_says_why_not_without_a_gpu() -> None:
    load = peers.flashinfer_verify()
    assert load.fn is None
    assert load.note and "\n" not in load.note
    assert "not importable" in load.note or "needs a CUDA GPU" in load.note


def test_bench_command_writes_files_and_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kdagen.cli as cli

    seen = {}

    def fake_bench(variants, batches, bandwidth, peers=True, seed=0):  # type: ignore[no-untyped-def]
        seen.update(variants=variants, batches=batches, bandwidth=bandwidth, peers=peers)
        return _rows()

    monkeypatch.setattr(cli, "_require_gpu", lambda command: None)
    monkeypatch.setattr(cli, "_runnable", lambda vs: ("sm_100a", vs))
    monkeypatch.setattr(cli, "_bench_header", lambda *a: {"kernel": "verify"})
    monkeypatch.setattr(cli, "_bench_peer_note", lambda kernel, on: "flashinfer (stub)")
    monkeypatch.setattr(kbench, "copy_bandwidth", lambda: ANCHOR_BW)
    monkeypatch.setattr(kbench, "bench_verify", fake_bench)
    out = tmp_path / "v.json"
    args = ["bench", "--space", "verify_sm100.yaml", "--heads", "12", "--window", "8"]
    result = CliRunner().invoke(cli.app, [*args, "--batches", "1,512", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert seen["batches"] == [1, 512] and seen["peers"] is True
    assert [v.name for v in seen["variants"]] == ["verify-h12-q8-i32-sm100_tcgen05-c740"]
    lines = result.output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["B", "B*H"])
    first, second = lines[header + 1].split(), lines[header + 2].split()
    assert first[:2] == ["1", "12"] and first[6:9] == ["7.32", "1.22x", "verify-h12-q8-i32-a"]
    assert second[:2] == ["512", "6144"] and second[6:8] == ["-", "-"]
    assert out.exists() and out.with_suffix(".csv").exists() and out.with_suffix(".svg").exists()


@pytest.mark.parametrize("option", [["--conv"], ["--tree", "yes"]])
def test_bench_command_rejects_conv_and_trees_for_commit(
    monkeypatch: pytest.MonkeyPatch, option: list[str]
) -> None:
    import kdagen.cli as cli

    monkeypatch.setattr(cli, "_require_gpu", lambda command: None)
    result = CliRunner().invoke(cli.app, ["bench", "--kernel", "commit", *option])
    assert result.exit_code != 0
    assert "--conv and --tree apply to verify only" in " ".join(result.output.split())


def test_bench_command_rejects_an_unknown_tree_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    import kdagen.cli as cli

    monkeypatch.setattr(cli, "_require_gpu", lambda command: None)
    result = CliRunner().invoke(cli.app, ["bench", "--space", "verify_tree_sm90.yaml",
                                          "--tree", "maybe"])  # fmt: skip
    assert result.exit_code != 0 and "expected no, yes or both" in " ".join(result.output.split())


# ---- GPU ----

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _runnable_verify() -> Variant:
    """A verify variant this GPU runs, from any verify space shipped (skip when none)."""
    from kdagen.serve.runtime import device_arch
    from kdagen.space import SPACE_DIR, Space

    arch = device_arch()
    for path in sorted(SPACE_DIR.glob("verify*.yaml")):
        for v in Space.load(path).expand().variants:
            if arch in v.spec.archs and not v.conv and v.slot_dtype == "int32":
                return v
    pytest.skip(f"no verify variant runs on {arch}")


@pytest.mark.gpu
@needs_gpu
def test_tiny_verify_sweep_with_flashinfer() -> None:
    variant = _runnable_verify()
    load = peers.flashinfer_verify()
    if load.fn is None:
        skip_without_peer(load.note)  # fails instead under KDAGEN_REQUIRE_PEERS
    rows = kbench.bench_verify([variant], [1, 3], kbench.copy_bandwidth(), peers=True)
    assert [r.batch for r in rows] == [1, 3]
    for r in rows:
        assert 0 < r.p10_us <= r.median_us <= r.p90_us and r.sets >= 1
        assert r.floor_us > 0 and r.pct_of_floor > 0
        assert r.flashinfer_us is not None and r.flashinfer_us > 0
        assert r.flashinfer_rel_l2 is not None and r.flashinfer_rel_l2 < 1e-2, load.note
        assert (
            r.flashinfer_corr_rel_l2 is not None and r.flashinfer_corr_rel_l2 <= r.flashinfer_rel_l2
        )


@pytest.mark.gpu
@needs_gpu
def test_flashinfer_computes_what_we_compute() -> None:
    """The peer's contract is ours: same outputs within bf16 rounding on the bench inputs
    (out over every token, corr/kg per request; theirs indexed by slot, ours by request)."""
    load = peers.flashinfer_verify()
    if load.fn is None:
        skip_without_peer(load.note)
    variant = _runnable_verify()
    inputs = kbench.verify_inputs(variant, batch=5, seed=3)
    theirs = kbench.flashinfer_args(inputs)
    kbench.verify_launch(inputs, variant)()
    load.fn(*theirs)
    torch.cuda.synchronize()
    distance = kbench.peer_distance(inputs, theirs)
    assert distance["kg"] < 1e-3, distance  # raw k and raw g: copies
    assert distance["out"] < 1e-2 and distance["corr"] < 1e-2, distance


@pytest.mark.gpu
@needs_gpu
def test_time_variant_for_both_kernels() -> None:
    commit = Variant(kernel="commit", heads=12, window=4)
    timing = kbench.time_variant(commit, 8)
    assert timing.sets >= 1 and timing.median_us > 0
    timing = kbench.time_variant(_runnable_verify(), 8)
    assert timing.sets >= 1 and timing.median_us > 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("heads", "lower_bound", "gate"), [(12, -5.0, "kda"), (16, None, "softplus")]
)
def test_the_model_bench_names_the_commit_kernel_it_timed(
    heads: int, lower_bound: float | None, gate: str
) -> None:
    from kdagen import bench_model

    (row,) = bench_model.bench_model(heads, 4, 2, [3], kbench.copy_bandwidth(), peers=False,
                                     step=True, lower_bound=lower_bound)  # fmt: skip
    chosen = Variant.parse(row.commit_variant)
    assert (chosen.kernel, chosen.heads, chosen.window, chosen.tree) == ("commit", heads, 4, False)
    assert chosen.gate == row.gate == gate
    assert row.commit_us > 0 and row.commit_floor_us > 0 and row.step_us > row.commit_us
