"""How the Python benchmarks find their ranks: one process per GPU under torchrun (RANK,
LOCAL_RANK, ... set), or a single process on one GPU without torch.distributed
(process_group_from_env) or with a group of one (world_group)."""

import os
import tempfile

import torch
import torch.distributed as dist


def process_group_from_env():
    """The NCCL world group under torchrun (the GPU set to LOCAL_RANK), else None."""
    if "RANK" not in os.environ:
        return None
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD


def world_group(device: torch.device):
    """The world group for a step that always talks through torch.distributed: under torchrun
    one process per rank (NCCL on CUDA, the GPU set to LOCAL_RANK; gloo on the CPU), else a group
    of one over a file store in a fresh temporary folder."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        if device.type == "cuda":
            return process_group_from_env()
        dist.init_process_group("gloo")
        return dist.group.WORLD
    device_id = None
    if device.type == "cuda":
        device_id = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device_id)
    store = os.path.join(tempfile.mkdtemp(prefix="weft-pg-"), "store")
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=device_id)
    return dist.group.WORLD


def rank0_value(value, group):
    """Rank 0's ``value`` (any picklable object) on every rank of ``group`` (None: one rank, the
    value itself); each rank passes its own. What a planner reads (costs, measured steps) goes
    through it, so that every rank plans the same schedule (all ranks of a collective must run
    one)."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def every_rank(flag: bool, group) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (None: this one), on every rank: so that
    a check that fails on one rank fails on all of them, not only where it was made."""
    if group is None:
        return bool(flag)
    flags = [None] * group.size()
    dist.all_gather_object(flags, bool(flag), group=group)
    return all(flags)
