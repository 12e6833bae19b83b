"""The communicator under a weft.ep Buffer: one NCCL communicator per Buffer, made from a unique
id that rank 0 of the torch process group broadcasts (the group must use NCCL, so that the ranks
are GPUs of one process each)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from .. import Error


def group_rank_size(group: Optional[dist.ProcessGroup]) -> Tuple[int, int]:
    """(rank, size) of group; (0, 1) for None, a single process without torch.distributed."""
    if group is None:
        return 0, 1
    if not isinstance(group, dist.ProcessGroup):
        raise Error(f"weft.ep: group must be a torch.distributed.ProcessGroup or None, got "
                    f"{type(group).__name__}")
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        raise Error(f"weft.ep needs an NCCL process group (its ranks are the GPUs the Buffer "
                    f"connects over NVLink), got backend '{backend}'")
    return group.rank(), group.size()


def share(group: Optional[dist.ProcessGroup], value, check_equal: Tuple) -> object:
    """Every rank gets rank 0's value; every rank checks that all ranks passed the same
    check_equal tuple (the Buffer's config), and raises naming the first that differs."""
    if group is None:
        return value
    rank, size = group.rank(), group.size()
    gathered = [None] * size
    dist.all_gather_object(gathered, (value if rank == 0 else None, check_equal), group=group)
    for r, (_, theirs) in enumerate(gathered):
        if theirs != check_equal:
            raise Error(f"weft.ep Buffer: rank {r} was given {theirs}, rank {rank} {check_equal} "
                        f"(every rank must build the Buffer with the same sizes)")
    return gathered[0][0]


def current_device() -> torch.device:
    if not torch.cuda.is_available():
        raise Error("weft.ep needs a CUDA GPU; torch.cuda.is_available() is False")
    return torch.device("cuda", torch.cuda.current_device())
