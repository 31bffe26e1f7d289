"""``kdagen emit``: the package it writes from the committed H200 table is kdagen/serve as it
is plus its kernels, serves every batch of its keys from those prebuilt kernels, imports
without kdagen or the tuning stack, and (GPU) gives the bits ``kdagen.verify`` and
``kdagen.commit`` give."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from kdagen.emit import SERVE, EmitError, emit, selected_keys
from kdagen.serve.dispatch import (
    TABLE_FILE,
    DispatchFallbackWarning,
    StaleTableError,
    load_table,
)
from kdagen.serve.resources import data_dir
from kdagen.serve.variant import VariantError

TABLE = data_dir("generated") / "nvidia-h200-sm90-132sm"
KEYS = ["verify-h12-q4-i32", "commit-h12-q4-i32"]
SERVED = [*KEYS, "commit-h12-q4-noprefix-i32"]  # the general commit brings its lean build
# What an engine that vendors the package must not need: kdagen and the tuning stack.
BLOCKED = ("kdagen", "jinja2", "optuna", "typer", "yaml")
BLOCKER = f"""
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError("the emitted package imported " + name)
sys.meta_path.insert(0, Blocked())
"""


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    return emit(TABLE, tmp_path_factory.mktemp("emit"), "kda_test_kernels", KEYS, jobs=2).package


def run_isolated(package: Path, body: str) -> dict:
    """Run ``body`` in a fresh interpreter that cannot import kdagen (only the package, from
    its folder); ``body`` sets ``result``, which comes back through JSON."""
    script = BLOCKER + f"sys.path.insert(0, {str(package.parent)!r})\n" + textwrap.dedent(body)
    script += "\nprint('RESULT ' + json.dumps(result))\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=package.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def test_the_package_is_kdagen_serve_as_it_is(package: Path) -> None:
    serve = sorted(p.name for p in SERVE.glob("*.py"))
    assert sorted(p.name for p in package.glob("*.py")) == serve
    assert all((package / name).read_bytes() == (SERVE / name).read_bytes() for name in serve)
    readme = (package / "README.md").read_text()
    assert "nvidia-h200-sm90-132sm (sm_90a)" in readme and "    verify-h12-q4-i32\n" in readme


def test_the_package_serves_every_batch_from_its_own_kernels(package: Path) -> None:
    manifest = json.loads((package / "kernels" / "manifest.json").read_text())
    assert manifest["keys"] == SERVED and manifest["arch"] == "sm_90a"
    result = run_isolated(
        package,
        """
        import json, warnings
        import torch
        import kda_test_kernels as pkg
        ops_at_import = hasattr(torch.ops.kdagen, "commit_layers")
        from kda_test_kernels import bundle, dispatch, kernel_source, runtime
        from kda_test_kernels.variant import Variant

        table_dir = dispatch.generated_root() / "nvidia-h200-sm90-132sm"
        table = dispatch.load_table(table_dir)
        dispatch.check_fresh(table, "verify", str(table_dir))
        chosen = {}
        warnings.simplefilter("ignore")
        for batch in (1, 3, 8, 20, 64, 100, 512, 4096):
            for kernel in ("verify", "commit"):
                contract = {"heads": 12, "window": 4, "slot_dtype": "int32"}
                base = runtime.heuristic_variant(kernel, contract, batch, "sm_90a", 132)
                chosen[f"{kernel} {batch}"] = dispatch.resolve(table, kernel, base, batch).name
        try:
            runtime.launcher(Variant.parse("verify-h12-q8-i32-sm90_wgmma-t128-r1-c396-s1-pdl"),
                             "sm_90a")
            unheld = "launched"
        except pkg.KdaInputError as err:
            unheld = str(err)
        try:
            x = torch.zeros(4, 3 * 12 * 128, dtype=torch.bfloat16)
            pkg.verify(x, x, x, x, x, x, x, x, x, x, x)
            bad_input = "accepted"
        except pkg.KdaInputError as err:
            bad_input = str(err)
        objects = [bundle.held(name, "sm_90a")[0] for name in bundle.manifest()["kernels"]]
        result = {
            "active": bundle.active(),
            "prebuilt": kernel_source.current() is bundle.PREBUILT,
            "objects": [path.stat().st_size for path in objects],
            "root": str(dispatch.generated_root()),
            "chosen": chosen,
            "unheld": unheld,
            "bad_input": bad_input,
            "loaded": sorted({m.split(".")[0] for m in sys.modules}),
            "ops_at_import": ops_at_import,
            "ops": [str(getattr(torch.ops.kdagen, n).default._schema).split("(")[0]
                    for n in ("verify", "commit", "commit_layers")],
        }
        """,
    )
    assert result["active"] and result["prebuilt"]
    assert result["root"] == str(package / "generated")
    assert len(result["objects"]) == len(manifest["kernels"]) and min(result["objects"]) > 0
    missing = {k: v for k, v in result["chosen"].items() if v not in manifest["kernels"]}
    assert not missing, f"the run-time would pick kernels the package does not hold: {missing}"
    assert "is not in this package" in result["unheld"] and "verify-h12-q4-i32" in result["unheld"]
    assert result["bad_input"].startswith(f"{package.name}.verify:"), result["bad_input"]
    assert not set(BLOCKED) & set(result["loaded"])
    assert result["ops_at_import"]  # an emitted package registers its ops on import
    assert result["ops"] == ["kdagen::verify", "kdagen::commit", "kdagen::commit_layers"]


def test_emit_refuses_a_stale_table(tmp_path: Path) -> None:
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    stale = tmp_path / "table"
    shutil.copytree(TABLE, stale, ignore=shutil.ignore_patterns("plots", "*.db"))
    data = json.loads((stale / TABLE_FILE).read_text())
    data["render_hashes"]["verify"] = "0" * 16
    (stale / TABLE_FILE).write_text(json.dumps(data))
    with pytest.raises(StaleTableError, match="the verify kernels it measured changed"):
        emit(stale, tmp_path / "out", keys=["verify-h12-q4-i32"])


def test_gate_selects_one_models_keys() -> None:
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    table = load_table(TABLE)
    assert table is not None
    softplus, kda = selected_keys(table, None, "softplus"), selected_keys(table, None, "kda")
    tuned = [k for k in softplus + kda if k in table.entries]
    assert softplus and kda and sorted(tuned) == sorted(table.entries)
    assert all("-softplus-" in k for k in softplus) and not any("softplus" in k for k in kda)


def test_a_package_commits_every_window_it_verifies() -> None:
    """The table tunes verify at 16 tokens but not yet the commit after it: the default
    selection adds that commit's keys (both builds, from commit_wide.yaml), and every verify
    key then has its commit."""
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    table = load_table(TABLE)
    assert table is not None and "verify-h12-q16-i32" in table.entries
    for gate in ("kda", "softplus"):
        keys = selected_keys(table, None, gate)
        added = [k for k in keys if k not in table.entries]
        assert added and all(k.startswith("commit-") and "-q16-" in k for k in added), added
        for key in keys:
            if key.startswith("verify-") and "-conv-" not in key:
                chain = key.replace("verify-", "commit-").replace("-tree", "")
                assert chain in keys, (key, chain)
    kda = selected_keys(table, None, "kda")
    assert {"commit-h12-q16-i32", "commit-h12-q16-noprefix-i32"} <= set(kda)
    with pytest.raises(EmitError, match="--gate 'relu': expected kda or softplus"):
        selected_keys(table, None, "relu")
    with pytest.raises(EmitError, match="give it or --key, not both"):
        selected_keys(table, ["verify-h12-q4-i32"], "kda")


def test_a_general_commit_key_brings_its_build_without_prefix_caching() -> None:
    """The run-time sends a commit without block tables to the build without prefix caching
    where the table tuned it, so a package asked for the general key must hold that build
    too (one emitted without it failed every such commit on the H200)."""
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    table = load_table(TABLE)
    assert table is not None and "commit-h12-q4-noprefix-i32" in table.entries
    assert selected_keys(table, KEYS, None) == SERVED
    assert selected_keys(table, ["commit-h16-q4-softplus-i32"], None) == [
        "commit-h16-q4-softplus-i32", "commit-h16-q4-softplus-noprefix-i32"]  # fmt: skip
    int64 = ["commit-h12-q4-i64"]  # int64 slots: the general build alone
    assert selected_keys(table, int64, None) == int64
    both = ["commit-h12-q4-noprefix-i32", "commit-h12-q4-i32"]
    assert selected_keys(table, both, None) == both


def test_a_verify_key_brings_the_commit_of_its_window() -> None:
    """A package that verifies a window commits it: a verify key given alone brings its
    window's commit builds, tuned (Q 8) or of a shipped space the table was not tuned with
    (Q 3, commit_between.yaml; Q 16 with the softplus gate, commit_wide.yaml)."""
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    table = load_table(TABLE)
    assert table is not None
    for verify, window in (("verify-h12-q8-i32", 8), ("verify-h12-q3-i32", 3)):
        commits = [f"commit-h12-q{window}-i32", f"commit-h12-q{window}-noprefix-i32"]
        assert selected_keys(table, [verify], None) == [verify, *commits]
    assert selected_keys(table, ["verify-h16-q16-softplus-i64"], None) == [
        "verify-h16-q16-softplus-i64", "commit-h16-q16-softplus-i64"]  # fmt: skip


def test_emit_names_a_malformed_key(tmp_path: Path) -> None:
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    with pytest.raises(
        VariantError, match="contract key 'verify-h12-q4'.*it ends before the slot dtype"
    ):
        emit(TABLE, tmp_path, keys=["verify-h12-q4"])


def test_an_untuned_key_gets_only_checked_variants(tmp_path: Path) -> None:
    """The per-GPU default at bucket 512 (ctas 528) is outside the space for this key (it
    spills): the package holds the key's checked point instead, and no key the space lacks."""
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    key = "verify-h12-q7-conv-tm-bf16-i32"
    table = load_table(TABLE)
    assert table is not None and key not in table.entries
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DispatchFallbackWarning)
        emitted = emit(TABLE, tmp_path, keys=[key], jobs=2)
    assert set(emitted.choices[key].values()) == {f"{key}-sm90_wgmma-t128-r1-c396-s1-pdl"}
    assert set(emitted.choices[key].values()) <= set(table.space["verify"][key])
    with pytest.raises(EmitError, match="verify-h64-q8-i32 is in no search space"):
        emit(TABLE, tmp_path / "other", keys=["verify-h64-q8-i32"])


def test_keys_of_untuned_shipped_spaces_hold_every_built_in_choice(tmp_path: Path) -> None:
    """Conv trees and the tree commit (shipped spaces the table was not tuned with) run the
    built-in choice, which moves with the batch for the commit: the package holds each
    variant it takes, and its run-time picks only held kernels at any batch."""
    if not (TABLE / TABLE_FILE).exists():
        pytest.skip("no committed H200 table")
    keys = ["verify-h12-q4-tree-conv-tm-bf16-i32", "commit-h12-q4-tree-i32", "commit-h12-q16-i32"]
    table = load_table(TABLE)
    assert table is not None and not set(keys) & set(table.entries)
    emitted = emit(TABLE, tmp_path, "kda_tree_kernels", keys, jobs=2)
    assert set(emitted.variants) == {
        f"{keys[0]}-sm90_wgmma-t128-r1-c396-s1-pdl",
        *(f"{key}-bulk-{t}-pdl" for t in ("t128-v4-r4", "t128-v4-r2", "t256-v4-r1")
          for key in keys[1:]),
    }  # fmt: skip
    result = run_isolated(
        emitted.package,
        """
        import json, warnings
        from kda_tree_kernels import dispatch, runtime

        table = dispatch.load_table(dispatch.generated_root() / "nvidia-h200-sm90-132sm")
        warnings.simplefilter("ignore")
        chosen = {}
        kinds = (("verify", {"tree": True, "conv": True}), ("commit", {"tree": True}),
                 ("commit", {"window": 16}))
        for batch in (1, 3, 8, 20, 30, 64, 100, 512, 4096):
            for n, (kernel, fields) in enumerate(kinds):
                contract = {"heads": 12, "window": 4, "slot_dtype": "int32", **fields}
                base = runtime.heuristic_variant(kernel, contract, batch, "sm_90a", 132)
                chosen[f"{n} {batch}"] = dispatch.resolve(table, kernel, base, batch).name
        result = chosen
        """,
    )
    assert set(result.values()) == set(emitted.variants), result


def test_emit_does_not_replace_a_folder_it_did_not_write(tmp_path: Path) -> None:
    (tmp_path / "kda_kernels").mkdir()
    (tmp_path / "kda_kernels" / "notes.txt").write_text("mine")
    with pytest.raises(EmitError, match="is not a package kdagen emitted"):
        emit(TABLE, tmp_path, keys=["verify-h12-q4-i32"])
    assert (tmp_path / "kda_kernels" / "notes.txt").read_text() == "mine"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_package_gives_kdagens_bits(package: Path, tmp_path: Path) -> None:
    """verify then commit through the package (in a process without kdagen) and through
    kdagen, on the same inputs: out, corr, kg and the committed state bit-identical."""
    from kdagen.serve.runtime import run_commit, run_verify
    from kdagen.testing import bits, clone_inputs, commit_args, make_verify_inputs, verify_args

    inputs = make_verify_inputs(20, 12, 4, device="cuda", seed=7)
    accepted = torch.randint(1, 5, (20,), dtype=torch.int32, device="cuda")
    theirs = clone_inputs(inputs)
    keywords = {k: v for k, v in theirs.items() if k not in ("state_pool", "qlen")}  # verify's
    torch.save({"verify": keywords, "accepted": accepted}, tmp_path / "inputs.pt")
    run_isolated(
        package,
        f"""
        import json, torch
        import kda_test_kernels as pkg
        saved = torch.load({str(tmp_path / "inputs.pt")!r})
        args = saved["verify"]
        pkg.verify(**args)
        pkg.commit(args["state"], args["corr"], args["kg"], args["a_log"], args["dt_bias"],
                   args["slots"], saved["accepted"], lower_bound=args["lower_bound"])
        torch.save(args, {str(tmp_path / "outputs.pt")!r})
        result = {{}}
        """,
    )
    run_verify(verify_args(inputs))
    run_commit(commit_args(inputs, accepted))
    got = torch.load(tmp_path / "outputs.pt")
    for name in ("out", "corr", "kg", "state"):
        assert torch.equal(bits(got[name].cuda()), bits(inputs[name])), name
