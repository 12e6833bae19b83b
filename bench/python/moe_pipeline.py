"""The micro-batched MoE training step (weft.moe: dense block + MoE layer, x layers, bf16, SGD)
under each schedule, timed per step. Forward and backward are cut into stages at every
communication (weft.moe.step); the pipelined schedules run them as weft.pipeline tasks.

    python bench/python/moe_pipeline.py --shapes comm --tokens 4096    # one GPU, local weft.ep
    python bench/python/moe_pipeline.py --comm emulated --shapes comm,dsv3 --tokens 4096,8192
    torchrun --nproc-per-node 2 bench/python/moe_pipeline.py
    python bench/python/moe_pipeline.py --device cpu --shapes tiny --tokens 256

--comm local (default): the dispatchers' own data path; at one rank "communication" is weft.ep's
local copy (or the all_to_all dispatcher's permutation), so the figures measure the schedule and
the engine's cost. --comm emulated (one GPU): every dispatcher call is followed, on its stream,
by weft's hold_sms kernel holding --num-sms SMs for the time the call takes on --target (tables
in weft.moe.emulated, from 2x H200 measurements); every row is then labelled "emu", an EMULATED
figure, not a two-GPU measurement.

Schedules, each with --micro-batches micro-batches per step:
  (a) weft.ep          serial_step, one stream, one weft.ep Buffer per layer
  (b) pipe+weft.ep d   PipelinedStep at depth d (moe_schedule), one Buffer per live layout
  (c) pipe+a2a d       PipelinedStep with the all_to_all dispatcher
  (a) a2a              serial_step with the all_to_all dispatcher
  no comm              serial_step with the local dispatcher (one rank only): the compute floor
Depth d: max = 4 x layers (every communication, forward and backward, beside another
micro-batch's compute); 2 x layers hides the forward communication only.
Step time: wall time of --iters steps after --warmup (synchronised), ranges over --repeats runs,
ratios against (a) weft.ep of the same run ((a) a2a on the CPU). hidden = (step(a) - step(b)) /
(step(a) - step(no comm)): the share of (a)'s communication time that (b) hides (likewise (c)
against (a) a2a); the goals printed with it: local, step(b) <= 1.02 x step(a); emulated,
hidden >= 0.8. Run from a folder that has bench-out/ (scripts/gpu-test.sh runs from the build
folder), it writes there an engine trace of one (b) step and the planner's drawing of the
schedules with stage costs measured from (a), and prints the planner's predicted step beside
the measured one. On the CPU the weft.ep rows are left out (weft.ep needs a GPU), and torch runs
one intra-op thread.
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist

import weft.moe as moe
from weft import plan
from weft.moe.step import COMM_STAGES

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
    from weft.moe.step import _Stages, chain, micro_batches

    stages = _Stages(model, slots)
    sums = dict.fromkeys(moe.STAGES, 0.0)
    counts = dict.fromkeys(moe.STAGES, 0)
    for mb in micro_batches(x, target, num_micro_batches, len(model.moe)):
        for _, stage, layer in chain(len(model.moe)):
            _sync(device)
            t = time.perf_counter()
            stages.run(mb, stage, layer)
            _sync(device)
            sums[stage] += (time.perf_counter() - t) * 1e6
            counts[stage] += 1
    for p in model.parameters():
        p.grad = None
    return {k: v / counts[k] for k, v in sums.items()}


def _dispatcher_factories(a, group, experts, T, M):
    """(ep_slots(num_slots), a2a_slots(), name prefix): the weft.ep and all_to_all layout slots
    of this run, emulated or not."""
    num_layers = a.layers
    a2a = moe.AllToAllDispatcher(group, experts)
    if a.comm == "local":
        shared_a2a = moe.LayoutSlots.shared(a2a, num_layers)

        def ep_slots(num_slots):
            return moe.LayoutSlots.ep(group, experts, num_slots, max_tokens=-(-T // M))
        return ep_slots, lambda: shared_a2a, ""
    import weft.ep

    tables = moe.emulated.TARGETS[a.target]
    num_sms = a.num_sms if a.num_sms is not None else weft.ep.Buffer.num_sms
    a2a_sms = a.a2a_num_sms if a.a2a_num_sms is not None else num_sms

    def ep_slots(num_slots):
        def make(layer, s):
            inner = moe.EpDispatcher(weft.ep.Buffer(group, 0, max_tokens=-(-T // M)), experts)
            return moe.EmulatedDispatcher(inner, tables["weft.ep"], num_sms)
        return moe.LayoutSlots(make, num_slots)

    emulated_a2a = moe.LayoutSlots.shared(
        moe.EmulatedDispatcher(a2a, tables["a2a"], a2a_sms), num_layers)
    return ep_slots, lambda: emulated_a2a, "emu "


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="comm,dsv3")
    p.add_argument("--tokens", default="4096,8192", help="tokens per rank and step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--depth", default="1,max", help="depths of (b) and (c); max = 4 x layers")
    p.add_argument("--comm", default="local", choices=("local", "emulated"),
                   help="emulated: one GPU, each call followed by a hold of the target's time")
    p.add_argument("--target", default="2xh200", choices=sorted(moe.emulated.TARGETS),
                   help="the machine whose communication --comm emulated stands in for")
    p.add_argument("--num-sms", type=int, default=None,
                   help="SMs an emulated weft.ep call holds (default weft.ep.Buffer.num_sms)")
    p.add_argument("--a2a-num-sms", type=int, default=None,
                   help="SMs an emulated all_to_all call holds (default --num-sms)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = p.parse_args()
    device = a.device
    if a.comm == "emulated" and device != "cuda":
        p.error("--comm emulated needs --device cuda")
    if device == "cpu":  # each engine thread that calls torch gets its own OpenMP team else
        torch.set_num_threads(1)
    group = None
    if device == "cuda":
        from launch import process_group_from_env
        group = process_group_from_env()
    world = group.size() if group else 1
    rank = group.rank() if group else 0
    if a.comm == "emulated" and world != 1:
        p.error("--comm emulated runs at one rank (it stands in for the other GPUs)")
    out = print if rank == 0 else (lambda *_, **__: None)
    max_depth = moe.max_depth(a.layers)
    depths = sorted({max_depth if d == "max" else int(d) for d in a.depth.split(",")})
    M = a.micro_batches
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    out(f"# {name} x {world}, torch {torch.__version__}, {a.layers} layers, {M} micro-batches, "
        f"{a.iters} steps per run, {a.repeats} runs", flush=True)
    if a.comm == "emulated":
        out(f"# EMULATED communication: {a.target} call times (weft.moe.emulated) as SM holds "
            f"on one GPU; rows marked emu are emulated figures", flush=True)
    backend = "torch" if device == "cuda" else "host"
    traced = False
    for shape in a.shapes.split(","):
        hidden, experts, top_k, ffn = SHAPES[shape]
        for T in map(int, a.tokens.split(",")):
            g = torch.Generator(device=device).manual_seed(rank)
            x = torch.randn((T, hidden), generator=g, device=device).bfloat16()
            target = torch.randn((T, hidden), generator=g, device=device).bfloat16()
            ep_slots, a2a_slots, emu = _dispatcher_factories(a, group, experts, T, M)
            configs = []  # (name, slots factory, depth or None for serial)
            if device == "cuda":
                configs.append((f"(a) {emu}weft.ep", lambda: ep_slots([1] * a.layers), None))
                configs += [(f"(b) {emu}pipe+weft.ep d{d}",
                             lambda d=d: ep_slots(moe.num_layout_slots(a.layers, d)), d)
                            for d in depths]
            configs.append((f"(a) {emu}a2a", a2a_slots, None))
            configs += [(f"(c) {emu}pipe+a2a d{d}", a2a_slots, d) for d in depths]
            if world == 1:
                configs.append(("no comm", lambda: moe.LayoutSlots.shared(
                    moe.LocalDispatcher(experts), a.layers), None))
            base_name = configs[0][0]
            out(f"{'shape':6s} {'T':>6s} {'schedule':24s} {'step ms':>17s} "
                f"{'vs ' + base_name:>20s}", flush=True)
            times, losses = {}, {}
            for cname, make_slots, depth in configs:
                slots = make_slots()
                # The model's dispatcher sets its share of the experts (the step uses slots).
                model = moe.MoEModel(a.layers, hidden, experts, top_k, ffn,
                                     moe.AllToAllDispatcher(group, experts), device=device)
                if depth is None:
                    def step(x, t):
                        return moe.serial_step(model, x, t, 0.0, M, slots)
                else:
                    piped = moe.PipelinedStep(model, slots, M, depth=depth, backend=backend)

                    def step(x, t):
                        return piped(x, t, 0.0)
                losses[cname], times[cname] = time_step(step, x, target, a, device)
                base = times[base_name]
                runs = times[cname]
                ratio = f"{min(runs) / max(base):.2f}-{max(runs) / min(base):.2f}x"
                out(f"{shape:6s} {T:6d} {cname:24s} {min(runs):8.2f}-{max(runs):<8.2f} "
                    f"{ratio:>20s}", flush=True)
                if depth is not None and not traced and os.path.isdir(OUT_DIR) and rank == 0:
                    _trace_and_plan(model, slots, x, target, a, depth, backend, device,
                                    f"{shape}_T{T}{'_emu' if emu else ''}", times[cname])
                    traced = True
                if depth is not None:
                    piped.close()
                if cname == "no comm" and emu:
                    compute_us = {k: v for k, v in stage_costs_us(model, slots, x, target, M,
                                                                  device).items()
                                  if k not in COMM_STAGES}
                # The step closure and the pipelined step hold the model too: drop every
                # reference before the next config builds its own (a DeepSeek-V3-sized model
                # and its gradients take most of a GPU).
                del model, slots, step
                piped = None
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            first = next(iter(losses.values()))
            same = all(torch.equal(first, v) for v in losses.values())
            out(f"{shape:6s} {T:6d} losses identical across schedules: {same}", flush=True)
            _print_hidden(out, shape, T, times, emu)
            if emu and "no comm" in times:
                _print_prediction(out, a, shape, T, hidden, compute_us, depths, times)
    if group:
        dist.destroy_process_group()


def _median(v):
    return sorted(v)[len(v) // 2]


def _print_hidden(out, shape, T, times, emu):
    """hidden = (serial - pipelined) / (serial - no comm), from the medians of the runs, and the
    issue's goals: local comm, pipelined <= 1.02 x serial; emulated, hidden >= 0.8, i.e.
    step(b) <= step(no comm) + 0.2 x (step(a) - step(no comm))."""
    med = {k: _median(v) for k, v in times.items()}
    for serial, prefix in ((f"(a) {emu}weft.ep", "(b)"), (f"(a) {emu}a2a", "(c)")):
        if serial not in med:
            continue
        for k, v in med.items():
            if not k.startswith(prefix):
                continue
            line = f"{shape:6s} {T:6d} {k}: {v / med[serial]:.3f} x {serial}"
            if "no comm" in med:
                comm_ms = med[serial] - med["no comm"]
                share = f"{(med[serial] - v) / comm_ms:.2f}" if comm_ms > 0 else "n/a"
                line += (f", hidden {share} = ({med[serial]:.2f} - {v:.2f}) / ({med[serial]:.2f}"
                         f" - {med['no comm']:.2f}) ms")
                if emu and comm_ms > 0:
                    goal = v <= med["no comm"] + 0.2 * comm_ms
                    line += f"; goal hidden >= 0.80: {'met' if goal else 'NOT met'}"
            if not emu:
                line += f"; goal <= 1.02x: {'met' if v <= 1.02 * med[serial] else 'NOT met'}"
            out(line + " (medians)", flush=True)


def _print_prediction(out, a, shape, T, hidden, compute_us, depths, times):
    """The planner's step on the target from the compute stages measured without communication
    and the target's call table, beside the emulated measurement (medians)."""
    tokens = -(-T // a.micro_batches)
    for kind, prefix in (("weft.ep", "(b)"), ("a2a", "(c)")):
        comm_us = moe.emulated.comm_stage_us(moe.emulated.TARGETS[a.target][kind], tokens,
                                             hidden)
        predicted = moe.emulated.predict_step_us(a.layers, [0] + depths, compute_us, comm_us)
        serial = f"(a) emu {kind}"
        parts = [f"serial {predicted[0] * a.micro_batches / 1e3:.2f} vs "
                 f"{_median(times[serial]):.2f}"]
        for d in depths:
            name = f"{prefix} emu pipe+{kind} d{d}"
            parts.append(f"d{d} {predicted[d] * a.micro_batches / 1e3:.2f} vs "
                         f"{_median(times[name]):.2f}")
        out(f"{shape:6s} {T:6d} planner on {a.target} {kind} (ms per step, {a.micro_batches} x "
            f"a steady-state micro-batch) vs emulated: " + ", ".join(parts), flush=True)


def _trace_and_plan(model, slots, x, target, a, depth, backend, device, tag, measured_ms):
    """One traced (b) step (Chrome JSON), and the planner's page of depths 0 .. 4 x layers with
    stage costs measured from a serial step, into bench-out/; the planner's step beside the
    measured one."""
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
                for d in range(moe.max_depth(L) + 1)]
    page = os.path.join(OUT_DIR, f"moe_pipeline_{tag}_plan.html")
    drawn = plan.write_report(page, variants, costs=costs)
    print(f"# wrote {trace_path} and {page}; stage us per micro-batch: "
          + ", ".join(f"{k} {v:.0f}" for k, v in costs_us.items()), flush=True)
    print("# planner's step per micro-batch (us): "
          + ", ".join(f"{v.name} {v.timeline.step_us:.0f}" for v in drawn), flush=True)
    predicted_ms = drawn[depth].timeline.step_us * a.micro_batches / 1e3
    print(f"# depth {depth}: planner {predicted_ms:.2f} ms per step ({a.micro_batches} x its "
          f"steady-state micro-batch, no fill or drain), measured {_median(measured_ms):.2f} ms "
          f"(median)", flush=True)


if __name__ == "__main__":
    main()
