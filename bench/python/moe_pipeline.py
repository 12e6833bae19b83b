"""The micro-batched MoE training step (weft.moe: dense block + MoE layer, x layers, bf16, SGD)
under each schedule, timed per step. Forward and backward are cut into stages at every
communication (weft.moe.step); the pipelined schedules run them as weft.pipeline tasks.

    python bench/python/moe_pipeline.py --shapes comm --tokens 4096    # one GPU, local weft.ep
    python bench/python/moe_pipeline.py --comm emulated --shapes comm,dsv3 --tokens 4096,8192
    torchrun --nproc-per-node 2 bench/python/moe_pipeline.py
    python bench/python/moe_pipeline.py --device cpu --shapes tiny --tokens 256
    torchrun --nproc-per-node 2 bench/python/moe_pipeline.py --device cpu --shapes tiny   # gloo

--comm local (default): the dispatchers' own data path; at one rank "communication" is weft.ep's
local copy (or the all_to_all dispatcher's permutation), so the figures measure the schedule and
the engine's cost. --comm emulated (one GPU): every dispatcher call is followed, on its stream,
by weft's hold_sms kernel holding --num-sms SMs for the time the call takes on --target (tables
in weft.moe.emulated: 2xh200 from 2x H200 measurements, 8xh200-model a model scaled from them by
the rows each GPU sends); every row is then labelled "emu", an EMULATED figure, not a multi-GPU
measurement. The planner's prediction for every target is printed from each family's serial
emulated step (its stages' GPU and host times, the run's holds swapped for the target's).

Schedules, each with --micro-batches micro-batches per step:
  (a) weft.ep          serial_step, one stream, one weft.ep Buffer per layer (--ep native:
                       NativeEpDispatcher, whose dispatch stage launches and whose experts stage
                       reads the count; --ep deepep: EpDispatcher, DeepEP's Buffer, whose
                       dispatch stage waits for the count)
  (b) pipe+weft.ep d   PipelinedStep at depth d (moe_schedule), one Buffer per live layout
  (c) pipe+a2a d       PipelinedStep with the all_to_all dispatcher, each dispatch a progress
                       after its router (its family, moe.stage_lookaheads); --a2a-with-router
                       also runs it in (b)'s family ("(c) pipe+a2a with-router d")
  (a) a2a              serial_step with the all_to_all dispatcher
  no comm              serial_step with the local dispatcher (one rank only)
  (a) weft.ep local    --comm emulated: (a) without the emulated holds (at one rank weft.ep's
                       communication is a local copy)
  (b)/(c) ... cvN      --gemm-sm-carveout N: the depth rows again with torch's SM carveout of N
                       SMs around the pipelined step (torch._C._set_sm_carveout_experimental:
                       cuBLAS and torch._grouped_mm then run on N fewer SMs), so that a GEMM
                       does not fill the SMs a communication kernel (an emulated hold) waits for
The compute floor is the faster of "no comm" and "(a) weft.ep local": the step whose
communication is a local copy (the local dispatcher's torch ops may cost more than weft.ep's).
Depth d: max = the family's deepest, 4 x layers for (b) (every communication, forward and
backward, beside another micro-batch's compute; 2 x layers hides the forward communication
only), 5 x layers for (c). (b) and (c) run on the engine threads PipelinedStep picks
(moe.default_num_threads: one over weft.ep's native dispatcher, which never waits on the host
in a comm task, and over the all_to_all one where every dispatch runs a progress after its
router; two, compute and comm, which share the GIL, over a dispatcher that waits elsewhere:
the all_to_all one beside its router, weft.ep's DeepEP API); --threads 1 or 2
sets them for both, and --switch-interval-ms sets how soon a thread waiting for the GIL gets it
(sys.setswitchinterval; Python's default is 5 ms): the two ways to tell the GIL's share of a
pipelined step's time.
Step time: wall time of --iters steps after --warmup (synchronised), ranges over --repeats runs
(one schedule's runs after another's; --interleave: every schedule of a shape and T built first,
then run r of each after run r - 1 of all, so that a drift of the machine's speed over the
minutes of a run falls on every schedule alike; every model then lives at once, which the comm
shape fits and the DeepSeek-V3 shape does not),
ratios against (a) weft.ep of the same run ((a) a2a on the CPU). Every schedule's first step,
its loss and every gradient, is compared bit for bit with the first schedule's (kept on the
host); the exit status is 1 if any differ. hidden = (step(a) - step(b)) /
(step(a) - floor): the share of (a)'s communication time that (b) hides (likewise (c)
against (a) a2a); the goals printed with it: local, step(b) <= 1.02 x step(a); emulated,
hidden >= 0.8. Run from a folder that has bench-out/ (scripts/gpu-test.sh runs from the build
folder), it writes there an engine trace of one (b) step and the planner's drawing of the
schedules with stage costs measured from (a), and prints the planner's predicted step beside
the measured one (at several ranks rank 0's folder decides; every rank runs those steps, rank 0
writes). On the CPU the weft.ep rows are left out (weft.ep needs a GPU), and torch runs
one intra-op thread.

--suggest (weft.moe.planning, docs/planner.md "From a trace to a schedule (MoE)"; at several ranks
every rank plans with rank 0's costs and measured steps, so all run the same schedule): per
shape and token count, for the pipelined family of the run ((b) weft.ep on a GPU, (c) a2a on the
CPU), first one traced run at depth 0 (--warmup steps, then --iters steps each traced): its
costs, per task (each layer's tasks apart) the median host span and, per stream, the median GPU
busy time (weft.plan.trace_costs; --gpu-costs span: the spans). Then weft.plan.suggest's search
over moe_schedule, kept to the layouts the family's steps hold (weft.ep: those of the deepest
--depth; a2a: any), with at most --max-threads threads; the suggestion's config goes to
--config-out (default moe_SHAPE_TTOKENS_suggested.json in --trace-dir, else here) and runs,
timed, as "suggested". --calibrate: a wake-up cost and the GIL model (on a GPU also a slowdown
of the compute stream's work) fitted to traced runs of depth 0 and every --depth
(weft.step_planning.fit_calibration), shown as fit ms and used by the search. The
table: per row of the family, the step's range, x its serial (a), planner ms (the variant's
step with those costs: one source of --micro-batches batches, fill and drain), err % against
the median of the timed runs, and bits: the first step's loss and every gradient bit for bit
against (a)'s (the exit status is 1 if any differ); its last line the rms of the errors over
the engine rows.
"""

import argparse
import gc
import os
import statistics
import sys
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

import weft.moe as moe
from launch import every_rank, rank0_value, world_group
from weft import plan
from weft.moe.planning import (count_waits, depth_variants, layout_waits, merged_trace,
                               suggest_variant)
from weft.moe.step import COMM_STAGES
from weft.step_planning import error_pct, fit_calibration, predicted_ms, rms_error_pct

SHAPES = {"dsv3": (7168, 256, 8, 2048), "comm": (2048, 128, 8, 768), "tiny": (64, 16, 4, 32)}
OUT_DIR = "bench-out"


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def _bits(t):
    """t's bytes, flat (bit-for-bit comparison: NaN equals itself, -0 differs from 0)."""
    return t.detach().reshape(-1).view(torch.uint8)


def host_bits(loss, model):
    """The first step's loss and gradients, copied to the host: the reference every schedule's
    first step is compared with. They are kept there, not on the GPU: a DeepSeek-V3-sized layer's
    gradients take 22.5 GB, and a copy beside the next schedule's model and gradients would not
    fit an 80 GB GPU. (copy=True: on the CPU, `to` would return the gradients themselves.)"""
    return (_bits(loss).to("cpu", copy=True),
            [_bits(p.grad).to("cpu", copy=True) for p in model.parameters()])


def same_bits(loss, model, reference, chunk_bytes=1 << 28):
    """Whether loss and the model's gradients equal reference (host_bits) bit for bit, each
    tensor brought to the host a chunk at a time (no second copy of the gradients anywhere)."""
    ref_loss, ref_grads = reference
    if not torch.equal(_bits(loss).cpu(), ref_loss):
        return False
    params = list(model.parameters())
    if len(params) != len(ref_grads):
        return False
    for p, ref in zip(params, ref_grads):
        mine = _bits(p.grad)
        if mine.numel() != ref.numel():
            return False
        for begin in range(0, ref.numel(), chunk_bytes):
            end = min(begin + chunk_bytes, ref.numel())
            if not torch.equal(mine[begin:end].cpu(), ref[begin:end]):
                return False
    return True


def first_steps(step, model, x, target, a, reference):
    """(whether the first step's loss and gradients equal reference bit for bit, reference), then
    --warmup more steps. reference: host_bits of an earlier config's first step, or None: then
    this first step's bits become the reference (and the result is True)."""
    loss = step(x, target)
    if reference is None:
        same, reference = True, host_bits(loss, model)
    else:
        same = same_bits(loss, model, reference)
    del loss
    for _ in range(a.warmup):
        step(x, target)
    return same, reference


def timed_runs(step, x, target, a, device, num_runs):
    """[ms per step of each run of --iters steps], num_runs runs."""
    runs = []
    for _ in range(num_runs):
        _sync(device)
        start = time.perf_counter()
        for _ in range(a.iters):
            step(x, target)
        _sync(device)
        runs.append((time.perf_counter() - start) * 1e3 / a.iters)
    return runs


class StageCosts(NamedTuple):
    """stage_costs_us' figures, per micro-batch and stage (the mean over a serial step's)."""

    gpu_us: dict  # its time on the step's stream (on the CPU the host's time)
    host_us: Optional[dict]  # the wall time of its call on the host (a GPU only; else None)
    update_us: float  # the optimizer's update after the last micro-batch


def stage_costs_us(model, slots, x, target, num_micro_batches, device,
                   synced=()) -> StageCosts:
    """The planner's cost model from serial steps. On a GPU a stage's GPU time is its busy time:
    after a sync the step's stream is held (a hold_sms kernel on one SM) for longer than the host
    takes to queue the stage (twice its host time, plus 200 us), and the time between two CUDA
    events recorded after the hold and after the stage is the stage's work run back to back, not
    the GPU's wait for launches that an event span in a host-bound step would include. Its host
    time is the wall time of its call in a running serial step (no sync between stages, whose
    latency would count in every stage); for the stages in synced, which wait on the host for
    GPU work (_synced_stages) and whose wait in a step lasts as long as the GPU is behind, the wall
    time in a serial step with a sync before each stage, where the wait lasts only as long as
    the stage's own work takes. The update: the span of the optimizer's update in the running
    step. On the CPU the GPU time is the host's time and host_us is None."""
    from weft.moe.step import _Stages, _sgd, _zero_grads, chain, micro_batches

    if device == "cuda":
        def mark():
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        def elapsed_us(begin, end):
            return begin.elapsed_time(end) * 1e3
    else:
        mark = time.perf_counter

        def elapsed_us(begin, end):
            return (end - begin) * 1e6
    L = len(model.moe)
    stages = _Stages(model, slots)

    def serial_pass(before_stage):
        """(stage, host us, GPU begin, GPU end) per stage of a serial step, before_stage(stage)
        called before each stage's marks; then the update's span."""
        _zero_grads(model)  # as a step starts: the last step's gradients freed
        stages.begin_step()
        out = []
        for mb in micro_batches(x, target, num_micro_batches, L):
            for _, stage, layer in chain(L):
                before_stage(stage)
                begin, host_begin = mark(), time.perf_counter()
                stages.run(mb, stage, layer)
                out.append((stage, (time.perf_counter() - host_begin) * 1e6, begin, mark()))
        begin = mark()
        _sgd(model, 0.0)  # as the timed steps (lr 0): the same pass over weights and gradients
        end = mark()
        _sync(device)
        return out, elapsed_us(begin, end)

    _sync(device)
    running, update_us = serial_pass(lambda stage: None)
    gpu_us = _stage_means((stage, elapsed_us(b, e)) for stage, _, b, e in running)
    host_us = None
    if device == "cuda":
        host_us = _stage_means((stage, us) for stage, us, _, _ in running)

        def held(stage):
            _sync(device)
            moe.emulated.hold_on_current_stream(1, 2 * host_us[stage] + 200.0, x.device)
        busy, _ = serial_pass(held)
        gpu_us = _stage_means((stage, elapsed_us(b, e)) for stage, _, b, e in busy)
        if synced:
            waited, _ = serial_pass(lambda stage: _sync(device))
            host_us.update((stage, us) for stage, us in
                           _stage_means((st, us) for st, us, _, _ in waited).items()
                           if stage in synced)
    _zero_grads(model)
    return StageCosts(gpu_us, host_us, update_us)


def _stage_means(pairs) -> dict:
    """(stage, us) pairs -> stage -> the mean of its figures."""
    sums = dict.fromkeys(moe.STAGES, 0.0)
    counts = dict.fromkeys(moe.STAGES, 0)
    for stage, us in pairs:
        sums[stage] += us
        counts[stage] += 1
    return {k: v / counts[k] for k, v in sums.items()}


def _host_waits(a, name):
    """The host waits for GPU work of the family a row's name belongs to, as moe_costs and
    trace_costs take them: weft.ep's native dispatcher finishes its dispatch (the count wait)
    in the experts stage; on a GPU the all_to_all dispatcher's dispatch waits for the sizes its
    layout counted in the router stage (on the CPU its layout's work is the router's host time)."""
    if "a2a" in name:
        return layout_waits(a.layers) if a.device == "cuda" else None
    return count_waits(a.layers) if a.ep == "native" else None


def _synced_stages(a, name):
    """The stages of a row's family that wait on the host for GPU work (stage_costs_us' synced):
    those of its host waits, and with --ep deepep weft.ep's dispatch, which waits for its own
    count inside the call (no wait the planner models)."""
    stages = {task.rsplit("_", 1)[0] for task in _host_waits(a, name) or {}}
    if "weft.ep" in name and a.ep == "deepep":
        stages.add("dispatch")
    return stages


def _dispatcher_factories(a, group, layout_group, experts, T, M):
    """(ep_slots(num_slots), a2a_slots(), name prefix, local_ep_slots(num_slots) or None): the
    weft.ep and all_to_all layout slots of this run, emulated or not; emulated, also weft.ep's
    without the emulation."""
    num_layers = a.layers
    a2a = moe.AllToAllDispatcher(group, experts, layout_group=layout_group)
    max_tokens = -(-T // M)

    def ep_dispatcher():
        if a.ep == "native":
            return moe.NativeEpDispatcher(group, experts, max_tokens)
        import weft.ep
        return moe.EpDispatcher(weft.ep.Buffer(group, 0, max_tokens=max_tokens), experts)

    def local_ep_slots(num_slots):
        return moe.LayoutSlots(lambda layer, s: ep_dispatcher(), num_slots)
    if a.comm == "local":
        shared_a2a = moe.LayoutSlots.shared(a2a, num_layers)
        return local_ep_slots, lambda: shared_a2a, "", None
    import weft.ep

    tables = moe.emulated.TARGETS[a.target]
    num_sms = a.num_sms if a.num_sms is not None else weft.ep.Buffer.num_sms
    a2a_sms = a.a2a_num_sms if a.a2a_num_sms is not None else num_sms

    def ep_slots(num_slots):
        def make(layer, s):
            return moe.EmulatedDispatcher(ep_dispatcher(), tables["weft.ep"], num_sms)
        return moe.LayoutSlots(make, num_slots)

    emulated_a2a = moe.LayoutSlots.shared(
        moe.EmulatedDispatcher(a2a, tables["a2a"], a2a_sms), num_layers)
    return ep_slots, lambda: emulated_a2a, "emu ", local_ep_slots


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="comm,dsv3")
    p.add_argument("--tokens", default="4096,8192", help="tokens per rank and step")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--depth", default="1,max",
                   help="depths of (b) and (c); max: the family's deepest, 4 x layers for (b), "
                        "5 x layers for (c) (its dispatch a progress after its router)")
    p.add_argument("--a2a-with-router", action="store_true",
                   help="also (c) with each dispatch in its router's progress (the family of "
                        "(b), on the threads PipelinedStep picks for it)")
    p.add_argument("--comm", default="local", choices=("local", "emulated"),
                   help="emulated: one GPU, each call followed by a hold of the target's time")
    p.add_argument("--ep", default="native", choices=("native", "deepep"),
                   help="weft.ep's API under the (a) and (b) rows: NativeEpDispatcher (the count "
                        "read in the experts stage) or EpDispatcher (DeepEP's Buffer)")
    p.add_argument("--target", default="2xh200", choices=sorted(moe.emulated.TARGETS),
                   help="the machine whose communication --comm emulated stands in for")
    p.add_argument("--num-sms", type=int, default=None,
                   help="SMs an emulated weft.ep call holds (default weft.ep.Buffer.num_sms)")
    p.add_argument("--a2a-num-sms", type=int, default=None,
                   help="SMs an emulated all_to_all call holds (default --num-sms)")
    p.add_argument("--gemm-sm-carveout", type=int, default=None, metavar="N",
                   help="also time every (b) and (c) depth with torch's GEMMs leaving N SMs "
                        "free during the pipelined step (rows marked cvN)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interleave", action="store_true",
                   help="build every schedule of a shape and T first, then time run r of each "
                        "after run r - 1 of all (every model lives at once)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--threads", type=int, default=None, choices=(1, 2),
                   help="engine threads of (b) and (c): 2, compute and comm (moe_thread_map); "
                        "1, every task on one thread (default: PipelinedStep's choice, "
                        "moe.default_num_threads)")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="sys.setswitchinterval: how soon a thread that waits for the GIL gets it")
    p.add_argument("--suggest", action="store_true",
                   help="plan the pipelined family from one traced run and run the suggestion")
    p.add_argument("--calibrate", action="store_true",
                   help="--suggest: fit a wake-up cost and the GIL model to traced runs")
    p.add_argument("--gpu-costs", choices=plan.GPU_COST_KINDS, default="busy",
                   help="--suggest: a task's GPU cost, its busy time or its whole span")
    p.add_argument("--max-threads", type=int, default=2, help="--suggest: the thread bound")
    p.add_argument("--min-gain-pct", type=float, default=1.0,
                   help="--suggest: keep the step's own schedule (the best depth under its thread "
                        "map) unless the search predicts more than this gain")
    p.add_argument("--config-out", help="--suggest: where the suggestion's config goes")
    p.add_argument("--trace-dir", help="--suggest: write the traced runs' Chrome traces here")
    a = p.parse_args()
    if a.switch_interval_ms is not None:
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    if a.calibrate and not a.suggest:
        p.error("--calibrate goes with --suggest")
    if not a.min_gain_pct >= 0:
        p.error(f"--min-gain-pct must be >= 0, got {a.min_gain_pct}")
    device = a.device
    if a.comm == "emulated" and device != "cuda":
        p.error("--comm emulated needs --device cuda")
    if a.gemm_sm_carveout is not None:
        if device != "cuda" or not hasattr(torch._C, "_set_sm_carveout_experimental"):
            p.error("--gemm-sm-carveout needs --device cuda and a torch with "
                    "torch._C._set_sm_carveout_experimental")
        num_device_sms = torch.cuda.get_device_properties(0).multi_processor_count
        if not 1 <= a.gemm_sm_carveout < num_device_sms:
            p.error(f"--gemm-sm-carveout must be in [1, {num_device_sms}), got "
                    f"{a.gemm_sm_carveout}")
    if device == "cpu":  # each engine thread that calls torch gets its own OpenMP team else
        torch.set_num_threads(1)
    group = None
    if "RANK" in os.environ:  # torchrun: NCCL on GPUs, gloo on the CPU
        group = world_group(torch.device(device))
    world = group.size() if group else 1
    rank = group.rank() if group else 0
    # The all_to_all dispatcher's sizes on a group of their own (AllToAllDispatcher).
    layout_group = dist.new_group(list(range(world))) if group else None
    if a.comm == "emulated" and world != 1:
        p.error("--comm emulated runs at one rank (it stands in for the other GPUs)")
    out = print if rank == 0 else (lambda *_, **__: None)
    # Rank 0's folder decides whether the ranks trace and draw a step (a collective).
    draw = rank0_value(os.path.isdir(OUT_DIR), group)

    def family_depths(dispatch_after_router):
        deepest = moe.max_depth(a.layers, dispatch_after_router)
        return sorted({deepest if d == "max" else int(d) for d in a.depth.split(",")})
    depths = family_depths(False)
    # (c)'s families: (row label, dispatch_after_router, depths); PipelinedStep's default first.
    a2a_families = [("", True, family_depths(True))]
    if a.a2a_with_router:
        a2a_families.append(("with-router ", False, depths))
    M = a.micro_batches
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    out(f"# {name} x {world}, torch {torch.__version__}, {a.layers} layers, {M} micro-batches, "
        f"{a.iters} steps per run, {a.repeats} runs, weft.ep API {a.ep}, "
        f"engine threads {a.threads or 'as PipelinedStep picks'}", flush=True)
    if a.comm == "emulated":
        modelled = " (a MODEL of the target, no measurement)" if "model" in a.target else ""
        out(f"# EMULATED communication: {a.target} call times{modelled} (weft.moe.emulated) as SM "
            f"holds on one GPU; rows marked emu are emulated figures", flush=True)
    backend = "torch" if device == "cuda" else "host"
    # The depth rows' map (None: PipelinedStep's); a suggestion runs on its config's.
    thread_map = _given_thread_map(a)
    traced = False
    mismatches = 0
    for shape in a.shapes.split(","):
        hidden, experts, top_k, ffn = SHAPES[shape]
        for T in map(int, a.tokens.split(",")):
            g = torch.Generator(device=device).manual_seed(rank)
            x = torch.randn((T, hidden), generator=g, device=device).bfloat16()
            target = torch.randn((T, hidden), generator=g, device=device).bfloat16()
            ep_slots, a2a_slots, emu, local_ep_slots = _dispatcher_factories(
                a, group, layout_group, experts, T, M)
            configs = []  # (name, slots factory, depth or None for serial, config or None)
            if device == "cuda":
                configs.append((f"(a) {emu}weft.ep", lambda: ep_slots([1] * a.layers), None,
                                None))
                configs += [(f"(b) {emu}pipe+weft.ep d{d}",
                             lambda d=d: ep_slots(moe.num_layout_slots(a.layers, d)), d, None)
                            for d in depths]
            configs.append((f"(a) {emu}a2a", a2a_slots, None, None))
            configs += [(f"(c) {emu}pipe+a2a {label}d{d}", a2a_slots, d, None, apart)
                        for label, apart, family in a2a_families for d in family]
            if a.gemm_sm_carveout is not None:
                cv = a.gemm_sm_carveout
                configs += [(f"{c[0]} cv{cv}", *c[1:4], c[4] if len(c) > 4 else None, cv)
                            for c in configs if c[2] is not None]
            if world == 1:
                configs.append(("no comm", lambda: moe.LayoutSlots.shared(
                    moe.LocalDispatcher(experts), a.layers), None, None))
            if local_ep_slots is not None and device == "cuda":
                configs.append(("(a) weft.ep local", lambda: local_ep_slots([1] * a.layers), None,
                                None))

            def make_model():
                # The model's dispatcher sets its share of the experts (the step uses slots).
                return moe.MoEModel(a.layers, hidden, experts, top_k, ffn,
                                    moe.AllToAllDispatcher(group, experts), device=device)
            if a.suggest:
                if device == "cuda":
                    family = (f"(b) {emu}pipe+weft.ep", f"(a) {emu}weft.ep",
                              moe.num_layout_slots(a.layers, depths[-1]))
                    family_slots = ep_slots
                    plan_depths = depths
                else:
                    family = (f"(c) {emu}pipe+a2a", f"(a) {emu}a2a", None)
                    family_slots = (lambda num_slots: a2a_slots())
                    plan_depths = a2a_families[0][2]
                plan_state = _plan_family(a, family, family_slots, make_model, x, target,
                                          plan_depths, backend, device, f"{shape}_T{T}", out,
                                          group)
                configs.append(plan_state["config"])
            base_name = configs[0][0]
            out(f"{'shape':6s} {'T':>6s} {'schedule':24s} {'step ms':>17s} "
                f"{'vs ' + base_name:>20s}", flush=True)
            # The first config's first step is the reference of every config's bits.
            times, same, reference = {}, {}, None
            num_threads = {}  # family of (b) and (c) rows -> the engine threads it ran on

            def build(cname, make_slots, depth, config, dispatch_after_router=None,
                      carveout=None):
                """The config's model and step, its first step's bits checked, warmed up.
                carveout: SMs torch's GEMMs leave free during the pipelined step."""
                nonlocal reference
                run = {"name": cname, "depth": depth, "config": config, "piped": None,
                       "slots": make_slots(), "model": make_model(),
                       "apart": dispatch_after_router}
                model, slots = run["model"], run["slots"]
                if depth is None:
                    def step(x, t):
                        return moe.serial_step(model, x, t, 0.0, M, slots)
                else:
                    piped = run["piped"] = moe.PipelinedStep(
                        model, slots, M, depth=depth, backend=backend, config=config,
                        thread_map=None if config else thread_map,
                        dispatch_after_router=dispatch_after_router)
                    if config is None:
                        num_threads[cname.rsplit(" d", 1)[0]] = len(piped.engine.threads)

                    def step(x, t):
                        if carveout is None:
                            return piped(x, t, 0.0)
                        torch._C._set_sm_carveout_experimental(carveout)
                        try:
                            return piped(x, t, 0.0)
                        finally:
                            torch._C._set_sm_carveout_experimental(None)
                run["step"] = step
                same[cname], reference = first_steps(step, model, x, target, a, reference)
                times[cname] = []
                return run

            def row(cname):
                base, runs = times[base_name], times[cname]
                ratio = f"{min(runs) / max(base):.2f}-{max(runs) / min(base):.2f}x"
                out(f"{shape:6s} {T:6d} {cname:24s} {min(runs):8.2f}-{max(runs):<8.2f} "
                    f"{ratio:>20s}", flush=True)

            def finish(run):
                """The traced step and the planner's page (the first pipelined row), the stage
                costs (emulated: each family's serial step), then every reference to the run's
                model dropped."""
                nonlocal traced
                model, slots, depth = run["model"], run["slots"], run["depth"]
                if depth is not None and run["config"] is None and not traced and draw:
                    _trace_and_plan(model, slots, x, target, a, depth, run["apart"], backend,
                                    device, f"{shape}_T{T}{'_emu' if emu else ''}",
                                    times[run["name"]], rank, run["name"])
                    traced = True
                if run["piped"] is not None:
                    run["piped"].close()
                kind = serial_rows.get(run["name"]) if emu else None
                if kind is not None:
                    family_costs[kind] = stage_costs_us(model, slots, x, target, M, device,
                                                        _synced_stages(a, kind))
                # The step closure and the pipelined step hold the model too: drop every
                # reference before the next config builds its own (a DeepSeek-V3-sized model
                # and its gradients take most of a GPU).
                run.clear()
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()

            # The serial emulated rows, whose stage costs the planner's prediction starts from.
            serial_rows = {f"(a) {emu}weft.ep": "weft.ep", f"(a) {emu}a2a": "a2a"}
            family_costs = {}
            if a.interleave:
                # Every config's model at once; run r of each config after run r - 1 of all.
                runs = [build(*c) for c in configs]
                for _ in range(a.repeats):
                    for run in runs:
                        times[run["name"]] += timed_runs(run["step"], x, target, a, device, 1)
                for run in runs:
                    row(run["name"])
                for run in runs:
                    finish(run)
                del runs
            else:
                for c in configs:
                    run = build(*c)
                    times[run["name"]] += timed_runs(run["step"], x, target, a, device, a.repeats)
                    row(run["name"])
                    finish(run)
                    del run
            different = [k for k, v in same.items() if not v]
            mismatches += len(different)
            out(f"{shape:6s} {T:6d} the first step's loss and every gradient bit-identical "
                f"across schedules: {not different}"
                + (f" (DIFFERENT from {base_name}: {', '.join(different)})" if different else ""),
                flush=True)
            out(f"{shape:6s} {T:6d} engine threads: "
                + ", ".join(f"{k} {n}" for k, n in num_threads.items()), flush=True)
            _print_hidden(out, shape, T, times, emu)
            if a.suggest:
                _print_plan_table(out, a, plan_state, times, same)
            if len(family_costs) == len(serial_rows):
                _print_prediction(out, a, shape, T, hidden, family_costs, depths,
                                  a2a_families[0][2], times, num_threads)
    # A rank whose bits differ fails the run on every rank (rank 0 prints its own bits only).
    same_everywhere = every_rank(mismatches == 0, group)
    if not same_everywhere:
        out("# MISMATCH: the bits of a schedule differ from the serial step's on some rank")
    if group:
        dist.destroy_process_group()
    return 0 if same_everywhere else 1


def _given_thread_map(a):
    """--threads' map of the pipelined steps, or None: PipelinedStep's choice."""
    return moe.moe_thread_map(a.layers, a.threads) if a.threads else None


def _traced_run(a, make_model, slots, x, target, depth, backend, device):
    """(ms per step, the merged trace of the --iters traced steps, the schedule, its engine
    threads, its dispatch_after_router): a traced PipelinedStep after --warmup
    untraced-for-the-costs steps."""
    model = make_model()
    step = moe.PipelinedStep(model, slots, a.micro_batches, depth=depth, backend=backend,
                             trace=True, thread_map=_given_thread_map(a))
    for _ in range(a.warmup):
        step(x, target, 0.0)
    _sync(device)
    step.engine.take_trace()
    traces, total_s = [], 0.0
    for _ in range(a.iters):
        start = time.perf_counter()
        step(x, target, 0.0)
        _sync(device)
        total_s += time.perf_counter() - start
        traces.append(step.engine.take_trace())
    schedule, num_threads = step.schedule, len(step.engine.threads)
    apart = step.dispatch_after_router
    step.close()
    return total_s * 1e3 / a.iters, traces, schedule, num_threads, apart


def _plan_family(a, family, family_slots, make_model, x, target, depths, backend, device, tag,
                 out, group):
    """The traced runs, the costs, the fit (--calibrate), the search: what the table needs, and
    the suggestion's config entry (name, slots factory, depth, config). Every rank runs the
    traced steps (they are collective); the costs and the measured steps are rank 0's on every
    rank (rank0_value), so every rank finds the same suggestion (checked); rank 0 writes the
    files."""
    rank = group.rank() if group else 0
    prefix, serial, num_slots = family
    L, M = a.layers, a.micro_batches

    def trace(depth, name):
        ms, traces, schedule, num_threads, apart = _traced_run(
            a, make_model, family_slots(num_slots), x, target, depth, backend, device)
        if a.trace_dir and rank == 0:
            os.makedirs(a.trace_dir, exist_ok=True)
            traces[-1].write_chrome_json(os.path.join(a.trace_dir,
                                                      f"moe_{tag}_{name}.trace.json"))
        log(f"traced {prefix} {name}: {ms:.2f} ms/step")
        return ms, merged_trace(traces), schedule, num_threads, apart

    # The traced runs' engine threads are the family's own (PipelinedStep's or --threads).
    ms0, trace0, schedule0, num_threads, apart = trace(0, "d0")
    waits = _host_waits(a, prefix)
    costs = rank0_value(plan.trace_costs(trace0, schedule0, gpu=a.gpu_costs, gpu_waits=waits),
                        group)
    gpu_ms = sum(g["us"] for t in costs["tasks"].values() for g in t.get("gpu", [])) / 1e3
    host_ms = sum(t["host_us"] for t in costs["tasks"].values()) / 1e3
    out(f"# costs: {prefix} d0's traced run ({a.iters} steps), {len(costs['tasks'])} tasks, per "
        f"micro-batch {host_ms:.2f} ms of host time"
        f"{' (the waits of ' + ', '.join(sorted(waits)) + ' left out)' if waits else ''} and "
        f"{gpu_ms:.2f} ms of GPU {a.gpu_costs} "
        "time", flush=True)
    variants = depth_variants(L, depths, M, num_threads, apart)
    fit = None
    if a.calibrate:
        fitted = depth_variants(L, sorted({0, *depths}), M, num_threads, apart)
        traced_ms = rank0_value({v.name: ms0 if v.depth == 0 else trace(v.depth, v.name)[0]
                                 for v in fitted}, group)
        # On a GPU the compute stream's work may run slower beside the communication's (the
        # emulated dispatcher's hold takes SMs): a slowdown of "default" is fitted too.
        fit = fit_calibration(traced_ms, fitted, costs,
                              slowdown_stream="default" if device == "cuda" else None)
        out(f"# calibration, fitted on the traced runs of {len(fitted)} depths "
            f"({', '.join(traced_ms)}): {fit.describe()} (rms error there "
            f"{fit.rms_error_pct:.1f}%, uncalibrated "
            f"{rms_error_pct(traced_ms, fitted, costs):.1f}%)", flush=True)
    found = suggest_variant(costs, L, M, num_slots=num_slots, max_threads=a.max_threads,
                            calibration=fit, min_gain_pct=a.min_gain_pct,
                            own_thread_map=moe.moe_thread_map(L, num_threads),
                            dispatch_after_router=apart)
    mine = found.variant.config.to_json()
    if not every_rank(rank0_value(mine, group) == mine, group):
        raise RuntimeError("a rank found another schedule than rank 0 from rank 0's costs")
    path = a.config_out or os.path.join(a.trace_dir or ".", f"moe_{tag}_suggested.json")
    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        found.write_config(path)
    layouts = "any number" if num_slots is None else f"at most {num_slots}"
    out(f"# suggested ({found.source}, {found.num_evaluated} schedules simulated; layouts kept "
        f"to {layouts} per layer, it keeps {found.variant.layouts()}; config in {path}): "
        f"{found.num_threads} thread{'s' if found.num_threads > 1 else ''}, predicted "
        f"{found.step_ms:.2f} ms", flush=True)
    for line in found.describe().splitlines():
        out(f"#   {line}", flush=True)
    name = f"{prefix} suggested"
    rows = [(f"{prefix} d{v.depth}", v) for v in variants] + [(name, found.variant)]
    return {"config": (name, lambda: family_slots(num_slots), found.variant.depth,
                       found.variant.config),
            "serial": serial, "rows": rows, "costs": costs, "fit": fit}


def _print_plan_table(out, a, state, times, same):
    """The --suggest table (hstu_step.py's columns); same: per row, whether its first step's
    bits equal the run's reference (the first config's: (a), the serial step)."""
    serial, costs, fit = state["serial"], state["costs"], state["fit"]
    base = times[serial]
    fit_header = f" {'fit ms':>7s} {'fit err %':>9s}" if fit else ""
    out(f"{'schedule':30s} {'step ms':>17s} {'x serial':>11s} {'planner ms':>10s} {'err %':>7s}"
        f"{fit_header}  bits", flush=True)
    timed_ms = {}
    for key, variant in [(serial, None)] + state["rows"]:
        ms = times[key]
        columns = []
        for calibration in [None] + ([fit] if fit else []):
            predicted = None if variant is None else predicted_ms(variant, costs, calibration)
            error = None if predicted is None else error_pct(predicted, statistics.median(ms))
            columns += [predicted, error]
        if variant is not None:
            timed_ms[variant.name] = statistics.median(ms)
        ratio = f"{min(ms) / max(base):.2f}-{max(ms) / min(base):.2f}"
        fitted = (f" {_fmt(columns[2], '7.2f'):>7s} {_fmt(columns[3], '+9.1f'):>9s}"
                  if fit else "")
        out(f"{key:30s} {min(ms):8.2f}-{max(ms):<8.2f} {ratio:>11s} "
            f"{_fmt(columns[0], '10.2f'):>10s} {_fmt(columns[1], '+7.1f'):>7s}{fitted}  "
            f"{'identical' if same[key] else 'DIFFERENT'}", flush=True)
    rows = [v for _, v in state["rows"]]
    out(f"# planner error over the {len(rows)} engine rows (timed medians): rms "
        f"{rms_error_pct(timed_ms, rows, costs):.1f}%"
        + (f", calibrated {rms_error_pct(timed_ms, rows, costs, fit):.1f}%" if fit else ""),
        flush=True)
    identical = all(same[key] for key, _ in [(serial, None)] + state["rows"])
    out(f"# {'every row bit-identical to ' + serial if identical else 'MISMATCH'} (the "
        "first step's loss and gradients)", flush=True)


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def log(*args):
    print(*args, file=sys.stderr, flush=True)


def _median(v):
    return sorted(v)[len(v) // 2]


def _print_hidden(out, shape, T, times, emu):
    """hidden = (serial - pipelined) / (serial - floor), from the medians of the runs, and the
    issue's goals: local comm, pipelined <= 1.02 x serial; emulated, hidden >= 0.8, i.e.
    step(b) <= floor + 0.2 x (step(a) - floor). floor: the faster of "no comm" and "(a) weft.ep
    local" (the steps whose communication is a local copy)."""
    med = {k: _median(v) for k, v in times.items()}
    floors = [k for k in ("no comm", "(a) weft.ep local") if k in med]
    floor_key = min(floors, key=med.get) if floors else None
    for serial, prefix in ((f"(a) {emu}weft.ep", "(b)"), (f"(a) {emu}a2a", "(c)")):
        if serial not in med:
            continue
        for k, v in med.items():
            if not k.startswith(prefix):
                continue
            line = f"{shape:6s} {T:6d} {k}: {v / med[serial]:.3f} x {serial}"
            if floor_key is not None:
                comm_ms = med[serial] - med[floor_key]
                share = f"{(med[serial] - v) / comm_ms:.2f}" if comm_ms > 0 else "n/a"
                line += (f", hidden {share} = ({med[serial]:.2f} - {v:.2f}) / ({med[serial]:.2f}"
                         f" - {med[floor_key]:.2f} {floor_key}) ms")
                if emu and comm_ms > 0:
                    goal = v <= med[floor_key] + 0.2 * comm_ms
                    line += f"; goal hidden >= 0.80: {'met' if goal else 'NOT met'}"
            if not emu:
                line += f"; goal <= 1.02x: {'met' if v <= 1.02 * med[serial] else 'NOT met'}"
            out(line + " (medians)", flush=True)


def _print_prediction(out, a, shape, T, hidden, family_costs, depths, a2a_depths, times,
                      num_threads):
    """The planner's step on each target from each family's stage costs (family_costs: kind ->
    StageCosts of its serial emulated step, GPU and host per stage, the update), its comm
    stages with the run's --target holds swapped for the target's, the family's host waits, on
    the engine threads each family ran on (num_threads: "(b) emu pipe+weft.ep" -> count) and its
    schedule family ((c): each dispatch a progress after its router); on --target, beside the
    emulated measurement (medians)."""
    tokens = -(-T // a.micro_batches)
    for kind, costs in family_costs.items():
        out(f"{shape:6s} {T:6d} stage costs of (a) emu {kind}, us per micro-batch (GPU / host): "
            + ", ".join(f"{k} {costs.gpu_us[k]:.0f}/{costs.host_us[k]:.0f}" for k in moe.STAGES),
            flush=True)
    for target, tables in moe.emulated.TARGETS.items():
        for kind, prefix, apart, family in (("weft.ep", "(b)", False, depths),
                                            ("a2a", "(c)", True, a2a_depths)):
            costs = family_costs[kind]
            held = moe.emulated.comm_stage_us(moe.emulated.TARGETS[a.target][kind], tokens,
                                              hidden)
            wanted = moe.emulated.comm_stage_us(tables[kind], tokens, hidden)
            comm_us = {k: max(0.0, costs.gpu_us[k] - held[k] + wanted[k]) for k in COMM_STAGES}
            compute_us = {k: v for k, v in costs.gpu_us.items() if k not in COMM_STAGES}
            threads = num_threads[f"{prefix} emu pipe+{kind}"]
            predicted = moe.emulated.predict_step_us(
                a.layers, [0] + family, compute_us, comm_us, host_us=costs.host_us,
                num_micro_batches=a.micro_batches, update_us=costs.update_us,
                num_threads=threads, dispatch_after_router=apart,
                waits=_host_waits(a, kind))
            measured = target == a.target
            rows = [("serial", 0, f"(a) emu {kind}")] + [
                (f"d{d}", d, f"{prefix} emu pipe+{kind} d{d}") for d in family]
            parts = []
            for label, d, name in rows:
                ms = predicted[d] / 1e3
                parts.append(f"{label} {ms:.2f}" + (f" vs {_median(times[name]):.2f}"
                                                    if measured else ""))
            out(f"{shape:6s} {T:6d} planner on {target} {kind} (ms per step of {a.micro_batches} "
                f"micro-batches, fill and drain, the update's {costs.update_us / 1e3:.2f} "
                "included)" + (" vs emulated" if measured else "") + ": "
                + ", ".join(parts), flush=True)


def _trace_and_plan(model, slots, x, target, a, depth, dispatch_after_router, backend, device,
                    tag, measured_ms, rank, row):
    """One traced step of the first pipelined row (Chrome JSON), and the planner's page of its
    family's depths (0 .. 4 x layers, or 5 x layers with each dispatch a progress after its
    router) with stage costs measured from a serial step (on a GPU its host time per stage
    too) and the family's host waits, into bench-out/; the planner's step beside the measured
    one. row: that row's name (its family's host waits). Every rank runs the steps (they are
    collective); rank 0 writes and prints."""
    L = len(model.moe)
    traced = moe.PipelinedStep(model, slots, a.micro_batches, depth=depth, backend=backend,
                               trace=True, thread_map=_given_thread_map(a),
                               dispatch_after_router=dispatch_after_router)
    traced(x, target, 0.0)
    _sync(device)
    trace = traced.engine.take_trace()
    num_threads = len(traced.engine.threads)
    apart = traced.dispatch_after_router
    traced.close()
    stage = stage_costs_us(model, slots, x, target, a.micro_batches, device,
                           _synced_stages(a, row))
    costs_us, update_us = stage.gpu_us, stage.update_us
    if rank != 0:
        return
    trace_path = os.path.join(OUT_DIR, f"moe_pipeline_{tag}_d{depth}.trace.json")
    trace.write_chrome_json(trace_path)
    host = {} if stage.host_us is None else {"host_us": stage.host_us}
    costs = moe.moe_costs(L, costs_us, waits=_host_waits(a, row), **host)
    thread_map = moe.moe_thread_map(L, num_threads)
    variants = [(f"moe_depth{d}", moe.moe_schedule(L, d, dispatch_after_router=apart),
                 thread_map) for d in range(moe.max_depth(L, apart) + 1)]
    page = os.path.join(OUT_DIR, f"moe_pipeline_{tag}_plan.html")
    drawn = plan.write_report(page, variants, costs=costs)
    print(f"# wrote {trace_path} and {page}; stage us per micro-batch: "
          + ", ".join(f"{k} {v:.0f}" for k, v in costs_us.items()), flush=True)
    print("# planner's step per micro-batch (us): "
          + ", ".join(f"{v.name} {v.timeline.step_us:.0f}" for v in drawn), flush=True)
    source = plan.simulate(moe.moe_schedule(L, depth, dispatch_after_router=apart), thread_map,
                           costs,
                           num_batches=a.micro_batches)
    step_ms = (source.timeline.step_us + update_us) / 1e3
    print(f"# depth {depth}: planner {step_ms:.2f} ms per step (a source of {a.micro_batches} "
          f"micro-batches, fill and drain, then the update, {update_us / 1e3:.2f}), measured "
          f"{_median(measured_ms):.2f} ms (median)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
