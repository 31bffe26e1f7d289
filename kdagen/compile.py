"""Variant -> compiled kernel, for any arch, with or without a GPU, cached on disk.

The cache is keyed by the variant digest (rendered source + DSL version) and the arch:
``<cache>/<digest>/kernel.py`` is the rendered module (tracebacks point at it) and
``<cache>/<digest>/<arch>/`` holds ``record.json``, the PTX, the cubin and an exported
object (``kernel.o``) that a later process loads instead of compiling again. Processes share
it safely: a compile builds in a folder of its own and renames its files in, and compiles on
first use of one variant wait on a lock for each other.
A failing compile is a result (``status == "error"`` with its message), never an exception.

Every way in shares this cache: ``CompilePool`` (``kdagen compile`` and ``kdagen emit`` through
``compile_many``, and the tuner) compiles in worker processes; ``load_kernel`` (compile on first
use) loads the exported object, compiling in its own process where it is missing.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import ctypes
import dataclasses
import fcntl
import functools
import importlib.util
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from kdagen.machine_code import machine_digest
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
    smem_bytes: int | None = None  # shared memory per CTA (static + the template's SHARED_BYTES)
    # Shared memory per CTA as launched (static + the dynamic bytes the host code requests,
    # kdagen.launch_config): what decides the CTAs an SM holds; SHARED_BYTES bounds it.
    launch_smem_bytes: int | None = None
    error: str | None = None
    cached: bool = False
    machine: str | None = None  # kdagen.machine_code.machine_digest (not stored: recomputed)

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
        _write_whole(path, render(variant))
    return path


def _write_whole(path: Path, text: str) -> None:
    """Written under another name, then renamed: other processes share the cache and never
    read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


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


def record_path(variant: Variant, arch: str, root: Path | None = None) -> Path:
    return variant_dir(variant, root) / arch / "record.json"


def object_path(variant: Variant, arch: str, root: Path | None = None) -> Path:
    """The exported object (its symbol: ``export_symbol``)."""
    return variant_dir(variant, root) / arch / "kernel.o"


def cached_record(variant: Variant, arch: str, root: Path | None = None) -> CompileRecord | None:
    """The record of an earlier compile of (variant, arch), or None."""
    path = record_path(variant, arch, root)
    if not path.exists():
        return None
    fields = json.loads(path.read_text())
    if fields["status"] == "ok" and "launch_smem_bytes" not in fields:
        return None  # written before records carried it: compile again
    record = CompileRecord(**fields | {"cached": True})
    _add_machine(record, path.parent)
    return record


def compile_variant(
    variant: Variant, arch: str, root: Path | None = None, force: bool = False
) -> CompileRecord:
    """Compile without a GPU (placeholder arguments) and export the object; reuse the cached
    record when present (unless ``force``)."""
    cached = None if force else cached_record(variant, arch, root)
    if cached is not None:
        return cached
    out_dir = variant_dir(variant, root) / arch
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Built in a folder of its own, then published file by file: processes that share the
    # cache (test workers, a server's ranks) may compile the same variant at once.
    stage = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=out_dir.parent))
    try:
        try:
            compiled = _compile(variant, arch, stage, root)
            record = CompileRecord(variant.name, arch, digest(variant), "ok", 0.0)
            _add_resources(record, stage)
            _add_launch_smem(record, compiled)
            record.smem_bytes = (record.smem_bytes or 0) + getattr(
                load_module(variant, root), "SHARED_BYTES", 0
            )
            _load_runtime_library()
            compiled.export_to_c(str(stage), "kernel", export_symbol(variant))
        except Exception as err:  # a compile error is a result, reported with the others
            record = CompileRecord(
                variant.name, arch, digest(variant), "error", 0.0, error=_short_error(err)
            )
        record.seconds = round(time.perf_counter() - started, 2)
        fields = dataclasses.asdict(record) | {"cached": False, "machine": None}
        (stage / "record.json").write_text(json.dumps(fields, indent=1))
        _publish(stage, out_dir)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    _add_machine(record, out_dir)
    return record


def _publish(stage: Path, out_dir: Path) -> None:
    """Each staged file renamed into ``out_dir`` (atomic per file), the record last: a reader
    that finds the record finds the object it describes."""
    for path in sorted(stage.iterdir(), key=lambda p: p.name == "record.json"):
        path.replace(out_dir / path.name)


def _add_machine(record: CompileRecord, out_dir: Path) -> None:
    """The record's machine digest, from its cubin (computed, never read from the record, so
    the digest may change what it covers)."""
    cubin = out_dir / "kernel.cubin"
    record.machine = None
    if record.ok and cubin.exists():
        record.machine = machine_digest(cubin, record.smem_bytes or 0)


class CompileError(RuntimeError):
    """A kernel needed now did not compile (its record's message)."""


def load_kernel(variant: Variant, arch: str, root: Path | None = None) -> Any:
    """The launchable kernel: the cache's exported object, compiled in this process first
    (``compile_variant``) where it is missing or cannot be loaded (stale, foreign)."""
    stale = False
    try:
        return _load_exported(variant, arch, root)
    except FileNotFoundError:
        pass
    except Exception as err:
        warnings.warn(f"kdagen: could not load {variant.name}'s object ({err}); compiling",
                      stacklevel=2)  # fmt: skip
        stale = True
    with _compile_lock(variant, arch, root):
        if not stale:  # another process may have compiled it while this one waited
            try:
                return _load_exported(variant, arch, root)
            except FileNotFoundError:
                pass
        record = compile_variant(variant, arch, root, force=True)
    if not record.ok:
        raise CompileError(f"{variant.name} did not compile for {arch}:\n{record.error}")
    return _load_exported(variant, arch, root)


@contextlib.contextmanager
def _compile_lock(variant: Variant, arch: str, root: Path | None) -> Iterator[None]:
    """One process at a time compiles a variant for first use; the others wait, then load its
    object instead of compiling it again."""
    path = variant_dir(variant, root) / f".{arch}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load_exported(variant: Variant, arch: str, root: Path | None) -> Any:
    import cutlass.cute as cute  # over a second to import: only once a kernel is needed

    obj = object_path(variant, arch, root)
    if not obj.exists():
        raise FileNotFoundError(obj)
    return getattr(cute.runtime.load_module(str(obj)), export_symbol(variant))


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


def _add_launch_smem(record: CompileRecord, compiled: Any) -> None:
    """``launch_smem_bytes`` from the compiled host code (before ``smem_bytes`` gains
    SHARED_BYTES: it holds the static section here)."""
    from kdagen.launch_config import launch_dynamic_smem

    host_ir = getattr(compiled, "ir_module", None)  # absent: the field stays None
    dynamic = None if host_ir is None else launch_dynamic_smem(str(host_ir))
    if dynamic is not None:
        record.launch_smem_bytes = (record.smem_bytes or 0) + dynamic


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


class CompilePool:
    """Compiles variants for one arch in spawned processes, each as soon as it is submitted.

    The one path to compiling many variants: ``kdagen compile``, ``kdagen emit`` (both through
    ``compile_many``) and the tuner, whose GPU threads share one pool (a lock around its books;
    waiting for a compile holds none). Spawned, not forked: the DSL's MLIR context does not
    survive a fork. Cached records are read in this process (no worker needed); a variant whose
    path does not target the arch is a "skipped" record. A compiler crash breaks the pool; the
    variants it took down are compiled again each in a process of its own (``_after_crash``),
    so only the one that crashes is recorded as an error.
    """

    def __init__(
        self, arch: str, jobs: int = 0, root: Path | None = None, force: bool = False
    ) -> None:
        self.arch = arch
        self.jobs = jobs or os.cpu_count() or 1
        self.root = root
        self.force = force  # compile again even where the cache holds a record
        self._pool: futures.ProcessPoolExecutor | None = None
        self._generation = 0  # counts pools: a crash replaces only the pool it broke
        self._pending: dict[str, tuple[futures.Future[CompileRecord], int]] = {}
        self._lost: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __enter__(self) -> CompilePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, variant: Variant) -> None:
        with self._lock:
            self._submit(variant)

    def result(self, variant: Variant) -> CompileRecord:
        """The variant's record (submitted now if it was not); never raises for a failure."""
        with self._lock:
            future, generation = self._submit(variant)
        try:
            return future.result()
        except futures.process.BrokenProcessPool as err:
            return self._after_crash(variant, future, generation, err)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None

    def _submit(self, variant: Variant) -> tuple[futures.Future[CompileRecord], int]:
        if variant.name in self._pending:
            return self._pending[variant.name]
        known = self._known(variant)
        if known is not None:
            done: futures.Future[CompileRecord] = futures.Future()
            done.set_result(known)
            self._pending[variant.name] = (done, -1)
        else:
            if self._pool is None:
                self._pool = self._executor(self.jobs)
                self._generation += 1
            self._pending[variant.name] = (self._send(self._pool, variant), self._generation)
        return self._pending[variant.name]

    def _known(self, variant: Variant) -> CompileRecord | None:
        """The record without a worker: skipped, or cached (unless forced); else None."""
        if self.arch not in variant.spec.archs:
            return CompileRecord(variant.name, self.arch, digest(variant), "skipped", 0.0,
                                 error=f"path {variant.path!r} targets "
                                       f"{', '.join(variant.spec.archs)}")  # fmt: skip
        if self.force:
            return None
        return cached_record(variant, self.arch, self.root)

    def _after_crash(
        self, variant: Variant, broken: futures.Future[CompileRecord], generation: int,
        err: Exception,
    ) -> CompileRecord:  # fmt: skip
        """The crash-retry routine: ``variant`` was in a pool that a dying worker broke."""
        with self._lock:
            if self._pending[variant.name][0] is not broken:  # another thread took it on
                again, alone = self._pending[variant.name][0], None
            else:
                self._lost[variant.name] += 1
                if self._pool is not None and generation == self._generation:
                    self._pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = None
                if self._lost[variant.name] > 1:
                    return self._died(variant, err)
                alone = self._executor(1)  # its own process: a crash now names it
                again = self._send(alone, variant)
                self._pending[variant.name] = (again, -1)
        try:
            return again.result()
        except futures.process.BrokenProcessPool as died:
            return self._died(variant, died)
        finally:
            if alone is not None:
                alone.shutdown()

    def _executor(self, jobs: int) -> futures.ProcessPoolExecutor:
        return futures.ProcessPoolExecutor(
            max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
            initializer=init_worker, initargs=(self.arch,),
        )  # fmt: skip

    def _send(
        self, pool: futures.ProcessPoolExecutor, variant: Variant
    ) -> futures.Future[CompileRecord]:
        root = str(self.root) if self.root else None
        return pool.submit(compile_named, variant.name, self.arch, root, self.force)

    def _died(self, variant: Variant, err: BaseException) -> CompileRecord:
        return CompileRecord(variant.name, self.arch, digest(variant), "error", 0.0,
                             error=f"the compiler process died: {err}")  # fmt: skip


def compile_many(
    variants: Sequence[Variant],
    archs: Iterable[str],
    jobs: int = 0,
    root: Path | None = None,
    force: bool = False,
    on_result: Callable[[CompileRecord], None] | None = None,
) -> list[CompileRecord]:
    """Every (variant, arch) through a ``CompilePool`` of ``jobs`` processes (0: one per CPU),
    in the order of ``variants``; ``on_result`` sees each build's record (not the skipped)."""
    records: list[CompileRecord] = []
    for arch in archs:
        with CompilePool(arch, jobs, root, force) as pool:
            for v in variants:
                pool.submit(v)
            for v in variants:
                records.append(pool.result(v))
                if on_result and records[-1].status != "skipped":
                    on_result(records[-1])
    order = {v.name: i for i, v in enumerate(variants)}
    records.sort(key=lambda r: (order.get(r.variant, 0), r.arch))
    return records
