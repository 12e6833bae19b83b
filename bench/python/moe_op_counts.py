"""The torch (aten) ops a micro-batched MoE step issues, per stage and per step: what the host
launches (on a GPU each op that is not a view is one or a few kernels). Counted with a
TorchDispatchMode around each stage of weft.moe.serial_step's chain (PipelinedStep runs the
same stage functions; the engine's own stream and event calls are not aten ops), then around a
whole serial step (the stages, the loss sum and the SGD step).

    python bench/python/moe_op_counts.py                       # CPU, comm experts at hidden 64
    python bench/python/moe_op_counts.py --shape comm --tokens 4096 --device cuda

Columns: ops, every aten call; compute, those that are not views or aliases (transpose, view,
slice, split, detach, ...: no kernel); both per stage per micro-batch and layer (loss: per
micro-batch), then per step. Op counts do not depend on the sizes but for the experts' fallback
(no torch._grouped_mm: one matmul per expert); they are host counts, not GPU timings.
"""

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import weft.moe as moe
from weft.moe.step import _Stages, chain, micro_batches

# hidden, experts, top-k, expert FFN. comm_small: the comm shape's experts and top-k at a hidden
# size a CPU runs in seconds.
SHAPES = {"comm_small": (64, 128, 8, 32), "comm": (2048, 128, 8, 768),
          "dsv3": (7168, 256, 8, 2048), "tiny": (64, 16, 4, 32)}
NO_KERNEL = {"detach", "_unsafe_view", "lift_fresh"}


def makes_no_kernel(func) -> bool:
    """Views and aliases of their input (not in-place ops, which return their written input):
    metadata only."""
    name = func.overloadpacket.__name__
    return name in NO_KERNEL or func.is_view or any(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class OpCount(TorchDispatchMode):
    """Counts the aten ops run under it: ops (all), compute (those makes_no_kernel leaves)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.compute = 0, 0
        self.by_name = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if not makes_no_kernel(func):
            self.compute += 1
            self.by_name[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="comm_small", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--detail", action="store_true", help="the compute ops by name per stage")
    a = p.parse_args()
    hidden, num_experts, top_k, ffn = SHAPES[a.shape]
    torch.manual_seed(0)
    model = moe.MoEModel(a.layers, hidden, num_experts, top_k, ffn,
                         moe.LocalDispatcher(num_experts), device=a.device)
    slots = moe.LayoutSlots.shared(moe.LocalDispatcher(num_experts), a.layers)
    x = torch.randn((a.tokens, hidden), device=a.device).bfloat16()
    target = torch.randn((a.tokens, hidden), device=a.device).bfloat16()
    M = a.micro_batches
    moe.serial_step(model, x, target, 0.0, M, slots)  # warm-up: lazy initialisation
    stages = _Stages(model, slots)
    stages.begin_step()
    for p_ in model.parameters():
        p_.grad = None
    per_stage = collections.defaultdict(lambda: [0, 0, collections.Counter(), 0])
    for mb in micro_batches(x, target, M, a.layers):
        for _, stage, layer in chain(a.layers):
            with OpCount() as c:
                stages.run(mb, stage, layer)
            row = per_stage[stage]
            row[0] += c.ops
            row[1] += c.compute
            row[2] += c.by_name
            row[3] += 1
    with OpCount() as step:
        moe.serial_step(model, x, target, 0.0, M, slots)
    print(f"# shape {a.shape} (hidden {hidden}, {num_experts} experts, top-{top_k}, FFN {ffn}), "
          f"T={a.tokens}, {a.layers} layers, {M} micro-batches, {a.device}; aten ops "
          f"(CPU-side counts, not GPU timings)")
    print(f"{'stage':18s} {'ops':>8s} {'compute':>8s}   (per micro-batch and layer)")
    total_ops = total_compute = 0
    for stage, (ops, compute, names, n) in per_stage.items():
        total_ops, total_compute = total_ops + ops, total_compute + compute
        print(f"{stage:18s} {ops / n:8.1f} {compute / n:8.1f}")
        if a.detail:
            print("    " + ", ".join(f"{k} {v / n:g}" for k, v in names.most_common()))
    print(f"{'stages, a step':18s} {total_ops:8d} {total_compute:8d}")
    print(f"{'serial step':18s} {step.ops:8d} {step.compute:8d}   (stages + loss sum + SGD)")


if __name__ == "__main__":
    main()
