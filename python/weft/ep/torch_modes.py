"""The hot calls of weft.ep outside torch's __torch_function__ modes.

A torch function mode (`torch.set_default_device`, which DeepEP's own tests set, installs one)
runs Python for every torch call and tensor method, about 1 us each on a fast host; a dispatch
makes some forty of them (checks, allocations, pointers, strides). Every tensor weft.ep makes
names its device and dtype, and its operations are opaque to the caller's modes (communication
whose results no mode could compute), so a call runs with the modes off: what the mode would
have done is what the call does anyway."""

from __future__ import annotations

import functools

import torch

_mode_enabled = torch._C._is_torch_function_mode_enabled
_DisableTorchFunction = torch._C.DisableTorchFunction


def outside_torch_function_modes(fn):
    """fn, run with torch's __torch_function__ handling off while a mode is on (one check when
    none is)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not _mode_enabled():
            return fn(*args, **kwargs)
        with _DisableTorchFunction():
            return fn(*args, **kwargs)
    return call
