"""What a compiled variant runs, as a hash: its cubin's sections (the instructions, the
kernel attributes such as registers and the block size it requires, the parameter and static
shared memory sizes) with the kernel's name taken out, plus the shared memory the template
allocates per CTA. Two renders with the same machine digest execute the same instructions
with the same resources, so the tuner keeps a study measured on one when a template refactor
produces the other (``kdagen.studies``). The grid is the render's host code: a refactor
is confirmed on the GPU by ``kdagen check`` and ``scripts/bench_ab.py``."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

from kdagen.cubin import sections

# The kernel's symbol carries the module digest and its mangled parameter types: a name, not code.
_KERNEL_NAME = re.compile(r"kernel_cutlass\w*")
_NAME_TABLES = {"", ".strtab", ".shstrtab", ".symtab"}


def machine_digest(cubin: Path, shared_bytes: int) -> str:
    """The hash of ``cubin``'s sections but its name tables, each under its name with the
    kernel's symbol replaced, and of ``shared_bytes``."""
    blob = cubin.read_bytes()
    h = hashlib.sha256(f"shared {shared_bytes}\n".encode())
    named = sorted((_KERNEL_NAME.sub("K", n), span) for n, span in sections(blob).items())
    for name, (offset, size) in named:
        if name not in _NAME_TABLES:
            h.update(name.encode() + b"\0" + blob[offset : offset + size])
    return h.hexdigest()[:16]


def machine_hash(digests: Mapping[str, str]) -> str:
    """One hash of a study's candidates' machine digests (name -> digest)."""
    text = "".join(f"{name}\0{digests[name]}\n" for name in sorted(digests))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
