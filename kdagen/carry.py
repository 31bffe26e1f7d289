"""``kdagen carry``: ship a correctness change to measured kernels ahead of their re-tune.

A change that renders a table's measured kernels differently makes the table stale, and the
run-time refuses it until the GPU is re-tuned. When the change fixes a defect (a write outside
a tensor, a race) and the GPU the table belongs to is out of reach, that would hold the fix
back. Carrying keeps the table's choices for the changed kernels and records, in the table,
the render hash its timings were measured on, why the kernels changed and the A/B that
measured the change's cost (a file in the checkout: both renders timed alternately on one GPU
of the table's architecture, ``scripts/bench_ab.py``). The run-time then serves the table with
one warning, ``kdagen doctor`` reports the kernel as carried (exit 1), and ``kdagen
regenerate`` or ``kdagen tune --refresh`` on that GPU re-times it: the studies still carry the
old render's stamps (a ``--match`` tune that would write the table without re-timing them is
refused).

Only the render may differ: the same nvidia-cutlass-dsl and measured variants that still
exist (so every choice is still a point of the table's recorded space).
"""

from __future__ import annotations

from pathlib import Path

from kdagen.render import kernels_digest, template_digest
from kdagen.serve.dispatch import DispatchTable, load_table, write_table
from kdagen.serve.fingerprint import dsl_version
from kdagen.serve.variant import VariantError


class CarryError(RuntimeError):
    """The table cannot be carried (fresh already, another DSL, a measured variant gone, no
    evidence); the message says which."""


def carry(folder: Path, kernel: str, reason: str, evidence: Path) -> DispatchTable:
    """Carry ``kernel``'s entries of the table in ``folder`` over the change of its kernels'
    render (``reason``, measured by ``evidence``); the table is rewritten in place."""
    table = load_table(folder)
    if table is None:
        raise CarryError(f"no dispatch table in {folder}")
    if kernel not in table.kernels():
        raise CarryError(f"the table in {folder} has no {kernel} entries")
    if not reason.strip():
        raise CarryError("--reason is empty: say what the change fixes")
    if not evidence.is_file() or evidence.stat().st_size == 0:
        raise CarryError(f"--evidence {evidence}: no such file (the A/B of the change's cost)")
    if table.dsl_version != dsl_version():
        raise CarryError(
            f"the table was made with nvidia-cutlass-dsl {table.dsl_version}, "
            f"{dsl_version()} is installed: another compiler is a re-tune, not a carry"
        )
    measured = table.measured.get(kernel)
    made = table.render_hashes.get(kernel)
    if not measured or made is None:
        raise CarryError(f"the table records no measured {kernel} variants or render hash")
    try:
        now = kernels_digest(measured)
    except VariantError as err:
        raise CarryError(f"a measured {kernel} variant no longer exists: {err}") from None
    if now == made:
        raise CarryError(f"the {kernel} kernels the table measured render as they did: fresh")
    earlier = table.carried.get(kernel, {})  # carried before: the timings are older still
    table.carried[kernel] = {
        "from_render_hash": earlier.get("from_render_hash", made),
        "reason": "; ".join(filter(None, (earlier.get("reason"), reason.strip()))),
        "evidence": ", ".join(filter(None, (earlier.get("evidence"), evidence.as_posix()))),
    }
    table.render_hashes[kernel] = now
    table.template_hashes[kernel] = template_digest(kernel)
    write_table(folder, table)
    return table
