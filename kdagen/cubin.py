"""Resource usage read from a cubin (ELF) without a GPU or the CUDA tools.

ptxas records per-kernel attributes in ``.nv.info`` sections: register count
(EIATTR_REGCOUNT) and stack frame (EIATTR_FRAME_SIZE, non-zero when registers spill or
an array went to local memory); static shared memory is the size of ``.nv.shared.<kernel>``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11
_EIFMT_SVAL = 0x04  # attribute with a length-prefixed payload


@dataclass(frozen=True)
class KernelResources:
    registers: int
    frame_bytes: int  # local memory per thread (spills, local arrays)
    static_smem_bytes: int


def sections(blob: bytes) -> dict[str, tuple[int, int]]:
    """ELF64 section name -> (file offset, size)."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise ValueError("not an ELF64 cubin")
    (shoff,) = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]

    def name(offset: int) -> str:
        start = names_offset + offset
        return blob[start : blob.index(b"\0", start)].decode()

    return {name(h[0]): (h[4], h[5]) for h in headers}


def _attributes(blob: bytes, offset: int, size: int) -> list[tuple[int, bytes]]:
    out = []
    p = offset
    while p < offset + size:
        fmt, attr = blob[p], blob[p + 1]
        if fmt == _EIFMT_SVAL:
            (length,) = struct.unpack_from("<H", blob, p + 2)
            out.append((attr, blob[p + 4 : p + 4 + length]))
            p += 4 + length
        else:  # EIFMT_NVAL (2 bytes) or EIFMT_HVAL (4 bytes): no payload we need
            p += 4 if fmt == 0x03 else 2
    return out


def kernel_resources(blob: bytes) -> KernelResources:
    """The largest figures over the cubin's kernels (our modules hold one kernel)."""
    found = sections(blob)
    registers = frame = 0
    info = found.get(".nv.info")
    if info:
        for attr, payload in _attributes(blob, *info):
            if len(payload) == 8:
                _, value = struct.unpack("<II", payload)
                if attr == _EIATTR_REGCOUNT:
                    registers = max(registers, value)
                elif attr == _EIATTR_FRAME_SIZE:
                    frame = max(frame, value)
    smem = max(
        (size for name, (_, size) in found.items() if name.startswith(".nv.shared.")),
        default=0,
    )
    return KernelResources(registers=registers, frame_bytes=frame, static_smem_bytes=smem)
