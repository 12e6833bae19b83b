"""An MoE training step on weft.pipeline: 4 micro-batches per step, the dispatches and combines
as collective tasks on a comm stream, running ahead of the experts (depth = 2 x layers: every
forward communication beside another micro-batch's compute), checked bit for bit against the
same step run serially. On a GPU with weft.ep (one Buffer per live layout); on the CPU with the
local dispatcher and the host backend.

    python3 examples/python/moe_pipeline.py
"""

import copy

import torch

import weft.moe as moe

cuda = torch.cuda.is_available()
device, layers, experts, micro_batches, tokens = ("cuda" if cuda else "cpu"), 2, 16, 4, 512
depth = 2 * layers


def slots(num_slots):
    if cuda:  # weft.ep keeps one layout per Buffer: a Buffer per layer and micro-batch in flight
        return moe.LayoutSlots.native_ep(None, experts, num_slots,
                                         max_tokens=tokens // micro_batches)
    return moe.LayoutSlots.shared(moe.LocalDispatcher(experts), layers)


serial = moe.MoEModel(layers, 128, experts, 4, 64, moe.LocalDispatcher(experts), device=device)
piped = copy.deepcopy(serial)
step = moe.PipelinedStep(piped, slots(moe.num_layout_slots(layers, depth)), micro_batches,
                         depth=depth, backend="torch" if cuda else "host")
serial_slots = slots([1] * layers)
g = torch.Generator(device=device).manual_seed(0)
target_map = torch.randn((128, 128), generator=g, device=device) / 128 ** 0.5
for i in range(20):
    x = torch.randn((tokens, 128), generator=g, device=device).bfloat16()
    target = (x.float() @ target_map).bfloat16()
    a = moe.serial_step(serial, x, target, 0.5, micro_batches, serial_slots)
    b = step(x, target, lr=0.5)
    assert torch.equal(a, b), "the pipelined step must give the serial step's bits"
    if i % 5 == 0 or i == 19:
        print(f"step {i:2d} loss {b.item():.5f}")
assert all(torch.equal(p, q) for p, q in zip(serial.parameters(), piped.parameters()))
print(f"{device}: 20 steps, pipelined == serial bit for bit")
