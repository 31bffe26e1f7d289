"""Benchmark peers loaded at run time: FlashInfer's CuTe-DSL ``kda_recoverssm_verify`` and
vLLM's Triton ``kda_recoverssm_verify`` / all-layer ``KDARecoverSSMCommitContext``.

The peers are not part of kdagen. GPU hosts here have no package index, so minimal copies
live in a git-ignored folder, ``.peers`` at the repository root or ``$KDAGEN_PEERS``, which is
put on ``sys.path`` only when a peer is asked for:

- FlashInfer: the four modules the verify needs, in a ``flashinfer/`` package skeleton with
  empty ``__init__.py`` files.
- vLLM: ``vllm/models/kimi_k3/nvidia/ops/recoverssm.py`` alone, in a ``vllm/`` package
  skeleton with empty ``__init__.py`` files and four small shims that kdagen writes (not
  copied from vLLM) for what that file imports from vLLM: ``triton`` and ``tl`` from
  ``vllm.triton_utils``, ``is_conv_state_dim_first`` (true when ``$KDAGEN_VLLM_CONV_DIM_FIRST``
  is "1", as vLLM's "DS" conv layout; vLLM's default "SD" otherwise), ``NULL_BLOCK_ID = 0``,
  and a ``cute_recoverssm_commit`` that refuses (the peer is the Triton commit, the file's
  default backend; its CuTe one is not copied).

An installed ``flashinfer`` or ``vllm`` is shadowed by these skeletons once a peer has been
loaded: the folder then sits first on ``sys.path``, so in that process ``import vllm`` (or
``flashinfer``) gives the skeleton, not the installed package.

    python -m kdagen.peers fetch [--only flashinfer|vllm] [--wheel WHEEL] [--vllm-wheel WHEEL]
    python -m kdagen.peers status
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from types import ModuleType
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
VLLM_VERSION = "0.33.0"  # the release whose all-layer Triton commit is the peer
VLLM_MODULE = "vllm.models.kimi_k3.nvidia.ops.recoverssm"
VLLM_FILE = "vllm/models/kimi_k3/nvidia/ops/recoverssm.py"
VLLM_CONV_ENV = "KDAGEN_VLLM_CONV_DIM_FIRST"
# kdagen's own stand-ins for the vLLM modules 0.33.0's recoverssm.py imports from (its
# other imports are torch and the standard library), written at fetch time: nothing in them
# comes from vLLM. The fetch refuses a recoverssm.py that imports anything else from vLLM.
VLLM_SHIMS = {
    "vllm/triton_utils.py": '''\
"""Written by kdagen.peers: Triton, under the names vLLM's recoverssm.py imports."""

import triton
import triton.language as tl

__all__ = ["tl", "triton"]
''',
    "vllm/model_executor/layers/mamba/mamba_utils.py": f'''\
"""Written by kdagen.peers: the conv state layout vLLM's recoverssm.py asks for."""

import os


def is_conv_state_dim_first() -> bool:
    """True when ${VLLM_CONV_ENV} is "1": conv states are (blocks, dim, tokens)."""
    return os.environ.get("{VLLM_CONV_ENV}", "0") == "1"
''',
    "vllm/models/kimi_k3/nvidia/recoverssm/kernels.py": '''\
"""Written by kdagen.peers: vLLM's CuTe commit backend is not part of the peer."""


def cute_recoverssm_commit(*args, **kwargs):
    """Refuses: the peer is vLLM's Triton commit (backend="triton", the default)."""
    raise NotImplementedError("kdagen's vLLM peer has the Triton commit only")
''',
    "vllm/v1/attention/backends/utils.py": '''\
"""Written by kdagen.peers: the null block id vLLM's recoverssm.py skips."""

NULL_BLOCK_ID = 0
''',
}


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


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def import_flashinfer_verify() -> Callable[..., object]:
    """FlashInfer's ``kda_recoverssm_verify``, imported (from the peers folder first) but not
    checked against the GPU; raises what the import raised."""
    _put_on_path(peers_dir())
    return importlib.import_module(FLASHINFER_VERIFY).kda_recoverssm_verify


def flashinfer_verify() -> PeerLoad:
    """FlashInfer's ``kda_recoverssm_verify`` when it can run here (import first, so a missing
    copy is named even on a machine without a GPU; then SM90+)."""
    try:
        fn = import_flashinfer_verify()
    except Exception as err:  # ImportError, or a module of another version
        where = peers_dir()
        return PeerLoad(None, f"flashinfer not importable ({_first_line(err)}); looked in {where}")
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


def import_vllm_recoverssm() -> ModuleType:
    """vLLM's ``recoverssm`` module, imported (from the peers folder first) but not checked
    against the GPU; raises what the import raised (without triton: ModuleNotFoundError)."""
    _put_on_path(peers_dir())
    return importlib.import_module(VLLM_MODULE)


def vllm_commit() -> PeerLoad:
    """vLLM's all-layer Triton commit, the ``KDARecoverSSMCommitContext`` class (``create``
    over layers with ``kv_cache`` (conv, state) and ``recoverssm_records``, then ``commit``),
    when it can run here."""
    return _vllm_load("KDARecoverSSMCommitContext")


def vllm_verify() -> PeerLoad:
    """vLLM's Triton ``kda_recoverssm_verify`` when it can run here (in 0.33.0 it takes the
    correction and key/gate records as one ``KDARecoverSSMRecords``, rows by request)."""
    return _vllm_load("kda_recoverssm_verify")


def _vllm_load(name: str) -> PeerLoad:
    """``name`` from vLLM's recoverssm (import first, so a missing copy or a missing triton
    is named even on a machine without a GPU; then a CUDA GPU)."""
    where = peers_dir()
    try:
        fn = getattr(import_vllm_recoverssm(), name)
    except Exception as err:  # ImportError (no copy, no triton), or a file of another version
        if not (where / VLLM_FILE).is_file() and isinstance(err, ImportError):
            fetch = "python -m kdagen.peers fetch --only vllm"
            return PeerLoad(None, f"vllm not importable: no copy in {where} ({fetch})")
        return PeerLoad(None, f"vllm not importable ({_first_line(err)}); looked in {where}")
    import torch

    if not torch.cuda.is_available():
        return PeerLoad(None, "vllm's Triton kernels need a CUDA GPU; none is visible")
    vllm = sys.modules.get("vllm")
    version = getattr(vllm, "__version__", "unknown version")
    source = Path(getattr(sys.modules.get(VLLM_MODULE), "__file__", None) or "?")
    return PeerLoad(fn, f"vllm {version} {name} from {source}")


def fetch_flashinfer(dest: Path, wheel: Path | None = None) -> list[Path]:
    """Copy FlashInfer's verify modules out of a flashinfer-python wheel into ``dest`` (the
    peers folder) with an empty package skeleton and FlashInfer's licence; without ``wheel``,
    pip downloads the release the anchors used. Returns the files written."""
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            wheel = _download_wheel(Path(tmp), "flashinfer-python", FLASHINFER_VERSION)
        written = _extract(wheel, dest)
    return written


def fetch_vllm(dest: Path, wheel: Path | None = None) -> list[Path]:
    """Copy vLLM's ``recoverssm.py`` out of a vllm wheel of ``VLLM_VERSION`` into ``dest``
    with a package skeleton, kdagen's shims and vLLM's licence; without ``wheel``, pip
    downloads that release (a few hundred MB, into a temporary folder). Returns the files
    written."""
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            wheel = _download_wheel(Path(tmp), "vllm", VLLM_VERSION)
        written = _extract_vllm(wheel, dest)
    return written


def _download_wheel(folder: Path, project: str, version: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(folder)]
    subprocess.run([*cmd, f"{project}=={version}"], check=True)
    return next(folder.glob(f"{project.replace('-', '_')}-*.whl"))


def _extract(wheel: Path, dest: Path) -> list[Path]:
    with zipfile.ZipFile(wheel) as zf:
        _check_files(zf, wheel, FLASHINFER_FILES)
        version = _wheel_version(zf) or "unknown"
        written = _copy_out(zf, FLASHINFER_FILES, dest, "flashinfer")
    for name in SKELETON:
        init = dest / name
        init.write_text(f'__version__ = "{version}"\n' if name == SKELETON[0] else "")
        written.append(init)
    return written


def _extract_vllm(wheel: Path, dest: Path) -> list[Path]:
    """recoverssm.py, licences, skeleton and shims into ``dest``; refuses a wheel of another
    version than ``VLLM_VERSION`` or whose file imports from vLLM what the shims lack
    (ValueError), and one without the file (FileNotFoundError)."""
    with zipfile.ZipFile(wheel) as zf:
        version = _wheel_version(zf)
        if version != VLLM_VERSION:
            found = f"vllm {version}" if version else "of no version"
            raise ValueError(f"{wheel.name} is {found}; the peer is vllm {VLLM_VERSION}")
        _check_files(zf, wheel, (VLLM_FILE,))
        _check_shimmed(zf.read(VLLM_FILE).decode(), wheel)
        written = _copy_out(zf, (VLLM_FILE,), dest, "vllm")
    for name, text in VLLM_SHIMS.items():
        written.append(_write(dest / name, text))
    for name in _package_inits([VLLM_FILE, *VLLM_SHIMS]):
        top = name == "vllm/__init__.py"
        written.append(_write(dest / name, f'__version__ = "{version}"\n' if top else ""))
    return written


def _check_shimmed(source: str, wheel: Path) -> None:
    """Raise ValueError unless every name ``source`` imports from vLLM is in a shim."""
    provided = {_module_of(path): _defined_names(text) for path, text in VLLM_SHIMS.items()}
    for module, names in _vllm_imports(source).items():
        lacking = names - provided.get(module, set())
        if lacking or module not in provided:
            what = f"{module} ({', '.join(sorted(lacking))})" if lacking else module
            raise ValueError(
                f"{wheel.name}'s recoverssm.py imports {what}, which kdagen's shims do not provide"
            )


def _vllm_imports(source: str) -> dict[str, set[str]]:
    """Module -> names for each ``from vllm... import`` (``import vllm.x``: no names)."""
    imports: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            imports.setdefault(node.module or "", set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    imports.setdefault(alias.name, set())
    return imports


def _defined_names(source: str) -> set[str]:
    """The names a module defines at its top level (defs, classes, assignments, imports)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _package_inits(files: Iterable[str]) -> list[str]:
    """The ``__init__.py`` of every package level above ``files``, top first."""
    inits = {
        f"{parent}/__init__.py"
        for name in files
        for parent in PurePosixPath(name).parents
        if str(parent) != "."
    }
    return sorted(inits, key=lambda n: (n.count("/"), n))


def _check_files(zf: zipfile.ZipFile, wheel: Path, files: Iterable[str]) -> None:
    names = set(zf.namelist())
    missing = [f for f in files if f not in names]
    if missing:
        raise FileNotFoundError(f"{wheel.name} lacks {missing}")


def _copy_out(zf: zipfile.ZipFile, files: Iterable[str], dest: Path, package: str) -> list[Path]:
    """``files`` as they are in the wheel, and its dist-info licences under
    ``<package>/licenses``."""
    written = [_write(dest / name, zf.read(name)) for name in files]
    for name in sorted(n for n in zf.namelist() if ".dist-info/" in n and "LICENSE" in n.upper()):
        written.append(_write(dest / package / "licenses" / Path(name).name, zf.read(name)))
    return written


def _write(target: Path, data: str | bytes) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, bytes):
        target.write_bytes(data)
    else:
        target.write_text(data)
    return target


def _wheel_version(zf: zipfile.ZipFile) -> str | None:
    for name in zf.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in zf.read(name).decode(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


FETCHERS: dict[str, Callable[[Path, Path | None], list[Path]]] = {
    "flashinfer": fetch_flashinfer,
    "vllm": fetch_vllm,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kdagen.peers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="fill the peers folder from flashinfer / vllm wheels")
    fetch.add_argument("--only", choices=sorted(FETCHERS), help="default: every peer")
    fetch.add_argument("--wheel", type=Path, help="a flashinfer-python wheel (default: pip)")
    fetch.add_argument(
        "--vllm-wheel", type=Path, help=f"a vllm {VLLM_VERSION} wheel (default: pip)"
    )
    fetch.add_argument("--dest", type=Path, default=None, help="default: $KDAGEN_PEERS or .peers")
    sub.add_parser("status", help="say whether each peer can be loaded here")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        dest = args.dest or peers_dir()
        wheels = {"flashinfer": args.wheel, "vllm": args.vllm_wheel}
        for peer in [args.only] if args.only else FETCHERS:
            for path in FETCHERS[peer](dest, wheels[peer]):
                print(f"{path.stat().st_size:>8}  {path}")
        return 0
    loads = {
        "flashinfer verify": flashinfer_verify,
        "vllm verify": vllm_verify,
        "vllm commit": vllm_commit,
    }
    for label, load in loads.items():
        print(f"{label}: {load().note}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
