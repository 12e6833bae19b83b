"""The micro-batched MoE training step: serial (one stream) and on weft.pipeline.

A step splits its tokens into M micro-batches; each runs forward and backward, gradients
accumulate over the micro-batches in micro-batch order, and one SGD step ends the step. A
micro-batch is a chain of stages, cut at every communication, forward and backward:

    dense_router_l     (l > 0: the residual of layer l-1) dense block, router top-k    compute
    dispatch_l         the rows to their experts' ranks (begun: dispatch_begin)         comm
    experts_l          the dispatch finished (its count wait, the rows' copy), the      compute
                       grouped GEMMs
    combine_l          the expert outputs back, summed per token                        comm
    loss               residual, loss, its gradient at the last layer's output          compute
    combine_bwd_l      the output gradient to the rows (a cached dispatch)              comm
    experts_bwd_l      the experts' data gradients: the rows' and router weights'       compute
    dispatch_bwd_l     the row and weight gradients back to their tokens (a combine)    comm
    experts_wgrad_l    the expert weights' gradients (computed at the step's last       compute
                       micro-batch, over all of the step's micro-batches)
    dense_router_bwd_l the router's and dense block's backward, the residual            compute

(forward for l = 0 .. L-1, then loss, then backward for l = L-1 .. 0). Each dense, router and
loss stage is an autograd graph of its own, rooted at leaves detached from the stage before it,
and run backward by its own backward stage; the experts run without autograd, forward and
backward by hand (experts.expert_forward, expert_backward.expert_dgrad), their weight gradients
deferred: experts_wgrad_l reads experts_bwd_l's output, not dispatch_bwd_l's, so the compute
stream has it to run while dispatch_bwd_l's communication is in flight, and dense_router_bwd_l
(which waits for that communication) is not queued behind it. The communication runs outside
autograd (the dispatcher's calls, as the autograd Functions of layer.py make them). serial_step runs the chain micro-batch after
micro-batch; PipelinedStep runs its stages as weft.pipeline tasks, one engine batch per
micro-batch, the first stages of the chain at decreasing lookaheads (stage_lookaheads), so that
the communication of one micro-batch, forward or backward, is enqueued beside compute of another.
Both run the same functions on the same tensors, and each parameter's gradient gets its
micro-batches' parts in micro-batch order (a layer's expert weights only in experts_wgrad_l, one
grouped GEMM per weight over the micro-batches' entries collected in micro-batch order; its
router and dense block only in dense_router_bwd_l): the same bits.

    slots = LayoutSlots.native_ep(group, 128, num_layout_slots(2, depth=8), max_tokens=T // 4)
    step = PipelinedStep(model, slots, num_micro_batches=4, depth=8, backend="torch")
    loss = step(x, target, lr=1e-3)            # == serial_step(model, x, target, 1e-3, 4, ...)
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch

from weft import Error
from .dispatchers import begin_dispatch
from .expert_backward import ExpertWgrad, expert_dgrad
from .experts import expert_forward
from .slots import LayoutSlots

FORWARD_STAGES = ("dense_router", "dispatch", "experts", "combine")
BACKWARD_STAGES = ("combine_bwd", "experts_bwd", "dispatch_bwd", "experts_wgrad",
                   "dense_router_bwd")
COMM_STAGES = ("dispatch", "combine", "combine_bwd", "dispatch_bwd")
STAGES = FORWARD_STAGES + ("loss",) + BACKWARD_STAGES
# Stages that read the output of a stage other than the one before them in the chain:
# experts_wgrad_l reads experts_bwd_l's, dense_router_bwd_l dispatch_bwd_l's (not the wgrad's).
READS = {"experts_wgrad": "experts_bwd", "dense_router_bwd": "dispatch_bwd"}
# Stages that share the chain position (so the lookahead) of another stage of their layer.
SHARES_POSITION = {"experts_wgrad": "experts_bwd"}


class MicroBatch:
    """One micro-batch's state through the stages (an engine batch of PipelinedStep): its
    inputs and every tensor its stages made, kept until the micro-batch is done (on weft.pipeline
    until its streams have finished with them). The per-layer lists hold layer l's tensors; the
    backward stages read the forward's graphs and leaves from them."""

    def __init__(self, index: int, x: torch.Tensor, target: torch.Tensor, num_layers: int,
                 denominator: int, last: bool = True) -> None:
        def per_layer():
            return [None] * num_layers

        self.index = index               # within the step: picks the layout slot
        self.last = last                 # the step's last micro-batch: computes the wgrad
        self.x, self.target = x, target
        self.denominator = denominator   # the step's element count: the loss is the step's mean
        self.loss: Optional[torch.Tensor] = None
        self.x_in = per_layer()          # l > 0: the layer's input, a leaf (its .grad: backward)
        self.h = per_layer()             # dense block output (graph from x_in)
        self.route = per_layer()         # (topk_idx, topk_weights), the weights' graph from h
        # the dispatcher's layout_begin, if it has one, until the dispatch takes it (a dispatcher
        # keeps what its stream still reads: AllToAllDispatcher records it on that stream)
        self.layout = per_layer()
        # (recv_x, recv_idx, recv_w, handle, num_entries); from dispatch to experts the
        # dispatch begun (dispatchers.Dispatched or its like), which experts finishes
        self.recv = per_layer()
        self.expert_act = per_layer()    # the experts' ExpertActivations
        self.y = per_layer()             # expert outputs
        self.combined = per_layer()
        self.grad_out = per_layer()      # gradient at h_l + combined_l (the next layer's input)
        self.grad_y = per_layer()
        self.grad_recv = per_layer()     # (grad recv_x, grad recv_w)
        self.wgrad_inputs = per_layer()  # the experts' WgradInputs, until experts_wgrad_l
        self.grad_h = per_layer()        # (grad h from the dispatch, grad topk_weights)


def micro_batches(x: torch.Tensor, target: torch.Tensor, num_micro_batches: int,
                  num_layers: int) -> List[MicroBatch]:
    """x and target [T, hidden] cut into num_micro_batches micro-batches of consecutive tokens."""
    if num_micro_batches < 1 or num_micro_batches > x.shape[0]:
        raise ValueError(f"num_micro_batches must be in [1, {x.shape[0]}] (the tokens), got "
                         f"{num_micro_batches}")
    if x.shape != target.shape:
        raise ValueError(f"x {tuple(x.shape)} and target {tuple(target.shape)} differ in shape")
    return [MicroBatch(i, xs, ts, num_layers, x.numel(), i == num_micro_batches - 1)
            for i, (xs, ts) in enumerate(zip(torch.tensor_split(x, num_micro_batches),
                                             torch.tensor_split(target, num_micro_batches)))]


def chain(num_layers: int) -> List[Tuple[str, str, Optional[int]]]:
    """(task name, stage, layer) of a micro-batch's stages in run order (loss: layer None)."""
    out = [(f"{s}_{layer}", s, layer) for layer in range(num_layers) for s in FORWARD_STAGES]
    out.append(("loss", "loss", None))
    out += [(f"{s}_{layer}", s, layer) for layer in reversed(range(num_layers))
            for s in BACKWARD_STAGES]
    return out


def stage_task_names(num_layers: int) -> List[str]:
    """The tasks in chain order: dense_router_0, dispatch_0, ..., loss, combine_bwd_{L-1}, ...,
    dense_router_bwd_0."""
    return [name for name, _, _ in chain(num_layers)]


def stage_reads(num_layers: int) -> Dict[str, str]:
    """Task -> the task whose output it reads (the first: "micro_batch", the step's input):
    the task before it in the chain, but experts_wgrad_l reads experts_bwd_l's and
    dense_router_bwd_l dispatch_bwd_l's."""
    out, previous = {}, "micro_batch"
    for name, stage, layer in chain(num_layers):
        out[name] = f"{READS[stage]}_{layer}" if stage in READS else previous
        previous = name
    return out


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_()


class _Stages:
    """The stage functions of one model over one LayoutSlots: stage(mb, layer)."""

    def __init__(self, model, slots) -> None:
        self.model, self.slots = model, slots
        self.wgrad = [ExpertWgrad() for _ in model.moe]

    def begin_step(self) -> None:
        """Forget what an earlier step that did not finish collected."""
        self.wgrad = [ExpertWgrad() for _ in self.model.moe]

    def run(self, mb: MicroBatch, stage: str, layer: Optional[int]) -> None:
        if layer is None:
            getattr(self, stage)(mb)
        else:
            getattr(self, stage)(mb, layer)

    def _dispatcher(self, mb: MicroBatch, layer: int):
        return self.slots.dispatcher(layer, mb.index)

    def dense_router(self, mb: MicroBatch, layer: int) -> None:
        if layer == 0:
            x = mb.x
        else:
            with torch.no_grad():
                x = _leaf(mb.h[layer - 1] + mb.combined[layer - 1])
            mb.x_in[layer] = x
        mb.h[layer] = self.model.dense[layer](x)
        mb.route[layer] = self.model.moe[layer].route(mb.h[layer])
        layout_begin = getattr(self._dispatcher(mb, layer), "layout_begin", None)
        if layout_begin is not None:  # on this stream, so that the dispatch waits for it alone
            with torch.no_grad():
                mb.layout[layer] = layout_begin(mb.route[layer][0])

    def dispatch(self, mb: MicroBatch, layer: int) -> None:
        idx, weights = mb.route[layer]
        with torch.no_grad():
            mb.recv[layer] = begin_dispatch(self._dispatcher(mb, layer), mb.h[layer].detach(),
                                            idx, weights.detach(), mb.layout[layer])
        mb.layout[layer] = None

    def experts(self, mb: MicroBatch, layer: int) -> None:
        mb.recv[layer] = mb.recv[layer].finish()  # the dispatch's count wait, if it has one
        recv_x, recv_idx, recv_w, _, num_entries = mb.recv[layer]
        moe = self.model.moe[layer]
        with torch.no_grad():
            mb.y[layer], mb.expert_act[layer] = expert_forward(recv_x, recv_idx, recv_w,
                                                               moe.w13, moe.w2, num_entries)

    def combine(self, mb: MicroBatch, layer: int) -> None:
        with torch.no_grad():
            mb.combined[layer], _ = self._dispatcher(mb, layer).combine(mb.y[layer].detach(),
                                                                        mb.recv[layer][3])

    def loss(self, mb: MicroBatch) -> None:
        # sum((out - target)^2) / denominator in fp32 and its gradient 2 (out - target) /
        # denominator, in out's dtype, without an autograd graph.
        with torch.no_grad():
            out = mb.h[-1] + mb.combined[-1]
            diff = out.float() - mb.target
            mb.loss = diff.pow(2).sum() / mb.denominator
            mb.grad_out[-1] = (diff * (2.0 / mb.denominator)).to(out.dtype)

    def combine_bwd(self, mb: MicroBatch, layer: int) -> None:
        with torch.no_grad():
            mb.grad_y[layer] = self._dispatcher(mb, layer).dispatch_cached(
                mb.grad_out[layer].contiguous(), mb.recv[layer][3])

    def experts_bwd(self, mb: MicroBatch, layer: int) -> None:
        moe = self.model.moe[layer]
        with torch.no_grad():
            grad_x, grad_w, mb.wgrad_inputs[layer] = expert_dgrad(
                mb.grad_y[layer], mb.expert_act[layer], moe.w13, moe.w2)
        mb.grad_recv[layer] = (grad_x, grad_w)

    def dispatch_bwd(self, mb: MicroBatch, layer: int) -> None:
        grad_x, grad_w = mb.grad_recv[layer]
        with torch.no_grad():
            mb.grad_h[layer] = self._dispatcher(mb, layer).combine(
                grad_x.contiguous(), mb.recv[layer][3], weights=grad_w.contiguous())

    def experts_wgrad(self, mb: MicroBatch, layer: int) -> None:
        wgrad = self.wgrad[layer]
        if wgrad.num_micro_batches != mb.index:
            raise Error(f"experts_wgrad_{layer}: micro-batch {mb.index} after "
                             f"{wgrad.num_micro_batches} (they must come in order)")
        wgrad.add(mb.wgrad_inputs[layer])
        mb.wgrad_inputs[layer] = None
        if mb.last:
            moe = self.model.moe[layer]
            with torch.no_grad():
                for p, g in zip((moe.w13, moe.w2), wgrad.compute()):
                    if p.grad is None:
                        p.grad = g
                    else:  # in place: no third expert-weight-sized tensor at the peak
                        p.grad.add_(g)

    def dense_router_bwd(self, mb: MicroBatch, layer: int) -> None:
        grad_h, grad_w = mb.grad_h[layer]
        # h_l feeds the dispatch, the router and the residual h_l + combined_l.
        torch.autograd.backward([mb.h[layer], mb.route[layer][1]],
                                [grad_h + mb.grad_out[layer], grad_w])
        if layer > 0:
            mb.grad_out[layer - 1] = mb.x_in[layer].grad


def _zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def _sgd(model, lr: float) -> None:
    """p -= lr * p.grad for every parameter, in one multi-tensor op."""
    params = list(model.parameters())
    with torch.no_grad():
        torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)


def serial_step(model, x: torch.Tensor, target: torch.Tensor, lr: float,
                num_micro_batches: int = 1, slots=None) -> torch.Tensor:
    """Schedule (a): the step's micro-batches one after another on the current stream, each
    micro-batch's chain of stages in order, gradients accumulated, one SGD step. slots: a
    LayoutSlots (one layout per layer is live at once; default: the layers' own dispatchers).
    Returns the loss (the step's mean squared error, fp32, on the device: the sum of the
    micro-batches' parts in micro-batch order)."""
    num_layers = len(model.moe)
    if slots is None:
        slots = LayoutSlots(lambda layer, s: model.moe[layer].dispatcher, [1] * num_layers)
    slots.check([1] * num_layers)
    stages = _Stages(model, slots)
    stages.begin_step()
    _zero_grads(model)
    total = None
    for mb in micro_batches(x, target, num_micro_batches, num_layers):
        for _, stage, layer in chain(num_layers):
            stages.run(mb, stage, layer)
        total = mb.loss if total is None else total + mb.loss
    _sgd(model, lr)
    return total


def _chain_positions(num_layers: int, dispatch_after_router: bool = False) -> Dict[str, int]:
    """Task -> its position k in the chain of (compute, comm) pairs: a comm task shares the
    position of the compute task before it, so that at lookahead depth - k its consumer, one
    position on, runs in a later progress() than it; experts_wgrad_l shares experts_bwd_l's
    (it reads that, and runs under dispatch_bwd_l's communication). dispatch_after_router: each
    dispatch_l has a position of its own, one after dense_router_l's (see stage_lookaheads)."""
    out, k = {}, -1
    for name, stage, layer in chain(num_layers):
        if stage in SHARES_POSITION:
            out[name] = out[f"{SHARES_POSITION[stage]}_{layer}"]
            continue
        if stage not in COMM_STAGES or (dispatch_after_router and stage == "dispatch"):
            k += 1
        out[name] = k
    return out


def max_depth(num_layers: int, dispatch_after_router: bool = False) -> int:
    """The deepest schedule: every communication's consumer runs in a later progress() (and with
    dispatch_after_router every dispatch in a later one than its router)."""
    return (5 if dispatch_after_router else 4) * num_layers


def stage_lookaheads(num_layers: int, depth: int,
                     dispatch_after_router: bool = False) -> Dict[str, int]:
    """Task -> lookahead. Position k of the chain (dense_router_0 + dispatch_0 = 0, experts_0 +
    combine_0 = 1, ..., loss + combine_bwd_{L-1} = 2L, experts_bwd_{L-1} + dispatch_bwd_{L-1} =
    2L + 1, dense_router_bwd_{L-1} + combine_bwd_{L-2} = 2L + 2, ..., dense_router_bwd_0 = 4L)
    runs at lookahead max(0, depth - k): a comm task at k < depth has its consumer in the next
    progress(), after compute of other micro-batches. depth 0: every task at lookahead 0 (the
    serial order on the engine); 2L: every forward communication runs beside another
    micro-batch's compute; 4L (max_depth): every backward one too.

    dispatch_after_router: dispatch_l gets a position of its own after dense_router_l's (the
    positions after it move one on; max_depth 5L), so that at a depth above dense_router_l's
    position the dispatch runs a progress after its router, with a progress of other
    micro-batches' work queued behind the router: a dispatch that waits on the host for what
    the router stage queued (AllToAllDispatcher's sizes, begun by its layout_begin there) then
    waits for work the device has done or is past, without draining it."""
    deepest = max_depth(num_layers, dispatch_after_router)
    if not 0 <= depth <= deepest:
        raise ValueError(f"depth must be in [0, {deepest}] for {num_layers} layers, got {depth}")
    return {name: max(0, depth - k)
            for name, k in _chain_positions(num_layers, dispatch_after_router).items()}


def num_layout_slots(num_layers: int, depth: int,
                     dispatch_after_router: bool = False) -> List[int]:
    """Per layer, the layouts live at once on weft.pipeline at this depth: a micro-batch's layout
    of layer l lives from its dispatch_l to its dispatch_bwd_l (the layout's last use), so
    lookahead(dispatch_l) - lookahead(dispatch_bwd_l) + 1 micro-batches hold one."""
    return layouts_of(stage_lookaheads(num_layers, depth, dispatch_after_router), num_layers)


def layouts_of(lookaheads: Mapping[str, int], num_layers: int) -> List[int]:
    """Per layer, the layouts live at once under any lookaheads (task -> lookahead, every
    dispatch_l and dispatch_bwd_l named): lookahead(dispatch_l) - lookahead(dispatch_bwd_l) + 1,
    what num_layout_slots gives for the depth family."""
    return [lookaheads[f"dispatch_{layer}"] - lookaheads[f"dispatch_bwd_{layer}"] + 1
            for layer in range(num_layers)]


def moe_schedule(num_layers: int, depth: int,
                 bodies: Optional[Mapping[str, Callable]] = None, *,
                 dispatch_after_router: bool = False):
    """The weft.pipeline Schedule of the step: the tasks in chain order (the run order), compute
    on stream "default", the communication, forward and backward, as collective tasks on stream
    "comm"; each task reads the slot of the task stage_reads names and writes its own (the
    MicroBatch), the last (dense_router_bwd_0) writes step_result. bodies: task name -> fn(ctx)
    (None: no bodies, for the planner). dispatch_after_router: stage_lookaheads'."""
    from weft.pipeline import Schedule, Task

    la = stage_lookaheads(num_layers, depth, dispatch_after_router)
    bodies = bodies or {}
    tasks = []
    names = stage_task_names(num_layers)
    reads = stage_reads(num_layers)
    for name, stage, _ in chain(num_layers):
        comm = stage in COMM_STAGES
        writes = "step_result" if name == names[-1] else name
        tasks.append(Task.from_fn(name, bodies.get(name, _no_body),
                                  stream="comm" if comm else "default", lookahead=la[name],
                                  reads=[reads[name]], writes=[writes], collective=comm))
    return Schedule(tasks, streams={"comm": 1}, inputs=["micro_batch"])


def moe_thread_map(num_layers: int, num_threads: int = 2) -> Dict[str, List[str]]:
    """Two engine threads: compute (dense, router, experts, loss, their backward) and comm (the
    dispatches and combines, forward and backward, whose host waits, a count read by weft.ep's
    DeepEP-API dispatch or the all_to_all dispatcher's sizes, then block only that thread).
    num_threads=1: every task on one thread, "host" (no GIL shared between engine threads)."""
    if num_threads == 1:
        return {"host": stage_task_names(num_layers)}
    if num_threads != 2:
        raise ValueError(f"num_threads must be 1 or 2, got {num_threads!r}")
    threads: Dict[str, List[str]] = {"compute": [], "comm": []}
    for name, stage, _ in chain(num_layers):
        threads["comm" if stage in COMM_STAGES else "compute"].append(name)
    return threads


def default_dispatch_after_router(slots) -> bool:
    """Whether PipelinedStep puts each dispatch a progress after its router (stage_lookaheads'
    dispatch_after_router) by default: where every dispatcher of the slots has
    dispatch_waits_for_layout, i.e. its dispatch's one host wait is for what its layout_begin
    queued in the router stage and the exchange of its sizes (AllToAllDispatcher)."""
    return all(getattr(d, "dispatch_waits_for_layout", False) for d in slots.dispatchers())


def dispatches_after_routers(lookaheads: Mapping[str, int], num_layers: int) -> bool:
    """Whether under these lookaheads every dispatch_l runs a progress after its dense_router_l
    (stage_lookaheads' dispatch_after_router at a depth of 3L - 2 or more)."""
    return all(lookaheads[f"dense_router_{layer}"] > lookaheads[f"dispatch_{layer}"]
               for layer in range(num_layers))


def default_num_threads(slots, dispatch_after_router: bool = False) -> int:
    """The engine threads PipelinedStep runs on by default: 2 (moe_thread_map's compute and comm)
    where a dispatcher of the slots has comm_waits_on_host (a dispatcher without the attribute
    counts as one), so that its waits block the comm thread only; else 1. Two threads that both
    issue torch ops hand the GIL to each other at every op (each op releases and retakes it);
    with nothing to wait for on the host that costs more than the second thread gives.
    dispatch_after_router: every dispatch of the schedule runs a progress after its router
    (dispatches_after_routers); a dispatcher whose one wait is for that router's work
    (dispatch_waits_for_layout) then waits for work queued a progress ago, which needs no thread
    of its own."""
    def waits(d):
        if dispatch_after_router and getattr(d, "dispatch_waits_for_layout", False):
            return False
        return getattr(d, "comm_waits_on_host", True)
    return 2 if any(waits(d) for d in slots.dispatchers()) else 1


def moe_costs(num_layers: int, gpu_us: Mapping[str, float],
              host_us: Union[float, Mapping[str, float]] = 20.0,
              waits: Optional[Mapping[str, str]] = None) -> dict:
    """A planner cost file (docs/planner.md "Cost files") for moe_schedule: gpu_us gives each
    stage's GPU time per micro-batch (every name of STAGES; the same for every layer); host_us
    each task's host time on its thread, one figure for every task or one per stage (every name
    of STAGES). waits: task -> the task whose GPU work of the same micro-batch its body waits
    for on the host (weft.moe.planning's count_waits and layout_waits), the cost's
    "waits_for_gpu_of"; host_us is then the body's work besides that wait."""
    per_stage = isinstance(host_us, Mapping)
    if per_stage and set(STAGES) - set(host_us):
        raise ValueError(f"host_us lacks the stages {sorted(set(STAGES) - set(host_us))}")
    waits = dict(waits or {})
    names = set(stage_task_names(num_layers))
    unknown = sorted(n for pair in waits.items() for n in pair if n not in names)
    if unknown:
        raise ValueError(f"waits name tasks the schedule does not have: {unknown}")
    tasks = {}
    for name, stage, _ in chain(num_layers):
        tasks[name] = {"host_us": float(host_us[stage] if per_stage else host_us),
                       "gpu": [{"stream": "comm" if stage in COMM_STAGES else "default",
                                "us": float(gpu_us[stage])}]}
        if name in waits:
            tasks[name]["waits_for_gpu_of"] = waits[name]
    out = {"tasks": tasks}
    if not per_stage:
        out["default_host_us"] = float(host_us)
    return out


def _no_body(ctx) -> None:
    pass


class PipelinedStep:
    """Schedule (b) (or (c), with the all_to_all dispatcher's slots): the step on weft.pipeline.

    One engine source per step: an iterator over the step's micro-batches, progress() until
    StopIteration (the pipeline drains), then the SGD step, so parameters never change while a
    micro-batch of the step is in flight. backend "host" (CPU tensors) or "torch" (the engine's
    "default" stream is the caller's current torch stream unless streams= says otherwise, so
    the SGD step and the next step's work order after the backward without a host wait).

    dispatch_after_router: the depth family with each dispatch a progress after its router
    (stage_lookaheads; depth up to max_depth(L, True)); default: default_dispatch_after_router
    (slots), i.e. for the all_to_all dispatcher, whose dispatch waits on the host for the sizes
    its layout counted in the router stage.
    thread_map: the engine's threads (default: the config's thread map if it has one, else
    moe_thread_map with default_num_threads(slots, dispatches_after_routers(lookaheads)): one
    thread over weft.ep's native dispatcher, and over the all_to_all one where every dispatch
    runs a progress after its router; compute and comm over one that waits on the host
    otherwise, the all_to_all one at a depth that leaves a dispatch beside its router
    included).
    config: a weft.pipeline ScheduleConfig (what weft.plan.suggest and weft.moe.planning write)
    applied over the depth's lookaheads. The slots must hold the layouts of the lookaheads that
    result (layouts_of; ValueError before any engine starts).
    """

    def __init__(self, model, slots, num_micro_batches: int, *, depth: int = 1,
                 backend: str = "host", thread_map=None, trace: bool = False,
                 streams: Optional[dict] = None, device: Optional[int] = None,
                 config=None, dispatch_after_router: Optional[bool] = None) -> None:
        from weft.pipeline import Engine

        self.model = model
        self.num_layers = len(model.moe)
        self.depth = depth
        if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")
        self.num_micro_batches = num_micro_batches
        if dispatch_after_router is None:
            dispatch_after_router = default_dispatch_after_router(slots)
        self.dispatch_after_router = dispatch_after_router
        self.stages = stages = _Stages(model, slots)
        self.schedule = moe_schedule(self.num_layers, depth, self._bodies(stages),
                                     dispatch_after_router=dispatch_after_router)
        if config is not None:
            config.apply(self.schedule)
            if thread_map is None:
                thread_map = config.thread_map
        self.lookaheads = {t.name: t.lookahead for t in self.schedule.tasks}
        slots.check(layouts_of(self.lookaheads, self.num_layers))
        self.slots = slots
        if backend == "torch" and streams is None:
            streams = {"default": torch.cuda.current_stream()}
        if thread_map is None:
            apart = dispatches_after_routers(self.lookaheads, self.num_layers)
            thread_map = moe_thread_map(self.num_layers, default_num_threads(slots, apart))
        self.engine = Engine(self.schedule, thread_map,
                             backend=backend, trace=trace, streams=streams, device=device)

    def _bodies(self, stages: _Stages) -> Dict[str, Callable]:
        names = stage_task_names(self.num_layers)
        reads = stage_reads(self.num_layers)
        bodies = {}
        for name, stage, layer in chain(self.num_layers):
            last, previous = name == names[-1], reads[name]

            def body(ctx, stage=stage, layer=layer, name=name, previous=previous, last=last):
                mb = ctx.get(previous)
                stages.run(mb, stage, layer)
                ctx.set("step_result" if last else name, mb.loss if last else mb)
            bodies[name] = body
        return bodies

    def __call__(self, x: torch.Tensor, target: torch.Tensor, lr: float) -> torch.Tensor:
        """One step; returns the loss as serial_step does (the same bits)."""
        self.stages.begin_step()
        _zero_grads(self.model)
        it = iter(micro_batches(x, target, self.num_micro_batches, self.num_layers))
        total = None
        while True:
            try:
                loss = self.engine.progress(it)
            except StopIteration:
                break
            total = loss if total is None else total + loss
        _sgd(self.model, lr)
        return total

    def close(self) -> None:
        self.engine.close()
