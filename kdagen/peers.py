"""Benchmark peers loaded at run time: FlashInfer's CuTe-DSL ``kda_recoverssm_verify``.

The peer is not part of kdagen. GPU hosts here have no package index, so a minimal copy of
FlashInfer (the four modules the verify needs, in a ``flashinfer/`` package skeleton with
empty ``__init__.py`` files) lives in a git-ignored folder, ``.peers`` at the repository root
or ``$KDAGEN_PEERS``, which is put on ``sys.path`` only when a peer is asked for. An installed
``flashinfer`` would be shadowed by that folder while it exists.

    python -m kdagen.peers fetch [--wheel WHEEL]   # fills .peers from a flashinfer-python wheel
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

PEERS_ENV = "KDAGEN_PEERS"
REPO_ROOT = Path(__file__).resolve().parents[1]
FLASHINFER_VERSION = "0.7.2.post1"  # the release docs/anchors.md measured
FLASHINFER_VERIFY = "flashinfer.kda_kernels.kda_decode_wy_output_only"
# Everything kda_recoverssm_verify imports from FlashInfer (checked: the other imports are
# torch, cuda-bindings and nvidia-cutlass-dsl).
FLASHINFER_FILES = (
    "flashinfer/kda_kernels/kda_decode_wy_output_only.py",
    "flashinfer/gdn_kernels/gdn_decode_bf16_wy_output_only.py",
    "flashinfer/gdn_kernels/device_target.py",
    "flashinfer/gdn_kernels/dtype_compat.py",
)
SKELETON = (
    "flashinfer/__init__.py",
    "flashinfer/kda_kernels/__init__.py",
    "flashinfer/gdn_kernels/__init__.py",
)


class PeerLoad(NamedTuple):
    """A peer's entry point, or None, and one line saying where it came from or why not."""

    fn: Callable[..., object] | None
    note: str


def peers_dir() -> Path:
    """$KDAGEN_PEERS, else ``.peers`` in the working directory or the repository root."""
    if os.environ.get(PEERS_ENV):
        return Path(os.environ[PEERS_ENV])
    here = Path.cwd() / ".peers"
    return here if here.is_dir() else REPO_ROOT / ".peers"


def _put_on_path(folder: Path) -> None:
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def import_flashinfer_verify() -> Callable[..., object]:
    """FlashInfer's ``kda_recoverssm_verify``, imported (from the peers folder first) but not
    checked against the GPU; raises what the import raised."""
    import importlib

    _put_on_path(peers_dir())
    return importlib.import_module(FLASHINFER_VERIFY).kda_recoverssm_verify


def flashinfer_verify() -> PeerLoad:
    """FlashInfer's ``kda_recoverssm_verify`` when it can run here (import first, so a missing
    copy is named even on a machine without a GPU; then SM90+)."""
    try:
        fn = import_flashinfer_verify()
    except Exception as err:  # ImportError, or a module of another version
        where = peers_dir()
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        return PeerLoad(None, f"flashinfer not importable ({detail}); looked in {where}")
    import torch

    if not torch.cuda.is_available():
        return PeerLoad(None, "flashinfer needs a CUDA GPU; none is visible")
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return PeerLoad(None, f"flashinfer's verify needs SM90+, this GPU is sm_{major}{minor}")
    flashinfer = sys.modules.get("flashinfer")
    version = getattr(flashinfer, "__version__", "unknown version")
    where = Path(getattr(flashinfer, "__file__", None) or "?").parent
    return PeerLoad(fn, f"flashinfer {version} from {where}")


def fetch_flashinfer(dest: Path, wheel: Path | None = None) -> list[Path]:
    """Copy FlashInfer's verify modules out of a flashinfer-python wheel into ``dest`` (the
    peers folder) with an empty package skeleton and FlashInfer's licence; without ``wheel``,
    pip downloads the release the anchors used. Returns the files written."""
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            wheel = _download_wheel(Path(tmp))
        written = _extract(wheel, dest)
    return written


def _download_wheel(folder: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder)]
    subprocess.run([*cmd, f"flashinfer-python=={FLASHINFER_VERSION}"], check=True)
    return next(folder.glob("flashinfer_python-*.whl"))


def _extract(wheel: Path, dest: Path) -> list[Path]:
    written = []
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        missing = [f for f in FLASHINFER_FILES if f not in names]
        if missing:
            raise FileNotFoundError(f"{wheel.name} lacks {missing}")
        version = _wheel_version(zf) or "unknown"
        for name in FLASHINFER_FILES:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
            written.append(target)
        for name in sorted(n for n in names if ".dist-info/" in n and "LICENSE" in n.upper()):
            target = dest / "flashinfer" / "licenses" / Path(name).name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
            written.append(target)
    for name in SKELETON:
        init = dest / name
        init.write_text(f'__version__ = "{version}"\n' if name == SKELETON[0] else "")
        written.append(init)
    return written


def _wheel_version(zf: zipfile.ZipFile) -> str | None:
    for name in zf.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in zf.read(name).decode(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kdagen.peers", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="fill the peers folder from a flashinfer-python wheel")
    fetch.add_argument("--wheel", type=Path, help="a downloaded wheel (default: pip download)")
    fetch.add_argument("--dest", type=Path, default=None, help="default: $KDAGEN_PEERS or .peers")
    sub.add_parser("status", help="say whether the FlashInfer verify can be loaded here")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        dest = args.dest or peers_dir()
        for path in fetch_flashinfer(dest, args.wheel):
            print(f"{path.stat().st_size:>8}  {path}")
        return 0
    print(flashinfer_verify().note)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
