"""weft.ep's hot calls run outside the caller's torch function modes (weft/ep/torch_modes.py):
the mode sees none of the call's internal torch operations, and is on again after it."""

import torch
from torch.overrides import TorchFunctionMode

from weft.ep.torch_modes import outside_torch_function_modes


class CountingMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


@outside_torch_function_modes
def internal_ops(x):
    y = torch.empty(3, 4, dtype=torch.float32, device="cpu")
    y.copy_(x)
    return y.sum(), x.data_ptr(), x.stride(), x.is_contiguous()


def test_a_mode_sees_none_of_the_internal_operations_and_is_on_again_after():
    x = torch.ones(3, 4)
    with CountingMode() as mode:
        total, *_ = internal_ops(x)
        assert mode.calls == 0
        assert torch._C._is_torch_function_mode_enabled()
        torch.empty(1)
        assert mode.calls == 1
    assert total.item() == 12.0


def test_without_a_mode_the_call_is_the_function_itself():
    x = torch.full((3, 4), 2.0)
    assert internal_ops(x)[0].item() == 24.0
    assert internal_ops.__name__ == "internal_ops"


def test_an_exception_inside_leaves_the_mode_on():
    @outside_torch_function_modes
    def fails():
        raise ValueError("inside")

    with CountingMode() as mode:
        try:
            fails()
        except ValueError:
            pass
        torch.zeros(1)
        assert mode.calls == 1


def test_the_default_device_still_applies_outside_the_call():
    torch.set_default_device("meta")
    try:
        assert internal_ops(torch.ones(3, 4, device="cpu"))[0].device.type == "cpu"
        assert torch.empty(1).device.type == "meta"
    finally:
        torch.set_default_device(None)
