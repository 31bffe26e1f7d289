"""The warp-sampling summary (`scripts/stall_map.py`) on a small Nsight Compute source-page
export of the shape ncu 2025.3 writes: phases split at the barriers or at given indexes, each
phase's share of the samples, the instructions ranked (CPU only)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

TOOL = Path(__file__).resolve().parents[1] / "scripts" / "stall_map.py"
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)"]  # fmt: skip
# (SASS, samples, barrier stalls, long-scoreboard stalls), 16 bytes apart from 0x1000.
CODE = [
    ("LDG.E R2, desc[UR4][R4.64]", 5, 0, 0),
    ("IADD3 R3, R2, 0x1, RZ", 60, 0, 58),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 2, 0, 0),
    ("BRA 0x2000", 25, 24, 0),
    ("FADD R5, R3, R3", 8, 0, 0),
]


@pytest.fixture(scope="module")
def tool() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("stall_map", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through the module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.fixture
def export(tmp_path: Path) -> Path:
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as file:
        writer = csv.writer(file, quoting=csv.QUOTE_ALL)
        writer.writerow(["Kernel Name", "kernel_KdaWgmmaVerify_0"])
        writer.writerow(HEADER)
        for i, (sass, samples, barrier, long_sb) in enumerate(CODE):
            address = hex(0x1000 + 16 * i)
            writer.writerow([address, f"      {sass}", samples, 128, barrier, long_sb, barrier])
    return path


def test_reads_the_kernel_s_instructions(tool: ModuleType, export: Path) -> None:
    code = tool.read_source_page(str(export))
    assert [i.index for i in code] == [0, 1, 2, 3, 4]
    assert code[1].text.startswith("IADD3") and code[1].samples == 60
    assert code[3].stalls == {"barrier": 24, "long_sb": 0}  # not-issued columns left out


def test_phases_split_at_barriers_or_given_indexes(
    tool: ModuleType, export: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tool.main(str(export), [], top=1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("5 instructions, 100 warp samples")
    assert "[    0,     2)   65.0 %  long_sb 58" in lines[1]
    assert "[    2,     5)   35.0 %  barrier 24" in lines[2]
    assert "IADD3" in lines[4] and "60.0 %" in lines[4]
    tool.main(str(export), [3], top=0)
    lines = capsys.readouterr().out.splitlines()
    assert "[    0,     3)   67.0 %" in lines[1] and "[    3,     5)   33.0 %" in lines[2]


def test_refuses_what_is_not_a_source_page(tool: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "error.csv"
    path.write_text("==ERROR== Could not open report file '/tmp/b64.ncu-rep'.\n")
    with pytest.raises(SystemExit, match="not an ncu source page .*Could not open report"):
        tool.read_source_page(str(path))
