"""What a compiled variant runs, as a hash: its object file (the host code that launches it
and the embedded cubin) with the variant's own module digest blanked. Two renders with the
same machine digest execute the same instructions with the same launch, so the tuner keeps a
study measured on one when a template refactor produces the other (``kdagen.studies``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path


def machine_digest(obj: Path, module_digest: str) -> str:
    """The hash of ``obj`` with every occurrence of ``module_digest`` (the render digest in
    the module's and kernel's symbol names) replaced by zeros."""
    blob = obj.read_bytes().replace(module_digest.encode(), b"0" * len(module_digest))
    return hashlib.sha256(blob).hexdigest()[:16]


def machine_hash(digests: Mapping[str, str]) -> str:
    """One hash of a study's candidates' machine digests (name -> digest)."""
    text = "".join(f"{name}\0{digests[name]}\n" for name in sorted(digests))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
