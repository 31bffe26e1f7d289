"""The CLI through Typer's runner: every command, its output and its exit code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from kdagen.cli import app

runner = CliRunner()


def _flat(text: str) -> str:
    """Output without Rich's box drawing and line wrapping."""
    return " ".join(text.replace("│", " ").split())


def test_help_lists_the_pipeline() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("variants", "render", "compile", "check", "bench"):
        assert command in result.output


def test_help_rewraps_docstrings_and_keeps_placeholders() -> None:
    """A docstring's source line breaks are not the help's (a wide terminal shows a summary on
    one line), and ``<out>/<gpu>`` placeholders survive the markup."""
    wide = runner.invoke(app, ["--help"], env={"COLUMNS": "300"})
    assert wide.exit_code == 0
    line = next(line for line in wide.output.splitlines() if " bench " in line)
    assert "(cold L2, CUDA graphs, the method of docs/anchors.md)" in line, line
    tune = runner.invoke(app, ["tune", "--help"], env={"COLUMNS": "300"})
    assert "report.md in <out>/<gpu-fingerprint>/." in _flat(tune.output)


def test_variants_prints_count_constraints_and_names() -> None:
    result = runner.invoke(app, ["variants", "--space", "commit.yaml"])
    assert result.exit_code == 0, result.output
    assert "space commit (commit): 1001 variants from 4608 points" in result.output
    assert "removed 1920: the models' head counts per GPU" in result.output
    assert "removed  847: an update path per accepted count at the 8-token window" in result.output
    assert "removed  616: the build without prefix caching" in result.output
    assert "removed  224: at most 16 update chunks per thread" in result.output
    assert "commit-h12-q8-i32-bulk-t128-v8-r1-pdl" in result.output
    assert "commit-h12-q8-noprefix-i32-bulk-t128-v8-r1-pdl" in result.output
    assert "commit-h32-q8-softplus-noprefix-i32-bulk-t128-v8-r1-pdl" in result.output
    assert "commit-h12-q8-noprefix-i64-bulk-t128-v8-r1-pdl" not in result.output
    assert "commit-h12-q8-noprefix-i32-bulk-t256-v4-r1-f8-pdl" in result.output
    assert "commit-h12-q8-i32-bulk-t256-v4-r1-f8-pdl" not in result.output


def test_variants_bad_space_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("kernel: commit\ntuning: {warps: [1]}\n")
    result = runner.invoke(app, ["variants", "--space", str(bad)])
    assert result.exit_code != 0
    assert "tuning.warps is not a tuning field" in _flat(result.output)


def test_render_prints_the_module() -> None:
    result = runner.invoke(app, ["render", "commit-h12-q8-i32-bulk-t128-v8-r1-pdl"])
    assert result.exit_code == 0
    assert result.output.startswith(
        '"""KDA commit kernel, variant commit-h12-q8-i32-bulk-t128-v8-r1-pdl.'
    )
    assert "class KdaCommit:" in result.output


def test_render_bad_name_says_why() -> None:
    result = runner.invoke(app, ["render", "commit-h12-q17-i32-bulk-t128-v8-r1-pdl"])
    assert result.exit_code != 0
    assert "window=17 is not allowed" in _flat(result.output)


def test_compile_prints_a_table_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDAGEN_CACHE", str(tmp_path))
    args = [
        "compile",
        "--arch",
        "sm_90a",
        "--arch",
        "sm_100a",
        "--match",
        "h12-q2-i64-bulk-t256-v8",
        "-j",
        "2",
    ]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "6 ok, 0 failed" in first.output
    assert "commit-h12-q2-i64-bulk-t256-v8-r1-pdl  sm_100a" in first.output
    second = runner.invoke(app, args)
    assert second.output.count("ok (cached)") == 6


def test_match_takes_a_comma_separated_list() -> None:
    from kdagen.cli import _filter
    from kdagen.space import Space
    from kdagen.tune import plan_studies

    variants = Space.load("commit.yaml").expand().variants
    one = _filter(variants, "h12-q1-i32-bulk-t256-v8-r4")
    other = _filter(variants, "h96-q8-i64-bulk-t128-v4-r2")
    assert len(one) == len(other) == 1
    assert _filter(variants, f"{one[0].name},{other[0].name}") == one + other
    with pytest.raises(typer.BadParameter, match="selects none of the"):
        _filter(variants, "no-such-variant,")
    assert _filter(variants, None) == variants
    plans, _ = plan_studies(
        ["commit.yaml"], "workloads.yaml", "sm_90a", "commit-h12-q1-i32,h96-q8-i"
    )
    assert sorted(p.key for p in plans) == [
        "commit-h12-q1-i32",
        "commit-h96-q8-i32",
        "commit-h96-q8-i64",
    ]


def test_compile_failure_exits_non_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from kdagen import render

    templates = tmp_path / "templates"
    shutil.copytree(render.TEMPLATE_DIR, templates)
    path = templates / "commit" / "bulk.py.j2"
    path.write_text(path.read_text().replace("cute.arch.block_idx()", "cute.arch.not_an_op()"))
    monkeypatch.setenv("KDAGEN_TEMPLATES", str(templates))
    monkeypatch.setenv("KDAGEN_CACHE", str(tmp_path / "cache"))
    result = runner.invoke(app, ["compile", "--match", "h12-q1-i32-bulk-t256-v8-r4", "-j", "1"])
    assert result.exit_code == 1
    assert "FAILED" in result.output and "not_an_op" in result.output


def test_a_match_that_selects_nothing_is_refused() -> None:
    result = runner.invoke(
        app, ["compile", "-s", "commit_ring.yaml", "--match", "q8-i32-bulk_ring"]
    )
    assert result.exit_code == 2
    assert "--match 'q8-i32-bulk_ring' selects none of the 112 variants" in _flat(result.output)


def test_compile_rejects_unknown_arch() -> None:
    result = runner.invoke(app, ["compile", "--arch", "sm_80"])
    assert result.exit_code != 0
    assert "allowed: ['sm_90a', 'sm_100a']" in _flat(result.output)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
@pytest.mark.parametrize("command", ["check", "bench", "tune", "regenerate"])
def test_gpu_commands_refuse_clearly_without_a_gpu(command: str) -> None:
    result = runner.invoke(app, [command])
    assert result.exit_code == 2
    assert result.output.startswith(f"kdagen {command}: needs a CUDA GPU; none is visible")


def test_the_model_bench_takes_one_models_gate() -> None:
    """``--layers`` times one model: its gate is kda or softplus, not both (refused before
    the GPU is looked for, so the message is the same on any machine)."""
    result = runner.invoke(app, ["bench", "--layers", "20", "--gate", "both"])
    assert result.exit_code == 2
    assert "--gate 'both' with --layers: expected kda or softplus" in _flat(result.output)


def test_check_refuses_sm100_variants_on_another_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import kdagen.cli
    import kdagen.serve.runtime

    monkeypatch.setattr(kdagen.cli, "_require_gpu", lambda command: None)
    monkeypatch.setattr(kdagen.serve.runtime, "device_arch", lambda device=None: "sm_90a")
    result = runner.invoke(app, ["check", "--space", "verify_sm100.yaml", "--match", "h12-q8-i32"])
    assert result.exit_code == 2
    text = _flat(result.output)
    assert (
        "verify-h12-q8-i32-sm100_tcgen05-c740: refused: path 'sm100_tcgen05' targets sm_100a"
        in text
    )
    assert "statically verified" in text and "nothing to run on this sm_90a GPU" in text


def test_check_compiles_its_variants_ahead_then_checks_each(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``kdagen check`` hands every variant to a pool of compile processes first: by the time a
    variant's check starts, its kernel is in the compile cache (the checks are faked here; no
    GPU), and the verdicts follow in order."""
    import kdagen.check
    import kdagen.cli
    import kdagen.serve.runtime
    from kdagen.check import CaseResult
    from kdagen.compile import object_path
    from kdagen.serve.variant import Variant

    monkeypatch.setenv("KDAGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(kdagen.cli, "_require_gpu", lambda command: None)
    monkeypatch.setattr(kdagen.serve.runtime, "device_arch", lambda device=None: "sm_90a")
    names = ["commit-h12-q1-i32-bulk-t128-v4-r4-pdl", "commit-h12-q1-i32-bulk-t256-v8-r2-pdl"]
    cached_at_check = {}

    def fake_check(variant: Variant, seed: int) -> list[CaseResult]:
        cached_at_check[variant.name] = object_path(variant, "sm_90a").exists()
        return [CaseResult(variant.name, "single", 0.0, 0.0, 0.0, True, True)]

    monkeypatch.setattr(kdagen.check, "check_variant", fake_check)
    args = ["check", "--space", "commit.yaml", "--match", ",".join(names), "--jobs", "2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert cached_at_check == dict.fromkeys(names, True)
    verdicts = [line.split()[1] for line in result.output.splitlines() if line.startswith("PASS")]
    assert verdicts == names and "2 passed, 0 failed" in result.output


SPACE = """description: one point
kernel: commit
contract: {heads: [HEADS], window: [1], slot_dtype: [int32]}
tuning: {path: [bulk], threads: [128], vec: [4], row_split: [4], pdl: [true]}
"""


@pytest.mark.parametrize(
    ("heads", "constraint", "says"),
    [
        ("twelve", "", "contract.heads: heads='twelve' is not allowed; expected an int"),
        ("12", "constraints: [{name: broken, expr: 1 // 0}]",
         "constraint 'broken' (1 // 0) raised ZeroDivisionError"),
    ],
)  # fmt: skip
def test_a_bad_space_is_one_clear_error(tmp_path: Path, heads: str, constraint: str,
                                        says: str) -> None:  # fmt: skip
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPACE.replace("HEADS", heads) + constraint + "\n")
    for command in ("variants", "compile"):
        result = runner.invoke(app, [command, "--space", str(bad)])
        assert result.exit_code == 2, result.output
        assert says in _flat(result.output) and "Traceback" not in result.output


def test_negative_jobs_and_incomplete_names_are_refused() -> None:
    for command in (["compile", "--jobs", "-1"], ["tune", "--jobs", "-2", "--simulate"],
                    ["emit", "--jobs", "-1"]):  # fmt: skip
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "'--jobs'" in result.output and "greater than or equal to 0" in _flat(result.output)
    for name in ("commit-h12-q8-i32-bulk-t128", "commit-h12-q8-i32-bulk-t128-v4-r2-c264-pdl",
                 "commit-h12-q8-i32-bulk-t128-v4-r2-pdl-t256"):  # fmt: skip
        result = runner.invoke(app, ["render", name])
        assert result.exit_code == 2 and "not a complete variant name" in _flat(result.output)


def test_emit_refuses_a_file_as_out_and_repeated_keys(tmp_path: Path) -> None:
    file = tmp_path / "dist"
    file.write_text("")
    result = runner.invoke(app, ["emit", "--out", str(file), "--key", "commit-h12-q1-i32"])
    assert result.exit_code == 1 and "is a file" in result.output
    twice = ["--key", "commit-h12-q1-i32"] * 2
    result = runner.invoke(app, ["emit", "--out", str(tmp_path / "out"), *twice])
    assert (
        result.exit_code == 1 and "--key given more than once: commit-h12-q1-i32" in result.output
    )


def test_compile_progress_counts_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDAGEN_CACHE", str(tmp_path))
    name = "commit-h12-q1-i32-bulk-t128-v4-r4-pdl"
    result = runner.invoke(app, ["compile", "--arch", "sm_90a", "--arch", "sm_100a", "--match",
                                 name, "-j", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "compiling 1 variants for sm_90a, sm_100a: 2 builds" in result.output
    assert "2/2 compiled" in result.output


def test_help_of_the_runtime_api_is_the_real_signature() -> None:
    import inspect

    import kdagen

    assert list(inspect.signature(kdagen.verify).parameters)[:2] == ["qkv", "raw_g"]
    assert "accepted prefix" in (kdagen.commit.__doc__ or "")
    assert "ModelCommit" in dir(kdagen)
