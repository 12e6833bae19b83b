"""The one copy-out path of weft.ep: rows of a Buffer's window into tensors the caller owns, in
one kernel (weft::cuda::copy_rows) per batch of up to 8 pitched copies, on a given stream. Both
the DeepEP layer's owned results and DispatchResult.copy() go through it."""

from __future__ import annotations

from typing import Sequence, Tuple, Union

import torch

from .. import _weft

Copy = Tuple[int, int, int, int, int, int]


def rows_copy(dst: torch.Tensor, src: Union[torch.Tensor, int], src_pitch: int,
              rows: int) -> Copy:
    """rows rows of dst's (contiguous) row width from src (a tensor or a device address), whose
    rows are src_pitch bytes apart."""
    width = dst.stride(0) * dst.element_size() if dst.dim() > 1 else dst.element_size()
    src_ptr = src if isinstance(src, int) else src.data_ptr()
    return (dst.data_ptr(), width, src_ptr, src_pitch, width, rows)


def copy_rows(copies: Sequence[Copy], stream: torch.cuda.Stream, device: torch.device) -> None:
    """Enqueues the copies on stream (a stream of device)."""
    _weft.ep.copy_rows(list(copies), stream.cuda_stream, device.index)


def empty_rows(x, rows: int):
    """Empty tensors of x's (or the fp8 pair's) row width and dtype, with rows rows."""
    if isinstance(x, tuple):
        return tuple(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in x)
    return torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)


def flat(x):
    """A tensor or the fp8 pair as a tuple of tensors (None: empty)."""
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)
