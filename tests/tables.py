"""What tests that dispatch from a temporary generated/ share."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdagen.serve import dispatch


def serve_tables_from(monkeypatch: pytest.MonkeyPatch, root: Path, fingerprint: str) -> None:
    """Dispatch from the tables under ``root`` as GPU ``fingerprint`` (no GPU needed), the
    dispatch table on, nothing cached from an earlier test."""
    monkeypatch.setenv("KDAGEN_GENERATED", str(root))
    monkeypatch.setenv("KDAGEN_FINGERPRINT", fingerprint)
    monkeypatch.delenv("KDAGEN_DISPATCH", raising=False)
    dispatch.reset()
