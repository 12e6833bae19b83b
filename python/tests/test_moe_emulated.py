"""Emulated communication (weft.moe.EmulatedDispatcher): the inner dispatcher's bits, a hold of
the cost table's time after every call, the planner's prediction from the tables, and on the host
backend other micro-batches' GEMM tasks issued under every backward call; on a GPU the hold
kernel itself, the pipelined step over emulated weft.ep against the serial one, and a trace in
which a micro-batch's backward communication runs under another micro-batch's GEMMs."""

import copy

import pytest

torch = pytest.importorskip("torch")

import weft.moe as moe  # noqa: E402
from conftest import needs_gpus  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SMALL = dict(num_layers=2, hidden=64, num_experts=8, top_k=2, ffn=32)


class Holds:
    """A hold that records (num_sms, us, device) instead of launching the kernel."""

    def __init__(self):
        self.calls = []

    def __call__(self, num_sms, us, device):
        self.calls.append((num_sms, us, device))


def test_the_2xh200_tables_go_through_their_measured_points():
    ep, a2a = moe.EP_2XH200, moe.A2A_2XH200
    for call, small, large in (("dispatch", 16.75, 343.2), ("combine", 18.8, 344.85),
                               ("dispatch_cached", 12.85, 332.05)):
        assert ep[call].us(128, 7168) == pytest.approx(small)
        assert ep[call].us(8192, 7168) == pytest.approx(large)
        # Half the bytes per row: the per-row part halves, the fixed part stays.
        half = ep[call].us(8192, 3584)
        assert half == pytest.approx(ep[call].fixed_us + (large - ep[call].fixed_us) / 2)
    assert a2a["dispatch"].us(8192, 7168) == pytest.approx(897.5)
    assert a2a["combine"].us(8192, 7168) == pytest.approx(1714.5)
    assert a2a["combine"].us(4096, 2048) == pytest.approx(1714.5 / 2 * 2048 / 7168)


def test_emulated_dispatcher_gives_the_inner_bits_and_holds_after_every_call():
    g = torch.Generator().manual_seed(5)
    inner = moe.LocalDispatcher(8)
    holds = Holds()
    costs = {"dispatch": moe.CallCost(3.0, 0.5), "combine": moe.CallCost(5.0, 0.25),
             "dispatch_cached": moe.CallCost(7.0, 0.125)}
    d = moe.EmulatedDispatcher(inner, costs, num_sms=6, hold=holds)
    x = torch.randn((40, 64), generator=g).bfloat16()
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40)])
    idx[3, 1] = -1
    w = torch.rand((40, 2), generator=g)
    got, want = d.dispatch(x, idx, w), inner.dispatch(x, idx, w)
    for a, b in zip(got[:3], want[:3]):
        assert torch.equal(a, b)
    assert got[4] == want[4] == 79
    y = torch.randn((got[0].shape[0], 64), generator=g).bfloat16()
    out, _ = d.combine(y, got[3])
    assert torch.equal(out, inner.combine(y, want[3])[0])
    assert torch.equal(d.dispatch_cached(x, got[3]), inner.dispatch_cached(x, want[3]))
    rows = got[0].shape[0]
    scale = 64 / 7168
    want_us = [3.0 + 0.5 * 40 * scale, 5.0 + 0.25 * rows * scale, 7.0 + 0.125 * 40 * scale]
    assert [c[0] for c in holds.calls] == [6, 6, 6]
    assert [c[1] for c in holds.calls] == pytest.approx(want_us)
    assert d.held_us == pytest.approx(sum(want_us))
    # The dispatch in two halves (the step's): the inner's begin, the same hold after it.
    begun = d.dispatch_begin(x, idx, w)
    assert [c[1] for c in holds.calls[3:]] == pytest.approx(want_us[:1])
    for a, b in zip(begun.finish()[:3], want[:3]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="costs lack"):
        moe.EmulatedDispatcher(inner, {"dispatch": costs["dispatch"]}, num_sms=6)
    with pytest.raises(ValueError, match="num_sms"):
        moe.EmulatedDispatcher(inner, costs, num_sms=0)


@pytest.mark.parametrize("depth", [1, 8])
def test_pipelined_step_over_emulated_dispatchers_agrees_with_serial(depth):
    M = 4
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=9, **SMALL)
    piped = copy.deepcopy(serial)
    holds = Holds()
    emulated = moe.EmulatedDispatcher(moe.LocalDispatcher(8), moe.EP_2XH200, 20, hold=holds)
    step = moe.PipelinedStep(piped, moe.LayoutSlots.shared(emulated, 2), M, depth=depth)
    for i in range(2):
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn((96, 64), generator=g).bfloat16()
        target = torch.randn((96, 64), generator=g).bfloat16()
        a = moe.serial_step(serial, x, target, 0.05, M)
        b = step(x, target, lr=0.05)
        assert torch.equal(a, b), i
        assert all(torch.equal(p, q) for p, q in zip(serial.parameters(), piped.parameters()))
    # Forward dispatch and combine, backward cached dispatch and combine, per layer and
    # micro-batch.
    assert len(holds.calls) == 2 * M * 2 * 4
    step.close()


def test_the_planner_predicts_the_step_from_compute_and_the_target_tables():
    from weft.moe.emulated import comm_stage_us, predict_step_us

    comm = comm_stage_us(moe.EP_2XH200, 2048, 7168)
    assert comm == pytest.approx({"dispatch": moe.EP_2XH200["dispatch"].us(2048, 7168),
                                  "combine": moe.EP_2XH200["combine"].us(2048, 7168),
                                  "combine_bwd": moe.EP_2XH200["dispatch_cached"].us(2048, 7168),
                                  "dispatch_bwd": moe.EP_2XH200["combine"].us(2048, 7168)})
    compute = {"dense_router": 300.0, "experts": 900.0, "loss": 200.0, "experts_bwd": 1200.0,
               "experts_wgrad": 600.0, "dense_router_bwd": 600.0}
    step = predict_step_us(2, range(9), compute, comm, host_us=1.0)
    compute_sum = 2 * (300 + 900 + 1800 + 600) + 200
    # Depth 0: serial but for each layer's dispatch_bwd, under its micro-batch's deferred wgrad.
    assert step[0] == pytest.approx(compute_sum + 2 * sum(comm.values())
                                    - 2 * min(compute["experts_wgrad"], comm["dispatch_bwd"]))
    assert step[8] == pytest.approx(compute_sum)  # every call (< 300 us) under compute
    # A step of one micro-batch has nothing to overlap but the wgrad, at any depth: depth 0's
    # micro-batch and the first body's host time (1 us) before any GPU work; a long step grows by
    # the steady-state micro-batch with each micro-batch more.
    one = predict_step_us(2, range(9), compute, comm, host_us=1.0, num_micro_batches=1)
    assert all(one[d] == pytest.approx(step[0] + 1.0) for d in range(9))
    m8 = predict_step_us(2, [0, 4, 8], compute, comm, host_us=1.0, num_micro_batches=8)
    m16 = predict_step_us(2, [0, 4, 8], compute, comm, host_us=1.0, num_micro_batches=16)
    for d in (0, 4, 8):
        assert (m16[d] - m8[d]) / 8 == pytest.approx(step[d], rel=1e-6)
        assert m8[d] >= 8 * step[d] - 1e-6  # the fill and the drain add
    assert all(step[d + 1] <= step[d] for d in range(8))
    # The optimizer's update after the last micro-batch: the same tail at every depth; a
    # steady-state micro-batch has none.
    updated = predict_step_us(2, [0, 4, 8], compute, comm, host_us=1.0, num_micro_batches=8,
                              update_us=250.0)
    assert all(updated[d] == pytest.approx(m8[d] + 250.0) for d in (0, 4, 8))
    with pytest.raises(ValueError, match="num_micro_batches"):
        predict_step_us(2, [0], compute, comm, update_us=250.0)


def test_the_planner_takes_a_host_time_per_stage_and_the_dispatchers_host_waits():
    from weft import plan
    from weft.moe.emulated import predict_step_us
    from weft.moe.planning import count_waits, layout_waits
    from weft.moe.step import COMM_STAGES, chain

    L, M = 2, 4
    host = {stage: 100.0 + 10 * i for i, stage in enumerate(moe.STAGES)}
    gpu = dict.fromkeys(moe.STAGES, 1.0)
    costs = moe.moe_costs(L, gpu, host_us=host, waits=layout_waits(L))
    for name, stage, layer in chain(L):
        entry = costs["tasks"][name]
        assert entry["host_us"] == host[stage], name
        assert entry.get("waits_for_gpu_of") == (
            f"dense_router_{layer}" if stage == "dispatch" else None), name
    assert "default_host_us" not in costs
    assert moe.moe_costs(L, gpu)["default_host_us"] == 20.0
    with pytest.raises(ValueError, match=r"host_us lacks the stages \['loss'\]"):
        moe.moe_costs(L, gpu, host_us={k: v for k, v in host.items() if k != "loss"})
    with pytest.raises(ValueError, match="waits name tasks the schedule does not have"):
        moe.moe_costs(L, gpu, waits={"dispatch_2": "dense_router_2"})
    # Host-bound (1 us of GPU a stage): the serial order on one thread takes every body's host
    # time, one after another, and the last body's GPU microsecond.
    compute = {k: v for k, v in gpu.items() if k not in COMM_STAGES}
    comm = {k: v for k, v in gpu.items() if k in COMM_STAGES}
    host_sum = M * sum(host[stage] for _, stage, _ in chain(L))
    serial = predict_step_us(L, [0], compute, comm, host_us=host, num_micro_batches=M,
                             num_threads=1)
    assert serial[0] == pytest.approx(host_sum + 1.0)
    # The router's GPU work long (the layout the dispatch's sizes wait for): the GPU-bound step
    # without the waits keeps the GPU busy; with them each dispatch's body at depth 0 waits for
    # its router's work, and the GPU idles while the host then issues what follows; a deeper
    # schedule of the family with each dispatch a progress after its router queues work
    # behind the router first.
    slow = {**compute, "dense_router": 3000.0}
    depths = range(moe.max_depth(L, True) + 1)
    free, waited = (predict_step_us(L, depths, slow, comm, host_us=host, num_micro_batches=M,
                                    num_threads=1, dispatch_after_router=True, waits=w)
                    for w in (None, layout_waits(L)))
    assert free[0] == pytest.approx(2 * M * 3000, rel=0.01)
    assert waited[0] > free[0] + M * 1500
    assert min(waited.values()) < waited[0] - M * 1500
    report = plan.simulate(moe.moe_schedule(L, 0), moe.moe_thread_map(L, 1),
                           moe.moe_costs(L, {**slow, **comm}, host_us=host, waits=layout_waits(L)),
                           num_batches=M)
    waits = {(w.producer, w.consumer) for w in report.timeline.waits if w.rule == "gpu_wait"}
    assert waits == {(f"dense_router_{layer}", f"dispatch_{layer}") for layer in range(L)}
    assert set(count_waits(L).items()) == {(f"experts_{layer}", f"dispatch_{layer}")
                                           for layer in range(L)}


def _overlaps(a, b):
    return a.begin_us < b.end_us and b.begin_us < a.end_us


def _is_gemm_task(name):
    """Tasks that run GEMMs for every micro-batch: the experts' (not experts_wgrad, which runs
    its GEMMs at the step's last micro-batch only) and the dense block's, forward or backward."""
    return name.startswith(("experts", "dense_router")) and not name.startswith("experts_wgrad")


def _backward_comm_under_other_gemms(trace, spans):
    """The backward communication tasks that, at least once, overlap a task with GEMMs (the
    experts', the dense block's, forward or backward) of another micro-batch; and all the
    backward communication tasks."""
    names = trace.task_names
    named = [(names[s.task], s) for s in spans]
    comm = [(n, s) for n, s in named if n.startswith(("combine_bwd", "dispatch_bwd"))]
    gemms = [s for n, s in named if _is_gemm_task(n)]
    hits = {n for n, c in comm if any(c.batch != e.batch and _overlaps(c, e) for e in gemms)}
    return hits, {n for n, _ in comm}


def _issued_under_backward_calls(depth):
    """On the host backend (where a task's span is its issue): the backward comm tasks for which
    some micro-batch's call is followed, before the task that consumes it starts, by a GEMM task
    (experts, dense block) of another micro-batch on the compute thread (the work that runs
    under the call on a GPU); and all the backward comm tasks."""
    from weft.moe.step import stage_reads, stage_task_names

    model = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=4, **SMALL)
    emulated = moe.EmulatedDispatcher(moe.LocalDispatcher(8), moe.EP_2XH200, 20, hold=Holds())
    step = moe.PipelinedStep(model, moe.LayoutSlots.shared(emulated, 2), 8, depth=depth,
                             trace=True)
    g = torch.Generator().manual_seed(6)
    step(torch.randn((256, 64), generator=g).bfloat16(),
         torch.randn((256, 64), generator=g).bfloat16(), lr=0.0)
    trace = step.engine.take_trace()
    step.close()
    names = stage_task_names(2)
    spans = {(trace.task_names[s.task], s.batch): s for s in trace.host_spans}
    gemms = [(b, s) for (n, b), s in spans.items() if _is_gemm_task(n)]
    backward_comm = {n for n in names if n.startswith(("combine_bwd", "dispatch_bwd"))}
    hits = set()
    for name in backward_comm:
        consumer, = (n for n, read in stage_reads(2).items() if read == name)
        if any(n == name and any(b != batch and c.begin_us <= s.begin_us <
                                 spans[consumer, batch].begin_us for b, s in gemms)
               for (n, batch), c in spans.items()):
            hits.add(name)
    return hits, backward_comm


def test_other_micro_batchs_gemms_are_issued_between_a_backward_call_and_its_consumer():
    hits, backward_comm = _issued_under_backward_calls(moe.max_depth(2))
    assert len(backward_comm) == 4 and hits == backward_comm
    # At depth 0 (the serial order on the engine) no call has other work under it.
    hits, _ = _issued_under_backward_calls(0)
    assert hits == set()


# -- on a GPU --------------------------------------------------------------------------------------

GPU_SHAPE = dict(num_layers=2, hidden=256, num_experts=16, top_k=4, ffn=128, device="cuda")


@needs_gpus(1)
def test_hold_sms_holds_for_at_least_its_time_and_checks_its_arguments():
    from weft import _weft
    from weft.moe.emulated import hold_on_current_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for us in (50.0, 2000.0):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        hold_on_current_stream(8, us, dev)
        stop.record()
        stop.synchronize()
        assert start.elapsed_time(stop) * 1e3 >= us
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(Exception, match="num_sms"):
        _weft.cuda.hold_sms(num_sms + 1, 10.0, stream, dev.index)
    with pytest.raises(Exception, match="num_sms"):
        _weft.cuda.hold_sms(0, 10.0, stream, dev.index)
    with pytest.raises(Exception, match="duration_us"):
        _weft.cuda.hold_sms(1, -1.0, stream, dev.index)


def _emulated_ep_slots(num_slots, tokens, costs=moe.EP_2XH200, num_sms=20, native=False):
    import weft.ep

    def make(layer, s):
        inner = moe.NativeEpDispatcher(None, 16, tokens) if native else \
            moe.EpDispatcher(weft.ep.Buffer(None, 0, max_tokens=tokens), 16)
        return moe.EmulatedDispatcher(inner, costs, num_sms)
    return moe.LayoutSlots(make, num_slots)


@needs_gpus(1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("depth,native", [(1, False), (8, False), (1, True), (8, True)])
def test_emulated_weft_ep_pipelined_step_agrees_with_serial_bit_for_bit(depth, native):
    T, M = 512, 4
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=12, **GPU_SHAPE)
    piped = copy.deepcopy(serial)
    serial_slots = _emulated_ep_slots([1, 1], T // M, native=native)
    step = moe.PipelinedStep(piped, _emulated_ep_slots(moe.num_layout_slots(2, depth), T // M,
                                                       native=native),
                             M, depth=depth, backend="torch")
    g = torch.Generator(device="cuda").manual_seed(3)
    for i in range(3):
        x = torch.randn((T, 256), generator=g, device="cuda").bfloat16()
        target = torch.randn((T, 256), generator=g, device="cuda").bfloat16()
        a = moe.serial_step(serial, x, target, 0.02, M, serial_slots)
        b = step(x, target, lr=0.02)
        torch.cuda.synchronize()
        assert torch.equal(a, b), i
        assert all(torch.equal(p, q) for p, q in zip(serial.parameters(), piped.parameters())), i
    step.close()


@needs_gpus(1)
@pytest.mark.timeout(300)
def test_trace_shows_backward_communication_under_another_micro_batchs_gemms():
    T, M, depth = 2048, 8, moe.max_depth(2)
    model = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=2, **GPU_SHAPE)
    # Calls long enough that the overlap cannot be a rounding of the trace's clock.
    long_calls = {c: moe.CallCost(500.0, 0.0) for c in ("dispatch", "combine", "dispatch_cached")}
    step = moe.PipelinedStep(model, _emulated_ep_slots(moe.num_layout_slots(2, depth), T // M,
                                                       long_calls, num_sms=8),
                             M, depth=depth, backend="torch", trace=True)
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn((T, 256), generator=g, device="cuda").bfloat16()
    step(x, torch.randn((T, 256), generator=g, device="cuda").bfloat16(), lr=0.0)
    step.engine.synchronize()
    trace = step.engine.take_trace()
    hits, comm = _backward_comm_under_other_gemms(trace, trace.gpu_spans)
    assert len(comm) == 4
    # A backward dispatch (dispatch_bwd: a combine of the gradients) and a backward combine
    # (combine_bwd: a cached dispatch) of some micro-batch run under another one's GEMMs.
    assert {n.rsplit("_", 1)[0] for n in hits} == {"combine_bwd", "dispatch_bwd"}, sorted(hits)
    step.close()


@needs_gpus(1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("depth", [0, moe.max_depth(2)])
def test_trace_shows_the_deferred_wgrad_does_not_wait_for_its_backward_dispatch(depth,
                                                                                num_threads):
    """The step's expert weight gradients (experts_wgrad_l of the last micro-batch: the grouped
    GEMMs over every micro-batch) do not wait for that micro-batch's dispatch_bwd_l: on the GPU
    they begin before it ends, while dense_router_bwd_l, which reads it, begins after; at depth 0
    as at full depth, on one engine thread as on two. Whether the two also overlap depends on
    the comm stream's backlog: with calls of 500 us the comm stream runs behind the compute
    stream, and the wgrad may be done before its dispatch_bwd_l starts."""
    T, M = 2048, 4
    model = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=3, **GPU_SHAPE)
    long_calls = {c: moe.CallCost(500.0, 0.0) for c in ("dispatch", "combine", "dispatch_cached")}
    step = moe.PipelinedStep(model, _emulated_ep_slots(moe.num_layout_slots(2, depth), T // M,
                                                       long_calls, num_sms=8),
                             M, depth=depth, backend="torch", trace=True,
                             thread_map=moe.moe_thread_map(2, num_threads))
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn((T, 256), generator=g, device="cuda").bfloat16()
    step(x, torch.randn((T, 256), generator=g, device="cuda").bfloat16(), lr=0.0)
    step.engine.synchronize()
    trace = step.engine.take_trace()
    step.close()
    spans = {(trace.task_names[s.task], s.batch): s for s in trace.gpu_spans}
    last = max(b for _, b in spans)
    for layer in range(2):
        wgrad, comm = spans[f"experts_wgrad_{layer}", last], spans[f"dispatch_bwd_{layer}", last]
        after = spans[f"dense_router_bwd_{layer}", last]
        seen = {n: (spans[n, last].begin_us, spans[n, last].end_us) for n, b in spans
                if b == last}
        # A span that waited for the comm begins behind the record event that ends the comm's
        # run, just before the comm's own end-of-span event: a few us of clock, where the
        # wgrad, not waiting, begins with the comm at the latest, 500 us before its end.
        assert wgrad.end_us > wgrad.begin_us and wgrad.begin_us < comm.end_us - 100.0, (
            layer, seen)
        assert after.begin_us >= comm.end_us - 10.0, (layer, seen)


def test_the_8xh200_model_scales_the_per_row_part_by_the_rows_each_gpu_sends():
    """remote_ranks_per_token against routing drawn as the model assumes (top-8 of 256 distinct
    experts, uniform), and the model's tables: the fixed part of 2x H200, the per-row part
    times the ratio of remote rows per token (weft.ep: deduplicated per rank; the all_to_all
    dispatcher: per selection)."""
    from weft.moe.emulated import (A2A_8XH200_MODEL, EP_8XH200_MODEL, TARGETS,
                                   remote_ranks_per_token)

    g = torch.Generator().manual_seed(11)
    num_tokens = 20000
    idx = torch.rand((num_tokens, 256), generator=g).topk(8, dim=1).indices
    for num_ranks in (2, 4, 8):
        ranks = torch.zeros((num_tokens, num_ranks), dtype=torch.bool)
        ranks.scatter_(1, idx // (256 // num_ranks), True)
        # Rank 0's view: the other ranks its tokens go to.
        drawn = ranks[:, 1:].sum(dim=1).double().mean().item()
        assert remote_ranks_per_token(num_ranks) == pytest.approx(drawn, rel=0.01), num_ranks
    assert remote_ranks_per_token(1) == 0.0
    factor = remote_ranks_per_token(8) / remote_ranks_per_token(2)
    assert 4.5 < factor < 4.7
    for call in ("dispatch", "combine", "dispatch_cached"):
        two, eight = moe.EP_2XH200[call], EP_8XH200_MODEL[call]
        assert eight.fixed_us == two.fixed_us
        assert eight.us_per_row == pytest.approx(two.us_per_row * factor)
        assert A2A_8XH200_MODEL[call].us(8192, 7168) == pytest.approx(
            moe.A2A_2XH200[call].us(8192, 7168) * 1.75)
    assert TARGETS["8xh200-model"] == {"weft.ep": EP_8XH200_MODEL, "a2a": A2A_8XH200_MODEL}
