"""Where kdagen's data lives: the kernel templates, the search spaces and the shipped tables.

In a checkout (and an editable install) they are the top-level folders beside ``kdagen/``; a
wheel carries them inside the package (``kdagen/templates``, ``kdagen/search_spaces``,
``kdagen/generated``: pyproject.toml maps them), so an installed kdagen works from any
directory. An emitted package never asks: its table sits in its own ``generated/``
(``bundle.table_root``).
"""

from __future__ import annotations

from pathlib import Path

# kdagen/ (this module is kdagen/serve/resources.py)
PACKAGE = Path(__file__).resolve().parent.parent


def data_dir(name: str) -> Path:
    """The folder ``name`` (templates, search_spaces or generated) of this installation."""
    inside = PACKAGE / name
    return inside if inside.is_dir() else PACKAGE.parent / name
