"""weft.moe.expert_backward: the experts' data gradient per micro-batch and their weight gradient
once over several micro-batches, against autograd through expert_ffn (fp32: to rounding; bf16:
within bf16's tolerance), with slots on other ranks, an empty group, a row without a local
expert and a micro-batch without any entry; and the deferred wgrad's contracts."""

import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
import weft.moe as moe  # noqa: E402
from weft.moe.expert_backward import ExpertWgrad, expert_dgrad  # noqa: E402
from weft.moe.experts import expert_ffn, expert_forward  # noqa: E402

pytestmark = pytest.mark.timeout(120)

HIDDEN, FFN, NUM_LOCAL, TOP_K = 32, 16, 5, 4


def _micro_batch(g, rows, dtype, none_local=False):
    recv_x = torch.randn((rows, HIDDEN), generator=g).to(dtype)
    # Each row's experts distinct, about a third of the slots on other ranks (-1); expert 3 is
    # never picked (an empty group); row 0 has no local expert.
    perm = torch.stack([torch.tensor([0, 1, 2, 4])[torch.randperm(4, generator=g)]
                        for _ in range(rows)])
    recv_idx = torch.where(torch.rand((rows, TOP_K), generator=g) < 0.35, -1, perm)
    recv_idx[0] = -1
    if none_local:
        recv_idx[:] = -1
    recv_w = torch.rand((rows, TOP_K), generator=g)
    grad_out = torch.randn((rows, HIDDEN), generator=g).to(dtype)
    return recv_x, recv_idx, recv_w, grad_out


def _weights(g, dtype):
    w13 = (torch.randn((NUM_LOCAL, 2 * FFN, HIDDEN), generator=g) / HIDDEN ** 0.5).to(dtype)
    w2 = (torch.randn((NUM_LOCAL, HIDDEN, FFN), generator=g) / FFN ** 0.5).to(dtype)
    return w13, w2


def _close(got, want, dtype):
    """fp32: to rounding; bf16: max |got - want| within 2% of max |want| (the step's tolerance)."""
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return err <= (1e-5 if dtype == torch.float32 else 2e-2) * max(scale, 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dgrad_and_deferred_wgrad_match_autograd_through_expert_ffn(dtype):
    g = torch.Generator().manual_seed(21)
    w13, w2 = _weights(g, dtype)
    batches = [_micro_batch(g, rows, dtype, none_local=(i == 2))
               for i, rows in enumerate((37, 20, 9, 28))]
    wgrad = ExpertWgrad()
    ref13 = torch.zeros(w13.shape, dtype=torch.float32)
    ref2 = torch.zeros(w2.shape, dtype=torch.float32)
    for recv_x, recv_idx, recv_w, grad_out in batches:
        # Autograd through the layer's experts.
        leaves = [t.detach().requires_grad_() for t in (recv_x, recv_w, w13, w2)]
        y = expert_ffn(leaves[0], recv_idx, leaves[1], leaves[2], leaves[3])
        y.backward(grad_out)
        ref13 += leaves[2].grad.float()
        ref2 += leaves[3].grad.float()
        # By hand: the same forward bits, then the data gradient.
        with torch.no_grad():
            out, act = expert_forward(recv_x, recv_idx, recv_w, w13, w2)
            assert torch.equal(out, y.detach())
            grad_x, grad_w, inputs = expert_dgrad(grad_out, act, w13, w2)
        assert grad_x.dtype == dtype and grad_w.dtype == torch.float32
        assert _close(grad_x, leaves[0].grad, dtype) and _close(grad_w, leaves[1].grad, dtype)
        # Slots without a local expert get no gradient; row 0 none at all.
        assert torch.all(grad_w[recv_idx < 0] == 0) and torch.all(grad_x[0] == 0)
        wgrad.add(inputs)
    assert wgrad.num_micro_batches == len(batches)
    with torch.no_grad():
        grad_w13, grad_w2 = wgrad.compute()
    assert grad_w13.dtype == dtype and grad_w13.shape == w13.shape and grad_w2.shape == w2.shape
    assert _close(grad_w13, ref13, dtype) and _close(grad_w2, ref2, dtype)
    assert torch.all(grad_w13[3] == 0) and torch.all(grad_w2[3] == 0)  # the empty group
    assert wgrad.num_micro_batches == 0  # compute() empties it


def test_wgrad_of_one_micro_batch_and_of_a_micro_batch_without_entries():
    g = torch.Generator().manual_seed(22)
    w13, w2 = _weights(g, torch.float32)
    for none_local in (False, True):
        recv_x, recv_idx, recv_w, grad_out = _micro_batch(g, 17, torch.float32, none_local)
        leaves = [t.detach().requires_grad_() for t in (w13, w2)]
        expert_ffn(recv_x, recv_idx, recv_w, *leaves).backward(grad_out)
        wgrad = ExpertWgrad()
        with torch.no_grad():
            _, act = expert_forward(recv_x, recv_idx, recv_w, w13, w2)
            wgrad.add(expert_dgrad(grad_out, act, w13, w2)[2])
            got = wgrad.compute()
        for a, b in zip(got, leaves):
            assert _close(a, b.grad, torch.float32)
            if none_local:
                assert torch.all(a == 0)
    with pytest.raises(ValueError, match="no micro-batch"):
        ExpertWgrad().compute()


def test_experts_wgrad_refuses_micro_batches_out_of_order():
    from weft.moe.step import _Stages, chain, micro_batches

    model = moe.MoEModel(num_layers=1, hidden=64, num_experts=8, top_k=2, ffn=32,
                         dispatcher=moe.LocalDispatcher(8))
    stages = _Stages(model, moe.LayoutSlots.shared(moe.LocalDispatcher(8), 1))
    x = torch.randn((32, 64)).bfloat16()
    mbs = micro_batches(x, torch.randn((32, 64)).bfloat16(), 2, 1)
    for name, stage, layer in chain(1):
        if stage == "experts_wgrad":
            break
        stages.run(mbs[1], stage, layer)
    with pytest.raises(weft.Error, match="micro-batch 1 after 0"):
        stages.run(mbs[1], "experts_wgrad", 0)


def test_experts_wgrad_adds_to_gradients_already_there_in_place():
    # Stages run outside a step (a step frees the gradients first) may find gradients there
    # already, e.g. a caller accumulating over several batches: the expert weights' gradients are
    # added to them in place (no third weight-sized tensor), with the bits an out-of-place sum
    # gives.
    from weft.moe.step import _Stages, chain, micro_batches

    model = moe.MoEModel(num_layers=1, hidden=64, num_experts=8, top_k=2, ffn=32,
                         dispatcher=moe.LocalDispatcher(8))
    stages = _Stages(model, moe.LayoutSlots.shared(moe.LocalDispatcher(8), 1))
    x, target = torch.randn((32, 64)).bfloat16(), torch.randn((32, 64)).bfloat16()

    def run_once():
        for mb in micro_batches(x, target, 2, 1):
            for _, stage, layer in chain(1):
                stages.run(mb, stage, layer)

    experts = model.moe[0]
    run_once()
    first = [experts.w13.grad.clone(), experts.w2.grad.clone()]
    earlier = [torch.randn_like(g) for g in first]
    experts.w13.grad, experts.w2.grad = (g.clone() for g in earlier)
    storage = [experts.w13.grad.data_ptr(), experts.w2.grad.data_ptr()]
    run_once()
    for p, e, f, ptr in zip((experts.w13, experts.w2), earlier, first, storage):
        assert p.grad.data_ptr() == ptr
        assert torch.equal(p.grad, e + f)
