"""The micro-batched MoE training step: serial (one stream) and on weft.pipeline.

A step splits its tokens into M micro-batches; each runs forward and backward, gradients
accumulate over the micro-batches in micro-batch order, and one SGD step ends the step. A
micro-batch's forward through layer l is four stages, cut at the communication:

    dense_router_l   (l > 0: the residual of layer l-1) dense block, router top-k   compute
    dispatch_l       the rows to their experts' ranks                                comm
    experts_l        the grouped GEMMs                                               compute
    combine_l        the expert outputs back, summed per token                       comm

then loss_backward (the residual, the loss, backward through every layer: autograd runs each
communication's backward on the stream of its forward, the comm stream). serial_step runs the
stages in this order, micro-batch after micro-batch; PipelinedStep runs them as weft.pipeline
tasks, one engine batch per micro-batch, with the first `depth` stages of that chain at
decreasing lookaheads (moe_schedule), so that communication of one micro-batch is enqueued beside
compute of another. Both run the same functions on the same tensors: the same bits.

    slots = LayoutSlots.ep(group, 128, num_layout_slots(2, depth=4), max_tokens=T // 4)
    step = PipelinedStep(model, slots, num_micro_batches=4, depth=4, backend="torch")
    loss = step(x, target, lr=1e-3)            # == serial_step(model, x, target, 1e-3, 4, ...)
"""

from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

from .experts import expert_ffn
from .layer import combine, dispatch
from .slots import LayoutSlots

STAGES = ("dense_router", "dispatch", "experts", "combine")
COMM_STAGES = ("dispatch", "combine")


class MicroBatch:
    """One micro-batch's state through the stages (an engine batch of PipelinedStep): its
    inputs and every tensor its stages made, kept until the micro-batch is done (on weft.pipeline
    until its streams have finished with them)."""

    def __init__(self, index: int, x: torch.Tensor, target: torch.Tensor, num_layers: int,
                 denominator: int) -> None:
        self.index = index               # within the step: picks the layout slot
        self.x, self.target = x, target
        self.denominator = denominator   # the step's element count: the loss is the step's mean
        self.h: List[Optional[torch.Tensor]] = [None] * num_layers       # dense block output
        self.route: List[Optional[tuple]] = [None] * num_layers          # (topk_idx, weights)
        self.recv: List[Optional[tuple]] = [None] * num_layers           # dispatch's outputs
        self.y: List[Optional[torch.Tensor]] = [None] * num_layers       # expert outputs
        self.combined: List[Optional[torch.Tensor]] = [None] * num_layers


def micro_batches(x: torch.Tensor, target: torch.Tensor, num_micro_batches: int,
                  num_layers: int) -> List[MicroBatch]:
    """x and target [T, hidden] cut into num_micro_batches micro-batches of consecutive tokens."""
    if num_micro_batches < 1 or num_micro_batches > x.shape[0]:
        raise ValueError(f"num_micro_batches must be in [1, {x.shape[0]}] (the tokens), got "
                         f"{num_micro_batches}")
    if x.shape != target.shape:
        raise ValueError(f"x {tuple(x.shape)} and target {tuple(target.shape)} differ in shape")
    return [MicroBatch(i, xs, ts, num_layers, x.numel())
            for i, (xs, ts) in enumerate(zip(torch.tensor_split(x, num_micro_batches),
                                             torch.tensor_split(target, num_micro_batches)))]


class _Stages:
    """The stage functions of one model over one LayoutSlots."""

    def __init__(self, model, slots) -> None:
        self.model, self.slots = model, slots

    def dense_router(self, mb: MicroBatch, layer: int) -> None:
        x = mb.x if layer == 0 else mb.h[layer - 1] + mb.combined[layer - 1]
        mb.h[layer] = self.model.dense[layer](x)
        mb.route[layer] = self.model.moe[layer].route(mb.h[layer])

    def dispatch(self, mb: MicroBatch, layer: int) -> None:
        idx, weights = mb.route[layer]
        mb.recv[layer] = dispatch(mb.h[layer], idx, weights,
                                  self.slots.dispatcher(layer, mb.index))

    def experts(self, mb: MicroBatch, layer: int) -> None:
        recv_x, recv_w, recv_idx, _ = mb.recv[layer]
        moe = self.model.moe[layer]
        mb.y[layer] = expert_ffn(recv_x, recv_idx, recv_w, moe.w13, moe.w2)

    def combine(self, mb: MicroBatch, layer: int) -> None:
        mb.combined[layer] = combine(mb.y[layer], mb.recv[layer][3],
                                     self.slots.dispatcher(layer, mb.index))

    def loss_backward(self, mb: MicroBatch) -> torch.Tensor:
        out = mb.h[-1] + mb.combined[-1]
        loss = (out.float() - mb.target.float()).pow(2).sum() / mb.denominator
        loss.backward()
        return loss.detach()


def _zero_grads(model) -> None:
    for p in model.parameters():
        p.grad = None


def _sgd(model, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(lr * p.grad)


def serial_step(model, x: torch.Tensor, target: torch.Tensor, lr: float,
                num_micro_batches: int = 1, slots=None) -> torch.Tensor:
    """Schedule (a): the step's micro-batches one after another on the current stream, each
    forward then backward, gradients accumulated, one SGD step. slots: a LayoutSlots (one
    layout per layer is live at once; default: the layers' own dispatchers). Returns the loss
    (the step's mean squared error, fp32, on the device: the sum of the micro-batches' parts in
    micro-batch order)."""
    num_layers = len(model.moe)
    if slots is None:
        slots = LayoutSlots(lambda layer, s: model.moe[layer].dispatcher, [1] * num_layers)
    slots.check([1] * num_layers)
    stages = _Stages(model, slots)
    _zero_grads(model)
    total = None
    for mb in micro_batches(x, target, num_micro_batches, num_layers):
        for layer in range(num_layers):
            for stage in STAGES:
                getattr(stages, stage)(mb, layer)
        loss = stages.loss_backward(mb)
        total = loss if total is None else total + loss
    _sgd(model, lr)
    return total


def stage_lookaheads(num_layers: int, depth: int) -> Dict[str, int]:
    """Task -> lookahead. Stage k of the chain (dense_router_0 + dispatch_0 = 0, experts_0 +
    combine_0 = 1, ..., loss_backward = 2 * num_layers) runs at lookahead max(0, depth - k):
    a comm task's consumer then runs in the next progress(), after compute of other
    micro-batches. depth 0: every task at lookahead 0 (the serial order on the engine); 1: only
    layer 0's first dispatch runs ahead (under the experts of the micro-batch before);
    2 * num_layers: every forward communication runs beside another micro-batch's compute."""
    if not 0 <= depth <= 2 * num_layers:
        raise ValueError(f"depth must be in [0, {2 * num_layers}] for {num_layers} layers, got "
                         f"{depth}")
    out = {}
    for layer in range(num_layers):
        for i, stage in enumerate(STAGES):
            out[f"{stage}_{layer}"] = max(0, depth - (2 * layer + i // 2))
    out["loss_backward"] = 0
    return out


def num_layout_slots(num_layers: int, depth: int) -> List[int]:
    """Per layer, the layouts live at once on weft.pipeline at this depth: the lookahead of the
    layer's dispatch + 1 (a micro-batch's layout lives from its dispatch, that many progress()
    calls ahead, to its backward at lookahead 0)."""
    la = stage_lookaheads(num_layers, depth)
    return [la[f"dispatch_{layer}"] + 1 for layer in range(num_layers)]


def stage_task_names(num_layers: int) -> List[str]:
    """The stage tasks in chain order: dense_router_0, dispatch_0, experts_0, combine_0,
    dense_router_1, ... (loss_backward follows them)."""
    return [f"{s}_{layer}" for layer in range(num_layers) for s in STAGES]


def moe_schedule(num_layers: int, depth: int,
                 bodies: Optional[Mapping[str, Callable]] = None):
    """The weft.pipeline Schedule of the step: the stage tasks in chain order (the run order),
    compute on stream "default", dispatch and combine collective tasks on stream "comm";
    each task reads its predecessor's slot and writes its own (the MicroBatch), loss_backward
    writes step_result. bodies: task name -> fn(ctx) (None: no bodies, for the planner)."""
    from weft.pipeline import Schedule, Task

    la = stage_lookaheads(num_layers, depth)
    bodies = bodies or {}
    tasks, previous = [], "micro_batch"
    names = stage_task_names(num_layers) + ["loss_backward"]
    for name in names:
        comm = name.rsplit("_", 1)[0] in COMM_STAGES
        writes = "step_result" if name == "loss_backward" else name
        tasks.append(Task.from_fn(name, bodies.get(name, _no_body), stream="comm" if comm else
                                  "default", lookahead=la[name], reads=[previous],
                                  writes=[writes], collective=comm or name == "loss_backward"))
        previous = name
    return Schedule(tasks, streams={"comm": 1}, inputs=["micro_batch"])


def moe_thread_map(num_layers: int) -> Dict[str, List[str]]:
    """Two engine threads: compute (dense, router, experts, loss and backward) and comm (the
    dispatches and combines, whose host waits, a count read by weft.ep's dispatch or the
    all_to_all dispatcher's sizes, then block only that thread)."""
    comm = [f"{s}_{layer}" for layer in range(num_layers) for s in COMM_STAGES]
    compute = [f"{s}_{layer}" for layer in range(num_layers) for s in ("dense_router", "experts")]
    return {"compute": compute + ["loss_backward"], "comm": comm}


def moe_costs(num_layers: int, gpu_us: Mapping[str, float], host_us: float = 20.0) -> dict:
    """A planner cost file (docs/planner.md "Cost files") for moe_schedule: gpu_us gives each
    stage's GPU time per micro-batch ("dense_router", "dispatch", "experts", "combine",
    "loss_backward"; the same for every layer), each task host_us on its thread."""
    tasks = {}
    for layer in range(num_layers):
        for stage in STAGES:
            tasks[f"{stage}_{layer}"] = {
                "host_us": host_us,
                "gpu": [{"stream": "comm" if stage in COMM_STAGES else "default",
                         "us": float(gpu_us[stage])}]}
    tasks["loss_backward"] = {"host_us": host_us,
                              "gpu": [{"stream": "default", "us": float(gpu_us["loss_backward"])}]}
    return {"default_host_us": host_us, "tasks": tasks}


def _no_body(ctx) -> None:
    pass


class PipelinedStep:
    """Schedule (b) (or (c), with the all_to_all dispatcher's slots): the step on weft.pipeline.

    One engine source per step: an iterator over the step's micro-batches, progress() until
    StopIteration (the pipeline drains), then the SGD step, so parameters never change while a
    micro-batch of the step is in flight. backend "host" (CPU tensors) or "torch" (the engine's
    "default" stream is the caller's current torch stream unless streams= says otherwise, so
    the SGD step and the next step's work order after the backward without a host wait).
    """

    def __init__(self, model, slots, num_micro_batches: int, *, depth: int = 1,
                 backend: str = "host", thread_map=None, trace: bool = False,
                 streams: Optional[dict] = None, device: Optional[int] = None) -> None:
        from weft.pipeline import Engine

        self.model = model
        self.num_layers = len(model.moe)
        self.depth = depth
        self.lookaheads = stage_lookaheads(self.num_layers, depth)
        slots.check(num_layout_slots(self.num_layers, depth))
        self.slots = slots
        if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be an int >= 1, got {num_micro_batches!r}")
        self.num_micro_batches = num_micro_batches
        stages = _Stages(model, slots)
        self.schedule = moe_schedule(self.num_layers, depth, self._bodies(stages))
        if backend == "torch" and streams is None:
            streams = {"default": torch.cuda.current_stream()}
        self.engine = Engine(self.schedule, thread_map or moe_thread_map(self.num_layers),
                             backend=backend, trace=trace, streams=streams, device=device)

    def _bodies(self, stages: _Stages) -> Dict[str, Callable]:
        names = stage_task_names(self.num_layers)
        bodies = {}
        for previous, name in zip(["micro_batch"] + names[:-1], names):
            stage, layer = name.rsplit("_", 1)

            def body(ctx, fn=getattr(stages, stage), layer=int(layer), name=name,
                     previous=previous):
                mb = ctx.get(previous)
                fn(mb, layer)
                ctx.set(name, mb)
            bodies[name] = body

        def loss_backward(ctx):
            ctx.set("step_result", stages.loss_backward(ctx.get(names[-1])))
        bodies["loss_backward"] = loss_backward
        return bodies

    def __call__(self, x: torch.Tensor, target: torch.Tensor, lr: float) -> torch.Tensor:
        """One step; returns the loss as serial_step does (the same bits)."""
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
