"""Megatron-core's DeepEP integration (megatron/core/transformer/moe/fused_a2a.py, the backend of
its flex token dispatcher) on weft.ep, forward and backward, against the CPU reference of all
ranks' inputs (ep_reference), one process per rank over an NCCL group: at one rank and, with two
GPUs, at two. Test-only dependency: skipped where megatron-core is not installed."""

import pytest

torch = pytest.importorskip("torch")

import weft.ep  # noqa: E402

import ep_reference as ref  # noqa: E402
from conftest import needs_gpus, num_gpus, run_ranks  # noqa: E402

pytestmark = [needs_gpus(1), pytest.mark.timeout(600)]

HIDDEN, EXPERTS, TOP_K = 1024, 32, 8


def have_megatron() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not have_megatron(), reason="megatron-core is not installed")
@pytest.mark.parametrize("world", sorted({1, min(num_gpus(), 2)} - {0}))
@pytest.mark.parametrize("async_finish", [False, True])
def test_fused_dispatch_and_combine_forward_and_backward(tmp_path, world, async_finish):
    # In processes of their own: an NCCL process group, as Megatron's, and Megatron's module state.
    run_ranks(_check_fused_a2a, world, tmp_path / "store", async_finish, backend="nccl",
              timeout_s=300)


def _check_fused_a2a(rank, world_size, async_finish):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    weft.ep.register_as_deep_ep()
    from megatron.core.transformer.moe import fused_a2a

    assert fused_a2a.HAVE_DEEP_EP, "Megatron found no deep_ep, although weft.ep is registered"
    group = dist.group.WORLD
    for num_tokens in (8192, 300):  # 8192 is above Megatron's size hint: the window grows
        check_round(fused_a2a, group, rank, world_size, async_finish, num_tokens)
    buffer = fused_a2a._buffer
    assert buffer.num_relayouts == 0 and buffer.num_regrowths == 1


def rank_inputs(num_tokens, seed):
    """One rank's tokens, selections (a fifth masked), probabilities, the gradient of its combine
    output and a per-token table for the gradient of the received probabilities (CPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((num_tokens, HIDDEN), generator=g).bfloat16()
    idx = torch.rand((num_tokens, EXPERTS), generator=g).topk(TOP_K, dim=1).indices
    idx = torch.where(torch.rand(idx.shape, generator=g) < 0.2, -1, idx)
    probs = torch.rand((num_tokens, TOP_K), generator=g)
    grad_out = torch.randn((num_tokens, HIDDEN), generator=g).bfloat16()
    grad_probs = torch.randn((num_tokens, TOP_K), generator=g)
    return x, idx, probs, grad_out, grad_probs


def check_round(fused_a2a, group, rank, world, async_finish, num_tokens):
    # Every rank draws every rank's inputs (seeded by rank), for the reference.
    xs, idxs, ps, grad_outs, grad_ps = zip(*(rank_inputs(num_tokens, num_tokens * 16 + r)
                                             for r in range(world)))
    received = ref.dispatch(list(xs), list(idxs), list(ps), EXPERTS)
    mine = received[rank]
    x_leaf = xs[rank].cuda().requires_grad_()
    p_leaf = ps[rank].cuda().requires_grad_()
    recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
        x_leaf, idxs[rank].cuda(), p_leaf, EXPERTS, group, async_finish=async_finish)
    y = (recv_x.float() * 2).bfloat16()
    combined, _ = fused_a2a.fused_combine(y, group, handle, async_finish=async_finish)

    def of_sources(tables, r):  # rows of rank r's received tokens, from their sources' tables
        src = received[r].src.long()
        rows = torch.empty((len(src), tables[0].shape[1]), dtype=tables[0].dtype)
        for s in range(world):
            from_s = src[:, 0] == s
            rows[from_s] = tables[s][src[from_s, 1]]
        return rows

    grad_probs = of_sources(grad_ps, rank)
    torch.autograd.backward([combined, recv_probs],
                            [grad_outs[rank].cuda(), grad_probs.cuda()])
    assert torch.equal(recv_x.cpu(), mine.x)
    assert torch.equal(recv_idx.cpu(), mine.expert_idx.long())
    assert torch.equal(recv_probs.cpu(), mine.weights)
    assert tokens_per_expert.tolist() == mine.tokens_per_local_expert.tolist()
    ys = [(d.x.float() * 2).bfloat16() for d in received]
    assert torch.equal(combined.cpu(), ref.combine(received, ys, [num_tokens] * world)[rank])
    # The combine's backward is a cached dispatch of grad_out (each rank receives its tokens'
    # rows of it), the dispatch's a combine of the rows' gradient (2x through y) and of the
    # received probabilities' gradient (fp32, summed over the ranks a token went to).
    grad_ys = [(of_sources(grad_outs, r).float() * 2).bfloat16() for r in range(world)]
    assert torch.equal(x_leaf.grad.cpu(),
                       ref.combine(received, grad_ys, [num_tokens] * world)[rank])
    want_gp = torch.zeros((num_tokens, TOP_K))
    for d in received:  # ascending, as the combine adds
        tokens = d.src[d.src[:, 0] == rank, 1].long()
        want_gp[tokens] += grad_ps[rank][tokens]
    assert torch.equal(p_leaf.grad.cpu(), want_gp)
