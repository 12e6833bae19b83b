"""The NCCL communicator under weft.ep Buffers: made from a unique id that rank 0 of the torch
process group shares over the group (the group must use NCCL, so that its ranks are GPUs of one
process each), or for one process alone without torch.distributed.

One communicator serves every window a DeepEP-style Buffer lays out over its life (a window is
rebuilt for new shapes or grown for more tokens; the communicator stays). weft destroys every live
communicator and Buffer at interpreter exit (lifetime.py), after the work queued on their devices.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch.distributed as dist

from .. import _weft
from . import _group, lifetime


class Communicator:
    """One rank's NCCL communicator over group (None: one process, one GPU), on the current
    device. Collective: every rank of group makes it, with the same check_equal tuple (checked)."""

    def __init__(self, group: Optional[dist.ProcessGroup], check_equal: Tuple = ()) -> None:
        self.rank, self.num_ranks = _group.group_rank_size(group)
        self.group = group
        self.device = _group.current_device()
        unique_id = _weft.ep.unique_id() if self.rank == 0 else None
        unique_id = _group.share(group, unique_id, check_equal)
        self.native = _weft.ep.Communicator(unique_id, self.num_ranks, self.rank,
                                            self.device.index)
        lifetime.track_communicator(self)

    @property
    def alive(self) -> bool:
        return self.native is not None and self.native.alive

    def destroy(self) -> None:
        """Destroys the communicator now; the Buffers made on it must be destroyed first."""
        if self.native is not None:
            self.native.destroy()
            self.native = None
