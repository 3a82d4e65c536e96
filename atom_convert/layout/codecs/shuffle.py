"""The aiter kernel weight shuffle ("shuffle16", spec §3.0.3) and its inverse.

A pure permutation of the last two dims of [..., N, K]: the matrix is cut into
16-row x 32-byte tiles stored tile-row-major; inside a tile the layout is
[k-chunk][row][Ke contiguous elements], Ke = 16 bytes / element size.
ATOM applies it per rank, after slicing and after fnuz normalisation (spec §5).
"""

from __future__ import annotations

import torch

from .. import buffers
from ...files.dtypes import SHUFFLE_K_BYTES, SHUFFLE_K_ELEMS, SHUFFLE_ROWS


def _geometry(x: torch.Tensor) -> tuple[int, int, int, int]:
    if x.dim() < 2:
        raise ValueError(f"shuffle16 needs a tensor of at least 2 dims, got shape {list(x.shape)}")
    n, k = x.shape[-2], x.shape[-1]
    ke = SHUFFLE_K_BYTES // x.element_size()
    # aiter views K as [K/32, 32/Ke, Ke]: 32 *elements* per tile column group, whatever the width.
    kcols = SHUFFLE_K_ELEMS
    if n % SHUFFLE_ROWS or k % kcols:
        raise ValueError(
            f"shuffle16 needs rows % {SHUFFLE_ROWS} == 0 and columns % {kcols} == 0, got shape {list(x.shape)}"
        )
    return n, k, ke, kcols


def shuffle_requirements_met(shape: tuple[int, ...] | list[int]) -> bool:
    return len(shape) >= 2 and shape[-2] % SHUFFLE_ROWS == 0 and shape[-1] % SHUFFLE_K_ELEMS == 0


def _units(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x's bytes as 16-byte units [B, N, K*eb/16]: one unit is exactly one Ke-element chunk of the
    shuffle (Ke = 16 / element size), so the permutation moves 16-byte units, not elements.

    A strided x whose rows are contiguous (a column slice of a source matrix, as a row-parallel
    rank reads it) is viewed in place: the shuffle's own copy then gathers the columns, instead
    of a `.contiguous()` copy before it (a [7168, 256] slice of a [7168, 2048] expert:
    3.3 ms -> 0.75 ms per expert, /tmp microbenchmark on the 2-core box).
    """
    n, k = x.shape[-2], x.shape[-1]
    row = k * x.element_size()
    b = x.reshape(-1, n, k) if x.dim() != 3 else x
    try:
        u = b.view(torch.uint8).view(torch.int64).view(torch.complex128)
    except RuntimeError:  # rows not contiguous or not 16-byte aligned: copy first
        u = b.contiguous().view(torch.uint8).view(torch.int64).view(torch.complex128)
    return u.reshape(-1, n, row // 16), row // 16


def shuffle16(x: torch.Tensor) -> torch.Tensor:
    """aiter `shuffle_weight(x, layout=(16, 16))`, returned contiguous, same dtype and shape.

    aiter's view [B, N/16, 16, K/32, 32/Ke, Ke] -> permute (0, 1, 3, 4, 2, 5) is, in 16-byte
    units, [B, N/16, 16, U] -> [B, N/16, U, 16] with U = K/Ke: inside each 16-row band the units
    are transposed. Done as one strided copy into a fresh tensor (an order of magnitude faster
    than `.contiguous()` on the 6-D byte view).
    """
    n, k, ke, kc = _geometry(x)
    u, nu = _units(x)
    out = buffers.empty((u.shape[0], n // 16, nu, 16), torch.complex128, device=x.device)
    out.copy_(u.view(-1, n // 16, 16, nu).transpose(2, 3))
    return out.view(torch.int64).view(torch.uint8).view(x.dtype).reshape(x.shape)


def shuffle16_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """shuffle16(x) written into `out` (contiguous, x's shape and element size), e.g. one part's
    rows of a fused tensor: the shuffle permutes within 16-row bands, so shuffling the parts of
    [gate; up] into their places equals shuffling the concatenation, without the concatenation's
    copy (w13 of a V3 expert: 60 -> 38 ms, /tmp microbenchmark on the 2-core box)."""
    n, k, ke, kc = _geometry(x)
    if tuple(out.shape) != tuple(x.shape) or out.element_size() != x.element_size() or not out.is_contiguous():
        raise ValueError(f"shuffle16_into: out {list(out.shape)} ({out.dtype}) does not fit x {list(x.shape)} ({x.dtype})")
    u, nu = _units(x)
    o = out.view(torch.uint8).view(torch.int64).view(torch.complex128).reshape(u.shape[0], n // 16, nu, 16)
    o.copy_(u.view(-1, n // 16, 16, nu).transpose(2, 3))


def unshuffle16(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `shuffle16` (used by the reference forward and by checks)."""
    n, k, ke, kc = _geometry(x)
    u, nu = _units(x)
    out = torch.empty((u.shape[0], n // 16, 16, nu), dtype=torch.complex128, device=x.device)
    out.copy_(u.view(-1, n // 16, nu, 16).transpose(2, 3))
    return out.view(torch.int64).view(torch.uint8).view(x.dtype).reshape(x.shape)
