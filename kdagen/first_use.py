"""Compile on first use: the kernel source kdagen plugs into its serving run-time.

``kdagen.serve`` never compiles; in kdagen (no prebuilt ``kernels/``) a launch's kernel comes
from here: the compile cache's exported object, else a compile now (seconds), exported for
the next process. A dispatch table is judged against the templates this checkout renders:
the variants it measured must render as they did (tables without render hashes: the same
template hash), with the same nvidia-cutlass-dsl.

``enable()`` registers it; ``kdagen.verify`` and the rest of kdagen's serving names call it,
and so do the build-side modules that launch (check, bench, the GPU tests).
"""

from __future__ import annotations

import warnings
from typing import Any

from kdagen import compile as kcompile
from kdagen.render import kernels_digest, template_digest
from kdagen.serve import kernel_source
from kdagen.serve.abi import placeholder_args
from kdagen.serve.dispatch import DispatchTable
from kdagen.serve.fingerprint import dsl_version
from kdagen.serve.variant import Variant, VariantError


class FirstUse:
    """Kernels from the compile cache (``kdagen.compile``), compiled where missing."""

    def load(self, variant: Variant, arch: str) -> Any:
        import cutlass.cute as cute  # over a second to import: only once a kernel is needed

        out_dir = kcompile.variant_dir(variant) / arch
        obj = out_dir / "kernel.o"
        if obj.exists():
            try:
                module = cute.runtime.load_module(str(obj))
                return getattr(module, kcompile.export_symbol(variant))
            except Exception as err:  # a stale or foreign object: compile instead
                warnings.warn(f"kdagen: could not load {obj} ({err}); compiling", stacklevel=2)
        compiled = cute.compile(
            kcompile.kernel_object(variant), *placeholder_args(variant),
            options=kcompile.compile_options(arch),
        )  # fmt: skip
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            compiled.export_to_c(str(out_dir), "kernel", kcompile.export_symbol(variant))
        except Exception as err:  # the in-process function still works
            warnings.warn(f"kdagen: could not export {variant.name}: {err}", stacklevel=2)
        return compiled

    def stale(self, table: DispatchTable, kernel: str) -> str | None:
        """``staleness`` and what to do about it."""
        why = staleness(table, kernel)
        if why is None:
            return None
        return (
            f"{why}. Its winners were measured on other kernels. Re-run `kdagen tune` on this "
            "GPU, or set KDAGEN_DISPATCH=off to use the built-in heuristic"
        )


def staleness(table: DispatchTable, kernel: str) -> str | None:
    """What changed since ``table`` measured ``kernel``'s variants (None: nothing): their
    renders (else the templates' hash, for tables without render hashes) or the DSL."""
    render_hash = None
    if table.render_hashes.get(kernel) and table.measured.get(kernel):
        try:
            render_hash = kernels_digest(table.measured[kernel])
        except VariantError as err:  # a measured variant no longer exists
            render_hash = f"none ({err})"
    return table.staleness(kernel, dsl_version(), template_digest(kernel), render_hash)


SOURCE = FirstUse()


def enable() -> None:
    """Compile on first use wherever no prebuilt kernels are present (idempotent)."""
    kernel_source.register(SOURCE)
