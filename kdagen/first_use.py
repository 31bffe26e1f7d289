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

from typing import Any

from kdagen import compile as kcompile
from kdagen.render import kernels_digest, template_digest
from kdagen.serve import kernel_source
from kdagen.serve.dispatch import DispatchTable
from kdagen.serve.fingerprint import dsl_version
from kdagen.serve.variant import Variant, VariantError


class FirstUse:
    """Kernels from the compile cache (``kdagen.compile.load_kernel``: the entries
    ``kdagen compile`` and the tuner write), compiled in this process where missing."""

    def load(self, variant: Variant, arch: str) -> Any:
        return kcompile.load_kernel(variant, arch)

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
