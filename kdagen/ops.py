"""``import kdagen.ops``: kdagen's launches as torch custom ops (``torch.ops.kdagen.verify``,
``.commit``, ``.commit_layers``), their kernels compiled on first use.

The ops are defined in ``kdagen.serve.ops``, which an emitted package carries as it is; this
module registers them for kdagen itself, with the compile-on-first-use kernel source on, and
gives their helpers (``register``: a ``ModelCommit``'s handle for ``commit_layers``)."""

from kdagen import first_use
from kdagen.serve.ops import commit_model, register

first_use.enable()

__all__ = ["commit_model", "register"]
