"""The ``kdagen`` command line: space -> variants -> render -> compile -> check -> bench.

Each command is a thin shell over one module: ``variants`` (kdagen.space), ``render``
(kdagen.render, templates/), ``compile`` (kdagen.compile), ``check`` (kdagen.check),
``bench`` (kdagen.bench), ``emit`` (kdagen.emit), ``tune`` (kdagen.tune_cli).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kdagen.serve.variant import Variant, VariantError
from kdagen.space import DEFAULT_SPACES, Space, SpaceError, name_matches

if TYPE_CHECKING:  # the build side's heavy modules load in the commands that use them
    from kdagen.check import CaseResult

app = typer.Typer(
    help="Generate, compile, check and time KDA speculative verify/commit kernels (CuTe DSL).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="markdown",  # docstring lines wrapped in the source join into paragraphs
)

SPACE_HELP = "search-space YAML (a path, or a name in search_spaces/); default: every shipped space"
# `bench --layers`: the lower bound of each model's gate (None: Kimi-Linear's softplus gate).
MODEL_GATES: dict[str, float | None] = {"kda": -5.0, "softplus": None}
MATCH_HELP = "only variants whose name contains this (or one of a,b,...)"


def _variants(space: list[str] | None) -> list[Variant]:
    out: list[Variant] = []
    try:
        for name in space or DEFAULT_SPACES:
            out += Space.load(name).expand().variants
    except SpaceError as err:
        raise typer.BadParameter(str(err)) from None
    return out


def _filter(variants: list[Variant], match: str | None) -> list[Variant]:
    """The variants ``--match`` selects; one that selects none is a mistyped filter."""
    selected = [v for v in variants if name_matches(v.name, match)]
    if variants and not selected:
        raise typer.BadParameter(f"--match {match!r} selects none of the {len(variants)} "
                                 "variants of the spaces given")  # fmt: skip
    return selected


@app.command()
def variants(
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    names: bool = typer.Option(True, help="list every variant name"),
) -> None:
    """What a search space expands to: the variants, and what each constraint removed."""
    for name in space or DEFAULT_SPACES:
        try:
            loaded = Space.load(name)
            expansion = loaded.expand()
        except SpaceError as err:
            raise typer.BadParameter(str(err)) from None
        typer.echo(
            f"space {loaded.name} ({loaded.kernel}): {len(expansion.variants)} variants "
            f"from {expansion.points} points"
        )
        if expansion.variants and all(v.spec.archs == ("sm_100a",) for v in expansion.variants):
            typer.echo(
                "  sm_100a only: statically verified (compiled and inspected), untuned defaults"
            )
        for reason, count in expansion.removed.most_common():
            typer.echo(f"  removed {count:4d}: {reason}")
        if names:
            for v in expansion.variants:
                typer.echo(f"  {v.name}")


@app.command()
def render(
    variant: str = typer.Argument(..., help="a variant name, as `kdagen variants` prints"),
) -> None:
    """Print the CuTe-DSL module a variant renders to: its docstring names the template that
    produced it (under templates/), its imports the device helpers it calls (kdagen/dsl)."""
    from kdagen.render import render as render_source

    try:
        v = Variant.parse(variant)
    except VariantError as err:
        raise typer.BadParameter(str(err)) from None
    typer.echo(render_source(v), nl=False)


@app.command()
def compile(
    arch: list[str] = typer.Option(["sm_90a"], "--arch", "-a", help="sm_90a and/or sm_100a"),
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    jobs: int = typer.Option(0, "--jobs", "-j", min=0, help="worker processes (0: one per CPU)"),
    match: str = typer.Option(None, help=MATCH_HELP),
    force: bool = typer.Option(False, help="ignore the compile cache"),
) -> None:
    """Compile every variant without a GPU, in worker processes, with an on-disk cache."""
    from kdagen.compile import ARCHS, compile_many

    bad = [a for a in arch if a not in ARCHS]
    if bad:
        raise typer.BadParameter(f"--arch {bad[0]!r} is not supported; allowed: {list(ARCHS)}")
    selected = _filter(_variants(space), match)
    builds = sum(a in v.spec.archs for a in arch for v in selected)
    typer.echo(f"compiling {len(selected)} variants for {', '.join(arch)}: {builds} builds",
               err=True)  # fmt: skip
    done = [0]

    def progress(record: object) -> None:
        done[0] += 1
        if done[0] % 10 == 0 or done[0] == builds:
            typer.echo(f"  {done[0]}/{builds} compiled", err=True)

    records = compile_many(selected, arch, jobs=jobs, force=force, on_result=progress)
    width = max((len(r.variant) for r in records), default=7)
    typer.echo(
        f"{'variant':<{width}}  {'arch':<7} {'sec':>6} {'regs':>5} {'frame':>5} {'smem':>6}  status"
    )
    for r in records:
        if r.status == "skipped":
            continue
        status = ("ok (cached)" if r.cached else "ok") if r.ok else "FAILED"
        if r.static_only:
            status += ", static only"
        typer.echo(
            f"{r.variant:<{width}}  {r.arch:<7} {r.seconds:>6.2f} {_num(r.registers):>5} "
            f"{_num(r.frame_bytes):>5} {_num(r.launch_smem_bytes):>6}  {status}"
        )
    failed = [r for r in records if r.failed]
    skipped = [r for r in records if r.status == "skipped"]
    for r in failed:
        typer.echo(f"\n{r.variant} [{r.arch}] failed:\n{r.error}", err=True)
    summary = f"{len(records) - len(failed) - len(skipped)} ok, {len(failed)} failed"
    if skipped:
        summary += f", {len(skipped)} skipped (their path targets another arch)"
    typer.echo(summary)
    if any(r.static_only for r in records):
        typer.echo(
            "static only: no sm_100 GPU has run the sm_100a builds; they are compiled and "
            "inspected (tests/test_sm100.py), untuned defaults"
        )
    if failed:
        raise typer.Exit(1)


def _num(value: int | None) -> str:
    return "-" if value is None else str(value)


def _runnable(variants: list[Variant]) -> tuple[str, list[Variant]]:
    """The variants this GPU can run; the others are listed as refused, with why. Exits with
    status 2 when none is left."""
    from kdagen.check import gpu_refusal
    from kdagen.serve import runtime

    arch = runtime.device_arch()
    refusals = [(v, gpu_refusal(v, arch)) for v in variants]
    refused = [why for _, why in refusals if why]
    for why in refused[:5]:
        typer.echo(why)
    if len(refused) > 5:
        typer.echo(f"... and {len(refused) - 5} more refused for the same reasons")
    runnable = [v for v, why in refusals if not why]
    if not runnable:
        typer.echo(f"kdagen: nothing to run on this {arch} GPU", err=True)
        raise typer.Exit(2)
    return arch, runnable


def _require_gpu(command: str) -> None:
    import torch

    if not torch.cuda.is_available():
        typer.echo(f"kdagen {command}: needs a CUDA GPU; none is visible", err=True)
        raise typer.Exit(2)


@app.command()
def check(
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    match: str = typer.Option(None, help=MATCH_HELP),
    seed: int = typer.Option(None, help="input seed (default: random, printed)"),
    json_out: Path = typer.Option(
        None, "--json", help="write every case result here (rewritten after each variant)"
    ),
    shard: str = typer.Option(
        "0/1",
        help="K/N: the K-th of N shards of whole contracts (run N processes to overlap "
        "their host-side reference work)",
    ),
    resume: list[Path] = typer.Option(
        None,
        help="--json files of earlier checks, or tuned folders (`generated/<gpu>/`: the tuner "
        "checks what it times): skip the variants that passed there and still render to the "
        "same kernel (a check cut short by a time limit goes on; a variant that failed in any "
        "--json file runs again)",
    ),
    jobs: int = typer.Option(
        0,
        "--jobs",
        "-j",
        min=0,
        help="processes compiling the variants ahead of their checks (0: the CPUs over the "
        "shard count)",
    ),
) -> None:
    """Run every variant on the GPU against the fp64 reference, edge cases included."""
    _require_gpu("check")
    from kdagen.check import (
        check_variant,
        check_verdicts,
        passed_in_tune,
        result_records,
        shard_by_contract,
    )
    from kdagen.compile import CompilePool
    from kdagen.render import digest
    from kdagen.serve.fingerprint import gpu_fingerprint

    seed = random.randrange(1 << 30) if seed is None else seed
    try:
        index, count = (int(x) for x in shard.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise typer.BadParameter(f"--shard must be K/N with 0 <= K < N, got {shard!r}") from None
    arch, selected = _runnable(shard_by_contract(_filter(_variants(space), match), index, count))
    digests = {v.name: digest(v) for v in selected}
    verdicts = check_verdicts(p for p in resume or [] if not p.is_dir())
    tuned = set().union(*(passed_in_tune(p, gpu_fingerprint()) for p in resume or [] if p.is_dir()))
    todo = [v for v in selected if not verdicts.get((v.name, digests[v.name]), v.name in tuned)]
    if len(todo) < len(selected):
        typer.echo(f"{len(selected) - len(todo)} variants passed before at this render: skipped")
    typer.echo(f"checking {len(todo)} variants on {arch}, seed {seed}")
    records: list[dict] = []
    if json_out:  # rewritten after each variant: a killed check keeps what it ran
        json_out.write_text("[]")
    failed = set()
    # Compiles run ahead in worker processes (into the cache the checks load from), so the
    # checks wait for the compiler once, not at every variant.
    with CompilePool(arch, jobs or max(1, (os.cpu_count() or 1) // count)) as pool:
        for v in todo:
            pool.submit(v)
        for v in todo:
            pool.result(v)  # a failed compile is reported by the check's own attempt
            started = time.perf_counter()
            cases = check_variant(v, seed)
            seconds = time.perf_counter() - started
            records += result_records(v, digests[v.name], cases)
            if json_out:
                json_out.write_text(json.dumps(records, indent=1))
            if not _echo_verdict(v, cases, seconds):
                failed.add(v.name)
    typer.echo(f"{len(todo) - len(failed)} passed, {len(failed)} failed")
    if failed:
        raise typer.Exit(1)


def _echo_verdict(variant: Variant, cases: list[CaseResult], seconds: float) -> bool:
    """One variant's check line: PASS or FAIL and its worst case. Whether every case passed."""
    worst = max(cases, key=lambda c: (not c.passed, c.score))
    ok = all(c.passed for c in cases)
    detail = worst.error or worst.summary()
    typer.echo(
        f"{'PASS' if ok else 'FAIL'}  {variant.name}  ({len(cases)} cases, {seconds:.1f} s; "
        f"worst {worst.case}: {detail})"
    )
    return ok


@app.command()
def bench(
    kernel: str = typer.Option(
        None, help="verify or commit (default: the kernel of --space, else commit)"
    ),
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    heads: int = typer.Option(12, help="heads H"),
    window: int = typer.Option(8, help="window Q"),
    batches: str = typer.Option("1,4,16,64,256,512", help="comma-separated batch sizes"),
    conv: bool = typer.Option(False, "--conv/--no-conv", help="verify with the fused conv"),
    conv_layout: str = typer.Option("token_major", help="with --conv: token_major or dim_first"),
    conv_weights: str = typer.Option("bf16", help="with --conv: tap dtype, bf16 or fp32"),
    gate: str = typer.Option(
        "kda",
        help="kda (Kimi-K3's bounded gate), softplus (Kimi-Linear's), or both: each softplus "
        "variant and its bounded twin (the same tuning), timed side by side on the same inputs "
        "(with --layers: the model's gate, kda or softplus)",
    ),
    tree: str = typer.Option(
        "no",
        help="verify: no (chains), yes (token trees, from a tree space such as "
        "verify_tree_sm90.yaml), or both: each tree variant and its chain twin (the same "
        "tuning), timed side by side on the same inputs",
    ),
    match: str = typer.Option(None, help=MATCH_HELP),
    peers: bool = typer.Option(
        True, "--peers/--no-peers", help="time the peers too (verify: flashinfer; commit: torch)"
    ),
    no_torch: bool = typer.Option(False, "--no-torch", help="commit: same as --no-peers"),
    seed: int = typer.Option(0, help="input seed"),
    layers: int = typer.Option(
        1,
        help="commit: L > 1 times a model's all-layer commit (vLLM's commit context, "
        "the dispatched variant) and its decode step, vLLM's Triton ops as the peer",
    ),
    step: bool = typer.Option(
        True, "--step/--no-step", help="with --layers: also time L verifies + the commit"
    ),
    out: Path = typer.Option(
        None, help="rows as JSON here, CSV and SVG plot beside it (default: out/bench/KEY.json)"
    ),
) -> None:
    """Time verify or commit variants of one contract key over a batch sweep (cold L2, CUDA
    graphs, the method of docs/anchors.md) against the HBM floor and the peers; with
    --layers, a whole model's commit and decode step."""
    if layers < 1:
        raise typer.BadParameter(f"--layers {layers}: must be at least 1")
    if layers > 1 and gate not in MODEL_GATES:
        raise typer.BadParameter(f"--gate {gate!r} with --layers: expected kda or softplus "
                                 "(one model's gate)")  # fmt: skip
    _require_gpu("bench")
    from kdagen import bench as kbench

    if layers > 1:
        _bench_model(kernel, heads, window, layers, batches, gate, peers, step, seed, out)
        return
    chosen_kernel = _bench_kernel(kernel, space)
    if gate not in ("kda", "softplus", "both"):
        raise typer.BadParameter(f"--gate {gate!r}: expected kda, softplus or both")
    if tree not in ("no", "yes", "both") or (tree != "no" and gate == "both"):
        raise typer.BadParameter(
            f"--tree {tree!r}: expected no, yes or both (not with --gate both)"
        )
    wanted = {"kernel": chosen_kernel, "heads": heads, "window": window, "slot_dtype": "int32",
              "gate": "softplus" if gate == "both" else gate}  # fmt: skip
    if chosen_kernel == "verify":
        wanted |= {"conv": conv, "tree": tree != "no"}
        if conv:
            wanted |= {"conv_layout": conv_layout, "conv_weight_dtype": conv_weights}
    elif conv or tree != "no":
        raise typer.BadParameter("--conv and --tree apply to verify only (commit reads neither)")
    candidates = [
        v for v in _filter(_variants(space), match)
        if all(getattr(v, k) == value for k, value in wanted.items())
    ]  # fmt: skip
    if not candidates:
        detail = ", ".join(f"{k}={value}" for k, value in wanted.items())
        raise typer.BadParameter(f"no variants with {detail} in the space")
    arch, chosen = _runnable(candidates)
    if gate == "both":
        chosen = [twin for v in chosen for twin in (v.replace(gate="kda"), v)]
    if tree == "both":
        chosen = [twin for v in chosen for twin in (v.replace(tree=False), v)]
    sizes = [int(b) for b in batches.split(",")]
    bw = kbench.copy_bandwidth()
    typer.echo(f"copy bandwidth {bw / 1e12:.3f} TB/s; {len(chosen)} variants on {arch}")
    peers = peers and not (chosen_kernel == "commit" and no_torch)
    peer_note = _bench_peer_note(chosen_kernel, peers)
    typer.echo(f"peer: {peer_note}")
    if chosen_kernel == "verify":
        rows: list = kbench.bench_verify(chosen, sizes, bw, peers=peers, seed=seed)
    else:
        rows = kbench.bench_commit(chosen, sizes, bw, with_torch=peers, seed=seed)
    key = next((v.contract_key for v in chosen if v.tree), chosen[0].contract_key)
    path = out or Path("out") / "bench" / f"{key}.json"
    header = _bench_header(chosen_kernel, key, arch, bw, peer_note)
    json_path, csv_path = kbench.write_results(path, header, rows)
    title = f"{key}: latency vs batch (cold L2, median of {kbench.TIMED_REPLAYS} replays)"
    svg_path = kbench.plot_results(rows, chosen_kernel, title, path.with_suffix(".svg"))
    _bench_table(rows, heads, chosen_kernel, conv)
    typer.echo(f"wrote {json_path}, {csv_path}, {svg_path}")


def _bench_model(kernel: str | None, heads: int, window: int, layers: int, batches: str,
                 gate: str, peers: bool, step: bool, seed: int, out: Path | None) -> None:  # fmt: skip
    """`bench --layers L`: the all-layer commit and the decode step (kdagen.bench_model)."""
    from kdagen import bench as kbench
    from kdagen import bench_model

    if kernel not in (None, "commit"):
        raise typer.BadParameter("--layers applies to the commit (one launch for every layer)")
    sizes = [int(b) for b in batches.split(",")]
    bw = kbench.copy_bandwidth()
    typer.echo(f"copy bandwidth {bw / 1e12:.3f} TB/s; {layers} layers, H {heads}, Q {window}, "
               f"gate {gate}")  # fmt: skip
    rows = bench_model.bench_model(heads, window, layers, sizes, bw, peers=peers, step=step,
                                   seed=seed, lower_bound=MODEL_GATES[gate])  # fmt: skip
    key = f"model-l{layers}-h{heads}-q{window}" + ("-softplus" if gate == "softplus" else "")
    path = out or Path("out") / "bench" / f"{key}.json"
    header = _bench_header("commit", key, "sm_90a", bw, "vLLM's Triton commit and verify "
                           "(.peers)" if peers else "none (--no-peers)")  # fmt: skip
    header["method"]["floor"] = bench_model.__doc__.split("The floor")[1].strip()
    json_path, csv_path = kbench.write_results(path, header, rows)
    typer.echo(f"{'B':>5} {'floor':>8} {'commit':>8} {'%floor':>7} {'vllm':>8} {'no-conv':>8} "
               f"{'floor':>8} {'step':>9} {'floor':>8} {'vllm step':>10}")  # fmt: skip
    for r in rows:
        typer.echo(
            f"{r.batch:>5} {r.commit_floor_us:>8.2f} {r.commit_us:>8.2f} "
            f"{100 * r.commit_floor_us / r.commit_us:>6.1f}% {_us(r.vllm_commit_us):>8} "
            f"{r.commit_no_conv_us:>8.2f} {r.commit_no_conv_floor_us:>8.2f} "
            f"{_us(r.step_us):>9} {_us(r.step_floor_us):>8} {_us(r.vllm_step_us):>10}"
        )
    for variant in sorted({r.commit_variant for r in rows}):
        at = ", ".join(str(r.batch) for r in rows if r.commit_variant == variant)
        typer.echo(f"commit kernel at B {at}: {variant}")
    typer.echo(f"wrote {json_path}, {csv_path} (us per launch; commit: vLLM's commit context "
               "with the conv compacted; no-conv: ModelCommit)")  # fmt: skip


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _bench_kernel(kernel: str | None, space: list[str] | None) -> str:
    """--kernel, else the one kernel the given spaces hold, else commit."""
    if kernel is not None:
        if kernel not in ("verify", "commit"):
            raise typer.BadParameter(f"--kernel {kernel!r}: allowed: verify, commit")
        return kernel
    if not space:
        return "commit"
    kinds = {v.kernel for v in _variants(space)}
    if len(kinds) != 1:
        raise typer.BadParameter(f"the spaces hold {sorted(kinds)} kernels: pick one with --kernel")
    return kinds.pop()


def _bench_peer_note(kernel: str, peers: bool) -> str:
    if not peers:
        return "none (--no-peers)"
    if kernel == "commit":
        return "plain torch (gather, fp32 math, scatter)"
    from kdagen.peers import flashinfer_verify

    return flashinfer_verify().note


def _bench_header(kernel: str, key: str, arch: str, bw: float, peer_note: str) -> dict:
    import torch

    from kdagen import bench as kbench

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "kernel": kernel,
        "contract_key": key,
        "device": props.name,
        "arch": arch,
        "torch": torch.__version__,
        "copy_bandwidth": bw,
        "method": {
            "l2_bytes": props.L2_cache_size,
            "sets": "ceil(3 x L2 / bytes one set touches), at most " + str(kbench.MAX_SETS),
            "warmup_replays": kbench.WARMUP_REPLAYS,
            "timed_replays": kbench.TIMED_REPLAYS,
            "time": "graph replay / sets; median, p10, p90 over replays",
            "floor": "bytes a launch must move / copy_bandwidth",
        },
        "peer": peer_note,
    }


def _bench_table(rows: list, heads: int, kernel: str, conv: bool) -> None:
    """The best variant per batch against the floor and the peer."""
    from kdagen.bench import PEER_FIELDS, best_per_batch

    ((label, field),) = PEER_FIELDS[kernel].items()
    name = label.split()[-1][:10]
    typer.echo(
        f"{'B':>5} {'B*H':>6} {'floor us':>9} {'best us':>9} {'spread%':>8} {'%floor':>7} "
        f"{name + ' us':>13} {'speedup':>8}  best variant"
    )
    for b, r in best_per_batch(rows).items():
        spread = 100 * (r.p90_us - r.p10_us) / r.median_us
        peer_us = getattr(r, field)
        peer_text = "-" if peer_us is None else f"{peer_us:.2f}"
        speedup = "-" if peer_us is None else f"{peer_us / r.median_us:.2f}x"
        typer.echo(
            f"{b:>5} {b * heads:>6} {r.floor_us:>9.2f} {r.median_us:>9.2f} {spread:>8.1f} "
            f"{r.pct_of_floor:>7.1f} {peer_text:>13} {speedup:>8}  {r.variant}"
        )
    if kernel == "verify" and conv:
        typer.echo(f"{label} does not fuse the conv: its time leaves out the conv kernel it needs")


@app.command()
def emit(
    table: Path = typer.Option(
        None, help="a tuned table's folder (default: the one folder under generated/)"
    ),
    out: Path = typer.Option(Path("out/emit"), help="the package is written to OUT/NAME"),
    name: str = typer.Option("kda_kernels", help="the package's import name"),
    key: list[str] = typer.Option(
        None,
        "--key",
        help="contract key to serve (repeatable; default: every tuned key); a verify key brings "
        "its window's commit",
    ),
    gate: str = typer.Option(
        None,
        help="only the tuned keys of one gate: kda (Kimi-K3's bounded gate) or softplus "
        "(Kimi-Linear's); default: both",
    ),
    jobs: int = typer.Option(0, min=0, help="compile processes (0: one per CPU)"),
) -> None:
    """Turn a tuned table into a package to vendor: prebuilt kernels, the table and the
    run-time API (needs only torch and nvidia-cutlass-dsl)."""
    from kdagen.emit import EmitError
    from kdagen.emit import emit as write_package
    from kdagen.serve.dispatch import StaleTableError, generated_root
    from kdagen.serve.variant import VariantError

    if table is None:
        found = sorted(p.parent for p in generated_root().glob("*/dispatch.json"))
        if len(found) != 1:
            raise typer.BadParameter(
                f"--table: {len(found)} tables under {generated_root()}; name one",
                param_hint="--table",
            )
        table = found[0]
    try:
        count = [0]

        def progress(record: object, total: int) -> None:
            count[0] += 1
            if count[0] % 10 == 0 or count[0] == total:
                typer.echo(f"  {count[0]}/{total} kernels compiled", err=True)

        done = write_package(table, out, name, key or None, jobs, progress, gate=gate)
    except (EmitError, StaleTableError, VariantError) as err:
        typer.echo(f"kdagen emit: {err}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{'contract key':<34} {'bucket -> variant'}")
    for k, by_batch in done.choices.items():
        for batch, variant in by_batch.items():
            typer.echo(f"{k:<34} {batch:>5}  {variant.removeprefix(k + '-')}")
    typer.echo(
        f"wrote {done.package}: {len(done.variants)} kernels for {done.arch} "
        f"({done.fingerprint}), {len(done.keys)} contract key(s), {done.bytes / 2**20:.1f} MiB\n"
        f"use: sys.path.insert(0, {str(done.package.parent)!r}); import {name}"
    )


@app.command()
def doctor(
    fingerprint: str = typer.Option(
        None,
        help="a GPU fingerprint, e.g. nvidia-h100-80gb-hbm3-sm90-132sm (default: the "
        "visible GPU's)",
    ),
    workloads: str = typer.Option("workloads.yaml", help="the workloads whose studies to check"),
    space: list[str] = typer.Option(None, "--space", "-s", help=SPACE_HELP),
    all_: bool = typer.Option(
        False, "--all", help="list every study that falls back (default: the first 20)"
    ),
) -> None:
    """Which dispatch table serves a GPU (its own, or a same-architecture GPU's), whether it is
    fresh, and which (contract key, batch) studies fall back and to what. Exit 0: nothing to
    re-tune; 1: served, but from another GPU's table, with fallbacks or carried timings; 3: no
    table or a stale one (re-tune)."""
    from kdagen.doctor import diagnose

    if fingerprint is None:
        try:
            from kdagen.serve.fingerprint import gpu_fingerprint

            fingerprint = gpu_fingerprint()
        except (AssertionError, RuntimeError):  # torch raises these without CUDA
            typer.echo("kdagen doctor: no CUDA GPU is visible; pass --fingerprint", err=True)
            raise typer.Exit(2) from None
    try:
        found = diagnose(fingerprint, workloads, tuple(space or DEFAULT_SPACES))
    except SpaceError as err:
        typer.echo(f"kdagen doctor: {err}", err=True)
        raise typer.Exit(2) from None
    typer.echo("\n".join(found.lines(most=len(found.fallbacks) if all_ else 20)))
    raise typer.Exit(found.code)


@app.command()
def carry(
    kernel: str = typer.Option(
        ..., help="the kernel whose measured variants changed: verify or commit"
    ),
    reason: str = typer.Option(..., help="what the change fixes (recorded in the table)"),
    evidence: Path = typer.Option(
        ...,
        help="the A/B of the change's cost (scripts/bench_ab.py: both renders, alternating "
        "processes on one GPU), a file in the checkout (recorded in the table)",
    ),
    fingerprint: str = typer.Option("nvidia-h200-sm90-132sm", help="the table's GPU"),
) -> None:
    """Keep a table's choices for KERNEL over a correctness change to its measured kernels,
    ahead of the re-tune (the run-time warns, `doctor` reports it, a re-tune re-times it)."""
    from kdagen.carry import CarryError
    from kdagen.carry import carry as carry_table
    from kdagen.serve.dispatch import generated_root

    folder = generated_root() / fingerprint
    try:
        table = carry_table(folder, kernel, reason, evidence)
    except CarryError as err:
        typer.echo(f"kdagen carry: {err}", err=True)
        raise typer.Exit(2) from None
    c = table.carried[kernel]
    typer.echo(f"{folder}: {kernel} carried from render {c['from_render_hash']} to "
               f"{table.render_hashes[kernel]} ({c['reason']}; {c['evidence']})")  # fmt: skip


from kdagen.tune_cli import regenerate, tune  # noqa: E402  (kdagen/tune_cli.py)

app.command()(tune)
app.command()(regenerate)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
