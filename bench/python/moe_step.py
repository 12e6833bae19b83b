"""An MoE training step (weft.moe.MoEModel: dense block + MoE layer, x layers, bf16, SGD) under
each dispatcher, timed per step.

    python bench/python/moe_step.py                      # one GPU (EP = 1)
    torchrun --nproc-per-node 2 bench/python/moe_step.py

Shapes: dsv3 (hidden 7168, 256 experts, top-8, expert FFN 2048) and comm (hidden 2048, 128
experts, top-8, FFN 768), at --tokens per rank. Dispatchers: weft.ep (EpDispatcher), the NCCL
all_to_all one users have today (AllToAllDispatcher), and, at one rank, the local one (no
communication at all: the step's compute floor). Step time: CUDA events around --iters steps
after --warmup, ranges over --repeats runs. All dispatchers give the same loss (checked).
"""

import argparse

import torch
import torch.distributed as dist

import weft.ep
import weft.moe as moe
from launch import process_group_from_env

SHAPES = {"dsv3": (7168, 256, 8, 2048), "comm": (2048, 128, 8, 768)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="comm,dsv3")
    p.add_argument("--tokens", default="4096,8192")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    group = process_group_from_env()
    world = group.size() if group else 1
    rank = group.rank() if group else 0
    print_ = print if rank == 0 else (lambda *_: None)
    print_(f"# {torch.cuda.get_device_name()} x {world}, torch {torch.__version__}, "
           f"{a.layers} layers, {a.iters} steps per run, {a.repeats} runs")
    print_(f"{'shape':6s} {'T':>6s} {'dispatcher':12s} {'step ms':>16s} {'vs weft.ep':>12s}")
    for shape in a.shapes.split(","):
        hidden, experts, top_k, ffn = SHAPES[shape]
        for T in map(int, a.tokens.split(",")):
            buffer = weft.ep.Buffer(group, weft.ep.sizing.window_bytes_for(T, hidden, world, top_k,
                                                                           experts))
            dispatchers = {"weft.ep": moe.EpDispatcher(buffer, experts),
                           "all_to_all": moe.AllToAllDispatcher(group, experts)}
            if world == 1:
                dispatchers["none (local)"] = moe.LocalDispatcher(experts)
            g = torch.Generator(device="cuda").manual_seed(rank)
            x = torch.randn((T, hidden), generator=g, device="cuda").bfloat16()
            target = torch.randn((T, hidden), generator=g, device="cuda").bfloat16()
            times, losses = {}, {}
            for name, d in dispatchers.items():
                model = moe.MoEModel(a.layers, hidden, experts, top_k, ffn, d, device="cuda")
                losses[name] = moe.train_step(model, x, target, lr=0.0)
                for _ in range(a.warmup):
                    moe.train_step(model, x, target, lr=0.0)
                runs = []
                for _ in range(a.repeats):
                    start = torch.cuda.Event(enable_timing=True)
                    stop = torch.cuda.Event(enable_timing=True)
                    torch.cuda.synchronize()
                    start.record()
                    for _ in range(a.iters):
                        moe.train_step(model, x, target, lr=0.0)
                    stop.record()
                    stop.synchronize()
                    runs.append(start.elapsed_time(stop) / a.iters)
                times[name] = runs
                del model
                torch.cuda.empty_cache()
            same = all(torch.equal(losses["weft.ep"], v) for v in losses.values())
            base = times["weft.ep"]
            for name, runs in times.items():
                ratio = f"{min(runs) / max(base):.2f}-{max(runs) / min(base):.2f}x"
                print_(f"{shape:6s} {T:6d} {name:12s} {min(runs):7.2f}-{max(runs):<8.2f} {ratio:>12s}")
            print_(f"{shape:6s} {T:6d} losses identical across dispatchers: {same}")
            buffer.destroy() if buffer.explicitly_destroy else None
            del buffer
    if group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
