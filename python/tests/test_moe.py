"""weft.moe: the MoE layer's forward and backward through each dispatcher, against a per-token
dense reference, and the dispatchers against each other bit for bit."""

import copy

import pytest

torch = pytest.importorskip("torch")

import weft.moe as moe  # noqa: E402
from weft import Error  # noqa: E402
from conftest import needs_gpus, run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def dense_reference(layer, x):
    """The layer token by token in fp32 (no dispatcher): sum_k w_k FFN_{e_k}(x)."""
    idx, w = layer.route(x)
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            h = layer.w13[e].float() @ x[t].float()
            gate, up = h.chunk(2)
            out[t] += w[t, k] * (layer.w2[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


def test_layer_matches_the_dense_reference_in_fp32():
    layer = moe.MoELayer(32, 8, 3, 16, moe.LocalDispatcher(8), dtype=torch.float32, seed=3)
    x = torch.randn(40, 32)
    y = layer(x)  # the combine returns bf16, as the EP kernels do
    want = dense_reference(layer, x)
    assert torch.allclose(y.float(), want, rtol=1e-2, atol=1e-2)


def _grads(model, x, target):
    moe.train_step(model, x, target, lr=0.0)
    return [p.grad.clone() for p in model.parameters()]


def test_local_and_all_to_all_dispatchers_agree_bit_for_bit():
    torch.manual_seed(0)
    kw = dict(num_layers=2, hidden=64, num_experts=16, top_k=4, ffn=32)
    a = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), **kw)
    b = moe.MoEModel(dispatcher=moe.AllToAllDispatcher(None, 16), **kw)
    x = torch.randn(50, 64).bfloat16()
    target = torch.randn(50, 64).bfloat16()
    la = moe.train_step(a, x, target, lr=1e-2)
    lb = moe.train_step(b, x, target, lr=1e-2)
    assert torch.equal(la, lb)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("num_tokens,idx_dtype", [(0, torch.int64), (1, torch.int64),
                                                  (33, torch.int64), (33, torch.int32)])
def test_all_to_all_dispatch_and_combine_match_the_local_ones_with_dropped_selections(
        num_tokens, idx_dtype):
    # Selections of -1 (a token may have none), so that some tokens go nowhere: the all_to_all
    # dispatcher's rows (picked by a sort, their number and the entry count exchanged with its
    # sizes) equal the local dispatcher's, element by element, and so do the combined rows.
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn((num_tokens, 32), generator=g).bfloat16()
    idx = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(num_tokens)]) \
        if num_tokens else torch.empty((0, 4), dtype=torch.int64)
    idx = torch.where(torch.rand((num_tokens, 4), generator=g) < 0.4, -1, idx)
    idx[0:1] = -1  # the first token (if any) selects nothing
    idx = idx.to(idx_dtype)
    w = torch.rand((num_tokens, 4), generator=g)
    local, a2a = moe.LocalDispatcher(16), moe.AllToAllDispatcher(None, 16)
    want, got = local.dispatch(x, idx, w), a2a.dispatch(x, idx, w)
    for a, b in zip(want[:3], got[:3]):
        assert torch.equal(a, b)
    assert got[4] == want[4] == int((idx >= 0).sum())
    assert got[1].dtype == want[1].dtype == idx_dtype
    y = torch.randn(want[0].shape, generator=g).bfloat16()
    # Rows and weights of -0.0: a sum into zeros gives +0.0, and every dispatcher sums.
    y[::3] = -0.0
    combined = [d.combine(y, r[3], weights=-r[2]) for d, r in ((local, want), (a2a, got))]
    for a, b in zip(combined[0], combined[1]):  # bit for bit: -0.0 differs from +0.0
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _selections(num_tokens, num_experts, top_k, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((num_tokens, 32), generator=g).bfloat16()
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:top_k]
                       for _ in range(num_tokens)])
    idx = torch.where(torch.rand((num_tokens, top_k), generator=g) < 0.3, -1, idx)
    w = torch.rand((num_tokens, top_k), generator=g)
    return x.to(device), idx.to(device), w.to(device)


def _assert_same_dispatch(want, got):
    for a, b in zip(want[:3], got[:3]):
        assert torch.equal(a, b)
    assert got[4] == want[4]
    for a, b in zip(want[3][0], got[3][0]):  # the tokens sent to each rank
        assert torch.equal(a, b)
    assert got[3][1:] == want[3][1:]


def test_all_to_all_dispatch_of_a_layout_begun_before_it_is_the_whole_dispatch():
    # layout_begin (the router stage's half) then dispatch(layout): the same rows, handle and
    # count as one dispatch; a layout of other selections (even of their shape and values), or
    # a layout group without a group, is refused.
    d = moe.AllToAllDispatcher(None, 16)
    for seed in range(3):
        x, idx, w = _selections(41, 16, 4, seed)
        layout = d.layout_begin(idx)
        _assert_same_dispatch(d.dispatch(x, idx, w), d.dispatch(x, idx, w, layout=layout))
        _assert_same_dispatch(d.dispatch(x, idx, w),
                              moe.dispatchers.begin_dispatch(d, x, idx, w, layout).finish())
    for other in (idx[:40], idx.clone()):
        with pytest.raises(Error, match="made of other selections"):
            d.dispatch(x[:other.shape[0]], other, w[:other.shape[0]], layout=layout)
    with pytest.raises(ValueError, match="layout_group"):
        moe.AllToAllDispatcher(None, 16, layout_group=object())


def test_all_to_all_dispatch_refuses_expert_ids_past_its_experts():
    # An id of no rank's expert would go nowhere: the dispatch counts the selections that are
    # not negative beside those that reached a rank, and refuses the difference before any row
    # moves (-1, or any negative id, selects no expert).
    d = moe.AllToAllDispatcher(None, 16)
    x, idx, w = _selections(20, 16, 4, 3)
    for bad in (16, 1000):
        wrong = idx.clone()
        wrong[5, 0] = bad
        with pytest.raises(Error, match=r"selects experts outside \[0, 16\)"):
            d.dispatch(x, wrong, w)
    fewer = idx.clone()
    fewer[5, 0] = -7
    got = d.dispatch(x, fewer, w)
    assert got[4] == int((fewer >= 0).sum())


def _one_rank_selects_no_experts_expert(rank, world_size):
    import torch.distributed as dist

    torch.set_num_threads(1)
    d = moe.AllToAllDispatcher(dist.group.WORLD, 16)
    x, idx, w = _selections(12, 16, 4, 20 + rank)
    wrong = idx.clone()
    if rank == 1:
        wrong[3, 0] = 16
    with pytest.raises(Error, match=r"outside \[0, 16\).*per rank \{1: 1\}; no row moved"):
        d.dispatch(x, wrong, w)
    got = d.dispatch(x, idx, w)  # both ranks go on in step
    assert got[4] == int((got[1] >= 0).sum()) > 0 and got[1].shape[0] == got[0].shape[0]


@pytest.mark.timeout(100)
def test_every_rank_refuses_a_selection_of_no_experts_expert_together(tmp_path):
    # One rank's id of no expert: its sizes carry the count to every rank, so every rank raises
    # before the rows' all_to_all (none waits in it for a rank that stopped), then all go on.
    run_ranks(_one_rank_selects_no_experts_expert, 2, tmp_path / "store", timeout_s=90)
    with pytest.raises(ValueError, match="multiple of the ranks"):
        moe.AllToAllDispatcher(None, 0)


def test_the_emulated_all_to_all_dispatcher_passes_its_layout_on():
    holds = []
    inner = moe.AllToAllDispatcher(None, 16)
    d = moe.EmulatedDispatcher(inner, moe.emulated.A2A_2XH200, num_sms=4,
                               hold=lambda sms, us, dev: holds.append(us))
    x, idx, w = _selections(20, 16, 4, 7)
    layout = d.layout_begin(idx)
    assert not holds  # a layout moves nothing
    _assert_same_dispatch(inner.dispatch(x, idx, w), d.dispatch(x, idx, w, layout=layout))
    _assert_same_dispatch(inner.dispatch(x, idx, w),
                          d.dispatch_begin(x, idx, w, d.layout_begin(idx)).finish())
    assert len(holds) == 2
    with pytest.raises(Error, match="made of other selections"):
        d.dispatch(x, idx.clone(), w, layout=layout)


@needs_gpus(1)
def test_all_to_all_dispatch_waits_for_its_layout_not_for_its_stream():
    # A 100 ms hold on the router's stream before its layout, a 600 ms hold on the dispatch's
    # stream before the dispatch: a dispatch of that layout returns after the router's hold
    # (its sizes are the layout's) and while the dispatch stream's hold still runs, and its
    # results are the whole dispatch's once the stream is done; one that makes its layout on
    # its own stream (no layout given) waits that stream's hold out.
    from weft.moe.emulated import hold_on_current_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    d = moe.AllToAllDispatcher(None, 16)
    x, idx, w = _selections(512, 16, 4, 11, device=dev)
    want = d.dispatch(x, idx, w)
    router, comm = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    router.wait_stream(torch.cuda.current_stream(dev))
    comm.wait_stream(torch.cuda.current_stream(dev))
    for given in (True, False):
        routed, held = torch.cuda.Event(), torch.cuda.Event()
        with torch.cuda.stream(router):
            hold_on_current_stream(1, 100_000.0, dev)
            routed.record(router)
            layout = d.layout_begin(idx) if given else None
        with torch.cuda.stream(comm):
            hold_on_current_stream(1, 600_000.0, dev)
            held.record(comm)
            got = d.dispatch(x, idx, w, layout=layout)
            after_the_router, during_the_hold = routed.query(), not held.query()
        comm.synchronize()
        assert after_the_router
        assert during_the_hold == given
        _assert_same_dispatch(want, got)


@needs_gpus(1)
def test_the_layout_kernel_gives_the_torch_layout_in_every_element():
    # The all_to_all dispatcher's layout on a GPU is one kernel (layout_on_gpu); elsewhere it is
    # torch ops (layout_in_torch). Fresh random selections with dropped (-1), other negative and
    # no rank's ids, int32 and int64, 1 to 64 ranks, token counts around the kernel's block
    # size, and a topk_idx that is a strided view: all four tensors equal, element by element,
    # in dtype and shape too.
    from weft.moe.dispatchers import can_layout_on_gpu, layout_in_torch, layout_on_gpu

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(5)
    for dtype in (torch.int64, torch.int32):
        for num_ranks in (1, 2, 3, 8, 64):
            epr = 4
            num_experts = num_ranks * epr
            for num_tokens in (0, 1, 511, 1024, 1025, 4099):
                for top_k in (1, 8):
                    idx = torch.randint(0, num_experts, (num_tokens, top_k), generator=g,
                                        device=dev)
                    kind = torch.randint(0, 20, idx.shape, generator=g, device=dev)
                    idx = torch.where(kind == 0, -1, torch.where(kind == 1, -9, idx))
                    idx = torch.where(kind == 2, idx + num_experts, idx).to(dtype)
                    assert can_layout_on_gpu(idx, num_ranks)
                    want = layout_in_torch(idx, num_ranks, epr)
                    got = layout_on_gpu(idx, num_ranks, epr)
                    for name, a, b in zip(("sizes", "order", "mine", "send_idx"), want, got):
                        assert a.dtype == b.dtype and torch.equal(a, b), \
                            (name, dtype, num_ranks, num_tokens, top_k)
    wide = torch.randint(0, 16, (300, 16), generator=g, device=dev)[:, ::2]  # not contiguous
    for a, b in zip(layout_in_torch(wide, 4, 4), layout_on_gpu(wide, 4, 4)):
        assert torch.equal(a, b)
    assert not can_layout_on_gpu(wide, 65)
    assert not can_layout_on_gpu(wide.float(), 4)


def test_gradients_match_autograd_through_the_dense_reference():
    torch.manual_seed(1)
    layer = moe.MoELayer(16, 4, 2, 8, moe.LocalDispatcher(4), dtype=torch.float32, seed=5)
    ref = copy.deepcopy(layer)
    x = torch.randn(12, 16, requires_grad=True)
    layer(x).float().sum().backward()
    x2 = x.detach().clone().requires_grad_()
    dense_reference(ref, x2).sum().backward()
    # bf16 rounding of the combine output (forward) and of the combined gradient.
    assert torch.allclose(x.grad, x2.grad, rtol=2e-2, atol=2e-2)
    for p, q in zip(layer.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=3e-2, atol=3e-2)


@needs_gpus(1)
def test_weft_ep_dispatcher_agrees_with_the_local_one_bit_for_bit():
    import weft.ep

    torch.manual_seed(2)
    kw = dict(num_layers=2, hidden=256, num_experts=16, top_k=4, ffn=128, device="cuda")
    ep = moe.MoEModel(dispatcher=moe.EpDispatcher(weft.ep.Buffer(None, int(1e9)), 16), **kw)
    local = moe.MoEModel(dispatcher=moe.LocalDispatcher(16), **kw)
    a2a = moe.MoEModel(dispatcher=moe.AllToAllDispatcher(None, 16), **kw)
    for step in range(3):
        x = torch.randn(300, 256, device="cuda").bfloat16()
        target = torch.randn(300, 256, device="cuda").bfloat16()
        losses = [moe.train_step(m, x, target, lr=1e-2) for m in (ep, local, a2a)]
        assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2]), step
    for pe, pl, pa in zip(ep.parameters(), local.parameters(), a2a.parameters()):
        assert torch.equal(pe, pl) and torch.equal(pe, pa)


def _expert_reference(recv_x, recv_idx, recv_w, w13, w2):
    """Row by row, slot by slot in fp32: sum over the slots with a local expert."""
    out = torch.zeros(recv_x.shape, dtype=torch.float32)
    for r in range(recv_x.shape[0]):
        for k in range(recv_idx.shape[1]):
            e = int(recv_idx[r, k])
            if e < 0:
                continue
            gate, up = (w13[e].float() @ recv_x[r].float()).chunk(2)
            out[r] += recv_w[r, k] * (w2[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_ffn_with_slots_elsewhere_matches_the_per_row_reference(dtype):
    from weft.moe.experts import expert_entries, expert_ffn

    g = torch.Generator().manual_seed(11)
    rows, hidden, ffn, num_local, top_k = 37, 32, 16, 5, 4
    recv_x = torch.randn((rows, hidden), generator=g).to(dtype)
    # Each row's experts distinct, about a third of the slots on other ranks (-1), one expert
    # (3) that no row picks: an empty group.
    perm = torch.stack([torch.tensor([0, 1, 2, 4])[torch.randperm(4, generator=g)]
                        for _ in range(rows)])
    recv_idx = torch.where(torch.rand((rows, top_k), generator=g) < 0.35, -1, perm)
    recv_idx[0] = -1  # a row with no local expert at all
    recv_w = torch.rand((rows, top_k), generator=g)
    w13 = (torch.randn((num_local, 2 * ffn, hidden), generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn((num_local, hidden, ffn), generator=g) / ffn ** 0.5).to(dtype)
    num_entries = int((recv_idx >= 0).sum())
    entries, ends = expert_entries(recv_idx, num_local)
    flat = recv_idx.flatten()
    assert ends.tolist() == [int((flat <= e).sum() - (flat < 0).sum()) for e in range(num_local)]
    assert torch.equal(flat[entries[:num_entries]].sort().values, flat[flat >= 0].sort().values)
    assert torch.all(flat[entries[num_entries:]] == -1)
    y = expert_ffn(recv_x, recv_idx, recv_w, w13, w2, num_entries)
    assert torch.equal(y, expert_ffn(recv_x, recv_idx, recv_w, w13, w2))  # counted here
    want = _expert_reference(recv_x, recv_idx, recv_w, w13, w2)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(y.float(), want, rtol=tol, atol=tol)
    assert torch.equal(y[0], torch.zeros_like(y[0]))
