"""An MoE layer's communication with weft.ep, written as DeepEP code is (only the import differs).

    python examples/python/ep_moe_layer.py                       # one GPU: every expert local
    torchrun --nproc-per-node 2 examples/python/ep_moe_layer.py  # one process per GPU
"""

import os

import torch
import torch.distributed as dist

import weft.ep as deep_ep  # was: import deep_ep


def main(num_tokens=512, hidden=1024, num_experts=16, top_k=4):
    group = None
    if "RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        group = dist.group.WORLD
    num_ranks = group.size() if group else 1
    rank = group.rank() if group else 0
    buffer = deep_ep.Buffer(group, int(1e9))

    torch.manual_seed(rank)
    x = torch.randn((num_tokens, hidden), dtype=torch.bfloat16, device="cuda")
    scores = torch.randn((num_tokens, num_experts), device="cuda")
    topk_weights, topk_idx = scores.softmax(dim=1).topk(top_k, dim=1)

    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_w, tokens_per_expert, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)

    # The "experts": each received row scaled by the sum of its local routing weights.
    expert_out = (recv_x.float() * recv_w.sum(dim=1, keepdim=True)).bfloat16()
    y, _, _ = buffer.combine(expert_out, handle)

    # Every token comes back as x times the sum of all its weights (up to bf16 rounding).
    want = x.float() * topk_weights.sum(dim=1, keepdim=True)
    err = ((y.float() - want).abs() / want.abs().clamp(min=1)).max().item()
    print(f"rank {rank}/{num_ranks}: received {recv_x.shape[0]} rows, per local expert "
          f"{tokens_per_expert}; combine max |error| {err:.3g}")
    assert err < 0.02, err
    if group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
