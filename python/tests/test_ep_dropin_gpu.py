"""weft.ep's DeepEP layer on one GPU under the uses that broke it: windows laid out anew or grown
while older handles live, previous_event from work still running elsewhere, results whose
memory the caching allocator could hand out, inputs dropped right after an async call, the GIL
while a call waits, worst-case row counts above the window, and what a script leaves at exit."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
import weft.ep  # noqa: E402

import ep_reference as ref  # noqa: E402
from conftest import needs_gpus  # noqa: E402
from test_ep_gpu import deepep_layout, inputs  # noqa: E402

pytestmark = [needs_gpus(1), pytest.mark.timeout(600)]
PACKAGE_ROOT = os.path.dirname(os.path.dirname(weft.__file__))


def dispatch(buf, x, idx, w, num_experts, **kw):
    """buf.dispatch of CPU inputs (x: a tensor, or the fp8 pair already on the device)."""
    x = x.cuda() if isinstance(x, torch.Tensor) else x
    return buf.dispatch(x, topk_idx=idx.cuda(), topk_weights=w.cuda(),
                        **deepep_layout(buf, idx.cuda(), num_experts), **kw)


def slow_on(stream, fn, cycles=200_000_000):
    """fn's result, computed on stream after a spin of ~0.1 s: work still running when the
    host goes on."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
        return fn()


def test_the_buffer_works_before_its_first_dispatch():
    buf = weft.ep.Buffer(None, int(1e9), explicitly_destroy=True)
    assert buf.get_local_device_id() == torch.cuda.current_device()
    assert isinstance(buf.get_comm_stream(), torch.cuda.Stream)
    buf.destroy()
    with pytest.raises(weft.Error, match="destroyed"):
        buf.get_comm_stream()


def test_the_handle_is_a_tuple_with_the_rank_prefix_matrix():
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(300, 512, 16, 4, 0.2, seed=1)
    (want,) = ref.dispatch([x], [idx], [w], 16)
    _, _, _, _, handle, _ = dispatch(buf, x, idx, w, 16)
    assert isinstance(handle, tuple) and len(handle) == 6
    assert handle[0].tolist() == [[want.x.shape[0]]]
    assert torch.equal(handle[3].cpu(), want.src[:, 1])


def test_a_window_laid_out_for_other_shapes_refuses_older_handles():
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(100, 512, 16, 4, 0.1, seed=2)
    _, _, _, _, old, _ = dispatch(buf, x, idx, w, 16)
    x2, idx2, w2 = inputs(100, 1024, 16, 4, 0.1, seed=3)
    dispatch(buf, x2, idx2, w2, 16)  # hidden 1024: a new window
    y = torch.zeros((old.layout.num_rows, 512), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(weft.Error, match="hidden 512.*laid out for hidden 1024"):
        buf.combine(y, old)
    with pytest.raises(weft.Error, match="hidden 512.*laid out for hidden 1024"):
        buf.dispatch(x.cuda(), handle=old)


def test_a_bad_input_is_refused_before_the_window_is_laid_out_anew():
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(100, 512, 16, 4, 0.1, seed=4)
    (want,) = ref.dispatch([x], [idx], [w], 16)
    _, _, _, _, handle, _ = dispatch(buf, x, idx, w, 16)
    x2, idx2, w2 = inputs(100, 1024, 16, 4, 0.1, seed=5)
    lay = deepep_layout(buf, idx2.cuda(), 16)
    lay["is_token_in_rank"] = lay["is_token_in_rank"][:7].contiguous()
    with pytest.raises(weft.Error, match="is_token_in_rank"):
        buf.dispatch(x2.cuda(), topk_idx=idx2.cuda(), topk_weights=w2.cuda(), **lay)
    scales_bad = (x2.cuda().to(torch.float8_e4m3fn), torch.ones((100, 3), device="cuda"))
    with pytest.raises(weft.Error, match="scales"):
        buf.dispatch(scales_bad, topk_idx=idx2.cuda(), topk_weights=w2.cuda(),
                     **deepep_layout(buf, idx2.cuda(), 16))
    # The first window is still the one in place: its handle combines with no re-run.
    y = torch.randn((want.x.shape[0], 512)).bfloat16()
    out, _, _ = buf.combine(y.cuda(), handle)
    (want_out,) = ref.combine([want], [y], [100])
    assert torch.equal(out.cpu(), want_out) and buf.num_relayouts == 0


def test_a_dispatch_above_the_window_grows_it_and_older_handles_stay_valid():
    hidden, experts = 1024, 16
    buf = weft.ep.Buffer(None, weft.ep.sizing.window_bytes_for(64, hidden, 1, 8, experts))
    small = inputs(50, hidden, experts, 4, 0.1, seed=6)
    (want_small,) = ref.dispatch([small[0]], [small[1]], [small[2]], experts)
    _, _, _, _, old, _ = dispatch(buf, *small, experts)
    big = inputs(700, hidden, experts, 4, 0.1, seed=7)
    (want_big,) = ref.dispatch([big[0]], [big[1]], [big[2]], experts)
    rx, ridx, rw, counts, handle, _ = dispatch(buf, *big, experts)
    assert buf.num_regrowths == 1
    assert torch.equal(rx.cpu(), want_big.x) and torch.equal(rw.cpu(), want_big.weights)
    assert counts == want_big.tokens_per_local_expert.tolist()
    y = torch.randn((want_small.x.shape[0], hidden)).bfloat16()
    out, _, _ = buf.combine(y.cuda(), old)  # the older handle, on the grown window
    (want_out,) = ref.combine([want_small], [y], [50])
    assert torch.equal(out.cpu(), want_out)
    dispatch(buf, *big, experts)
    assert buf.num_regrowths == 1  # the grown window holds it now


def test_previous_event_from_work_still_running_elsewhere_orders_bf16_and_fp8():
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(400, 1024, 16, 4, 0.1, seed=8)
    (want,) = ref.dispatch([x], [idx], [w], 16)
    x8, scales = ref.per_token_cast_to_fp8(x)
    lay = deepep_layout(buf, idx.cuda(), 16)
    side = torch.cuda.Stream()
    for payload in ("bf16", "fp8"):
        for async_finish in (False, True):
            if payload == "bf16":
                cur = slow_on(side, lambda: x.cuda(non_blocking=False).clone())
            else:
                cur = slow_on(side, lambda: (x8.cuda().clone(),
                                             scales.t().contiguous().t().cuda().clone()))
            event = weft.ep.EventOverlap(weft.ep.EventHandle(side))
            recv, _, _, _, _, done = buf.dispatch(cur, topk_idx=idx.cuda(),
                                                  topk_weights=w.cuda(), previous_event=event,
                                                  async_finish=async_finish, **lay)
            if async_finish:
                done.current_stream_wait()
            if payload == "bf16":
                assert torch.equal(recv.cpu(), want.x)
            else:
                rows = want.src[:, 1].long()
                assert torch.equal(recv[0].cpu().view(torch.uint8), x8.view(torch.uint8)[rows])
                assert torch.equal(recv[1].cpu(), scales[rows])


def _segment_stream(t: torch.Tensor) -> int:
    """The stream that owns the caching allocator's segment holding t."""
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]:
            return seg["stream"]
    raise AssertionError("no segment holds the tensor")


def test_results_are_allocated_on_the_callers_stream():
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(256, 512, 16, 4, 0.1, seed=9)
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        per_rank, _, per_expert, in_rank, event = buf.get_dispatch_layout(
            idx.cuda(), 16, previous_event=buf.capture(), async_finish=True)
        event.current_stream_wait()
        rx, ridx, rw, _, handle, event = buf.dispatch(
            x.cuda(), topk_idx=idx.cuda(), topk_weights=w.cuda(), num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=buf.capture(), async_finish=True)
        event.current_stream_wait()
        out, cw, event = buf.combine(rx, handle, topk_weights=rw, previous_event=buf.capture(),
                                     async_finish=True)
        event.current_stream_wait()
    for t in (per_rank, per_expert, in_rank, rx, ridx, rw, handle[0], out, cw):
        assert _segment_stream(t) == caller.cuda_stream


@pytest.mark.parametrize("top_k", [4, 8])
def test_allocate_on_comm_stream_puts_every_result_there(top_k):
    """allocate_on_comm_stream (with previous_event and async_finish, as DeepEP requires): the
    owned results of the host-synced, the num_worst_tokens and the cached dispatch are allocated
    on the comm stream and match the reference. Top-8 fits the window's selections (the owned
    tensors made before the launch), top-4 is widened first."""
    hidden, experts = 512, 16
    buf = weft.ep.Buffer(None, int(1e9))
    comm = buf.get_comm_stream().cuda_stream
    x, idx, w = inputs(256, hidden, experts, top_k, 0.2, seed=12)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    n = want.x.shape[0]
    layout = deepep_layout(buf, idx.cuda(), experts)
    stream_args = dict(allocate_on_comm_stream=True, async_finish=True)
    for worst in (0, n + 5):
        rx, ridx, rw, _, handle, event = buf.dispatch(
            x.cuda(), topk_idx=idx.cuda(), topk_weights=w.cuda(), num_worst_tokens=worst,
            previous_event=buf.capture(), **layout, **stream_args)
        event.current_stream_wait()
        for t in (rx, ridx, rw, handle[0], handle[3]):
            assert _segment_stream(t) == comm
        assert torch.equal(rx.cpu()[:n], want.x), worst
        assert torch.equal(ridx.cpu()[:n], want.expert_idx.long()), worst
        assert torch.equal(rw.cpu()[:n], want.weights), worst
    y = torch.randn((256, hidden)).bfloat16()
    cached, _, _, _, _, event = buf.dispatch(y.cuda(), handle=handle,
                                             previous_event=buf.capture(), **stream_args)
    event.current_stream_wait()
    assert _segment_stream(cached) == comm
    assert torch.equal(cached.cpu()[:n], y[want.src[:, 1].long()])


def test_inputs_and_handles_dropped_after_an_async_call_are_kept_for_it():
    hidden, experts = 2048, 16
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(512, hidden, experts, 4, 0.1, seed=10)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    n = want.x.shape[0]
    y = torch.randn((n, hidden)).bfloat16()
    (want_out,) = ref.combine([want], [y], [512])
    for _ in range(20):
        _, _, rw, _, handle, _ = dispatch(buf, x, idx, w, experts)
        y_dev, rw_dev = y.cuda(), rw.clone()
        torch.cuda._sleep(100_000_000)  # the caller's stream is busy: the call waits for it
        out, cw, event = buf.combine(y_dev, handle, topk_weights=rw_dev, async_finish=True)
        del y_dev, rw_dev, handle  # their memory must not be handed out under the call
        scribble = [torch.full((n, hidden), 7.0, dtype=torch.bfloat16, device="cuda"),
                    torch.full((n, 4), 7.0, device="cuda")]
        event.current_stream_wait()
        assert torch.equal(out.cpu(), want_out)
        sent = (idx >= 0).any(dim=1)
        assert torch.equal(cw.cpu()[sent], torch.where(idx >= 0, w, 0)[sent])
        del scribble


def test_num_worst_tokens_above_the_window_pads_the_rows():
    hidden, experts = 512, 16
    buf = weft.ep.Buffer(None, int(1e9), max_tokens=64)
    x, idx, w = inputs(64, hidden, experts, 4, 0.2, seed=11)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    n = want.x.shape[0]
    rx, ridx, rw, counts, handle, _ = dispatch(buf, x, idx, w, experts, num_worst_tokens=200)
    assert counts == [] and rx.shape[0] == 200
    assert torch.equal(rx[:n].cpu(), want.x)
    assert (ridx[n:] == -1).all() and (rw[n:] == 0).all()
    assert (handle[3][n:] == 64).all()
    y = torch.randn((200, hidden)).bfloat16()
    out, _, _ = buf.combine(y.cuda(), handle)
    (want_out,) = ref.combine([want], [y[:n]], [64])
    assert torch.equal(out.cpu(), want_out)


def test_a_waiting_call_lets_other_python_threads_run():
    buf = weft.ep.NativeBuffer(None, max_tokens=256, hidden=512, num_experts=16, top_k=4)
    x, idx, w = (t.cuda() for t in inputs(256, 512, 16, 4, 0.1, seed=12))
    buf.dispatch(x, idx, w, sync_count=True)
    ticks = []
    stop = threading.Event()

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s of device work before the dispatch
        start = time.perf_counter()
        buf.dispatch(x, idx, w, sync_count=True)  # waits on the host for its count
        end = time.perf_counter()
    finally:
        stop.set()
        t.join()
    assert end - start > 0.1, "the call did not wait: the test proves nothing"
    during = [s for s in ticks if start < s < end]
    assert len(during) > 20, f"{len(during)} ticks in {end - start:.3f} s: the GIL was held"


def test_a_plain_then_an_expanded_dispatch_on_one_buffer():
    buf = weft.ep.NativeBuffer(None, max_tokens=128, hidden=256, num_experts=8, top_k=3,
                               expand_factor=4)
    x, idx, w = (t.cuda() for t in inputs(100, 256, 8, 3, 0.1, seed=13))
    plain = buf.dispatch(x, idx, w, sync_count=True)
    assert plain.segment_begin is None
    expanded = buf.dispatch(x, idx, w, expand=weft.ep.Expand(expert_alignment=4),
                            sync_count=True)
    assert expanded.segment_begin is not None and expanded.segment_begin.shape == (9,)


def test_the_moe_docstring_example_runs():
    import weft.moe as moe

    group = None
    layer = moe.MoELayer(hidden=256, num_experts=16, top_k=4, ffn=64,
                         dispatcher=moe.EpDispatcher(weft.ep.Buffer(group, 2**31), 16),
                         device="cuda")
    x = torch.randn((64, 256), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad.float()).all()
    text = moe.__doc__
    assert "EpDispatcher(weft.ep.Buffer(group, 2**31), 128)" in text


def test_a_script_with_a_buffer_exits_cleanly():
    script = textwrap.dedent("""
        import torch, weft.ep, weft.moe as moe
        buf = weft.ep.Buffer(None, int(1e9))
        layer = moe.MoELayer(hidden=256, num_experts=16, top_k=4, ffn=64,
                             dispatcher=moe.EpDispatcher(buf, 16), device="cuda")
        x = torch.randn((64, 256), device="cuda", dtype=torch.bfloat16, requires_grad=True)
        y = layer(x)
        y.float().sum().backward()
        native = weft.ep.NativeBuffer(None, max_tokens=64, hidden=256, num_experts=16, top_k=4)
        res = native.dispatch(x.detach(), torch.zeros((64, 4), dtype=torch.int64, device="cuda"),
                              torch.ones((64, 4), device="cuda"))
        view = res.recv_x  # a view of the window, alive at exit
        torch.cuda.synchronize()
        print("done")
    """)
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done"
    assert "leak" not in r.stderr, r.stderr
    assert r.stderr.strip() == "", r.stderr


def test_a_handle_that_is_not_this_buffers_is_refused():
    buf = weft.ep.Buffer(None, int(1e9))
    other = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(50, 512, 16, 4, 0.1, seed=14)
    _, _, _, _, theirs, _ = dispatch(other, x, idx, w, 16)
    dispatch(buf, x, idx, w, 16)
    y = torch.zeros((50, 512), dtype=torch.bfloat16, device="cuda")
    for handle, match in ((object(), "handle must come from this Buffer's dispatch"),
                          ((1, 2, 3), "handle must come from this Buffer's dispatch"),
                          (theirs, "another Buffer")):
        with pytest.raises(weft.Error, match=match):
            buf.combine(y, handle)
        with pytest.raises(weft.Error, match=match):
            buf.dispatch(y, handle=handle)


@pytest.mark.parametrize("layout", ["row-major", "column-major", "strided"])
def test_fp8_scales_are_read_where_they_are(layout):
    """The kernel packs the fp8 pair on the way (no pack pass): every received payload byte and
    scale equals the sender's, whatever the scales' strides; the native result's packed rows equal
    pack_fp8's."""
    num_tokens, hidden, experts = 300, 1024, 16
    x, idx, w = inputs(num_tokens, hidden, experts, 4, 0.2, seed=21)
    x8, scales = ref.per_token_cast_to_fp8(x)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    src = want.src[:, 1].long()
    if layout == "column-major":
        s = scales.t().contiguous().t().cuda()
    elif layout == "strided":  # every other column of a wider tensor, and not contiguous rows
        wide = torch.full((num_tokens, 2 * scales.shape[1]), float("nan"))
        wide[:, ::2] = scales
        s = wide.cuda()[:, ::2]
    else:
        s = scales.cuda()
    buf = weft.ep.Buffer(None, int(1e9))
    rx, _, _, _, _, _ = dispatch(buf, (x8.cuda(), s), idx, w, experts)
    assert torch.equal(rx[0].cpu().view(torch.uint8), x8.view(torch.uint8)[src])
    assert torch.equal(rx[1].cpu(), scales[src])
    native = weft.ep.NativeBuffer(None, max_tokens=num_tokens, hidden=hidden, num_experts=experts,
                                 top_k=4)
    res = native.dispatch((x8.cuda(), s), idx.cuda(), w.cuda(), sync_count=True)
    packed = weft.ep.pack_fp8(x8, scales, native.fp8_row_bytes)[src]
    got = torch.cat([res.recv_x[0].view(torch.uint8), res.recv_x[1].view(torch.uint8)], 1)
    assert torch.equal(got.cpu(), packed[:, :got.shape[1]])


@pytest.mark.parametrize("top_k", [4, 8])
def test_a_thousand_owned_dispatches_back_to_back_each_match_the_reference(top_k):
    """Counts read early (as soon as the count exchange ends), owned tensors filled by one copy
    kernel: 1000 calls with fresh routing, every row, index, weight and count checked; top-8
    fits the window's selections as they are, top-4 is widened to it first."""
    num_tokens, hidden, experts = 96, 256, 16
    buf = weft.ep.Buffer(None, int(1e9))
    g = torch.Generator().manual_seed(22)
    for i in range(1000):
        x = torch.randn((num_tokens, hidden), generator=g).bfloat16()
        idx = ref.random_routing(num_tokens, experts, top_k, g, 0.3)
        w = torch.rand((num_tokens, top_k), generator=g)
        (want,) = ref.dispatch([x], [idx], [w], experts)
        rx, ridx, rw, counts, handle, _ = dispatch(buf, x, idx, w, experts)
        assert torch.equal(rx.cpu(), want.x), i
        assert torch.equal(ridx.cpu(), want.expert_idx.long()), i
        assert torch.equal(rw.cpu(), want.weights), i
        assert counts == [(idx == e).sum().item() for e in range(experts)], i
        assert torch.equal(handle[3].cpu(), want.src[:, 1]), i


@pytest.mark.parametrize("fp8", [False, True])
def test_owned_tensors_are_made_again_at_the_count_where_the_bound_falls_short(monkeypatch, fp8):
    """An owned dispatch makes its tensors but recv_x before the launch, for a bound of rows
    that a peer with more tokens can exceed; then they are made again at the count. Forced here
    (a third of the tokens): every row, scale, index and weight still matches, and so do the
    rows of calls that fit the bound (masked tokens: fewer rows than the bound, narrowed). Top-8,
    the window's: the path of selections that fit it (fewer columns are widened first)."""
    num_tokens, hidden, experts, top_k = 96, 256, 16, 8
    buf = weft.ep.Buffer(None, int(1e9))
    g = torch.Generator().manual_seed(23)
    real_bound = weft.ep.Buffer._owned_rows_bound
    bounds = []

    def short_bound(self, n, worst):
        bounds.append(n // 3)
        return n // 3

    def spied_bound(self, n, worst):
        bounds.append(real_bound(self, n, worst))
        return bounds[-1]

    for short in (True, False, True):
        monkeypatch.setattr(weft.ep.Buffer, "_owned_rows_bound",
                            short_bound if short else spied_bound)
        for i in range(10):
            x = torch.randn((num_tokens, hidden), generator=g).bfloat16()
            idx = ref.random_routing(num_tokens, experts, top_k, g, 0.5)
            idx[i % 7::7] = -1  # tokens that select nothing: fewer rows than tokens
            w = torch.rand((num_tokens, top_k), generator=g)
            (want,) = ref.dispatch([x], [idx], [w], experts)
            if fp8:
                x8, scales = ref.per_token_cast_to_fp8(x)
                rx, ridx, rw, _, handle, _ = dispatch(buf, (x8.cuda(), scales.cuda()), idx, w,
                                                      experts)
                src = want.src[:, 1].long()
                assert torch.equal(rx[0].cpu().view(torch.uint8), x8.view(torch.uint8)[src]), i
                assert torch.equal(rx[1].cpu(), scales[src]), i
            else:
                rx, ridx, rw, _, handle, _ = dispatch(buf, x, idx, w, experts)
                assert torch.equal(rx.cpu(), want.x), i
            assert torch.equal(ridx.cpu(), want.expert_idx.long()), i
            assert torch.equal(rw.cpu(), want.weights), i
            assert torch.equal(handle[3].cpu(), want.src[:, 1]), i
            # The path under test ran, and the rows were above the short bound or below the
            # real one (narrowed).
            rows = want.x.shape[0]
            assert len(bounds) == 1 and (rows > bounds[0] if short else rows < bounds[0]), i
            bounds.clear()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("headroom", [0.0, 0.25, None])
def test_recv_x_is_made_before_the_count_where_the_latest_count_holds_it(fp8, headroom):
    """A host-synced owned dispatch makes recv_x before its count is known, for the latest
    count of as many tokens plus recv_x_headroom of it, and copies in the dispatch's own call;
    a larger count (or the first call, or recv_x_headroom=None) makes recv_x at the count.
    Counts that go up and down take both paths, counted by num_recv_x_at_count; every row,
    scale, index and weight matches the reference on either, and recv_x has exactly the
    count's rows."""
    num_tokens, hidden, experts, top_k = 128, 256, 16, 8
    buf = weft.ep.Buffer(None, int(1e9), recv_x_headroom=headroom)
    g = torch.Generator().manual_seed(29)
    # Tokens that select nothing: fewer rows received (128 masked: none, and the next call
    # has no count to go by).
    masked = [40, 10, 30, 30, 0, 60, 61, 128, 100, 20]
    at_count, latest = 0, 0
    for i, num_masked in enumerate(masked):
        x = torch.randn((num_tokens, hidden), generator=g).bfloat16()
        idx = ref.random_routing(num_tokens, experts, top_k, g, 0.1)
        idx[torch.randperm(num_tokens, generator=g)[:num_masked]] = -1
        w = torch.rand((num_tokens, top_k), generator=g)
        (want,) = ref.dispatch([x], [idx], [w], experts)
        rows = want.x.shape[0]
        if fp8:
            x8, scales = ref.per_token_cast_to_fp8(x)
            rx, ridx, rw, _, handle, _ = dispatch(buf, (x8.cuda(), scales.cuda()), idx, w,
                                                  experts)
            src = want.src[:, 1].long()
            assert rx[0].shape[0] == rows and rx[1].shape[0] == rows, i
            assert torch.equal(rx[0].cpu().view(torch.uint8), x8.view(torch.uint8)[src]), i
            assert torch.equal(rx[1].cpu(), scales[src]), i
        else:
            rx, ridx, rw, _, handle, _ = dispatch(buf, x, idx, w, experts)
            assert rx.shape[0] == rows, i
            assert torch.equal(rx.cpu(), want.x), i
        assert torch.equal(ridx.cpu(), want.expert_idx.long()), i
        assert torch.equal(rw.cpu(), want.weights), i
        assert torch.equal(handle[3].cpu(), want.src[:, 1]), i
        x_rows = 0 if headroom is None else min(num_tokens, latest + int(latest * headroom))
        at_count += x_rows == 0 or rows > x_rows  # no recv_x before the count, or too few rows
        latest = rows
        assert buf.num_recv_x_at_count == at_count, i
    if headroom is not None:  # both paths ran (counts up, down, equal, zero)
        assert 0 < buf.num_recv_x_at_count < len(masked)
    # The count is kept per T: the first call of another T makes recv_x at its count.
    x, idx, w = inputs(64, hidden, experts, top_k, 0.1, seed=30)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    rx, _, _, _, _, _ = dispatch(buf, x, idx, w, experts)
    assert torch.equal(rx.cpu(), want.x)
    assert buf.num_recv_x_at_count == at_count + 1


def test_a_failure_after_the_held_launch_hands_the_callers_stream_back(monkeypatch):
    """An owned dispatch launches its kernel with the hand-off back to the caller's stream left
    to its copy; where the call fails between the two (here the regrowth of a window too small
    for the tokens), the caller's stream is still ordered after the comm stream before the
    error propagates, and the Buffer works afterwards."""
    hidden, experts = 256, 16
    buf = weft.ep.Buffer(None, int(1e9), max_tokens=64)
    x, idx, w = inputs(32, hidden, experts, 8, 0.1, seed=31)
    dispatch(buf, x, idx, w, experts)  # lays out the window for 64 tokens
    handed_back = []
    real_hand_back = weft.ep.NativeBuffer.hand_back

    def spied_hand_back(self, stream):
        handed_back.append(stream)
        real_hand_back(self, stream)

    def failed_growth(self, tokens_required):
        raise weft.Error("no room to grow (injected)")

    monkeypatch.setattr(weft.ep.NativeBuffer, "hand_back", spied_hand_back)
    monkeypatch.setattr(weft.ep.Buffer, "_grow", failed_growth)
    big, big_idx, big_w = inputs(128, hidden, experts, 8, 0.1, seed=32)
    with pytest.raises(weft.Error, match="injected"):
        dispatch(buf, big, big_idx, big_w, experts)
    assert handed_back == [torch.cuda.current_stream().cuda_stream]
    monkeypatch.undo()
    (want,) = ref.dispatch([x], [idx], [w], experts)
    rx, _, _, _, _, _ = dispatch(buf, x, idx, w, experts)
    assert torch.equal(rx.cpu(), want.x)


def test_a_failure_while_the_kernel_runs_hands_the_stream_back_and_abandons_the_count(
        monkeypatch):
    """A host-synced owned dispatch is launched first and makes its tensors while its kernel
    runs, then waits for the count (finish_dispatch). Where the making fails (here an injected
    error), the caller's stream is handed back, the count left unread is abandoned, and the
    next dispatches match the reference; finish_dispatch without a pending dispatch is a
    weft.Error."""
    hidden, experts = 256, 16
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(48, hidden, experts, 8, 0.1, seed=33)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    dispatch(buf, x, idx, w, experts)
    handed_back = []
    real_hand_back = weft.ep.NativeBuffer.hand_back

    def spied_hand_back(self, stream):
        handed_back.append(stream)
        real_hand_back(self, stream)

    def failed_making(*args, **kwargs):
        raise weft.Error("out of memory (injected)")

    monkeypatch.setattr(weft.ep.NativeBuffer, "hand_back", spied_hand_back)
    monkeypatch.setattr(weft.ep.Buffer, "_owned_meta", failed_making)
    with pytest.raises(weft.Error, match="injected"):
        dispatch(buf, x, idx, w, experts)
    assert handed_back == [torch.cuda.current_stream().cuda_stream]
    monkeypatch.undo()
    with pytest.raises(weft.Error, match="no dispatch launched with wait_later"):
        buf._native.finish_dispatch()
    for _ in range(3):
        rx, ridx, _, _, _, _ = dispatch(buf, x, idx, w, experts)
        assert torch.equal(rx.cpu(), want.x)
        assert torch.equal(ridx.cpu(), want.expert_idx.long())


def test_an_older_handle_is_laid_out_again_from_is_token_in_rank_alone():
    """The handle keeps no copy of the caller's selections: re-running an older layout needs only
    is_token_in_rank, so overwriting topk_idx after the dispatch changes nothing."""
    hidden, experts = 512, 16
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(120, hidden, experts, 4, 0.2, seed=23)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    idx_gpu = idx.cuda()
    _, _, _, _, old, _ = dispatch_on(buf, x, idx_gpu, w, experts)
    dispatch(buf, *inputs(80, hidden, experts, 4, 0.1, seed=24), experts)  # a newer layout
    idx_gpu.fill_(0)  # the caller reuses its tensor
    y = torch.randn((want.x.shape[0], hidden)).bfloat16()
    out, _, _ = buf.combine(y.cuda(), old)
    (want_out,) = ref.combine([want], [y], [120])
    assert torch.equal(out.cpu(), want_out) and buf.num_relayouts == 1
    cx, _, _, _, _, _ = buf.dispatch(x.cuda(), handle=old)
    assert buf.num_relayouts == 1  # the layout is in place again
    assert torch.equal(cx.cpu(), want.x)


def dispatch_on(buf, x, idx_gpu, w, num_experts):
    """dispatch() with the caller's own device selections (kept by the caller)."""
    return buf.dispatch(x.cuda(), topk_idx=idx_gpu, topk_weights=w.cuda(),
                        **deepep_layout(buf, idx_gpu, num_experts))


@pytest.mark.parametrize("top_k", [8, 4])  # the window's top-k, and fewer columns (widened)
def test_expert_alignment_rounds_each_count_up(top_k):
    """num_recv_tokens_per_expert_list: each local expert's received rows rounded up to a
    multiple of expert_alignment (rounded by the extension), on either dispatch path; an
    alignment the extension cannot hold is a weft.Error."""
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(200, 256, 16, top_k, 0.2, seed=4)
    (want,) = ref.dispatch([x], [idx], [w], 16)
    exact = want.tokens_per_local_expert.tolist()
    assert any(c % 4 for c in exact)  # the alignment changes something
    for alignment in (1, 4, 7):
        _, _, _, counts, _, _ = dispatch(buf, x, idx, w, 16, expert_alignment=alignment)
        assert counts == [-(-c // alignment) * alignment for c in exact], alignment
    for bad in (0, 2**31):
        with pytest.raises(weft.Error, match="expert_alignment"):
            dispatch(buf, x, idx, w, 16, expert_alignment=bad)


def test_deepep_combine_adds_one_bias_or_a_pair_with_optional_members():
    """DeepEP's combine(bias=...): one [T, hidden] tensor, or a pair whose members may be None,
    added to every token's sum in fp32 (the reference); a bias of the wrong shape is a
    weft.Error."""
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(150, 256, 16, 8, 0.2, seed=5)
    (received,) = ref.dispatch([x], [idx], [w], 16)
    recv_x, _, _, _, handle, _ = dispatch(buf, x, idx, w, 16)
    g = torch.Generator().manual_seed(6)
    b0, b1 = (torch.randn((150, 256), generator=g).bfloat16() for _ in range(2))
    for bias, given in ((b0, [b0]), ((b0, b1), [b0, b1]), ((b0, None), [b0]),
                        ((None, b1), [b1])):
        cuda_bias = bias.cuda() if isinstance(bias, torch.Tensor) else \
            tuple(None if b is None else b.cuda() for b in bias)
        got, _, _ = buf.combine(recv_x, handle, bias=cuda_bias)
        (want,) = ref.combine([received], [recv_x.cpu()], [150], [given])
        assert torch.equal(got.cpu(), want)
    with pytest.raises(weft.Error, match=r"bias\[0\]"):
        buf.combine(recv_x, handle, bias=b0[:100].cuda())


def test_calls_under_a_default_device_match_the_reference():
    """DeepEP's tests set torch.set_default_device('cuda') (a torch function mode): the calls run
    outside it (weft/ep/torch_modes.py) and give the same rows, owned and cached, bf16 and fp8."""
    num_tokens, hidden, experts, top_k = 64, 256, 16, 4
    buf = weft.ep.Buffer(None, int(1e9))
    g = torch.Generator().manual_seed(31)
    x = torch.randn((num_tokens, hidden), generator=g).bfloat16()
    idx = ref.random_routing(num_tokens, experts, top_k, g, 0.2)
    w = torch.rand((num_tokens, top_k), generator=g)
    (want,) = ref.dispatch([x], [idx], [w], experts)
    x8, scales = ref.per_token_cast_to_fp8(x)
    x_fp8 = (x8.cuda(), scales.t().contiguous().t().cuda())  # DeepEP's column-major scales
    torch.set_default_device("cuda")
    try:
        rx, ridx, rw, _, handle, _ = dispatch(buf, x, idx, w, experts)
        cached = buf.dispatch(x.cuda(), handle=handle)[0]
        fp8 = dispatch(buf, x_fp8, idx, w, experts)[0]
        combined, _, _ = buf.combine(rx, handle)
    finally:
        torch.set_default_device(None)
    assert torch.equal(rx.cpu(), want.x)
    assert torch.equal(ridx.cpu(), want.expert_idx.long())
    assert torch.equal(rw.cpu(), want.weights)
    assert torch.equal(cached.cpu(), want.x)
    rows = want.src[:, 1].long()
    assert torch.equal(fp8[0].cpu().view(torch.uint8), x8.view(torch.uint8)[rows])
    assert torch.equal(fp8[1].cpu(), scales[rows])
    sent = (idx >= 0).any(dim=1)
    assert torch.equal(combined.cpu()[sent], x[sent])


def test_plain_calls_of_every_form_in_random_order_each_match_the_reference(monkeypatch):
    """The plain calls (no event, no bias: DeepEP's uncached, cached and combine calls, bf16 and
    fp8, with and without topk_weights; the native dispatch and combine on either stream) check
    only the accepted case and reuse their argument objects: 600 of them in random order, T,
    the selections' dtype and the SM count changing, every result checked against the
    reference, so that nothing one form sets leaks into another's call; none of them took the
    general path."""
    hidden, experts, top_k = 256, 16, 8
    buf = weft.ep.Buffer(None, int(1e9))
    native = weft.ep.NativeBuffer(None, max_tokens=128, hidden=hidden, num_experts=experts,
                                  top_k=top_k)
    general = []
    for cls, name in ((weft.ep.Buffer, "_check_inputs"), (weft.ep.Buffer, "_cached_dispatch"),
                      (weft.ep.Buffer, "_native_of"), (weft.ep.NativeBuffer, "check_x"),
                      (weft.ep.NativeBuffer, "check_combine")):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda *a, _real=real, _name=name, **kw: (
            general.append(_name), _real(*a, **kw))[1])
    g = torch.Generator().manual_seed(41)
    pick = __import__("random").Random(41)
    latest = None  # (T, want, recv_w, handle) of buf's latest uncached dispatch
    num_forms = {}
    for i in range(600):
        form = pick.choice(["uncached", "uncached fp8", "cached", "cached fp8", "combine",
                            "combine weights", "native"] if latest else ["uncached"])
        num_forms[form] = num_forms.get(form, 0) + 1
        num_sms = pick.choice([0, 4, 20])
        config = weft.ep.Config(num_sms)
        if form.startswith("uncached") or form == "native":
            num_tokens = pick.randint(1, 128)
            x, idx, w = inputs(num_tokens, hidden, experts, top_k, 0.2, seed=1000 + i)
            (want,) = ref.dispatch([x], [idx], [w], experts)
            src = want.src[:, 1].long()
            if pick.random() < 0.5:
                idx = idx.int()
        if form == "uncached":
            rx, ridx, rw, counts, handle, _ = dispatch(buf, x, idx, w, experts, config=config)
            assert torch.equal(rx.cpu(), want.x), i
            assert torch.equal(ridx.cpu(), want.expert_idx.to(idx.dtype)), i
            assert torch.equal(rw.cpu(), want.weights), i
            assert counts == [(idx == e).sum().item() for e in range(experts)], i
            latest = (num_tokens, want, rw, handle)
        elif form == "uncached fp8":
            x8, scales = ref.per_token_cast_to_fp8(x)
            rx, ridx, _, _, handle, _ = dispatch(
                buf, (x8.cuda(), scales.t().contiguous().t().cuda()), idx, w, experts,
                config=config)
            assert torch.equal(rx[0].cpu().view(torch.uint8), x8.view(torch.uint8)[src]), i
            assert torch.equal(rx[1].cpu(), scales[src]), i
            assert torch.equal(ridx.cpu(), want.expert_idx.to(idx.dtype)), i
            latest = (num_tokens, want, None, handle)
        elif form.startswith("cached"):
            num_tokens, want, _, handle = latest
            x2 = torch.randn((num_tokens, hidden), generator=g).bfloat16()
            src = want.src[:, 1].long()
            if form == "cached":
                rx = buf.dispatch(x2.cuda(), handle=handle, config=config)[0]
                assert torch.equal(rx.cpu(), x2[src]), i
            else:
                x8, scales = ref.per_token_cast_to_fp8(x2)
                rx = buf.dispatch((x8.cuda(), scales.t().contiguous().t().cuda()),
                                  handle=handle, config=config)[0]
                assert torch.equal(rx[0].cpu().view(torch.uint8), x8.view(torch.uint8)[src]), i
                assert torch.equal(rx[1].cpu(), scales[src]), i
        elif form.startswith("combine"):
            num_tokens, want, rw, handle = latest
            y = torch.randn((want.x.shape[0], hidden), generator=g).bfloat16()
            (expected,) = ref.combine([want], [y], [num_tokens])
            weights = form == "combine weights" and rw is not None
            out, combined_w, _ = buf.combine(y.cuda(), handle, rw if weights else None,
                                             config=config)
            assert torch.equal(out.cpu(), expected), i
            if weights:
                expected_w = torch.zeros((num_tokens, top_k))
                expected_w[want.src[:, 1].long()] = want.weights
                assert torch.equal(combined_w.cpu(), expected_w), i
            else:
                assert combined_w is None, i
        else:  # native: zero copy, then combine into out=
            current = pick.random() < 0.5
            res = native.dispatch(x.cuda(), idx.cuda(), w.cuda(), on_current_stream=current,
                                  num_sms=num_sms)
            n = int(res.num_recv_device.item())
            assert n == want.x.shape[0] and res.num_recv is None, i
            assert torch.equal(res.recv_x[:n].cpu(), want.x), i
            assert torch.equal(res.recv_expert_idx[:n].cpu(), want.expert_idx), i
            assert torch.equal(res.recv_weights[:n].cpu(), want.weights), i
            assert torch.equal(res.recv_src[:n].cpu(), want.src), i
            assert torch.equal(res.tokens_per_local_expert.cpu(),
                               want.tokens_per_local_expert), i
            assert res.rank_prefix_matrix.tolist() == [[n]], i
            y = torch.randn((n, hidden), generator=g).bfloat16()
            (expected,) = ref.combine([want], [y], [num_tokens])
            out = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16,
                             device="cuda")
            native.combine(y.cuda(), res.handle, out=out, on_current_stream=not current,
                           num_sms=num_sms)
            assert torch.equal(out.cpu(), expected), i
    assert len(num_forms) == 7, num_forms
    assert general == [], general[:5]


def test_the_plain_checks_accept_only_what_the_full_checks_accept():
    """An uncached dispatch's inputs are checked for the accepted case alone first (the least
    host work), then, for anything else, by the full checks, which raise for what is wrong: every
    input the quick check accepts, the full checks accept with the same shapes, for inputs
    spoilt one at a time (dtype, shape, strides, device, type)."""
    buf = weft.ep.Buffer(None, int(1e9))
    x, idx, w = inputs(64, 256, 16, 8, 0.2, seed=42)
    x8, scales = ref.per_token_cast_to_fp8(x)
    good = dict(x=x.cuda(), topk_idx=idx.cuda(), topk_weights=w.cuda(),
                **deepep_layout(buf, idx.cuda(), 16))
    spoilt = [good]
    for name, t in good.items():
        for bad in (t.cpu(), t.float() if t.dtype != torch.float32 else t.double(),
                    t.int() if t.dtype != torch.int32 else t.long(), t[:-1] if t.dim() else t,
                    t.unsqueeze(0), t.t() if t.dim() == 2 else t.expand(2, -1)[:, 0], None,
                    t.tolist()):
            spoilt.append({**good, name: bad})
    fp8 = (x8.cuda(), scales.t().contiguous().t().cuda())
    spoilt += [{**good, "x": fp8}, {**good, "x": (fp8[0], fp8[1].double())},
               {**good, "x": (fp8[0], fp8[1][:, :-1])}, {**good, "x": (fp8[0].view(torch.uint8),
                                                                          fp8[1])},
               {**good, "x": (fp8[0],)}, {**good, "x": list(fp8)}]
    num_accepted = 0
    for case in spoilt:
        main = case["x"][0] if isinstance(case["x"], (tuple, list)) else case["x"]
        args = (case["num_tokens_per_rank"], case["is_token_in_rank"],
                case["num_tokens_per_expert"], case["topk_idx"], case["topk_weights"])
        quick = buf._plain_inputs(case["x"], *args)
        try:
            full = buf._check_inputs(case["x"], main, *args)
        except (weft.Error, AttributeError, TypeError, ValueError):
            full = None
        if quick is not None:
            num_accepted += 1
            assert quick == full, case
    assert num_accepted >= 2  # the good bf16 and fp8 inputs among them
