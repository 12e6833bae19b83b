"""The micro-batched MoE step: serial (a), on weft.pipeline with weft.ep (b) and with the
all_to_all dispatcher (c), forward and backward as stages of their own. (a) and (b)/(c) agree
bit for bit at every depth; both agree with the full-batch step of the same layers on one device
(no micro-batches, LocalDispatcher, autograd through the whole model) within the bf16 tolerance
below; and with one Buffer per live layout no layout is ever re-run."""

import copy
import time

import pytest

torch = pytest.importorskip("torch")

import weft.moe as moe  # noqa: E402
from weft import plan  # noqa: E402
from conftest import needs_gpus, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SMALL = dict(num_layers=2, hidden=64, num_experts=8, top_k=2, ffn=32)

# bf16 tolerance against the full-batch reference: per parameter tensor, max |g - g_ref| within
# 2% of max |g_ref| (bf16 keeps 8 significant bits; the micro-batched step accumulates 4 bf16
# gradients where the reference rounds once), the loss within 1e-3 relative.
GRAD_TOL = 2e-2
LOSS_RTOL = 1e-3


def _inputs(step, rank=0, tokens=96, hidden=64, device="cpu"):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn((tokens, hidden), generator=g).bfloat16().to(device)
    target = torch.randn((tokens, hidden), generator=g).bfloat16().to(device)
    return x, target


def _assert_close_to_reference(loss, ref_loss, grads, ref_grads):
    assert abs(loss.item() - ref_loss.item()) <= LOSS_RTOL * abs(ref_loss.item())
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        err = (g.float() - r.float()).abs().max().item()
        assert err <= GRAD_TOL * r.float().abs().max().item(), (i, err)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def _same_bits(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def _check_steps(serial, piped, ref, step, inputs, lr, serial_slots=None):
    """Steps of serial_step and of the PipelinedStep `step` on the same inputs, with SGD between
    them (each step sees the parameters of the last): the same bits every step; the first
    against the full-batch reference."""
    for i, (x, target) in enumerate(inputs):
        a = moe.serial_step(serial, x, target, lr, step.num_micro_batches, serial_slots)
        b = step(x, target, lr=lr)
        assert torch.equal(a, b), i
        assert _same_bits(_grads(serial), _grads(piped)), i
        assert _same_bits(serial.parameters(), piped.parameters()), i
        if i == 0:
            ref_loss = moe.train_step(ref, x, target, lr=lr)
            _assert_close_to_reference(b, ref_loss, _grads(piped), _grads(ref))


class OneLayoutBuffer:
    """weft.ep.Buffer's layout rule without a GPU, for EpDispatcher: it keeps the layout of its
    latest uncached dispatch; a combine or cached dispatch of an older handle re-runs that
    handle's layout first (counted in num_relayouts, as the real Buffer does). The data path is
    LocalDispatcher's."""

    group_size, rank = 1, 0

    def __init__(self, num_experts):
        self._local = moe.LocalDispatcher(num_experts)
        self._latest = None
        self.num_relayouts = 0

    def get_dispatch_layout(self, topk_idx, num_experts):
        return None, None, None, None, None

    def _use(self, handle):
        if handle is not self._latest:
            self.num_relayouts += 1
            self._latest = handle

    def dispatch(self, x, handle=None, topk_idx=None, topk_weights=None, **_layout):
        if handle is not None:
            self._use(handle)
            return self._local.dispatch_cached(x, handle[0]), None, None, None, None, None
        recv_x, recv_idx, recv_w, local, _ = self._local.dispatch(x, topk_idx, topk_weights)
        handle = (local,)
        self._latest = handle
        per_expert = [int((recv_idx == e).sum()) for e in range(self._local.num_local_experts)]
        return recv_x, recv_idx, recv_w, per_expert, handle, None

    def combine(self, y, handle, topk_weights=None):
        self._use(handle)
        out, w = self._local.combine(y, handle[0], weights=topk_weights)
        return out, w, None


def _one_layout_slots(num_slots):
    return moe.LayoutSlots(lambda layer, s: moe.EpDispatcher(OneLayoutBuffer(8), 8), num_slots)


def _relayouts(slots):
    return sum(d.buffer.num_relayouts for d in slots.dispatchers())


def test_serial_micro_batched_step_matches_the_full_batch_reference():
    for step in range(3):
        model = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=step, **SMALL)
        ref = copy.deepcopy(model)
        x, target = _inputs(step)
        loss = moe.serial_step(model, x, target, lr=0.0, num_micro_batches=4)
        ref_loss = moe.train_step(ref, x, target, lr=0.0)
        _assert_close_to_reference(loss, ref_loss, _grads(model), _grads(ref))


@pytest.mark.parametrize("depth", range(moe.max_depth(2) + 1))
def test_pipelined_step_agrees_with_the_serial_one_bit_for_bit(depth):
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=7, **SMALL)
    piped = copy.deepcopy(serial)
    ref = copy.deepcopy(serial)
    slots = moe.LayoutSlots.shared(moe.LocalDispatcher(8), 2)
    step = moe.PipelinedStep(piped, slots, num_micro_batches=4, depth=depth)
    _check_steps(serial, piped, ref, step, [_inputs(i) for i in range(4)], lr=0.05)
    step.close()


@pytest.mark.parametrize("depth", [1, moe.max_depth(2)])
def test_every_task_on_one_engine_thread_agrees_with_the_serial_step(depth):
    """moe_pipeline.py --threads 1: the step's tasks share one host thread (no GIL between two);
    the streams still overlap, and the bits are the serial step's."""
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=8, **SMALL)
    piped = copy.deepcopy(serial)
    ref = copy.deepcopy(serial)
    slots = moe.LayoutSlots.shared(moe.LocalDispatcher(8), 2)
    step = moe.PipelinedStep(piped, slots, num_micro_batches=4, depth=depth,
                             thread_map=moe.moe_thread_map(2, num_threads=1))
    assert list(step.engine.threads) == ["host"]
    _check_steps(serial, piped, ref, step, [_inputs(i) for i in range(3)], lr=0.05)
    step.close()


class NeverWaitingDispatcher(moe.LocalDispatcher):
    """Says its comm calls never wait on the host, as weft.ep's native dispatcher does."""

    comm_waits_on_host = False


def test_the_engine_threads_follow_whether_a_comm_call_waits_on_the_host():
    """One engine thread where no dispatcher's comm call waits on the host (two would hand the
    GIL back and forth at every torch op), compute and comm where one does, or may (a
    dispatcher that does not say); an emulated dispatcher says what its inner one does; the
    bits are the serial step's either way."""
    assert not moe.NativeEpDispatcher(None, 8, 16).comm_waits_on_host
    assert moe.EpDispatcher(OneLayoutBuffer(8), 8).comm_waits_on_host
    assert not moe.EpDispatcher(OneLayoutBuffer(8), 8, num_worst_tokens=64).comm_waits_on_host
    never = moe.LayoutSlots.shared(NeverWaitingDispatcher(8), 2)
    assert moe.default_num_threads(never) == 1
    assert moe.default_num_threads(moe.LayoutSlots.shared(moe.LocalDispatcher(8), 2)) == 2
    assert moe.default_num_threads(moe.LayoutSlots.shared(ThreeCallDispatcher(8), 2)) == 2
    assert moe.default_num_threads(moe.LayoutSlots.shared(
        moe.AllToAllDispatcher(None, 8), 2)) == 2
    mixed = moe.LayoutSlots(lambda layer, s: NeverWaitingDispatcher(8) if layer else
                            moe.LocalDispatcher(8), [1, 1])
    assert moe.default_num_threads(mixed) == 2
    for inner, want in ((NeverWaitingDispatcher(8), False), (moe.LocalDispatcher(8), True)):
        emulated = moe.EmulatedDispatcher(inner, moe.EP_2XH200, num_sms=4,
                                          hold=lambda *_: None)
        assert emulated.comm_waits_on_host is want
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=9, **SMALL)
    piped = copy.deepcopy(serial)
    ref = copy.deepcopy(serial)
    step = moe.PipelinedStep(piped, never, num_micro_batches=4, depth=moe.max_depth(2))
    assert list(step.engine.threads) == ["host"]
    _check_steps(serial, piped, ref, step, [_inputs(i) for i in range(2)], lr=0.05)
    step.close()
    waits = moe.PipelinedStep(copy.deepcopy(serial),
                              moe.LayoutSlots.shared(moe.LocalDispatcher(8), 2), 4, depth=1)
    assert sorted(waits.engine.threads) == ["comm", "compute"]
    waits.close()
    given = moe.PipelinedStep(copy.deepcopy(serial), never, 4, depth=1,
                              thread_map=moe.moe_thread_map(2, 2))
    assert sorted(given.engine.threads) == ["comm", "compute"]  # a given map wins
    given.close()


class ThreeCallDispatcher:
    """A user's dispatcher of the three calls alone (no dispatch_begin, no weft base class)."""

    keeps_layouts = False

    def __init__(self, num_experts):
        self._inner = moe.LocalDispatcher(num_experts)
        self.num_ranks, self.rank = 1, 0
        self.num_local_experts = num_experts

    def dispatch(self, x, topk_idx, topk_weights):
        return self._inner.dispatch(x, topk_idx, topk_weights)

    def combine(self, y, handle, weights=None):
        return self._inner.combine(y, handle, weights)

    def dispatch_cached(self, x, handle):
        return self._inner.dispatch_cached(x, handle)


def test_a_dispatcher_of_the_three_calls_alone_runs_the_step():
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=3, **SMALL)
    piped = copy.deepcopy(serial)
    ref = copy.deepcopy(serial)
    d = ThreeCallDispatcher(8)
    step = moe.PipelinedStep(piped, moe.LayoutSlots.shared(d, 2), num_micro_batches=4, depth=4)
    _check_steps(serial, piped, ref, step, [_inputs(i) for i in range(2)], lr=0.05,
                 serial_slots=moe.LayoutSlots.shared(d, 2))
    step.close()


def test_one_buffer_per_live_layout_means_no_layout_is_re_run():
    x, target = _inputs(0)
    want = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL)
    want_loss = moe.serial_step(want, x, target, lr=0.05, num_micro_batches=4)
    # One Buffer for both layers: every backward call of layer 0 meets layer 1's layout.
    shared = moe.EpDispatcher(OneLayoutBuffer(8), 8)
    m = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL)
    moe.serial_step(m, x, target, 0.05, 4, moe.LayoutSlots(lambda layer, s: shared, [1, 1]))
    assert shared.buffer.num_relayouts > 0
    # Serial: one Buffer per layer.
    m = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL)
    slots = _one_layout_slots([1, 1])
    assert torch.equal(moe.serial_step(m, x, target, 0.05, 4, slots), want_loss)
    assert _same_bits(m.parameters(), want.parameters())
    assert _relayouts(slots) == 0
    for depth in (1, 2, 4, 8):
        need = moe.num_layout_slots(2, depth)
        m = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL)
        slots = _one_layout_slots(need)
        step = moe.PipelinedStep(m, slots, num_micro_batches=4, depth=depth)
        assert torch.equal(step(x, target, lr=0.05), want_loss)
        assert _same_bits(m.parameters(), want.parameters())
        for _ in range(2):
            step(x, target, lr=0.05)
        assert _relayouts(slots) == 0, depth
        step.close()
        # Fewer Buffers than live layouts: refused, and (the check bypassed) re-runs happen.
        few = _one_layout_slots([1, 1])
        with pytest.raises(ValueError, match="layouts per layer live at once"):
            moe.PipelinedStep(m, few, num_micro_batches=4, depth=depth)
        few.keeps_layouts = False
        step = moe.PipelinedStep(m, few, num_micro_batches=4, depth=depth)
        step(x, target, lr=0.0)
        assert _relayouts(few) > 0, depth
        step.close()


def _expert_weight_shaped_ops(model, x, target, num_micro_batches):
    """The aten ops of one serial step that return a tensor of an expert weight's shape: the
    expert weight gradients' GEMMs and any accumulation of them. Views are not counted, nor is
    the SGD step's multi-tensor update, which returns nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shapes = {tuple(w.shape) for m in model.moe for w in (m.w13, m.w2)}

    class Count(TorchDispatchMode):
        names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            views = func.is_view or func.overloadpacket.__name__ in ("detach", "_unsafe_view")
            if not views and any(isinstance(t, torch.Tensor) and tuple(t.shape) in shapes
                                 for t in outs):
                self.names.append(func.overloadpacket.__name__)
            return out

    with Count() as c:
        moe.serial_step(model, x, target, 0.0, num_micro_batches)
    return c.names


def test_expert_weight_gradients_are_written_once_per_layer_and_step():
    """One grouped GEMM per expert weight and step, whatever the micro-batch count: no
    per-micro-batch weight gradient and no accumulation of one."""
    x, target = _inputs(0)
    for num_micro_batches in (1, 4):
        model = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL)
        names = _expert_weight_shaped_ops(model, x, target, num_micro_batches)
        assert names == ["_grouped_mm"] * 2 * SMALL["num_layers"], (num_micro_batches, names)


# The tasks of a two-layer step in chain order, spelled out (stage_task_names(2) gives them).
TWO_LAYER_CHAIN = ("dense_router_0", "dispatch_0", "experts_0", "combine_0", "dense_router_1",
                   "dispatch_1", "experts_1", "combine_1", "loss", "combine_bwd_1",
                   "experts_bwd_1", "dispatch_bwd_1", "experts_wgrad_1", "dense_router_bwd_1",
                   "combine_bwd_0", "experts_bwd_0", "dispatch_bwd_0", "experts_wgrad_0",
                   "dense_router_bwd_0")


def test_lookaheads_layout_slots_and_bad_arguments():
    assert moe.stage_lookaheads(2, 1) == {
        "dense_router_0": 1, "dispatch_0": 1, "experts_0": 0, "combine_0": 0,
        "dense_router_1": 0, "dispatch_1": 0, "experts_1": 0, "combine_1": 0, "loss": 0,
        "combine_bwd_1": 0, "experts_bwd_1": 0, "dispatch_bwd_1": 0, "experts_wgrad_1": 0,
        "dense_router_bwd_1": 0, "combine_bwd_0": 0, "experts_bwd_0": 0, "dispatch_bwd_0": 0,
        "experts_wgrad_0": 0, "dense_router_bwd_0": 0}
    la = moe.stage_lookaheads(2, 8)
    # Each comm task shares the lookahead of the compute task before it; its consumer is one less.
    # The deferred wgrad shares its experts_bwd's (it runs under that layer's dispatch_bwd).
    assert [la[n] for n in TWO_LAYER_CHAIN] == \
        [8, 8, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 3, 2, 2, 1, 1, 1, 0]
    assert moe.stage_lookaheads(2, 4)["combine_bwd_1"] == 0
    assert moe.stage_lookaheads(2, 5)["combine_bwd_1"] == 1
    assert moe.num_layout_slots(2, 0) == [1, 1]
    assert moe.num_layout_slots(2, 1) == [2, 1]
    assert moe.num_layout_slots(2, 4) == [5, 3]
    assert moe.num_layout_slots(2, 8) == [8, 4]
    assert moe.num_layout_slots(1, 2) == [3]
    assert moe.num_layout_slots(1, 4) == [4]
    assert moe.moe_schedule(2, 8).run_order() == list(la)
    threads = moe.moe_thread_map(2)
    assert sorted(threads["comm"]) == sorted(n for n in la if n.rsplit("_", 1)[0] in (
        "dispatch", "combine", "combine_bwd", "dispatch_bwd"))
    assert sorted(threads["comm"] + threads["compute"]) == sorted(la)
    with pytest.raises(ValueError, match="depth"):
        moe.stage_lookaheads(2, 9)
    m = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL)
    slots = moe.LayoutSlots.shared(moe.LocalDispatcher(8), 2)
    with pytest.raises(ValueError, match="num_micro_batches"):
        moe.PipelinedStep(m, slots, num_micro_batches=0)
    with pytest.raises(ValueError, match="num_micro_batches"):
        moe.serial_step(m, *_inputs(0, tokens=3), lr=0.0, num_micro_batches=4)
    with pytest.raises(ValueError, match="num_slots"):
        moe.LayoutSlots(lambda layer, s: None, [1, 0])


def test_lookaheads_with_each_dispatch_a_progress_after_its_router():
    """dispatch_after_router: each dispatch_l a position of its own after dense_router_l's, the
    positions after it one on (max_depth 5L); where dense_router_l's lookahead is above 0 its
    dispatch runs a progress later."""
    assert moe.max_depth(2, True) == 10 and moe.max_depth(3, True) == 15
    la = moe.stage_lookaheads(2, 10, True)
    assert [la[n] for n in TWO_LAYER_CHAIN] == \
        [10, 9, 8, 8, 7, 6, 5, 5, 4, 4, 3, 3, 3, 2, 2, 1, 1, 1, 0]
    assert moe.stage_lookaheads(2, 0, True) == moe.stage_lookaheads(2, 0)
    for depth in range(11):
        la = moe.stage_lookaheads(2, depth, True)
        apart = [la[f"dense_router_{l}"] > la[f"dispatch_{l}"] for l in range(2)]
        assert apart == [depth > 0, depth > 3], depth
        assert moe.dispatches_after_routers(la, 2) is (depth > 3)
        assert moe.num_layout_slots(2, depth, True) == [
            la[f"dispatch_{l}"] - la[f"dispatch_bwd_{l}"] + 1 for l in range(2)]
    assert moe.num_layout_slots(2, 10, True) == [9, 4]
    assert moe.moe_schedule(2, 10, dispatch_after_router=True).run_order() == list(
        moe.stage_lookaheads(2, 10, True))
    with pytest.raises(ValueError, match=r"depth must be in \[0, 10\]"):
        moe.stage_lookaheads(2, 11, True)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 8\]"):
        moe.PipelinedStep(moe.MoEModel(dispatcher=moe.LocalDispatcher(8), **SMALL),
                          moe.LayoutSlots.shared(moe.LocalDispatcher(8), 2), 4, depth=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("depth", [0, 1, 4, moe.max_depth(2, True)])
def test_all_to_all_step_runs_each_dispatch_a_progress_after_its_router(depth):
    """The all_to_all dispatcher's dispatch waits on the host for the sizes its layout counted in
    the router stage: PipelinedStep's default family for it puts each dispatch a progress after
    its router (where the depth parts them), on one engine thread where the depth parts every
    layer's and on two (compute and comm) where one waits beside its router; the bits are the
    serial step's. The other dispatchers keep the family of shared positions."""
    d = moe.AllToAllDispatcher(None, 8)
    slots = moe.LayoutSlots.shared(d, 2)
    assert d.dispatch_waits_for_layout and moe.default_dispatch_after_router(slots)
    assert moe.default_num_threads(slots, dispatch_after_router=True) == 1
    assert moe.default_num_threads(slots) == 2
    for other in (moe.LocalDispatcher(8), NeverWaitingDispatcher(8), ThreeCallDispatcher(8)):
        assert not moe.default_dispatch_after_router(moe.LayoutSlots.shared(other, 2))
    mixed = moe.LayoutSlots(lambda layer, s: moe.LocalDispatcher(8) if layer else d, [1, 1])
    assert not moe.default_dispatch_after_router(mixed)
    assert moe.default_num_threads(mixed, dispatch_after_router=True) == 2
    emulated = moe.EmulatedDispatcher(d, moe.A2A_2XH200, num_sms=4, hold=lambda *_: None)
    assert emulated.dispatch_waits_for_layout
    assert not moe.EmulatedDispatcher(moe.LocalDispatcher(8), moe.A2A_2XH200, num_sms=4,
                                      hold=lambda *_: None).dispatch_waits_for_layout
    M = 4
    serial = moe.MoEModel(dispatcher=d, seed=11, **SMALL)
    piped = copy.deepcopy(serial)
    step = moe.PipelinedStep(piped, slots, M, depth=depth, trace=True)
    assert step.dispatch_after_router
    assert sorted(step.engine.threads) == (["host"] if depth > 3 else ["comm", "compute"])
    for i in range(2):
        x, target = _inputs(i)
        assert torch.equal(step(x, target, lr=0.05), moe.serial_step(serial, x, target, 0.05, M))
        assert _same_bits(serial.parameters(), piped.parameters()), i
        trace = step.engine.take_trace()  # a step's batches are 0 .. M - 1
        spans = {(trace.task_names[s.task], s.batch): s for s in trace.host_spans}
        assert sorted({b for _, b in spans}) == list(range(M))
        for layer, parted in enumerate([depth > 0, depth > 3]):
            for b in range(M):
                router = spans[f"dense_router_{layer}", b]
                dispatch = spans[f"dispatch_{layer}", b]
                assert (dispatch.iteration > router.iteration) is parted, (i, layer, b)
                assert dispatch.begin_us >= router.end_us
                assert dispatch.iteration <= spans[f"experts_{layer}", b].iteration
    step.close()
    with_router = moe.PipelinedStep(copy.deepcopy(serial), slots, M, depth=min(depth, 8),
                                    dispatch_after_router=False)
    assert not with_router.dispatch_after_router
    assert sorted(with_router.engine.threads) == ["comm", "compute"]
    with_router.close()


class SlowBackwardCombine(moe.LocalDispatcher):
    """LocalDispatcher whose combine of gradients (dispatch_bwd's call, the only combine with
    weights) holds the comm thread for hold_s first: a backward dispatch that takes long."""

    def __init__(self, num_experts, hold_s):
        super().__init__(num_experts)
        self.hold_s = hold_s

    def combine(self, y, handle, weights=None):
        if weights is not None:
            time.sleep(self.hold_s)
        return super().combine(y, handle, weights=weights)


@pytest.mark.parametrize("depth", [0, moe.max_depth(2)])
def test_deferred_wgrad_runs_while_its_backward_dispatch_is_in_flight(depth):
    """experts_wgrad_l needs only experts_bwd_l: on the compute thread it starts while the comm
    thread is still in the same micro-batch's dispatch_bwd_l, whose consumer
    (dense_router_bwd_l) starts only after it; at every depth, and with the same bits as the
    serial step."""
    M = 4
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=5, **SMALL)
    piped = copy.deepcopy(serial)
    slow = SlowBackwardCombine(8, hold_s=0.05)
    step = moe.PipelinedStep(piped, moe.LayoutSlots.shared(slow, 2), M, depth=depth, trace=True,
                             thread_map=moe.moe_thread_map(2, 2))  # the comm on a thread apart
    x, target = _inputs(0)
    assert torch.equal(step(x, target, lr=0.05), moe.serial_step(serial, x, target, 0.05, M))
    assert _same_bits(serial.parameters(), piped.parameters())
    trace = step.engine.take_trace()
    step.close()
    spans = {(trace.task_names[s.task], s.batch): s for s in trace.host_spans}
    batches = sorted({b for _, b in spans})
    assert len(batches) == M
    for layer in range(2):
        for b in batches:
            comm = spans[f"dispatch_bwd_{layer}", b]
            assert spans[f"experts_wgrad_{layer}", b].begin_us < comm.end_us, (layer, b)
            assert spans[f"dense_router_bwd_{layer}", b].begin_us >= comm.end_us, (layer, b)


STAGE_US = {"dense_router": 300, "dispatch": 400, "experts": 900, "combine": 400, "loss": 200,
            "combine_bwd": 400, "experts_bwd": 1200, "dispatch_bwd": 400, "experts_wgrad": 600,
            "dense_router_bwd": 600}


def test_the_planner_draws_what_overlaps_what():
    costs = moe.moe_costs(2, STAGE_US)
    comm = {"dispatch", "combine", "combine_bwd", "dispatch_bwd"}
    compute_us = sum(2 * v if k != "loss" else v for k, v in STAGE_US.items() if k not in comm)
    comm_us = sum(2 * STAGE_US[k] for k in comm)
    step_us = {}
    for depth in range(moe.max_depth(2) + 1):
        v = plan.simulate(moe.moe_schedule(2, depth), moe.moe_thread_map(2), costs)
        step_us[depth] = v.timeline.step_us
        spans = v.timeline.gpu
        if depth == 1:  # the next micro-batch's first dispatch under this one's experts
            gpu = {s.task: (s.start_us, s.end_us) for s in spans}
            (a0, a1), (b0, b1) = gpu["dispatch_0"], gpu["experts_0"]
            assert a0 < b1 and b0 < a1
        if depth == moe.max_depth(2):  # every backward comm under some compute span
            for name in ("combine_bwd_1", "dispatch_bwd_1", "combine_bwd_0", "dispatch_bwd_0"):
                for c in (s for s in spans if s.task == name):
                    assert any(o.task.rsplit("_", 1)[0] not in comm and o.start_us < c.end_us
                               and c.start_us < o.end_us for o in spans), name
    # At depth 0 the serial sum but for each layer's dispatch_bwd, which runs under the deferred
    # wgrad of its micro-batch (which does not wait for it); at full depth the compute alone
    # (each comm fits under compute).
    assert step_us[0] == compute_us + comm_us - 2 * min(STAGE_US["experts_wgrad"],
                                                        STAGE_US["dispatch_bwd"])
    assert step_us[moe.max_depth(2)] == compute_us
    # Each deeper schedule puts one more comm task beside other micro-batches' compute: a
    # shorter step, but where that task is a dispatch_bwd (depths 5 and 7 -> 6 and 8), which
    # already ran under its wgrad (600 us >= 400 us).
    for d in range(moe.max_depth(2)):
        if d in (5, 7):
            assert step_us[d + 1] == step_us[d], d
        else:
            assert step_us[d + 1] < step_us[d], d


def _is_expert(name):
    return name.startswith("moe.") and not name.endswith("router")


def _gloo_rank(rank, world_size, own_layout_group):
    import torch.distributed as dist

    torch.set_num_threads(1)
    group = dist.group.WORLD
    # The sizes on the rows' group or on one of their own (the router stage makes the layout,
    # the comm thread exchanges it).
    layout_group = dist.new_group([0, 1]) if own_layout_group else None
    d = moe.AllToAllDispatcher(group, 8, layout_group=layout_group)
    if own_layout_group:  # a group of other ranks: rank 0's is [0], rank 1 is in none
        with pytest.raises(ValueError, match="layout_group must be a process group of group"):
            moe.AllToAllDispatcher(group, 8, layout_group=dist.new_group([0]))
    serial = moe.MoEModel(dispatcher=d, seed=3, **SMALL)    # this rank's 4 experts
    piped = moe.MoEModel(dispatcher=d, seed=3, **SMALL)
    ref = moe.MoEModel(dispatcher=moe.LocalDispatcher(8), seed=3, **SMALL)  # all 8
    step = moe.PipelinedStep(piped, moe.LayoutSlots.shared(d, 2), num_micro_batches=3, depth=8)
    for i in range(2):
        x, target = _inputs(i, rank, tokens=48)
        a = moe.serial_step(serial, x, target, lr=0.0, num_micro_batches=3)
        c = step(x, target, lr=0.0)
        assert torch.equal(a, c) and _same_bits(_grads(serial), _grads(piped)), (rank, i)
        # The reference: both ranks' tokens on one device. Each rank's loss is its tokens'
        # mean, so the reference's gradients are the ranks' mean (dense, router) and half of
        # the expert gradients (which sum both ranks' tokens).
        both = [_inputs(i, r, tokens=48) for r in range(2)]
        ref_loss = moe.train_step(ref, torch.cat([b[0] for b in both]),
                                  torch.cat([b[1] for b in both]), lr=0.0)
        loss = a.clone()
        dist.all_reduce(loss, group=group)
        grads = []
        for name, p in serial.named_parameters():
            g = p.grad.float()
            if _is_expert(name):
                grads.append(g / 2)
            else:
                dist.all_reduce(g, group=group)
                grads.append(g / 2)
        ref_grads = []
        for name, p in ref.named_parameters():
            g = p.grad
            if _is_expert(name):
                g = g[rank * 4:(rank + 1) * 4]
            ref_grads.append(g)
        _assert_close_to_reference(loss / 2, ref_loss, grads, ref_grads)
    step.close()


@pytest.mark.timeout(100)
@pytest.mark.parametrize("own_layout_group", [False, True])
def test_all_to_all_over_gloo_two_ranks(tmp_path, own_layout_group):
    run_ranks(_gloo_rank, 2, tmp_path / "store", own_layout_group, timeout_s=90)


class LayoutRecordingDispatcher(moe.AllToAllDispatcher):
    """The all_to_all dispatcher at one rank, recording whether each dispatch came with the
    layout that layout_begin made for its own selections."""

    def __init__(self, num_experts):
        super().__init__(None, num_experts)
        self.begun, self.calls = [], []

    def layout_begin(self, topk_idx):
        layout = super().layout_begin(topk_idx)
        self.begun.append((topk_idx, layout))
        return layout

    def dispatch(self, x, topk_idx, topk_weights, layout=None):
        self.calls.append(any(t is topk_idx and b is layout for t, b in self.begun))
        return super().dispatch(x, topk_idx, topk_weights, layout)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("depth", [0, 8])
def test_each_dispatch_takes_the_layout_its_router_stage_began(depth):
    serial = moe.MoEModel(dispatcher=moe.AllToAllDispatcher(None, 8), seed=4, **SMALL)
    d = LayoutRecordingDispatcher(8)
    piped = moe.MoEModel(dispatcher=d, seed=4, **SMALL)
    step = moe.PipelinedStep(piped, moe.LayoutSlots.shared(d, 2), num_micro_batches=3,
                             depth=depth)
    for i in range(2):
        x, target = _inputs(i)
        a = moe.serial_step(serial, x, target, lr=0.05, num_micro_batches=3)
        c = step(x, target, lr=0.05)
        assert torch.equal(a, c) and _same_bits(serial.parameters(), piped.parameters()), i
    step.close()
    # 2 steps x 3 micro-batches x 2 layers, each dispatch with the layout begun for it
    assert d.calls == [True] * 12 and len(d.begun) == 12


# -- on a GPU (world size 1: every expert local) --------------------------------------------------

def _ep_slots(num_slots, tokens):
    return moe.LayoutSlots.ep(None, 16, num_slots, max_tokens=tokens)


GPU_SHAPE = dict(num_layers=2, hidden=256, num_experts=16, top_k=4, ffn=128, device="cuda")


@needs_gpus(1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("depth", range(moe.max_depth(2) + 1))
def test_weft_ep_pipelined_step_agrees_with_serial_bit_for_bit_on_gpu(depth):
    torch.manual_seed(4)
    T, M = 512, 4
    serial_slots = _ep_slots([1, 1], T // M)
    piped_slots = _ep_slots(moe.num_layout_slots(2, depth), T // M)
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=5, **GPU_SHAPE)
    piped = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=5, **GPU_SHAPE)
    ref = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=5, **GPU_SHAPE)
    step = moe.PipelinedStep(piped, piped_slots, num_micro_batches=M, depth=depth,
                             backend="torch")
    _check_steps(serial, piped, ref, step,
                 [_inputs(i, tokens=T, hidden=256, device="cuda") for i in range(5)], lr=0.02,
                 serial_slots=serial_slots)
    assert _relayouts(serial_slots) == 0 and _relayouts(piped_slots) == 0
    step.close()


@needs_gpus(1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("depth,num_threads", [(0, None), (1, None), (4, None),
                                               (moe.max_depth(2), None), (1, 2),
                                               (moe.max_depth(2), 2)])
def test_native_weft_ep_pipelined_step_agrees_with_serial_bit_for_bit_on_gpu(depth, num_threads):
    """NativeEpDispatcher: the dispatch stage begins, the experts stage finishes (on another
    stream and, at depth >= 1, in a later progress(); with two engine threads on another
    thread: None is PipelinedStep's choice, one); the bits of the serial step with it and of
    the serial step with the DeepEP-compatible EpDispatcher."""
    T, M = 512, 4
    native_slots = moe.LayoutSlots.native_ep(None, 16, [1, 1], max_tokens=T // M)
    piped_slots = moe.LayoutSlots.native_ep(None, 16, moe.num_layout_slots(2, depth),
                                            max_tokens=T // M)
    serial = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=5, **GPU_SHAPE)
    piped = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=5, **GPU_SHAPE)
    deepep = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=5, **GPU_SHAPE)
    deepep_slots = _ep_slots([1, 1], T // M)
    ref = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=5, **GPU_SHAPE)
    step = moe.PipelinedStep(piped, piped_slots, num_micro_batches=M, depth=depth,
                             backend="torch", thread_map=moe.moe_thread_map(2, num_threads)
                             if num_threads else None)
    assert len(step.engine.threads) == (num_threads or 1)
    inputs = [_inputs(i, tokens=T, hidden=256, device="cuda") for i in range(5)]
    _check_steps(serial, piped, ref, step, inputs, lr=0.02, serial_slots=native_slots)
    for x, target in inputs:
        moe.serial_step(deepep, x, target, 0.02, M, deepep_slots)
    assert _same_bits(deepep.parameters(), piped.parameters())
    step.close()


@needs_gpus(1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("depth,after_router,num_threads", [
    (1, None, 2), (moe.max_depth(2, True), None, 1), (moe.max_depth(2), False, 2)])
def test_all_to_all_pipelined_step_agrees_with_serial_on_gpu(depth, after_router, num_threads):
    """PipelinedStep's default family for the all_to_all dispatcher (each dispatch a progress
    after its router: one engine thread at a depth that parts every layer's, two at depth 1,
    where layer 1's waits beside its router) and the family of the others (two threads)."""
    T, M = 512, 4
    d = moe.AllToAllDispatcher(None, 16)
    serial = moe.MoEModel(dispatcher=d, seed=6, **GPU_SHAPE)
    piped = moe.MoEModel(dispatcher=d, seed=6, **GPU_SHAPE)
    step = moe.PipelinedStep(piped, moe.LayoutSlots.shared(d, 2), num_micro_batches=M,
                             depth=depth, backend="torch", dispatch_after_router=after_router)
    assert step.dispatch_after_router is (after_router is None)
    assert len(step.engine.threads) == num_threads
    for i in range(3):
        x, target = _inputs(i, tokens=T, hidden=256, device="cuda")
        a = moe.serial_step(serial, x, target, 0.02, M)
        c = step(x, target, lr=0.02)
        torch.cuda.synchronize()
        assert torch.equal(a, c) and _same_bits(serial.parameters(), piped.parameters()), i
    step.close()


@needs_gpus(1)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("dispatcher", ["weft.ep", "weft.ep native", "local", "all_to_all"])
def test_no_stage_but_the_dispatch_waits_for_the_device(dispatcher):
    """torch's sync debug mode raises in every stage but the dispatch (weft.ep's DeepEP API
    reads the layout's counts to the host once, as weft.ep's dispatch does anyway; the local
    one its rows; the all_to_all one its sizes, counted in the router stage); the experts take
    their group offsets on the device. NativeEpDispatcher's count wait (in the experts stage, on
    the count the kernel publishes) is no torch sync: no stage is exempt."""
    from weft.moe.experts import uses_grouped_mm
    from weft.moe.step import _Stages, chain, micro_batches

    T, M = 512, 4
    model = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=8, **GPU_SHAPE)
    if not uses_grouped_mm(torch.empty((1, 256), dtype=torch.bfloat16, device="cuda"),
                           model.moe[0].w13):
        pytest.skip("torch._grouped_mm is not available on this device: the experts read their "
                    "group sizes to the host")
    slots = {"weft.ep": lambda: _ep_slots([1, 1], T // M),
             "weft.ep native": lambda: moe.LayoutSlots.native_ep(None, 16, [1, 1],
                                                                 max_tokens=T // M),
             "local": lambda: moe.LayoutSlots.shared(moe.LocalDispatcher(16), 2),
             "all_to_all": lambda: moe.LayoutSlots.shared(moe.AllToAllDispatcher(None, 16),
                                                          2)}[dispatcher]()
    exempt = None if dispatcher == "weft.ep native" else "dispatch"
    stages = _Stages(model, slots)
    x, target = _inputs(0, tokens=T, hidden=256, device="cuda")
    for mb in micro_batches(x, target, M, 2):
        for name, stage, layer in chain(2):
            torch.cuda.set_sync_debug_mode(0 if stage == exempt else "error")
            try:
                stages.run(mb, stage, layer)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(p.grad is not None for p in model.parameters())
    # The same step without the debug mode: the same gradients (the stages did their work).
    ref = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), seed=8, **GPU_SHAPE)
    moe.serial_step(ref, x, target, 0.0, M, slots)
    assert _same_bits(_grads(model), _grads(ref))
