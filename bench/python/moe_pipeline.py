"""The micro-batched MoE training step (weft.moe: dense block + MoE layer, x layers, bf16, SGD)
under each schedule, timed per step.

    python bench/python/moe_pipeline.py --shapes comm --tokens 4096    # one GPU (EP = 1)
    torchrun --nproc-per-node 2 bench/python/moe_pipeline.py
    python bench/python/moe_pipeline.py --device cpu --shapes tiny --tokens 256

Schedules, each with --micro-batches micro-batches per step:
  (a) weft.ep          serial_step, one stream, one weft.ep Buffer per layer
  (b) pipe+weft.ep d   PipelinedStep at depth d (moe_schedule), one Buffer per live layout
  (c) pipe+a2a d       PipelinedStep with the all_to_all dispatcher
  (a) a2a              serial_step with the all_to_all dispatcher
  no comm              serial_step with the local dispatcher (one rank only): the compute floor
Step time: wall time of --iters steps after --warmup (synchronised), ranges over --repeats runs,
ratios against (a) weft.ep of the same run ((a) a2a on the CPU). hidden = (step(a) - step(b)) / (step(a) -
step(no comm)): the share of (a)'s communication time that (b) hides (likewise (c) against
(a) a2a). Run from a folder that has bench-out/ (scripts/gpu-test.sh runs from the build folder),
it writes there an engine trace of one (b) step and the planner's drawing of the schedules with
stage costs measured from (a). On the CPU the weft.ep rows are left out (weft.ep needs a GPU),
and torch runs one intra-op thread.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import weft.moe as moe
from weft import plan

SHAPES = {"dsv3": (7168, 256, 8, 2048), "comm": (2048, 128, 8, 768), "tiny": (64, 16, 4, 32)}
OUT_DIR = "bench-out"


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_step(step, x, target, a, device):
    """(loss of the first step, [ms per step for each repeat])."""
    loss = step(x, target).clone()
    for _ in range(a.warmup):
        step(x, target)
    runs = []
    for _ in range(a.repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(a.iters):
            step(x, target)
        _sync(device)
        runs.append((time.perf_counter() - start) * 1e3 / a.iters)
    return loss, runs


def stage_costs_us(model, slots, x, target, num_micro_batches, device):
    """Per stage, the mean time of one micro-batch's stage in a serial step (synchronised around
    each stage; on a GPU mostly its GPU time): the planner's cost model."""
    from weft.moe.step import STAGES, _Stages, micro_batches

    stages = _Stages(model, slots)
    sums = dict.fromkeys(STAGES + ("loss_backward",), 0.0)
    mbs = micro_batches(x, target, num_micro_batches, len(model.moe))
    for mb in mbs:
        for layer in range(len(model.moe)):
            for stage in STAGES:
                _sync(device)
                t = time.perf_counter()
                getattr(stages, stage)(mb, layer)
                _sync(device)
                sums[stage] += (time.perf_counter() - t) * 1e6
        _sync(device)
        t = time.perf_counter()
        stages.loss_backward(mb)
        _sync(device)
        sums["loss_backward"] += (time.perf_counter() - t) * 1e6
    for p in model.parameters():
        p.grad = None
    n = len(mbs)
    return {k: v / (n if k == "loss_backward" else n * len(model.moe)) for k, v in sums.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="comm,dsv3")
    p.add_argument("--tokens", default="4096,8192", help="tokens per rank and step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--depth", default="1,max", help="depths of (b) and (c); max = 2 x layers")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args()
    device = a.device
    if device == "cpu":  # each engine thread that calls torch gets its own OpenMP team else
        torch.set_num_threads(1)
    group = None
    if device == "cuda":
        from launch import process_group_from_env
        group = process_group_from_env()
    world = group.size() if group else 1
    rank = group.rank() if group else 0
    out = print if rank == 0 else (lambda *_, **__: None)
    depths = sorted({2 * a.layers if d == "max" else int(d) for d in a.depth.split(",")})
    M = a.micro_batches
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    out(f"# {name} x {world}, torch {torch.__version__}, {a.layers} layers, {M} micro-batches, "
        f"{a.iters} steps per run, {a.repeats} runs", flush=True)
    base_name = "(a) weft.ep" if device == "cuda" else "(a) a2a"
    out(f"{'shape':6s} {'T':>6s} {'schedule':18s} {'step ms':>17s} {'vs ' + base_name:>15s}",
        flush=True)
    traced = False
    for shape in a.shapes.split(","):
        hidden, experts, top_k, ffn = SHAPES[shape]
        for T in map(int, a.tokens.split(",")):
            g = torch.Generator(device=device).manual_seed(rank)
            x = torch.randn((T, hidden), generator=g, device=device).bfloat16()
            target = torch.randn((T, hidden), generator=g, device=device).bfloat16()
            a2a = moe.AllToAllDispatcher(group, experts)
            shared_a2a = moe.LayoutSlots.shared(a2a, a.layers)
            backend = "torch" if device == "cuda" else "host"

            def ep_slots(num_slots):
                return moe.LayoutSlots.ep(group, experts, num_slots, max_tokens=-(-T // M))

            configs = []  # (name, slots factory, depth or None for serial)
            if device == "cuda":
                configs.append(("(a) weft.ep", lambda: ep_slots([1] * a.layers), None))
                configs += [(f"(b) pipe+weft.ep d{d}",
                             lambda d=d: ep_slots(moe.num_layout_slots(a.layers, d)), d)
                            for d in depths]
            configs.append(("(a) a2a", lambda: shared_a2a, None))
            configs += [(f"(c) pipe+a2a d{d}", lambda: shared_a2a, d) for d in depths]
            if world == 1:
                configs.append(("no comm", lambda: moe.LayoutSlots.shared(
                    moe.LocalDispatcher(experts), a.layers), None))
            times, losses = {}, {}
            for cname, make_slots, depth in configs:
                slots = make_slots()
                model = moe.MoEModel(a.layers, hidden, experts, top_k, ffn, a2a, device=device)
                if depth is None:
                    def step(x, t):
                        return moe.serial_step(model, x, t, 0.0, M, slots)
                else:
                    piped = moe.PipelinedStep(model, slots, M, depth=depth, backend=backend)

                    def step(x, t):
                        return piped(x, t, 0.0)
                losses[cname], times[cname] = time_step(step, x, target, a, device)
                base = times[configs[0][0]]
                runs = times[cname]
                ratio = f"{min(runs) / max(base):.2f}-{max(runs) / min(base):.2f}x"
                out(f"{shape:6s} {T:6d} {cname:18s} {min(runs):8.2f}-{max(runs):<8.2f} "
                    f"{ratio:>15s}", flush=True)
                if depth is not None and not traced and os.path.isdir(OUT_DIR) and rank == 0:
                    _trace_and_plan(model, slots, x, target, a, depth, backend, device,
                                    f"{shape}_T{T}")
                    traced = True
                if depth is not None:
                    piped.close()
                del model, slots
                if device == "cuda":
                    torch.cuda.empty_cache()
            first = next(iter(losses.values()))
            same = all(torch.equal(first, v) for v in losses.values())
            out(f"{shape:6s} {T:6d} losses identical across schedules: {same}", flush=True)
            _print_hidden(out, shape, T, times)
    if group:
        dist.destroy_process_group()


def _print_hidden(out, shape, T, times):
    """hidden = (serial - pipelined) / (serial - no comm), from the medians of the runs."""
    if "no comm" not in times:
        return
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    for serial, prefix in (("(a) weft.ep", "(b)"), ("(a) a2a", "(c)")):
        if serial not in med:
            continue
        comm_ms = med[serial] - med["no comm"]
        for k, v in med.items():
            if not k.startswith(prefix):
                continue
            share = f"{(med[serial] - v) / comm_ms:.2f}" if comm_ms > 0 else "n/a (no comm time)"
            out(f"{shape:6s} {T:6d} hidden {k}: {share} = ({med[serial]:.2f} - {v:.2f}) / "
                f"({med[serial]:.2f} - {med['no comm']:.2f}) ms (medians)", flush=True)


def _trace_and_plan(model, slots, x, target, a, depth, backend, device, tag):
    """One traced (b) step (Chrome JSON), and the planner's page of depths 0 .. 2 x layers with
    stage costs measured from a serial step, into bench-out/."""
    L = len(model.moe)
    traced = moe.PipelinedStep(model, slots, a.micro_batches, depth=depth, backend=backend,
                               trace=True)
    traced(x, target, 0.0)
    _sync(device)
    trace_path = os.path.join(OUT_DIR, f"moe_pipeline_{tag}_d{depth}.trace.json")
    traced.engine.take_trace().write_chrome_json(trace_path)
    traced.close()
    costs_us = stage_costs_us(model, slots, x, target, a.micro_batches, device)
    costs = moe.moe_costs(L, costs_us)
    variants = [(f"moe_depth{d}", moe.moe_schedule(L, d), moe.moe_thread_map(L))
                for d in range(2 * L + 1)]
    page = os.path.join(OUT_DIR, f"moe_pipeline_{tag}_plan.html")
    drawn = plan.write_report(page, variants, costs=costs)
    print(f"# wrote {trace_path} and {page}; stage us per micro-batch: "
          + ", ".join(f"{k} {v:.0f}" for k, v in costs_us.items()), flush=True)
    print("# planner's step per micro-batch (us): "
          + ", ".join(f"{v.name} {v.timeline.step_us:.0f}" for v in drawn), flush=True)


if __name__ == "__main__":
    main()
