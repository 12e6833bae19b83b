import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # ep_reference


def num_gpus() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    return pytest.mark.skipif(num_gpus() < n, reason=f"needs {n} GPU(s), found {num_gpus()}")


def drain(engine, data):
    """Every result of a weft.pipeline Engine over data, until StopIteration."""
    it = iter(data)
    out = []
    while True:
        try:
            out.append(engine.progress(it))
        except StopIteration:
            return out
