"""weft.ep over a torch.distributed NCCL group, one process per GPU (as many as are present, one
included): every rank's received rows and combine outputs against the CPU reference of all
ranks' inputs, through the native and the DeepEP-compatible API."""

import os
import socket
import traceback

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from conftest import needs_gpus, num_gpus  # noqa: E402

pytestmark = [needs_gpus(1), pytest.mark.timeout(900)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, body, errors):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
        try:
            body(rank, world)
        finally:
            dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))


def run_ranks(body, world):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, _free_port(), body, errors), nprocs=world,
                       join=True, start_method="spawn")
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(f"rank {r}:\n{tb}" for r, tb in failures)


def _gather(t: torch.Tensor, world: int):
    """Every rank's t (same shape on every rank), on the CPU."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t)
    return [p.cpu() for p in parts]


def _body_native_and_deepep(rank, world):
    import weft.ep
    import ep_reference as ref

    num_experts, top_k, hidden = 8 * world, 4, 1024
    group = dist.group.WORLD
    native = weft.ep.NativeBuffer(group, max_tokens=512, hidden=hidden, num_experts=num_experts,
                                  top_k=top_k)
    compat = weft.ep.Buffer(group, int(1e9))
    for seed, num_tokens in ((1, 512), (2, 311), (3, 1)):
        # Same T on every rank for all_gather; each rank's own routing and payload.
        g = torch.Generator().manual_seed(seed * 100 + rank)
        x = torch.randn((num_tokens, hidden), generator=g).bfloat16()
        idx = ref.random_routing(num_tokens, num_experts, top_k, g, 0.2)
        w = torch.rand((num_tokens, top_k), generator=g)
        xs, idxs, ws = (_gather(t.cuda(), world) for t in (x, idx, w))
        want = ref.dispatch(xs, idxs, ws, num_experts)
        res = native.dispatch(x.cuda(), idx.cuda(), w.cuda(), sync_count=True)
        mine = want[rank]
        assert res.num_recv == mine.x.shape[0]
        assert torch.equal(res.recv_x.cpu(), mine.x)
        assert torch.equal(res.recv_expert_idx.cpu(), mine.expert_idx)
        assert torch.equal(res.recv_weights.cpu(), mine.weights)
        assert torch.equal(res.recv_src.cpu(), mine.src)
        y = torch.randn((res.num_recv, hidden), generator=g).bfloat16()
        ys = [torch.empty(0)] * world
        dist.all_gather_object(ys, y)
        out, _ = native.combine(y.cuda(), res.handle)
        want_out = ref.combine(want, ys, [num_tokens] * world)
        assert torch.equal(out.cpu(), want_out[rank])
        # The same through DeepEP's API.
        per_rank, _, per_expert, in_rank, _ = compat.get_dispatch_layout(idx.cuda(), num_experts)
        rx, ridx, rw, counts, handle, _ = compat.dispatch(
            x.cuda(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx.cuda(), topk_weights=w.cuda())
        assert torch.equal(rx.cpu(), mine.x) and torch.equal(ridx.cpu(), mine.expert_idx.long())
        prefix = handle[0].cpu()
        counts_from = [[(want[d].src[:, 0] == s).sum().item() for d in range(world)]
                       for s in range(world)]
        assert prefix.tolist() == torch.tensor(counts_from).cumsum(0).tolist()
        combined, combined_w, _ = compat.combine(y.cuda(), handle, topk_weights=rw)
        assert torch.equal(combined.cpu(), want_out[rank])
        sent = (idx >= 0).any(dim=1)
        assert torch.equal(combined_w.cpu()[sent], torch.where(idx >= 0, w, 0)[sent])


@pytest.mark.parametrize("world", sorted({1, min(num_gpus(), 2)} - {0}))
def test_every_rank_matches_the_reference(world):
    run_ranks(_body_native_and_deepep, world)


def _body_config_mismatch(rank, world):
    import weft
    import weft.ep

    with pytest.raises(weft.Error, match="same sizes"):
        weft.ep.NativeBuffer(dist.group.WORLD, max_tokens=64 * (rank + 1), hidden=256,
                             num_experts=2 * world, top_k=2)


@needs_gpus(2)
def test_ranks_with_different_sizes_all_raise():
    run_ranks(_body_config_mismatch, 2)
