"""weft.ep's DeepEP low-latency API (low_latency_dispatch / low_latency_combine): argument checks
and refusals without a GPU; on one GPU, every received element, count, scale and combined
element against a CPU reference, under masked and empty selections, M far above T, fp8 in every
scale format, 1000 back-to-back calls and a CUDA graph replayed with new inputs."""

import types

import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
import weft.ep  # noqa: E402
from weft.ep import low_latency as ll  # noqa: E402

import ep_reference as ref  # noqa: E402
from conftest import needs_gpus  # noqa: E402

pytestmark = pytest.mark.timeout(600)


# -- without a GPU ------------------------------------------------------------------------------
def test_the_constructor_accepts_low_latency_mode_and_refuses_what_weft_cannot_do():
    with pytest.raises(weft.Error, match="allow_nvlink_for_low_latency_mode"):
        weft.ep.Buffer(None, 0, 1 << 30, True, 24, False)
    with pytest.raises(weft.Error, match="num_rdma_bytes"):
        weft.ep.Buffer(None, int(1e9), 1 << 20, False)
    with pytest.raises(weft.Error, match="num_rdma_bytes"):
        weft.ep.Buffer(None, 0, -1, True)
    if not torch.cuda.is_available():
        # DeepEP's test_low_latency.py arguments pass the checks (no num_nvl_bytes needed); the
        # first thing refused is the missing device.
        with pytest.raises(weft.Error, match="CUDA GPU"):
            weft.ep.Buffer(None, num_rdma_bytes=1 << 30, low_latency_mode=True,
                           num_qps_per_rank=36, allow_nvlink_for_low_latency_mode=True,
                           explicitly_destroy=True, allow_mnnvl=False, enable_shrink=False)


def test_the_size_hint_covers_two_windows_and_grows_with_the_shapes():
    hint = weft.ep.Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    # Two windows, each at least the receive rows [E_local, M * R, hidden] bf16.
    assert hint >= 2 * (288 // 8) * 128 * 8 * 7168 * 2
    assert weft.ep.Buffer.get_low_latency_rdma_size_hint(256, 7168, 8, 288) > hint
    assert weft.ep.Buffer.get_low_latency_rdma_size_hint(128, 4096, 8, 288) < hint
    assert hint == ll.window_bytes(128, 7168, 8, 288, 32)
    assert ll.window_bytes(128, 7168, 8, 288, 8) <= hint  # any top-k fits the hint
    for args, what in [((0, 7168, 8, 288), "num_max_dispatch_tokens_per_rank"),
                       ((128, 7168, 8, 100), "multiple of the number of ranks"),
                       ((128, 7164, 8, 288), "hidden"), ((128, 7168, 8, 0), "num_experts")]:
        with pytest.raises(weft.Error, match=what):
            weft.ep.Buffer.get_low_latency_rdma_size_hint(*args)


@pytest.mark.parametrize("method,num_args", [("low_latency_dispatch", 4),
                                             ("low_latency_combine", 4),
                                             ("clean_low_latency_buffer", 3),
                                             ("get_next_low_latency_combine_buffer", 1)])
def test_low_latency_calls_need_low_latency_mode(method, num_args):
    buf = weft.ep.Buffer.__new__(weft.ep.Buffer)
    buf._destroyed, buf._low_latency = False, None
    with pytest.raises(weft.Error, match=f"{method} needs a Buffer made with low_latency_mode"):
        getattr(buf, method)(*([None] * num_args))


def _cpu_state(num_ranks=2):
    """A LowLatency over a stand-in Buffer on the CPU: the argument checks run before any
    window or stream is touched."""
    fake = types.SimpleNamespace(_device=torch.device("cpu"), group_size=num_ranks,
                                 num_rdma_bytes=0)
    return ll.LowLatency(fake)


def _dispatch_kwargs(**kw):
    args = dict(cumulative_local_expert_recv_stats=None, dispatch_wait_recv_cost_stats=None,
                use_fp8=False, round_scale=False, use_ue8m0=False, async_finish=False,
                return_recv_hook=False)
    args.update(kw)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(num_tokens=9), "above num_max_dispatch_tokens_per_rank=8"),
    (dict(x_dtype=torch.float32), "x must be"),
    (dict(idx_rows=3), "topk_idx"),
    (dict(num_topk=33), "1..32"),
    (dict(num_experts=7), "multiple of the number of ranks"),
    (dict(hidden=260), "hidden"),
    (dict(use_fp8=True, hidden=136), "multiple of 128"),
    (dict(use_fp8=True, round_scale=True, use_ue8m0=True, hidden=256), "multiple of 512"),
    (dict(use_fp8=True, use_ue8m0=True), "needs round_scale=True"),
    (dict(round_scale=True), "need use_fp8=True"),
    (dict(stats_shape=(3,)), "cumulative_local_expert_recv_stats"),
    (dict(wait_stats=True), "dispatch_wait_recv_cost_stats"),
])
def test_bad_dispatch_arguments_are_clear_errors(change, match):
    t, h = change.pop("num_tokens", 4), change.pop("hidden", 512)
    num_experts = change.pop("num_experts", 8)
    x = torch.zeros((t, h), dtype=change.pop("x_dtype", torch.bfloat16))
    idx = torch.zeros((change.pop("idx_rows", t), change.pop("num_topk", 2)), dtype=torch.int64)
    kw = _dispatch_kwargs(**{k: v for k, v in change.items()
                             if k in ("use_fp8", "round_scale", "use_ue8m0")})
    if "stats_shape" in change:
        kw["cumulative_local_expert_recv_stats"] = torch.zeros(change["stats_shape"],
                                                               dtype=torch.int32)
    if change.get("wait_stats"):
        kw["dispatch_wait_recv_cost_stats"] = torch.zeros((2, 2), dtype=torch.int64)
    with pytest.raises(weft.Error, match=match):
        _cpu_state().dispatch(x, idx, 8, num_experts, **kw)


def test_bad_combine_arguments_are_clear_errors():
    state = _cpu_state()
    x = torch.zeros((2, 16, 128), dtype=torch.bfloat16)
    idx = torch.zeros((4, 2), dtype=torch.int64)
    w = torch.zeros((4, 2), dtype=torch.float32)
    common = dict(zero_copy=False, async_finish=False, return_recv_hook=False, out=None)
    with pytest.raises(weft.Error, match="use_logfmt"):
        state.combine(x, idx, w, None, use_logfmt=True, combine_wait_recv_cost_stats=None,
                      **common)
    with pytest.raises(weft.Error, match="combine_wait_recv_cost_stats"):
        state.combine(x, idx, w, None, use_logfmt=False,
                      combine_wait_recv_cost_stats=torch.zeros(2), **common)
    with pytest.raises(weft.Error, match="handle must be a low_latency_dispatch handle"):
        state.combine(x, idx, w, (None,) * 5, use_logfmt=False, combine_wait_recv_cost_stats=None,
                      **common)


def test_a_handle_older_than_the_two_latest_dispatches_is_refused():
    state = _cpu_state()
    slots = [types.SimpleNamespace(serial=2), types.SimpleNamespace(serial=1)]
    state._slots = slots

    def handle(owner, serial):
        return ll.LowLatencyHandle(torch.zeros(1), torch.zeros(1), 8, 128, 8, owner, serial,
                                   None, 4, 2)

    assert state._slot_of(handle(slots[0], 2), "x") is slots[0]
    assert state._slot_of(handle(slots[1], 1), "x") is slots[1]
    with pytest.raises(weft.Error, match="two latest dispatches"):
        state._slot_of(handle(slots[0], 0), "low_latency_combine")
    with pytest.raises(weft.Error, match="other shapes"):
        state._slot_of(handle(types.SimpleNamespace(serial=2), 2), "low_latency_combine")
    h = handle(slots[0], 2)
    assert isinstance(h, tuple) and len(h) == 5 and h[2:] == (8, 128, 8)


def test_every_call_runs_after_the_previous_calls_stream(monkeypatch):
    # The stream logic of the Python layer on the CPU, with the binding recorded: a plain call
    # names the current stream, one with async_finish or the hook the comm stream, and every
    # call after the first the stream of the previous call of either window (flag AFTER).
    flags = dict(LOW_LATENCY_FP8=1, LOW_LATENCY_ROUND_SCALE=2, LOW_LATENCY_UE8M0=4,
                 LOW_LATENCY_ON_COMM=8, LOW_LATENCY_AFTER=16)
    calls = []

    class Native:
        def low_latency_dispatch(self, slot, x, t, idx, int64, stats, stream, previous, f):
            calls.append(("dispatch", slot.comm_stream, stream, previous, f))
            return types.SimpleNamespace(handle=(slot.comm_stream,) * 9)

        def low_latency_combine(self, slot, y, rows, w, out, handle, stream, previous, f):
            calls.append(("combine", slot.comm_stream, stream, previous, f))

    m, hidden, num_experts, top_k, comm = 4, 128, 2, 2, 99
    state = _cpu_state(num_ranks=1)
    state._shapes = (m, hidden, num_experts, top_k)
    state._flags = tuple(flags.values())
    recv = torch.empty((num_experts, m, hidden), dtype=torch.bfloat16)
    state._slots = [types.SimpleNamespace(
        native=types.SimpleNamespace(_native=Native(), num_local_experts=num_experts,
                                     hidden=hidden),
        args=types.SimpleNamespace(comm_stream=comm), serial=-1, stride=m, src_info=None,
        layout_range=None, scales=None, ue8m0=None, combine_buffer=None, recv_q=recv,
        recv_bf16=recv, recv_count=torch.zeros(num_experts, dtype=torch.int32))
        for _ in range(2)]
    current = [7]
    monkeypatch.setattr(ll, "_current_raw_stream", lambda index: current[0])
    # The event of an async call needs a CUDA stream: none here.
    monkeypatch.setattr(state, "_finish", lambda a, r, keep: (None, None))
    x = torch.zeros((m, hidden), dtype=torch.bfloat16)
    idx = torch.zeros((m, top_k), dtype=torch.int64)
    w = torch.zeros((m, top_k), dtype=torch.float32)
    h0 = state.dispatch(x, idx, m, num_experts, **_dispatch_kwargs())[2]
    current[0] = 8
    state.dispatch(x, idx, m, num_experts, **_dispatch_kwargs(return_recv_hook=True))
    state.combine(recv, idx, w, h0, False, False, False, False, None, None)
    state.dispatch(x, idx, m, num_experts, **_dispatch_kwargs(async_finish=True, use_fp8=True))
    assert calls == [
        ("dispatch", comm, 7, 0, 0),        # the first call waits for nothing
        ("dispatch", comm, 8, 7, 8 | 16),   # on the comm stream, after stream 7
        ("combine", comm, 8, comm, 16),     # plain, on stream 8, after the comm stream
        ("dispatch", comm, 8, 8, 1 | 8 | 16),
    ]


def test_power_of_two_at_or_above_is_exact():
    v = torch.tensor([1.0, 0.75, 1.0 + 2**-23, 3.0, 2.0**-20, 448.0, 0.5 - 2**-25],
                     dtype=torch.float32)
    want = torch.tensor([1.0, 1.0, 2.0, 4.0, 2.0**-20, 512.0, 0.5], dtype=torch.float32)
    assert torch.equal(ref.power_of_two_at_or_above(v), want)


@pytest.mark.parametrize("round_scale", [False, True])
def test_the_fp8_cast_follows_deepeps_per_token_cast(round_scale):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn((33, 512), generator=g) * torch.rand((33, 1), generator=g) * 50).to(
        torch.bfloat16)
    x[3] = 0  # an all-zero row: the minimum amax
    q, scales = ref.cast_fp8(x, round_scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    amax = x.float().view(33, 4, 128).abs().amax(dim=2).clamp(min=1e-4)
    if round_scale:
        assert torch.all(scales >= amax / 448)
        assert torch.all(scales < 2 * amax / 448)
        assert torch.equal(torch.log2(scales), torch.log2(scales).round())
        want = (x.float().view(33, 4, 128) / scales.unsqueeze(2)).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), want.view(33, 512).view(torch.uint8))
    else:
        # DeepEP's formula on the CPU: the same payload; its scale a quotient there (torch on the
        # GPU multiplies, as weft does: test_the_cast_is_deepeps_torch_cast_on_the_gpu).
        want_q, want_s = ref.per_token_cast_to_fp8(x)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        ulp = (want_s.view(torch.int32) - scales.view(torch.int32)).abs()
        assert int(ulp.max()) <= 1
    back = (q.float().view(33, 4, 128) * scales.unsqueeze(2)).view(33, 512)
    assert torch.allclose(back, x.float(), rtol=2**-3, atol=1e-6)


def _special_groups(hidden=8 * 128, non_finite=True):
    """One token whose groups of 128 are the hand-computed cases of the C++ reference's test
    (tests/cpu/ep/fp8_test.cpp, CastWithRoundScaleMatchesHandComputedGroups); without
    non_finite, groups 5 and 6 hold no NaN or inf (the sign of a NaN that torch's cast writes
    differs between devices, where weft's kernel writes 0x7F)."""
    x = torch.ones((1, hidden), dtype=torch.float32)
    grp = x.view(hidden // 128, 128)
    grp[1] = 0.0                                    # amax clamps to 1e-4
    grp[2] = 2.0 ** -16                             # amax below 1e-4
    grp[3, 0], grp[3, 1] = 448.0, -448.0
    grp[4], grp[4, 0] = 3.0, 464.0                  # 232 = a tie of 224 and 240
    grp[5], grp[5, 0] = -2.0, float("nan") if non_finite else -1.0  # the NaN does not count
    grp[6, 0] = float("inf") if non_finite else 0.5
    grp[7, 1] = 2.0 ** -12
    return x.to(torch.bfloat16)


def test_the_fp8_cast_matches_the_hand_computed_groups():
    x = _special_groups()
    q, scales = ref.cast_fp8(x, True)
    q = q.view(torch.uint8).view(8, 128)
    assert scales.view(8).tolist() == [2.0 ** -8, 2.0 ** -22, 2.0 ** -22, 1.0, 2.0, 2.0 ** -7,
                                       float("inf"), 2.0 ** -8]
    want = {(0, 0): 0x78, (0, 127): 0x78, (1, 0): 0x00, (2, 5): 0x68, (3, 0): 0x7E,
            (3, 1): 0xFE, (3, 2): 0x38, (4, 0): 0x76, (4, 1): 0x3C, (5, 0): 0x7F, (5, 1): 0xF8,
            (6, 0): 0x7F, (6, 1): 0x00, (7, 0): 0x78, (7, 1): 0x18}
    for (g, i), code in want.items():
        got = int(q[g, i])
        assert (got & 0x7F if code == 0x7F else got) == code, (g, i)  # a NaN of either sign
    q, scales = ref.cast_fp8(x, False)
    assert int(q.view(torch.uint8)[0, 0]) == 0x7E
    assert float(scales[0, 0]) == torch.tensor(1.0 / 448.0, dtype=torch.float32).item()
    assert float(scales[0, 5]) == torch.tensor(2.0, dtype=torch.float32).div(448.0).item()


# -- on one GPU -----------------------------------------------------------------------------------
def _routing(num_tokens, num_experts, top_k, g, mask_fraction=0.2, empty_tokens=()):
    idx = ref.random_routing(num_tokens, num_experts, top_k, g, mask_fraction)
    for t in empty_tokens:
        idx[t] = -1
    return idx


def _weights(num_tokens, top_k, g):
    # Multiples of 2^-10 in (0, 4): 12 significant bits, so a weight times a bf16 row is exact
    # in fp32 and the kernel's fused multiply-adds equal the reference's multiply then add.
    return (torch.randint(1, 4096, (num_tokens, top_k), generator=g) / 1024.0).float()


def _expected_dispatch(x, idx, num_experts, stride):
    """Per local expert (one rank: every expert is local): the tokens in ascending order that
    select it (once however often), and their rows."""
    rows = []
    for e in range(num_experts):
        tokens = [t for t in range(idx.shape[0]) if bool((idx[t] == e).any())]
        assert len(tokens) <= stride
        rows.append(tokens)
    return rows


def _expected_combine(y, idx, w, rows):
    """combined_x on one rank in the kernel's order: per token, over its distinct experts in
    ascending order, partial += (0 + its selections' weights, k ascending) * y[e, slot], from 0
    in fp32, rounded once to bf16."""
    t_count, hidden = idx.shape[0], y.shape[2]
    slot = {(e, t): i for e, tokens in enumerate(rows) for i, t in enumerate(tokens)}
    out = torch.zeros((t_count, hidden), dtype=torch.float32)
    for t in range(t_count):
        for e in sorted({int(v) for v in idx[t] if v >= 0}):
            we = torch.zeros((), dtype=torch.float32)
            for k in range(idx.shape[1]):
                if int(idx[t, k]) == e:
                    we = we + w[t, k]
            out[t] = out[t] + we * y[e, slot[(e, t)]].float()
    return out.to(torch.bfloat16)


def _check_dispatch(res, x, idx, num_experts, m, use_fp8=False, round_scale=False,
                    use_ue8m0=False, stats=None):
    recv_x, recv_count, handle, _, _ = res
    stride = m
    rows = _expected_dispatch(x, idx, num_experts, stride)
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    assert recv_count.dtype == torch.int32 and torch.equal(recv_count.cpu(), counts)
    if stats is not None:
        assert torch.equal(stats.cpu(), counts)
    src_info, layout_range = handle[0].cpu(), handle[1].cpu()
    assert src_info.shape == (num_experts, stride) and src_info.dtype == torch.int32
    assert layout_range.shape == (num_experts, 1) and layout_range.dtype == torch.int64
    assert handle[2:] == (m, x.shape[1], num_experts)
    assert torch.equal(layout_range[:, 0] & 0xFFFFFFFF, counts.long())
    assert torch.equal(layout_range[:, 0] >> 32, torch.zeros(num_experts, dtype=torch.int64))
    if use_fp8:
        q, scales = ref.cast_fp8(x.cuda(), round_scale)  # the source's cast, on the device
        assert torch.equal(q.cpu().view(torch.uint8),
                           ref.cast_fp8(x, round_scale)[0].view(torch.uint8)), \
            "the device's cast differs from the host's"
        q, scales = q.cpu(), scales.cpu()
        got_q, got_s = recv_x
        assert got_q.dtype == torch.float8_e4m3fn
        assert got_q.shape == (num_experts, stride, x.shape[1])
        g = x.shape[1] // 128
        if use_ue8m0:
            assert got_s.dtype == torch.int32 and got_s.shape == (num_experts, stride, g // 4)
            assert got_s.stride() == (stride * (g // 4), 1, stride)
            # Row-major first (.contiguous() keeps a [.., .., 1] tensor's strides).
            got_s = torch.empty(got_s.shape, dtype=torch.int32).copy_(got_s)
            got_s = got_s.view(torch.uint8).to(torch.int32) << 23
            got_s = got_s.view(torch.float32)  # the exponent bytes as the scales they encode
        else:
            assert got_s.dtype == torch.float32 and got_s.shape == (num_experts, stride, g)
            assert got_s.stride() == (stride * g, 1, stride)
        got_q, got_s = got_q.cpu(), got_s.cpu()
    else:
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (num_experts, stride, x.shape[1])
        got = recv_x.cpu()
    for e, tokens in enumerate(rows):
        n = len(tokens)
        assert src_info[e, :n].tolist() == tokens, f"expert {e}"
        tt = torch.tensor(tokens, dtype=torch.long)
        if use_fp8:
            assert torch.equal(got_q[e, :n].view(torch.uint8), q[tt].view(torch.uint8)), \
                f"expert {e}"
            assert torch.equal(got_s[e, :n], scales[tt]), f"expert {e} scales"
        else:
            assert torch.equal(got[e, :n].view(torch.int16), x[tt].view(torch.int16)), f"expert {e}"
    return rows


@pytest.fixture
def gpu_buffer():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    bufs = []

    def make(m, hidden, num_experts, top_k=8):
        hint = weft.ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, 1, num_experts)
        buf = weft.ep.Buffer(None, num_rdma_bytes=hint, low_latency_mode=True,
                             explicitly_destroy=True)
        bufs.append(buf)
        return buf

    yield make
    for b in bufs:
        b.destroy()


@needs_gpus(1)
@pytest.mark.parametrize("round_scale", [False, True])
def test_the_cast_is_deepeps_torch_cast_on_the_gpu(gpu_buffer, round_scale):
    # DeepEP's per_token_cast_to_fp8 as its tests write it, run by torch on the GPU (round_scale:
    # its kernel's power-of-two scale, 2^ceil(log2(amax / 448)), and x times its inverse),
    # against what low_latency_dispatch received, every payload byte and scale. Token t selects
    # expert t % E alone, so expert e holds tokens e, e + E, ... in order.
    t, hidden, num_experts = 192, 2048, 8
    buf = gpu_buffer(t, hidden, num_experts)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn((t, hidden), generator=g) * torch.rand((t, 1), generator=g) * 20).to(
        torch.bfloat16).cuda()
    x[3, :128] = 0  # the minimum amax
    x[5, 7] = 1000.0  # its group's amax, cast to 448 exactly
    xv = x.float().view(t, hidden // 128, 128)
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    if round_scale:
        want_s = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
        want_q = (xv * (1.0 / want_s).unsqueeze(2)).to(torch.float8_e4m3fn).view(t, hidden)
    else:
        want_q, want_s = ref.per_token_cast_to_fp8(x)
    idx = (torch.arange(t, device="cuda") % num_experts).view(t, 1)
    (q, scales), count, _, _, _ = buf.low_latency_dispatch(x, idx, t, num_experts,
                                                            round_scale=round_scale)
    for e in range(num_experts):
        tokens = torch.arange(e, t, num_experts, device="cuda")
        n = tokens.numel()
        assert int(count[e]) == n
        assert torch.equal(q[e, :n].view(torch.uint8), want_q[tokens].view(torch.uint8)), e
        assert torch.equal(scales[e, :n].view(torch.int32), want_s[tokens].view(torch.int32)), e


@needs_gpus(1)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_round", "fp8_ue8m0"])
@pytest.mark.parametrize("mode", ["plain", "async", "hook"])
def test_dispatch_and_combine_match_the_reference(gpu_buffer, fmt, mode):
    m, hidden, num_experts, top_k = 96, 1024, 12, 5
    buf = gpu_buffer(m, hidden, num_experts)
    hook = mode == "hook"
    g = torch.Generator().manual_seed(11 + 3 * ["bf16", "fp8", "fp8_round", "fp8_ue8m0"].index(fmt)
                                      + ["plain", "async", "hook"].index(mode))
    use_fp8, round_scale, use_ue8m0 = fmt != "bf16", fmt in ("fp8_round", "fp8_ue8m0"), \
        fmt == "fp8_ue8m0"
    for t in (0, 1, 7, 40, m):  # M far above T, and T = M
        x = (torch.randn((t, hidden), generator=g) * 3).to(torch.bfloat16)
        if t >= 7:  # the cast's edge cases: the minimum amax, +-448, a tie
            x[3] = _special_groups(hidden, non_finite=False)[0]
        idx = _routing(t, num_experts, top_k, g, empty_tokens=range(0, t, 5))
        w = _weights(t, top_k, g)
        stats = torch.zeros(num_experts, dtype=torch.int32, device="cuda")
        res = buf.low_latency_dispatch(x.cuda(), idx.cuda(), m, num_experts,
                                       cumulative_local_expert_recv_stats=stats, use_fp8=use_fp8,
                                       round_scale=round_scale, use_ue8m0=use_ue8m0,
                                       async_finish=mode == "async", return_recv_hook=hook)
        if hook:
            assert res[4] is not None
            res[4]()
        elif mode == "async":
            res[3].current_stream_wait()
        rows = _check_dispatch(res, x, idx, num_experts, m, use_fp8, round_scale, use_ue8m0,
                               stats)
        y = (torch.randn((num_experts, m, hidden), generator=g)).to(torch.bfloat16)
        out, event, chook = buf.low_latency_combine(y.cuda(), idx.cuda(), w.cuda(), res[2],
                                                    async_finish=mode == "async",
                                                    return_recv_hook=hook)
        if hook:
            chook()
        elif mode == "async":
            event.current_stream_wait()
        want = _expected_combine(y, idx, w, rows)
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), f"T {t}"
        for e_t in range(0, t, 5):
            assert torch.equal(out[e_t].cpu(), torch.zeros(hidden, dtype=torch.bfloat16))


@needs_gpus(1)
def test_zero_copy_combine_and_the_two_latest_calls(gpu_buffer):
    m, hidden, num_experts, top_k = 16, 256, 4, 2
    buf = gpu_buffer(m, hidden, num_experts)
    g = torch.Generator().manual_seed(5)
    calls = []
    for i in range(3):
        x = torch.randn((m, hidden), generator=g).to(torch.bfloat16)
        idx = _routing(m, num_experts, top_k, g)
        calls.append((x, idx, buf.low_latency_dispatch(x.cuda(), idx.cuda(), m, num_experts,
                                                       use_fp8=False)))
    # The two latest dispatches' results are intact; the oldest handle is refused.
    for x, idx, res in calls[1:]:
        _check_dispatch(res, x, idx, num_experts, m)
    x, idx, res = calls[0]
    w = _weights(m, top_k, g)
    with pytest.raises(weft.Error, match="two latest dispatches"):
        buf.low_latency_combine(res[0], idx.cuda(), w.cuda(), res[2])
    for x, idx, res in calls[1:]:
        rows = _expected_dispatch(x, idx, num_experts, m)
        y = torch.randn((num_experts, m, hidden), generator=g).to(torch.bfloat16)
        buf.get_next_low_latency_combine_buffer(res[2])[:] = y.cuda()
        out, _, _ = buf.low_latency_combine(torch.empty_like(y).cuda(), idx.cuda(), w.cuda(),
                                            res[2], zero_copy=True)
        assert torch.equal(out.cpu().view(torch.int16),
                           _expected_combine(y, idx, w, rows).view(torch.int16))


@needs_gpus(1)
def test_a_thousand_back_to_back_calls_with_fresh_inputs(gpu_buffer):
    m, hidden, num_experts, top_k = 32, 512, 8, 4
    buf = gpu_buffer(m, hidden, num_experts)
    g = torch.Generator().manual_seed(7)
    for i in range(1000):
        t = int(torch.randint(0, m + 1, (1,), generator=g))
        x = torch.randn((t, hidden), generator=g).to(torch.bfloat16)
        idx = _routing(t, num_experts, top_k, g)
        w = _weights(t, top_k, g)
        use_fp8 = i % 3 == 1
        res = buf.low_latency_dispatch(x.cuda(), idx.cuda(), m, num_experts, use_fp8=use_fp8,
                                       return_recv_hook=i % 2 == 0)
        if res[4] is not None:
            res[4]()
        y = torch.randn((num_experts, m, hidden), generator=g).to(torch.bfloat16)
        out, _, _ = buf.low_latency_combine(y.cuda(), idx.cuda(), w.cuda(), res[2])
        if i % 50 == 0 or i == 999:
            rows = _check_dispatch(res, x, idx, num_experts, m, use_fp8)
            assert torch.equal(out.cpu().view(torch.int16),
                               _expected_combine(y, idx, w, rows).view(torch.int16)), f"call {i}"
        else:
            # Every call's counts still checked: they name a misrouted call cheaply.
            want = torch.stack([(idx == e).any(dim=1).sum() for e in range(num_experts)])
            assert torch.equal(res[1].cpu(), want.to(torch.int32)), f"call {i}"
    torch.cuda.synchronize()


@needs_gpus(1)
def test_calls_on_other_streams_wait_for_the_windows_previous_call(gpu_buffer):
    # A plain call runs on the current stream. Dispatch 0 (window A) is held back on stream s1
    # behind a long kernel; dispatches 1 (window B) and 2 (window A again) are made on s2, which
    # does not wait for s1: both must still follow dispatch 0 (a Buffer's low-latency kernels run
    # in call order on every rank; had dispatch 2 not waited, dispatch 0 would land after it and
    # its results would be dispatch 0's), and so must a combine of dispatch 2 made on a third
    # stream.
    m, hidden, num_experts, top_k = 32, 512, 8, 4
    buf = gpu_buffer(m, hidden, num_experts)
    g = torch.Generator().manual_seed(13)
    s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    for use_fp8 in (False, True):
        inputs = []
        for _ in range(3):
            x = torch.randn((m, hidden), generator=g).to(torch.bfloat16)
            inputs.append((x, _routing(m, num_experts, top_k, g), x.cuda()))
        idx_dev = [idx.cuda() for _, idx, _ in inputs]
        torch.cuda.synchronize()
        results = []
        with torch.cuda.stream(s1):
            torch.cuda._sleep(50_000_000)  # about 25 ms or more on any recent GPU
            results.append(buf.low_latency_dispatch(inputs[0][2], idx_dev[0], m, num_experts,
                                                    use_fp8=use_fp8))
        with torch.cuda.stream(s2):
            for i in (1, 2):
                results.append(buf.low_latency_dispatch(inputs[i][2], idx_dev[i], m,
                                                        num_experts, use_fp8=use_fp8))
        y = torch.randn((num_experts, m, hidden), generator=g).to(torch.bfloat16)
        w = _weights(m, top_k, g)
        y_dev, w_dev = y.cuda(), w.cuda()
        torch.cuda.synchronize()  # y and w are on the device before s3 reads them
        with torch.cuda.stream(s3):
            out, _, _ = buf.low_latency_combine(y_dev, idx_dev[2], w_dev, results[2][2])
        torch.cuda.synchronize()
        for i in (1, 2):
            x, idx, _ = inputs[i]
            rows = _check_dispatch(results[i], x, idx, num_experts, m, use_fp8)
        want = _expected_combine(y, inputs[2][1], w, rows)
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


@needs_gpus(1)
def test_a_call_outside_a_capture_still_running_after_a_captured_call_is_refused(gpu_buffer):
    # The previous call was captured on a stream whose capture has not ended: a plain call on
    # another stream cannot wait for it (a capture is not work that runs), and running before it
    # could break the Buffer's call order. It is refused before it launches anything, the capture
    # goes on, and once the capture ends the same call runs and gives the reference's rows.
    m, hidden, num_experts, top_k = 16, 256, 4, 2
    buf = gpu_buffer(m, hidden, num_experts)
    g = torch.Generator().manual_seed(21)
    x = torch.randn((m, hidden), generator=g).to(torch.bfloat16)
    idx = _routing(m, num_experts, top_k, g)
    x_dev, idx_dev = x.cuda(), idx.cuda()
    buf.low_latency_dispatch(x_dev, idx_dev, m, num_experts, use_fp8=False)  # lays out
    torch.cuda.synchronize()
    other = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        buf.low_latency_dispatch(x_dev, idx_dev, m, num_experts, use_fp8=False)
        with torch.cuda.stream(other):
            with pytest.raises(weft.Error, match="capture has not ended"):
                buf.low_latency_dispatch(x_dev, idx_dev, m, num_experts, use_fp8=False)
    graph.replay()
    with torch.cuda.stream(other):
        res = buf.low_latency_dispatch(x_dev, idx_dev, m, num_experts, use_fp8=False)
    torch.cuda.synchronize()
    _check_dispatch(res, x, idx, num_experts, m)


@needs_gpus(1)
@pytest.mark.parametrize("use_fp8", [False, True])
def test_a_cuda_graph_of_dispatch_expert_matmul_combine_replays_with_new_inputs(gpu_buffer,
                                                                                use_fp8):
    m, hidden, num_experts, top_k = 24, 256, 4, 3
    buf = gpu_buffer(m, hidden, num_experts)
    g = torch.Generator().manual_seed(9 + use_fp8)
    # Static inputs the graph reads; each replay gets new contents.
    x_in = torch.zeros((m, hidden), dtype=torch.bfloat16, device="cuda")
    idx_in = torch.zeros((m, top_k), dtype=torch.int64, device="cuda")
    w_in = torch.zeros((m, top_k), dtype=torch.float32, device="cuda")
    # One matrix per expert, entries multiples of 2^-4 with few bits: the bf16 matmul's products
    # and sums stay exact enough to compare against the same matmul on the device below.
    weight = (torch.randint(-8, 9, (num_experts, hidden, hidden), generator=g) / 16.0).to(
        torch.bfloat16).cuda()

    def step():
        recv_x, recv_count, handle, _, hook = buf.low_latency_dispatch(
            x_in, idx_in, m, num_experts, use_fp8=use_fp8, return_recv_hook=True)
        hook()
        if use_fp8:  # the expert's input dequantised (each group times its scale)
            q, scales = recv_x
            rows = q.float() * scales.repeat_interleave(128, dim=2)
            y = torch.bmm(rows.to(torch.bfloat16), weight)
        else:
            y = torch.bmm(recv_x, weight)
        out, _, _ = buf.low_latency_combine(y, idx_in, w_in, handle)
        return recv_x, recv_count, y, out, handle

    def fill():
        x = (torch.randint(-4, 5, (m, hidden), generator=g) / 4.0).to(torch.bfloat16)
        idx = _routing(m, num_experts, top_k, g)
        w = _weights(m, top_k, g)
        x_in.copy_(x)
        idx_in.copy_(idx)
        w_in.copy_(w)
        return x, idx, w

    fill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture (lays the windows out)
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_count, y, out, handle = step()
    for replay in range(1000):  # races hide on first calls: a thousand, every one checked
        x, idx, w = fill()
        graph.replay()
        torch.cuda.synchronize()
        rows = _expected_dispatch(x, idx, num_experts, m)
        assert recv_count.cpu().tolist() == [len(r) for r in rows], f"replay {replay}"
        if use_fp8:
            want_q, want_s = ref.cast_fp8(x, False)
            got_q, got_s = (v.cpu() for v in recv_x)
        else:
            got_x = recv_x.cpu()
        for e, tokens in enumerate(rows):
            tt = torch.tensor(tokens, dtype=torch.long)
            n = len(tokens)
            if use_fp8:
                assert torch.equal(got_q[e, :n].view(torch.uint8), want_q[tt].view(torch.uint8)), \
                    f"replay {replay} expert {e}"
                assert torch.equal(got_s[e, :n], want_s[tt]), f"replay {replay} expert {e}"
            else:
                assert torch.equal(got_x[e, :n].view(torch.int16), x[tt].view(torch.int16)), \
                    f"replay {replay} expert {e}"
        # The combine's input is the graph's own matmul output: the reference combines that.
        want = _expected_combine(y.cpu(), idx, w, rows)
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), \
            f"replay {replay}"


# -- one process per GPU over an NCCL group -------------------------------------------------------
def _body_ranks(rank, world):
    import torch.distributed as dist

    import weft.ep

    from test_ep_ranks import _gather

    m, hidden, top_k = 32, 512, 3
    num_experts = 4 * world
    e_local, stride = num_experts // world, m * world
    group = dist.group.WORLD
    hint = weft.ep.Buffer.get_low_latency_rdma_size_hint(m, hidden, world, num_experts)
    buf = weft.ep.Buffer(group, num_rdma_bytes=hint, low_latency_mode=True,
                         explicitly_destroy=True)
    # T >= 1 (every rank's inputs are all-gathered for the reference); T = 0 is a one-GPU case.
    for round_, t in enumerate((m, 1, 2, 17, m, 5)):
        g = torch.Generator().manual_seed(round_ * 100 + rank)
        x = (torch.randn((t, hidden), generator=g) * 2).to(torch.bfloat16)
        idx = _routing(t, num_experts, top_k, g, empty_tokens=range(0, t, 7))
        w = _weights(t, top_k, g)
        use_fp8, hook = round_ % 2 == 1, round_ % 3 == 2
        round_scale = use_fp8 and round_ % 4 == 3
        res = buf.low_latency_dispatch(x.cuda(), idx.cuda(), m, num_experts, use_fp8=use_fp8,
                                       round_scale=round_scale, return_recv_hook=hook)
        if hook:
            res[4]()
        xs, idxs, ws = (_gather(v.cuda(), world) for v in (x, idx, w))
        if use_fp8:
            sent = [tuple(p.cpu() for p in ref.cast_fp8(v.cuda(), round_scale)) for v in xs]
        # Rank d's segment of its local expert e: (source rank, token) in that order.
        segments = {}
        for d in range(world):
            for e in range(e_local):
                gid = d * e_local + e
                segments[(d, e)] = [(s, tt) for s in range(world) for tt in range(t)
                                    if bool((idxs[s][tt] == gid).any())]
        recv_x, recv_count, handle = res[0], res[1].cpu(), res[2]
        src_info, layout_range = handle[0].cpu(), handle[1].cpu()
        got = tuple(v.cpu() for v in recv_x) if use_fp8 else recv_x.cpu()
        for e in range(e_local):
            seg = segments[(rank, e)]
            assert int(recv_count[e]) == len(seg), f"round {round_} expert {e}"
            assert src_info[e, :len(seg)].tolist() == [tt for _, tt in seg]
            for s in range(world):
                begin = sum(1 for s2, _ in seg if s2 < s)
                count = sum(1 for s2, _ in seg if s2 == s)
                assert int(layout_range[e, s]) == (begin << 32) | count
            for i, (s, tt) in enumerate(seg):
                if use_fp8:
                    assert torch.equal(got[0][e, i].view(torch.uint8),
                                       sent[s][0][tt].view(torch.uint8))
                    assert torch.equal(got[1][e, i], sent[s][1][tt])
                else:
                    assert torch.equal(got[e, i].view(torch.int16), xs[s][tt].view(torch.int16))
        # Combine: every rank's expert outputs, gathered for the reference.
        y = torch.randn((e_local, stride, hidden), generator=g).to(torch.bfloat16)
        ys = _gather(y.cuda(), world)
        out, event, chook = buf.low_latency_combine(y.cuda(), idx.cuda(), w.cuda(), handle,
                                                    return_recv_hook=hook)
        if hook:
            chook()
        want = torch.zeros((t, hidden), dtype=torch.float32)
        for tt in range(t):
            for d in range(world):
                partial = torch.zeros(hidden, dtype=torch.float32)
                sent_here = False
                for e in range(e_local):
                    seg = segments[(d, e)]
                    if (rank, tt) not in seg:
                        continue
                    sent_here = True
                    we = torch.zeros((), dtype=torch.float32)
                    for k in range(top_k):
                        if int(idx[tt, k]) == d * e_local + e:
                            we = we + w[tt, k]
                    partial = partial + we * ys[d][e, seg.index((rank, tt))].float()
                if sent_here:
                    want[tt] = want[tt] + partial.to(torch.bfloat16).float()
        want = want.to(torch.bfloat16)
        assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16)), f"round {round_}"
    buf.destroy()


@needs_gpus(1)
@pytest.mark.parametrize("world", sorted({1, min(torch.cuda.device_count() if
                                                 torch.cuda.is_available() else 0, 2)} - {0}))
def test_every_rank_matches_the_reference_over_an_nccl_group(world):
    from test_ep_ranks import run_ranks
    run_ranks(_body_ranks, world)
