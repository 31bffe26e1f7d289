"""Variant -> compiled kernel, for any arch, with or without a GPU, cached on disk.

The cache is keyed by the variant digest (rendered source + DSL version) and the arch:
``<cache>/<digest>/kernel.py`` is the rendered module (tracebacks point at it) and
``<cache>/<digest>/<arch>/`` holds ``record.json``, the PTX, the cubin and an exported
object (``kernel.o``) that a later process loads instead of compiling again.
A failing compile is a result (``status == "error"`` with its message), never an exception.
"""

from __future__ import annotations

import concurrent.futures as futures
import ctypes
import dataclasses
import functools
import importlib.util
import json
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kdagen.render import digest, render
from kdagen.serve.variant import Variant

ARCHS = ("sm_90a", "sm_100a")


def cache_root() -> Path:
    return Path(os.environ.get("KDAGEN_CACHE", Path.home() / ".cache" / "kdagen"))


@dataclass
class CompileRecord:
    """What one (variant, arch) compile gave; JSON-serialisable."""

    variant: str
    arch: str
    digest: str
    status: str  # "ok", "error", or "skipped" (the variant's path does not target the arch)
    seconds: float
    registers: int | None = None
    frame_bytes: int | None = None  # stack frame: non-zero means spills or local arrays
    smem_bytes: int | None = None  # shared memory per CTA (static + what the kernel allocates)
    error: str | None = None
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def failed(self) -> bool:
        return self.status == "error"

    @property
    def static_only(self) -> bool:
        """Compiled for an arch no GPU of ours runs (sm_100a): verified by inspection only."""
        return self.ok and self.arch == "sm_100a"


def variant_dir(variant: Variant, root: Path | None = None) -> Path:
    return (root or cache_root()) / digest(variant)


def write_module(variant: Variant, root: Path | None = None) -> Path:
    """The rendered module on disk (written once per digest)."""
    path = variant_dir(variant, root) / "kernel.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(render(variant))
        tmp.replace(path)
    return path


def load_module(variant: Variant, root: Path | None = None) -> ModuleType:
    path = write_module(variant, root)
    name = f"kdagen_kernel_{digest(variant)}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def kernel_object(variant: Variant, root: Path | None = None) -> Any:
    return getattr(load_module(variant, root), variant.spec.class_name)()


def compile_options(arch: str, dump_dir: Path | None = None) -> str:
    """DSL compile flags; ``KDAGEN_DSL_OPTIONS`` appends more (e.g. ``--generate-line-info``
    for compute-sanitizer; such builds land in the same cache, so use a separate one)."""
    options = f"--gpu-arch {arch}"
    extra = os.environ.get("KDAGEN_DSL_OPTIONS", "").strip()
    if extra:
        options += f" {extra}"
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return options


def compile_variant(
    variant: Variant, arch: str, root: Path | None = None, force: bool = False
) -> CompileRecord:
    """Compile without a GPU (placeholder arguments); reuse the cached record when present."""
    out_dir = variant_dir(variant, root) / arch
    record_path = out_dir / "record.json"
    if record_path.exists() and not force:
        record = CompileRecord(**json.loads(record_path.read_text()))
        record.cached = True
        return record
    started = time.perf_counter()
    try:
        compiled = _compile(variant, arch, out_dir, root)
        record = CompileRecord(variant.name, arch, digest(variant), "ok", 0.0)
        _add_resources(record, out_dir)
        record.smem_bytes = (record.smem_bytes or 0) + getattr(
            load_module(variant, root), "SHARED_BYTES", 0
        )
        _load_runtime_library()
        compiled.export_to_c(str(out_dir), "kernel", export_symbol(variant))
    except Exception as err:  # a compile error is a result, reported with the others
        record = CompileRecord(
            variant.name, arch, digest(variant), "error", 0.0, error=_short_error(err)
        )
    record.seconds = round(time.perf_counter() - started, 2)
    out_dir.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(dataclasses.asdict(record) | {"cached": False}, indent=1))
    return record


@functools.cache
def _load_runtime_library() -> None:
    """Exporting resolves CUDA runtime symbols; a GPU-less process has not loaded them."""
    from cutlass.cute.runtime import find_runtime_libraries

    for path in find_runtime_libraries(enable_tvm_ffi=False):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def export_symbol(variant: Variant) -> str:
    return f"kdagen_{digest(variant)}"


def _compile(variant: Variant, arch: str, out_dir: Path, root: Path | None) -> Any:
    import cutlass.cute as cute

    from kdagen.serve.abi import placeholder_args

    dump = out_dir / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    compiled = cute.compile(
        kernel_object(variant, root),
        *placeholder_args(variant),
        options=compile_options(arch, dump),
    )
    for suffix, name in ((".ptx", "kernel.ptx"), (".cubin", "kernel.cubin")):
        found = sorted(dump.glob(f"*{suffix}"))
        if found:
            found[-1].replace(out_dir / name)
    for leftover in dump.iterdir():
        leftover.unlink()
    dump.rmdir()
    return compiled


def _add_resources(record: CompileRecord, out_dir: Path) -> None:
    from kdagen.cubin import kernel_resources

    cubin = out_dir / "kernel.cubin"
    if cubin.exists():
        res = kernel_resources(cubin.read_bytes())
        record.registers, record.frame_bytes = res.registers, res.frame_bytes
        record.smem_bytes = res.static_smem_bytes


def _short_error(err: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(err), err)).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return "\n".join(lines[-12:])


# ---- many variants in worker processes ----


def init_worker(arch: str) -> None:
    # Arch-checked ops (wgmma, tcgen05) read the target at import time on a GPU-less host.
    os.environ["CUTE_DSL_ARCH"] = arch


def compile_named(name: str, arch: str, root: str | None, force: bool = False) -> CompileRecord:
    """``compile_variant`` by variant name (what a spawned worker process is sent)."""
    return compile_variant(Variant.parse(name), arch, Path(root) if root else None, force)


def compile_many(
    variants: Sequence[Variant],
    archs: Iterable[str],
    jobs: int = 0,
    root: Path | None = None,
    force: bool = False,
    on_result: Callable[[CompileRecord], None] | None = None,
) -> list[CompileRecord]:
    """Compile every (variant, arch) in ``jobs`` spawned worker processes (0: one per CPU).

    Spawned, not forked: the DSL's MLIR context does not survive a fork. A worker that dies
    (a crash in the compiler) breaks its pool; the variants in flight then are compiled
    again one per process, so only the one that crashes is recorded as an error.
    """
    jobs = jobs or os.cpu_count() or 1
    records: list[CompileRecord] = []

    def report(record: CompileRecord) -> None:
        records.append(record)
        if on_result:
            on_result(record)

    for arch in archs:
        supported = [v for v in variants if arch in v.spec.archs]
        for v in variants:
            if arch not in v.spec.archs:
                records.append(
                    CompileRecord(v.name, arch, digest(v), "skipped", 0.0,
                                  error=f"path {v.path!r} targets {', '.join(v.spec.archs)}")
                )  # fmt: skip
        lost = _compile_in_pool(supported, arch, jobs, root, force, report)
        for v in lost:  # one process each: a crash now names its variant
            _compile_in_pool([v], arch, 1, root, force, report, crashed_is_error=True)
    order = {v.name: i for i, v in enumerate(variants)}
    records.sort(key=lambda r: (order.get(r.variant, 0), r.arch))
    return records


def _compile_in_pool(
    variants: Sequence[Variant],
    arch: str,
    jobs: int,
    root: Path | None,
    force: bool,
    report: Callable[[CompileRecord], None],
    crashed_is_error: bool = False,
) -> list[Variant]:
    """Compile ``variants`` in one pool; returns those lost to a dead worker (unless
    ``crashed_is_error``, which records them as errors instead)."""
    if not variants:
        return []
    lost: list[Variant] = []
    with futures.ProcessPoolExecutor(
        max_workers=min(jobs, len(variants)),
        mp_context=multiprocessing.get_context("spawn"),
        initializer=init_worker,
        initargs=(arch,),
    ) as pool:
        pending = {
            pool.submit(compile_named, v.name, arch, str(root) if root else None, force): v
            for v in variants
        }
        for done in futures.as_completed(pending):
            v = pending[done]
            try:
                report(done.result())
            except futures.process.BrokenProcessPool as err:
                if not crashed_is_error:
                    lost.append(v)
                    continue
                report(
                    CompileRecord(v.name, arch, digest(v), "error", 0.0,
                                  error=f"the compiler process died: {err}")
                )  # fmt: skip
    return lost
