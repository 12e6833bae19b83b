"""How the Python benchmarks find their ranks: one process per GPU under torchrun (RANK,
LOCAL_RANK, ... set), or a single process on one GPU without torch.distributed."""

import os

import torch
import torch.distributed as dist


def process_group_from_env():
    """The NCCL world group under torchrun (the GPU set to LOCAL_RANK), else None."""
    if "RANK" not in os.environ:
        return None
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    return dist.group.WORLD
