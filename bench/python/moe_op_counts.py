"""The torch (aten) ops a micro-batched MoE step issues, per stage and per step: what the host
launches (on a GPU each op that is not a view is one or a few kernels). Counted with a
TorchDispatchMode around each stage of weft.moe.serial_step's chain (PipelinedStep runs the
same stage functions; the engine's own stream and event calls are not aten ops), then around a
whole serial step (the stages, the loss sum and the SGD step).

    python bench/python/moe_op_counts.py                       # CPU, comm experts at hidden 64
    python bench/python/moe_op_counts.py --shape comm --tokens 4096 --device cuda

Columns: ops, every aten call; compute, those that are not views or aliases (transpose, view,
slice, split, detach, ...: no kernel); expert-weight, the compute ops that return a tensor of
an expert weight's shape (w13 or w2: the expert weight gradients' GEMMs and any accumulation
of them; on a GPU each a memory-bound pass over a whole weight's gradient; the SGD step's
multi-tensor update returns nothing and is not among them). Per stage per micro-batch and layer
(loss: per micro-batch), then per step. Op counts do not depend on the sizes but for the
experts' fallback (no torch._grouped_mm: one matmul per expert); they are host counts, not GPU
timings.
"""

import argparse
import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import weft.moe as moe
from weft.moe.step import _Stages, chain, micro_batches

# hidden, experts, top-k, expert FFN. comm_small: the comm shape's experts, top-k and FFN at a
# hidden size a CPU runs in seconds.
SHAPES = {"comm_small": (64, 128, 8, 768), "comm": (2048, 128, 8, 768),
          "dsv3": (7168, 256, 8, 2048), "tiny": (64, 16, 4, 32)}
NO_KERNEL = {"detach", "_unsafe_view", "lift_fresh"}


def makes_no_kernel(func) -> bool:
    """Views and aliases of their input (not in-place ops, which return their written input):
    metadata only."""
    name = func.overloadpacket.__name__
    return name in NO_KERNEL or func.is_view or any(
        r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class OpCount(TorchDispatchMode):
    """Counts the aten ops run under it: ops (all), compute (those makes_no_kernel leaves),
    weight_shaped (compute ops returning a tensor of one of weight_shapes)."""

    def __init__(self, weight_shapes) -> None:
        super().__init__()
        self.weight_shapes = set(weight_shapes)
        self.ops, self.compute, self.weight_shaped = 0, 0, 0
        self.by_name = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if not makes_no_kernel(func):
            self.compute += 1
            self.by_name[func.overloadpacket.__name__] += 1
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.weight_shaped += any(isinstance(t, torch.Tensor) and tuple(t.shape) in
                                      self.weight_shapes for t in outs)
        return out


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
    for param in model.parameters():
        param.grad = None
    weight_shapes = [tuple(w.shape) for m in model.moe for w in (m.w13, m.w2)]
    per_stage = collections.defaultdict(lambda: [0, 0, 0, collections.Counter(), 0])
    for mb in micro_batches(x, target, M, a.layers):
        for _, stage, layer in chain(a.layers):
            with OpCount(weight_shapes) as c:
                stages.run(mb, stage, layer)
            row = per_stage[stage]
            row[0] += c.ops
            row[1] += c.compute
            row[2] += c.weight_shaped
            row[3] += c.by_name
            row[4] += 1
    with OpCount(weight_shapes) as step:
        moe.serial_step(model, x, target, 0.0, M, slots)
    print(f"# shape {a.shape} (hidden {hidden}, {num_experts} experts, top-{top_k}, FFN {ffn}), "
          f"T={a.tokens}, {a.layers} layers, {M} micro-batches, {a.device}; aten ops "
          f"(host-side counts, not GPU timings)")
    print(f"{'stage':18s} {'ops':>8s} {'compute':>8s} {'expert-weight':>13s}   (per micro-batch "
          f"and layer)")
    totals = [0, 0, 0]
    for stage, (ops, compute, weight_shaped, names, n) in per_stage.items():
        totals = [t + v for t, v in zip(totals, (ops, compute, weight_shaped))]
        print(f"{stage:18s} {ops / n:8.2f} {compute / n:8.2f} {weight_shaped / n:13.2f}")
        if a.detail:
            print("    " + ", ".join(f"{k} {v / n:g}" for k, v in names.most_common()))
    print(f"{'stages, a step':18s} {totals[0]:8d} {totals[1]:8d} {totals[2]:13d}")
    print(f"{'serial step':18s} {step.ops:8d} {step.compute:8d} {step.weight_shaped:13d}   "
          f"(stages + loss sum + SGD)")


if __name__ == "__main__":
    main()
