"""Megatron-core's DeepEP integration (megatron/core/transformer/moe/fused_a2a.py, the backend of
its flex token dispatcher) on weft.ep, forward and backward, against a torch reference, at one
rank over an NCCL group, in a process of its own. Test-only dependency: skipped where
megatron-core is not installed."""

import pytest

torch = pytest.importorskip("torch")

import weft.ep  # noqa: E402

from conftest import needs_gpus, run_ranks  # noqa: E402

pytestmark = [needs_gpus(1), pytest.mark.timeout(600)]


def have_megatron() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def reference(x, idx, probs, y, grad_out, grad_probs):
    """One rank: the tokens with a selection, in order; combine sums rows back to their tokens."""
    sent = (idx >= 0).any(dim=1)
    tokens = sent.nonzero().flatten()
    recv_x = x[tokens]
    recv_idx = torch.where(idx >= 0, idx, -1)[tokens]
    recv_probs = torch.where(idx >= 0, probs, 0)[tokens]
    combined = torch.zeros_like(x)
    combined[tokens] = y
    grad_y = grad_out[tokens]
    grad_x = torch.zeros_like(x)
    grad_x[tokens] = grad_y  # the dispatch's backward: a combine of the rows' gradients
    grad_p = torch.zeros_like(probs)
    grad_p[tokens] = grad_probs
    return recv_x, recv_idx, recv_probs, combined, grad_x, grad_p


@pytest.mark.skipif(not have_megatron(), reason="megatron-core is not installed")
@pytest.mark.parametrize("async_finish", [False, True])
def test_fused_dispatch_and_combine_forward_and_backward(tmp_path, async_finish):
    # In a process of its own: an NCCL process group, as Megatron's, and Megatron's module state.
    run_ranks(_check_fused_a2a, 1, tmp_path / "store", async_finish, backend="nccl",
              timeout_s=300)


def _check_fused_a2a(rank, world_size, async_finish):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    weft.ep.register_as_deep_ep()
    from megatron.core.transformer.moe import fused_a2a

    assert fused_a2a.HAVE_DEEP_EP, "Megatron found no deep_ep, although weft.ep is registered"
    group = dist.group.WORLD
    for num_tokens in (8192, 300):  # 8192 is above Megatron's size hint: the window grows
        check_round(fused_a2a, group, async_finish, num_tokens)
    buffer = fused_a2a._buffer
    assert buffer.num_relayouts == 0 and buffer.num_regrowths == 1


def check_round(fused_a2a, group, async_finish, num_tokens):
    hidden, experts, top_k = 1024, 32, 8
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn((num_tokens, hidden), generator=g, device="cuda").bfloat16()
    scores = torch.rand((num_tokens, experts), generator=g, device="cuda")
    idx = scores.topk(top_k, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g, device="cuda") < 0.2, -1, idx)
    probs = torch.rand((num_tokens, top_k), generator=g, device="cuda")
    x_leaf = x.clone().requires_grad_()
    p_leaf = probs.clone().requires_grad_()
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
        x_leaf, idx, p_leaf, experts, group, async_finish=async_finish)
    y = (recv_x.float() * 2).bfloat16()
    combined, _ = fused_a2a.fused_combine(y, group, handle, async_finish=async_finish)
    grad_out = torch.randn(combined.shape, generator=g, device="cuda").bfloat16()
    grad_probs = torch.randn(recv_probs.shape, generator=g, device="cuda")
    torch.autograd.backward([combined, recv_probs], [grad_out, grad_probs])
    want = reference(x, idx, probs, (x.float() * 2).bfloat16()[(idx >= 0).any(dim=1)],
                     grad_out, grad_probs)
    want_x, want_idx, want_p, want_out, want_gx, want_gp = want
    assert torch.equal(recv_x, want_x)
    assert torch.equal(recv_idx, want_idx)
    assert torch.equal(recv_probs, want_p)
    assert tokens_per_expert.tolist() == [(idx == e).sum().item() for e in range(experts)]
    assert torch.equal(combined, want_out)
    # The combine's backward is a cached dispatch of grad_out, the dispatch's a combine of the
    # rows' gradient (2x through y) and of grad_probs (exact in fp32).
    assert torch.equal(x_leaf.grad, (want_gx.float() * 2).bfloat16())
    assert torch.equal(p_leaf.grad, want_gp)
