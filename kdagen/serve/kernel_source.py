"""Where launches get their kernels: the source the run-time loads compiled variants from.

A source loads the launchable kernel of a variant for an arch, and says why a dispatch table
must not pick a kernel's variants from it (its winners were measured on other kernels).
``current()`` is, in a package written by ``kdagen emit``, its prebuilt ``kernels/``
(``bundle``); elsewhere the source the build side registered (kdagen compiles on first use:
``kdagen.first_use``). The run-time never compiles: with neither, it cannot launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from . import bundle

if TYPE_CHECKING:
    from .dispatch import DispatchTable
    from .variant import Variant


class KernelSource(Protocol):
    def load(self, variant: Variant, arch: str) -> Any:
        """The launchable kernel of ``variant`` for ``arch`` (loaded once per process)."""

    def stale(self, table: DispatchTable, kernel: str) -> str | None:
        """Why ``table`` must not choose among ``kernel``'s variants from this source, and
        what to do about it; None when it may."""


class NoKernelSourceError(RuntimeError):
    """Nothing can provide kernels: no prebuilt ones here and no source registered."""


_registered: KernelSource | None = None


def register(source: KernelSource) -> None:
    """Make ``source`` the kernels' source where no prebuilt ones are present."""
    global _registered
    _registered = source


def current() -> KernelSource:
    """The emitted package's prebuilt kernels, else the registered source."""
    if bundle.active():
        return bundle.PREBUILT
    if _registered is None:
        raise NoKernelSourceError(
            f"kdagen: no kernels to launch: no prebuilt kernels ({bundle.KERNELS / bundle.MANIFEST}"
            " is missing) and no kernel source registered. Serve a package written by "
            "`kdagen emit`, or compile on first use through kdagen: `kdagen.verify` and "
            "kdagen's other serving names turn it on, as does `kdagen.first_use.enable()`."
        )
    return _registered
