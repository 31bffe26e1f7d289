"""Hopper (sm_90a) verify helpers: the shared-memory addresses of the probe tile (the wgmma B
operand: 128-byte rows, 16-byte chunks XOR row % 8 within 8-row groups, K-blocks of 64
channels ``cols`` rows apart) and of the w tiles of the coupling MMAs (64-byte rows of 32
channels, 16-byte chunks XOR row pair), written a row at a time and read by ldmatrix.

Stores take a per-thread base address (``tile_at``, ``w_at``: this thread's channel in row
0) and XOR a per-row constant into it, which ptxas folds into the store's immediate."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from kdagen.dsl.common import shared_address, store_bf16_split


@cute.jit
def store_probe(tile_at: Int32, n, value: Float32):
    """Probe ``n`` of this thread's channel as bf16 hi (row 2n) and lo (row 2n + 1)."""
    row = 2 * n  # hi, then lo in the next row
    store_bf16_split(
        value, (tile_at ^ (row % 8 * 16)) + row * 128,
        (tile_at ^ ((row + 1) % 8 * 16)) + (row + 1) * 128,
    )  # fmt: skip


@cute.jit
def store_w(w_at: Int32, t, value: Float32):
    """w_t of this thread's channel: hi in row t, lo in row 8 + t of its warp's w tile."""
    store_bf16_split(
        value,
        (w_at ^ (t // 2 % 4 * 16)) + t * 64,
        (w_at ^ ((8 + t) // 2 % 4 * 16)) + (8 + t) * 64,
    )


@cute.jit
def w_address(base: Int32, row: Int32, chunk: Int32) -> Int32:
    """Row ``row``, 16-byte chunk ``chunk`` of the w tile at ``base`` (ldmatrix)."""
    return base + row * 64 + ((chunk ^ (row // 2 % 4)) * 16)


@cute.jit
def probe_address(
    tile: cute.Tensor, quarter, row8: Int32, quad: Int32, cols: cutlass.Constexpr[int]
) -> Int32:
    """This lane's ldmatrix row of channel quarter ``quarter`` (32 channels: chunks
    4 (quarter % 2) + quad of K-block quarter // 2) in the probe tile ``tile``."""
    return (
        shared_address(tile.iterator) + (quarter // 2) * (cols * 128)
        + row8 * 128 + (((4 * (quarter % 2) + quad) ^ row8) * 16)
    )  # fmt: skip
