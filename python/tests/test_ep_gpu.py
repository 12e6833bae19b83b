"""weft.ep on one GPU (one rank, everything local), against the CPU reference: the native API,
DeepEP's API in the combinations its users go through, back-to-back calls, CUDA graphs, and
every bad input."""

import itertools

import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
import weft.ep  # noqa: E402

import ep_reference as ref  # noqa: E402
from conftest import needs_gpus  # noqa: E402

pytestmark = [needs_gpus(1), pytest.mark.timeout(600)]

SHAPES = [  # (tokens, hidden, experts, top_k, masked fraction)
    (128, 7168, 256, 8, 0.05),
    (37, 256, 16, 4, 0.2),
    (1000, 2048, 64, 6, 0.6),
    (1, 128, 8, 1, 0.0),
]


def inputs(num_tokens, hidden, num_experts, top_k, masked, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((num_tokens, hidden), generator=g).bfloat16()
    idx = ref.random_routing(num_tokens, num_experts, top_k, g, masked)
    w = torch.rand((num_tokens, top_k), generator=g)
    return x, idx, w


def poisoned_native(hidden, num_experts, top_k, max_tokens=1024, expand_factor=0):
    """A NativeBuffer whose window's result regions hold non-zero garbage (0xA5 bytes), so that
    a row a dispatch should write (or zero) and does not cannot pass as right."""
    buf = weft.ep.NativeBuffer(None, max_tokens=max_tokens, hidden=hidden,
                               num_experts=num_experts, top_k=top_k, expand_factor=expand_factor)
    x = torch.zeros((1, hidden), dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros((1, top_k), dtype=torch.int64, device="cuda")
    res = buf.dispatch(x, idx, torch.zeros((1, top_k), device="cuda"), sync_count=True)
    for view in (res.recv_x, res.recv_expert_idx, res.recv_weights, res.recv_src):
        region = view._base if view._base is not None else view
        region.view(torch.uint8).fill_(0xA5)
    torch.cuda.synchronize()
    return buf


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}_E{}_K{}".format(*s[:4]))
@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
def test_native_dispatch_and_combine_match_the_reference(shape, idx_dtype):
    num_tokens, hidden, num_experts, top_k, masked = shape
    buf = poisoned_native(hidden, num_experts, top_k)
    for seed in range(3):  # fresh inputs, the same Buffer
        x, idx, w = inputs(*shape, seed=seed)
        (want,) = ref.dispatch([x], [idx], [w], num_experts)
        res = buf.dispatch(x.cuda(), idx.to(idx_dtype).cuda(), w.cuda(), sync_count=True)
        n = res.num_recv
        assert n == want.x.shape[0]
        assert torch.equal(res.recv_x.cpu(), want.x)
        assert torch.equal(res.recv_expert_idx.cpu(), want.expert_idx)
        assert torch.equal(res.recv_weights.cpu(), want.weights)
        assert torch.equal(res.recv_src.cpu(), want.src)
        assert torch.equal(res.tokens_per_local_expert.cpu(), want.tokens_per_local_expert)
        assert res.tokens_per_local_expert_list == want.tokens_per_local_expert.tolist()
        y = torch.randn((n, hidden)).bfloat16()
        b0, b1 = torch.randn((2, num_tokens, hidden)).bfloat16()
        out = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        got, _ = buf.combine(y.cuda(), res.handle, bias=(b0.cuda(), b1.cuda()), out=out)
        (want_out,) = ref.combine([want], [y], [num_tokens], [[b0, b1]])
        assert torch.equal(got.cpu(), want_out)
    buf.destroy()


def test_native_count_on_device_and_zero_copy_views():
    x, idx, w = inputs(256, 512, 32, 4, 0.3, seed=7)
    buf = poisoned_native(512, 32, 4)
    res = buf.dispatch(x.cuda(), idx.cuda(), w.cuda())  # no host sync
    assert res.num_recv is None and res.recv_x.shape[0] == buf.capacity
    (want,) = ref.dispatch([x], [idx], [w], 32)
    n = int(res.num_recv_device.item())
    assert n == want.x.shape[0]
    kept = res.copy(n)
    assert torch.equal(kept.recv_x.cpu(), want.x)
    # A view is the window: the next dispatch overwrites it, the copy stays.
    x2, idx2, w2 = inputs(256, 512, 32, 4, 0.0, seed=8)
    buf.dispatch(x2.cuda(), idx2.cuda(), w2.cuda(), sync_count=True)
    torch.cuda.synchronize()
    assert torch.equal(kept.recv_x.cpu(), want.x)
    assert torch.equal(res.recv_x[:256].cpu(), x2)


def test_native_fp8_rows_arrive_bit_exact():
    x, idx, w = inputs(300, 1024, 16, 4, 0.2, seed=3)
    x8, scales = ref.per_token_cast_to_fp8(x)
    buf = poisoned_native(1024, 16, 4)
    res = buf.dispatch((x8.cuda(), scales.cuda()), idx.cuda(), w.cuda(), sync_count=True)
    (want,) = ref.dispatch([x8.view(torch.uint8)], [idx], [w], 16)
    rx8, rscales = res.recv_x
    assert torch.equal(rx8.cpu().view(torch.uint8), want.x)
    tokens = want.src[:, 1].long()
    assert torch.equal(rscales.cpu(), scales[tokens])


def test_expanded_layout_segments_and_combine():
    x, idx, w = inputs(200, 256, 8, 3, 0.1, seed=11)
    buf = poisoned_native(256, 8, 3, max_tokens=256, expand_factor=4)
    res = buf.dispatch(x.cuda(), idx.cuda(), w.cuda(), sync_count=True,
                       expand=weft.ep.Expand(expert_alignment=16, zero_padding=True))
    seg = res.segment_begin.cpu()
    counts = [(idx == e).any(dim=1).sum().item() for e in range(8)]
    want_seg = [0]
    for c in counts:
        want_seg.append(want_seg[-1] + -(-c // 16) * 16)
    assert seg.tolist() == want_seg
    assert res.rows_required == want_seg[-1]
    rx, src = res.recv_x.cpu(), res.recv_src.cpu()
    for e, c in enumerate(counts):
        rows = range(want_seg[e], want_seg[e] + c)
        tokens = (idx == e).any(dim=1).nonzero().flatten()
        assert torch.equal(src[want_seg[e]:want_seg[e] + c, 1].long(), tokens)
        assert torch.equal(rx[list(rows)], x[tokens])
        assert not rx[want_seg[e] + c:want_seg[e + 1]].view(torch.int16).any()  # zero padding
    y = res.recv_x[:res.num_recv].clone()
    out, _ = buf.combine(y, res.handle)
    # Expanded combine: per token, its rows summed in fp32 in row order, rounded once.
    acc = torch.zeros((200, 256))
    for e in range(8):
        tokens = (idx == e).any(dim=1).nonzero().flatten()
        acc[tokens] += x[tokens].float()
    assert torch.equal(out.cpu(), acc.bfloat16())


def deepep_layout(buf, idx, num_experts):
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert)


@pytest.mark.parametrize("previous,async_mode,payload,with_topk", list(itertools.product(
    (False, True), (False, True), ("random", "constant", "fp8"), (False, True))))
def test_deepep_intranode_combinations(previous, async_mode, payload, with_topk):
    num_tokens, hidden, num_experts, top_k = 500, 2048, 32, 8
    x, idx, w = inputs(num_tokens, hidden, num_experts, top_k, 0.1, seed=5)
    if payload == "constant":
        x = torch.ones_like(x) * 3
    buf = weft.ep.Buffer(None, int(2e9))
    layout = deepep_layout(buf, idx.cuda(), num_experts)
    (want,) = ref.dispatch([x], [idx], [w], num_experts)
    n = want.x.shape[0]
    x8, scales = ref.per_token_cast_to_fp8(x)  # cast on the CPU: the test checks movement
    # The inputs are made by work still running when the call is made (a spin first): on
    # another stream, whose event is previous_event, or else on the current stream. A call that
    # does not wait for them reads what is there before.
    side = torch.cuda.Stream() if previous else torch.cuda.current_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        cur_x = (x8.cuda().clone(), scales.t().contiguous().t().cuda().clone()) \
            if payload == "fp8" else x.cuda().clone()
    args = dict(x=cur_x, config=weft.ep.Config(24), async_finish=async_mode, **layout)
    if with_topk:
        args.update(topk_idx=idx.cuda(), topk_weights=w.cuda())
    if previous:
        args["previous_event"] = weft.ep.EventOverlap(weft.ep.EventHandle(side))
    recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(**args)
    if async_mode:
        torch.cuda._sleep(20_000_000)  # the wait comes late: the results must not move
        event.current_stream_wait()
    if payload == "fp8":
        assert torch.equal(recv_x[0].cpu().view(torch.uint8), x8.view(torch.uint8)[want.src[:, 1].long()])
        assert torch.equal(recv_x[1].cpu(), scales[want.src[:, 1].long()])
    else:
        assert torch.equal(recv_x.cpu(), want.x)
    assert counts == [(idx == e).sum().item() for e in range(num_experts)]
    assert handle[0].tolist() == [[n]]
    if with_topk:
        assert recv_idx.dtype == torch.int64
        assert torch.equal(recv_idx.cpu(), want.expert_idx.long())
        assert torch.equal(recv_w.cpu(), want.weights)
        # num_worst_tokens: no host sync, [num_worst_tokens] rows, -1 past the received ones.
        worst = dict(args, num_worst_tokens=num_tokens + 7)
        if previous:
            worst["previous_event"] = buf.capture()
        wx, widx, ww, empty, _, event = buf.dispatch(**worst)
        if async_mode:
            event.current_stream_wait()
        assert empty == [] and wx_rows(wx) == num_tokens + 7
        assert torch.equal(widx[:n].cpu(), want.expert_idx.long())
        assert (widx[n:] == -1).all() and (ww[n:] == 0).all()
    else:
        cached = dict(x=cur_x, handle=handle, config=weft.ep.Config(24), async_finish=async_mode)
        if previous:
            cached["previous_event"] = buf.capture()
        cx, none1, none2, none3, none4, event = buf.dispatch(**cached)
        if async_mode:
            event.current_stream_wait()
        assert (none1, none2, none3, none4) == (None, None, None, None)
        assert torch.equal(_first(cx).cpu().view(torch.uint8), _first(recv_x).cpu().view(torch.uint8))
    y = torch.randn((n, hidden)).bfloat16()
    cargs = dict(x=y.cuda(), handle=handle, config=weft.ep.Config(24), async_finish=async_mode)
    if with_topk:
        cargs["topk_weights"] = recv_w
    if previous:
        cargs["previous_event"] = buf.capture()
    combined, combined_w, event = buf.combine(**cargs)
    if async_mode:
        event.current_stream_wait()
    (want_out,) = ref.combine([want], [y], [num_tokens])
    assert torch.equal(combined.cpu(), want_out)
    if with_topk:
        sent = (idx >= 0).any(dim=1)
        assert torch.equal(combined_w.cpu()[sent], torch.where(idx >= 0, w, 0)[sent])
        assert not combined_w.cpu()[~sent].any()
    else:
        assert combined_w is None


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def wx_rows(x):
    return _first(x).shape[0]


def test_compat_and_native_agree_bit_for_bit():
    x, idx, w = inputs(700, 1024, 64, 8, 0.2, seed=21)
    compat = weft.ep.Buffer(None, int(1e9))
    native = weft.ep.NativeBuffer(None, max_tokens=1024, hidden=1024, num_experts=64, top_k=8)
    layout = deepep_layout(compat, idx.cuda(), 64)
    cx, cidx, cw, counts, handle, _ = compat.dispatch(x.cuda(), topk_idx=idx.cuda(),
                                                      topk_weights=w.cuda(), **layout)
    res = native.dispatch(x.cuda(), idx.cuda(), w.cuda(), sync_count=True)
    assert torch.equal(cx, res.recv_x) and torch.equal(cidx.int(), res.recv_expert_idx)
    assert torch.equal(cw, res.recv_weights) and counts == res.tokens_per_local_expert_list
    y = torch.randn_like(cx)
    a, _, _ = compat.combine(y, handle)
    b, _ = native.combine(y, res.handle)
    assert torch.equal(a, b)


def test_an_old_handle_still_works_in_deepep_mode():
    buf = weft.ep.Buffer(None, int(1e9))
    first = inputs(300, 512, 16, 4, 0.1, seed=1)
    second = inputs(200, 512, 16, 4, 0.1, seed=2)
    outs = []
    for x, idx, w in (first, second):
        layout = deepep_layout(buf, idx.cuda(), 16)
        outs.append(buf.dispatch(x.cuda(), topk_idx=idx.cuda(), topk_weights=w.cuda(), **layout))
    (want1,) = ref.dispatch([first[0]], [first[1]], [first[2]], 16)
    handle1 = outs[0][4]
    # Backward of layer 1 after layer 2's dispatch: a cached dispatch and a combine of handle1.
    x_new = torch.randn((300, 512)).bfloat16()
    cx, *_ = buf.dispatch(x_new.cuda(), handle=handle1)
    assert torch.equal(cx.cpu(), x_new[want1.src[:, 1].long()])
    y = torch.randn((want1.x.shape[0], 512)).bfloat16()
    combined, _, _ = buf.combine(y.cuda(), handle1)
    (want_out,) = ref.combine([want1], [y], [300])
    assert torch.equal(combined.cpu(), want_out)
    # Results of the first dispatch are owned: unchanged by everything since.
    assert torch.equal(outs[0][0].cpu(), want1.x)


def test_a_thousand_back_to_back_rounds():
    """Fresh inputs every round, dispatch and combine back to back with no host sync; every
    element is compared on the device and the mismatches are counted, read once at the end."""
    num_tokens, hidden, num_experts, top_k = 256, 512, 32, 4
    buf = weft.ep.NativeBuffer(None, max_tokens=num_tokens, hidden=hidden,
                               num_experts=num_experts, top_k=top_k)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.arange(num_tokens, device="cuda")
    wrong = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(1000):
        x = torch.randn((num_tokens, hidden), generator=g, device="cuda").bfloat16()
        scores = torch.rand((num_tokens, num_experts), generator=g, device="cuda")
        idx = scores.topk(top_k, dim=1).indices
        idx = torch.where(torch.rand(idx.shape, generator=g, device="cuda") < 0.3, -1, idx)
        w = torch.rand((num_tokens, top_k), generator=g, device="cuda")
        res = buf.dispatch(x, idx, w)
        out, _ = buf.combine(res.recv_x * 2, res.handle)
        sent = (idx >= 0).any(dim=1)
        # Received rows: the sent tokens in token order (a stable sort puts them first).
        order = torch.sort((~sent).int(), stable=True).indices
        received = rows < res.num_recv_device
        wrong += (res.num_recv_device != sent.sum()).sum()
        wrong += ((res.recv_x[:num_tokens] != x[order]) & received[:, None]).sum()
        wrong += (out != torch.where(sent[:, None], (x.float() * 2).bfloat16(), 0)).sum()
    assert wrong.item() == 0


def graph_inputs(num_tokens, hidden, top_k):
    """The x, topk_idx and topk_weights a captured graph reads (refilled before each replay)."""
    return (torch.zeros((num_tokens, hidden), dtype=torch.bfloat16, device="cuda"),
            torch.full((num_tokens, top_k), -1, dtype=torch.int64, device="cuda"),
            torch.zeros((num_tokens, top_k), dtype=torch.float32, device="cuda"))


def replay_with_new_inputs(graph, static, num_experts, masked, seed):
    """Fresh inputs copied into the captured ones, one replay; returns the reference dispatch."""
    num_tokens, hidden = static[0].shape
    fresh = inputs(num_tokens, hidden, num_experts, static[1].shape[1], masked, seed=seed)
    for captured, value in zip(static, fresh):
        captured.copy_(value)
    graph.replay()
    torch.cuda.synchronize()
    x, idx, w = fresh
    (want,) = ref.dispatch([x], [idx], [w], num_experts)
    return want


def test_cuda_graph_capture_and_replay_with_new_inputs():
    num_tokens, hidden, num_experts, top_k = 320, 1024, 32, 4
    buf = weft.ep.NativeBuffer(None, max_tokens=num_tokens, hidden=hidden,
                               num_experts=num_experts, top_k=top_k)
    sx, sidx, sw = static = graph_inputs(num_tokens, hidden, top_k)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        buf.dispatch(sx, sidx, sw)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = buf.dispatch(sx, sidx, sw)
        y = res.recv_x * 3
        out, _ = buf.combine(y, res.handle)
        count = res.num_recv_device.clone()
    for seed in range(5):
        want = replay_with_new_inputs(graph, static, num_experts, 0.25, seed=100 + seed)
        n = want.x.shape[0]
        assert int(count.item()) == n
        assert torch.equal(res.recv_x[:n].cpu(), want.x)
        assert torch.equal(res.recv_expert_idx[:n].cpu(), want.expert_idx)
        (want_out,) = ref.combine([want], [(want.x.float() * 3).bfloat16()], [num_tokens])
        assert torch.equal(out.cpu(), want_out)


def test_cuda_graph_of_deepep_calls_with_num_worst_tokens():
    num_tokens, hidden, num_experts, top_k = 200, 512, 16, 4
    buf = weft.ep.Buffer(None, int(1e9))
    sx, sidx, sw = static = graph_inputs(num_tokens, hidden, top_k)

    def step():
        layout = deepep_layout(buf, sidx, num_experts)
        rx, ridx, rw, _, handle, _ = buf.dispatch(sx, topk_idx=sidx, topk_weights=sw,
                                                  num_worst_tokens=num_tokens, **layout)
        combined, _, _ = buf.combine(rx * 2, handle)
        return rx, ridx, combined

    step()  # builds the window outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rx, ridx, combined = step()
    for seed in range(3):
        want = replay_with_new_inputs(graph, static, num_experts, 0.3, seed=200 + seed)
        n = want.x.shape[0]
        assert torch.equal(rx[:n].cpu(), want.x)
        assert torch.equal(ridx[:n].cpu(), want.expert_idx.long()) and (ridx[n:] == -1).all()
        (want_out,) = ref.combine([want], [(want.x.float() * 2).bfloat16()], [num_tokens])
        assert torch.equal(combined.cpu(), want_out)


def test_bad_inputs_raise_weft_errors_and_leave_the_buffer_usable():
    hidden, num_experts, top_k = 256, 16, 4
    buf = poisoned_native(hidden, num_experts, top_k, max_tokens=64)
    x, idx, w = (t.cuda() for t in inputs(64, hidden, num_experts, top_k, 0.1, seed=9))
    cases = {
        "must be bfloat16": lambda: buf.dispatch(x.float(), idx, w),
        "is on cpu": lambda: buf.dispatch(x.cpu(), idx, w),
        r"must have shape \[\*, 256\]": lambda: buf.dispatch(x[:, :128].contiguous(), idx, w),
        "contiguous": lambda: buf.dispatch(x.t().contiguous().t(), idx, w),
        "topk_idx must be int64 or int32": lambda: buf.dispatch(x, idx.float(), w),
        r"topk_weights must have shape \[64, 4\]":
            lambda: buf.dispatch(x, idx, w[:, :3].contiguous()),
        "scales": lambda: buf.dispatch((x.to(torch.float8_e4m3fn), w), idx, w),
        "takes no topk_idx": lambda: buf.dispatch(x, idx, w, handle=object()),
    }
    for match, call in cases.items():
        with pytest.raises(weft.Error, match=match):
            call()
    with pytest.raises(weft.Error, match=r"src/ep/.*out of range|expert id"):
        bad = idx.clone()
        bad[3, 1] = num_experts + 5
        buf.dispatch(x, bad, w, sync_count=True)
    # More tokens than the Buffer holds: every rank learns it in the count exchange and moves
    # no row; the Buffer stays usable.
    over = buf.dispatch(torch.cat([x, x]), torch.cat([idx, idx]), torch.cat([w, w]),
                        sync_count=True)
    assert over.tokens_required == 128 and over.num_recv == 0
    with pytest.raises(weft.Error, match="tokens_required|max_tokens"):
        buf.combine(x, over.handle)
    # A stale handle: the C++ check, carried as weft.Error with its file:line.
    res1 = buf.dispatch(x, idx, w, sync_count=True)
    buf.dispatch(x, idx, w, sync_count=True)
    with pytest.raises(weft.Error, match=r"src/ep/\w+\.cpp:\d+: .*stale"):
        buf.combine(res1.recv_x[:res1.num_recv].clone(), res1.handle)
    # Still usable, and correct.
    (want,) = ref.dispatch([x.cpu()], [idx.cpu()], [w.cpu()], num_experts)
    res = buf.dispatch(x, idx, w, sync_count=True)
    assert torch.equal(res.recv_x.cpu(), want.x)
    deep = weft.ep.Buffer(None, int(1e8))
    layout = deepep_layout(deep, idx, num_experts)
    with pytest.raises(weft.Error, match="x has 3 rows"):
        _, _, _, _, h, _ = deep.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
        deep.combine(x[:3].contiguous(), h)
    with pytest.raises(weft.Error, match="is_token_in_rank"):
        deep.dispatch(x, topk_idx=idx, topk_weights=w,
                      **dict(layout, is_token_in_rank=layout["is_token_in_rank"][:5]))


@needs_gpus(2)
def test_a_tensor_on_another_gpu_is_refused():
    buf = poisoned_native(256, 16, 4, max_tokens=64)
    x, idx, w = inputs(64, 256, 16, 4, 0.1, seed=1)
    with pytest.raises(weft.Error, match="cuda:1"):
        buf.dispatch(x.to("cuda:1"), idx.cuda(), w.cuda())


def test_native_calls_on_the_current_stream():
    x, idx, w = inputs(300, 512, 16, 4, 0.2, seed=31)
    buf = poisoned_native(512, 16, 4)
    (want,) = ref.dispatch([x], [idx], [w], 16)
    res = buf.dispatch(x.cuda(), idx.cuda(), w.cuda(), on_current_stream=True)
    n = want.x.shape[0]
    y = torch.randn((n, 512)).bfloat16()
    out, event = buf.combine(y.cuda(), res.handle, on_current_stream=True)
    assert event.event is None
    assert torch.equal(res.recv_x[:n].cpu(), want.x)
    (want_out,) = ref.combine([want], [y], [300])
    assert torch.equal(out.cpu(), want_out)
    with pytest.raises(weft.Error, match="on_current_stream"):
        buf.dispatch(x.cuda(), idx.cuda(), w.cuda(), on_current_stream=True, async_finish=True)


@pytest.mark.parametrize("idx_dtype,top_k", [(torch.int32, 8), (torch.int64, 3)])
def test_deepep_dispatch_of_other_index_widths_and_top_k(idx_dtype, top_k):
    """int32 indices are copied out as they are; a top-k below the window's is widened."""
    x, idx, w = inputs(400, 1024, 32, top_k, 0.2, seed=41)
    buf = weft.ep.Buffer(None, int(1e9))
    layout = deepep_layout(buf, idx.cuda(), 32)
    (want,) = ref.dispatch([x], [idx], [w], 32)
    rx, ridx, rw, counts, handle, _ = buf.dispatch(
        x.cuda(), topk_idx=idx.to(idx_dtype).cuda(), topk_weights=w.cuda(), **layout)
    assert ridx.dtype == idx_dtype and ridx.shape[1] == top_k
    assert torch.equal(rx.cpu(), want.x)
    assert torch.equal(ridx.cpu().long(), want.expert_idx.long())
    assert torch.equal(rw.cpu(), want.weights)
    # The handle kept its own copy of the selections: changing the caller's does not matter.
    idx.fill_(-1)
    x2 = torch.randn_like(x)
    buf.dispatch(x2.cuda(), topk_idx=idx.to(idx_dtype).cuda(), topk_weights=w.cuda(), **layout)
    cx, *_ = buf.dispatch(x.cuda(), handle=handle)  # an old handle: its layout re-runs
    assert torch.equal(cx.cpu(), want.x)


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_a_virtual_team_dispatches_and_combines_as_the_reference(num_ranks):
    """R simulated ranks on one GPU (NativeBuffer.virtual_team), each driven on a stream of its
    own: every rank's received rows, sources, selections and weights, and every combined token,
    against the CPU reference of R ranks; ranks with different T, one with none."""
    hidden, experts, top_k = 512, 32, 4
    sizes = [max(0, 150 - 37 * r) for r in range(num_ranks)]
    team = weft.ep.NativeBuffer.virtual_team(num_ranks, max_tokens=150, hidden=hidden,
                                             num_experts=experts, top_k=top_k)
    assert [b.rank for b in team] == list(range(num_ranks))
    cpu = [inputs(t, hidden, experts, top_k, 0.2, seed=40 + r) for r, t in enumerate(sizes)]
    wants = ref.dispatch(*[list(col) for col in zip(*cpu)], experts)
    gpu = [tuple(t.cuda() for t in rank_inputs) for rank_inputs in cpu]
    streams = [torch.cuda.Stream() for _ in team]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for buf, s, (x, idx, w) in zip(team, streams, gpu):
        with torch.cuda.stream(s):
            results.append(buf.dispatch(x, idx, w, on_current_stream=True))
    torch.cuda.synchronize()
    ys = []
    for res, want in zip(results, wants):
        n = int(res.num_recv_device.item())
        assert n == want.x.shape[0]
        assert torch.equal(res.recv_x[:n].cpu(), want.x)
        assert torch.equal(res.recv_src[:n].cpu(), want.src)
        assert torch.equal(res.recv_expert_idx[:n].cpu(), want.expert_idx)
        assert torch.equal(res.recv_weights[:n].cpu(), want.weights)
        ys.append(torch.randn((n, hidden)).bfloat16())
    ys_gpu = [y.cuda() for y in ys]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for buf, s, res, y in zip(team, streams, results, ys_gpu):
        with torch.cuda.stream(s):
            outs.append(buf.combine(y, res.handle, on_current_stream=True)[0])
    torch.cuda.synchronize()
    for out, want in zip(outs, ref.combine(wants, ys, sizes)):
        assert torch.equal(out.cpu(), want)
    with pytest.raises(weft.Error, match="virtual team"):
        team[0].dispatch(*gpu[0], sync_count=True)
    for buf in team:
        buf.destroy()
