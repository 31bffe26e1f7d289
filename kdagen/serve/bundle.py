"""The prebuilt kernels of a package written by ``kdagen emit``.

An emitted package holds a copy of ``kdagen/serve`` (this module among them), its dispatch
table under ``generated/`` and ``kernels/manifest.json`` with the exported kernel objects the
table can choose. There ``PREBUILT`` is the launches' kernel source (``kernel_source``): it
loads those objects and never compiles, and a variant the package does not hold is an error
that says which ones it does. ``kdagen/serve`` itself has no ``kernels/`` folder: ``active()``
is False and kernels come from the build side.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .fingerprint import dsl_version

if TYPE_CHECKING:
    from .dispatch import DispatchTable
    from .variant import Variant

KERNELS = Path(__file__).resolve().parent / "kernels"
MANIFEST = "manifest.json"


@functools.cache
def manifest() -> dict[str, Any] | None:
    """The package's manifest (None outside an emitted package)."""
    path = KERNELS / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def active() -> bool:
    return manifest() is not None


def table_root() -> Path:
    """Where an emitted package keeps its dispatch table (``generated/<fingerprint>/``)."""
    return KERNELS.parent / "generated"


def held(variant_name: str, arch: str) -> tuple[Path, str]:
    """The exported object of ``variant_name`` for ``arch`` and its symbol; a variant the
    package does not hold is a ``KdaInputError`` naming what it does hold."""
    found = manifest()["kernels"].get(variant_name, {}).get(arch)
    if found is None:
        # Here, not at import: validate loads torch, and dispatch (read by the build side
        # without torch) imports this module.
        from .validate import KdaInputError

        package = manifest()
        raise KdaInputError(
            f"{variant_name} for {arch} is not in this package: it holds "
            f"{len(package['kernels'])} kernels for {package['arch']} on {package['fingerprint']} "
            f"(contract keys {', '.join(package['keys'])}). Re-run `kdagen emit` with this "
            "contract key (--key), on a table for this GPU."
        )
    return KERNELS / found["object"], found["symbol"]


def load(variant_name: str, arch: str) -> Any:
    """The launchable kernel ``variant_name`` for ``arch`` from the package's objects."""
    import cutlass.cute as cute

    path, symbol = held(variant_name, arch)
    return getattr(cute.runtime.load_module(str(path)), symbol)


class Prebuilt:
    """The package's kernels as a ``kernel_source.KernelSource``."""

    def load(self, variant: Variant, arch: str) -> Any:
        return load(variant.name, arch)

    def stale(self, table: DispatchTable, kernel: str) -> str | None:
        """The kernels were compiled from this table's templates (emit refuses a stale
        table); what can still change is the DSL that loads their objects."""
        why = table.staleness(kernel, dsl_version(), table.template_hashes.get(kernel, ""))
        if why is None:
            return None
        return (
            f"{why}. The package's kernels were built with nvidia-cutlass-dsl=="
            f"{table.dsl_version}: install it, or re-run `kdagen emit`"
        )


PREBUILT = Prebuilt()
