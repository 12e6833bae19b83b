"""The HSTU training step of weft.hstu (weft.hstu.tasks) under every HSTU variant of the engine
(and loader_split_d6, weft.hstu.variants) gives the plain loop's bits: every loss and every
parameter (dense model and embedding shard) after a few steps, at world size 1 and 2 (gloo, CPU)
and on one GPU (NCCL, torch backend)."""

import os

import pytest

torch = pytest.importorskip("torch")

from conftest import needs_gpus, run_ranks  # noqa: E402

NUM_BATCHES = 6


def check_variants(rank, world_size, device_type):
    """In one rank: the loop, then each variant from the same start; asserts identical bits."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch.distributed as dist

    from conftest import drain
    from weft.hstu.data import ZipfLoader
    from weft.hstu.tasks import HstuConfig, HstuStep
    from weft.hstu.variants import step_variants
    from weft.pipeline import Engine

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if device_type == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    config = HstuConfig(batch_size=4, max_seq_len=16, num_items=2000, dim=16, num_layers=2,
                        num_heads=2, head_dim=8, mlp_dim=32, num_negatives=16,
                        events_per_token=4, seed=7)
    group = dist.group.WORLD
    step = HstuStep(config, group, device)
    start = step.parameters()
    losses = [x.cpu() for x in step.sequential(ZipfLoader(NUM_BATCHES))]
    params = step.parameters()
    assert len(losses) == NUM_BATCHES and all(torch.isfinite(x) for x in losses)
    assert len({x.item() for x in losses}) == NUM_BATCHES, "every batch has its own loss"
    assert all(not torch.equal(start[k], params[k]) for k in params), "every parameter trained"
    # The gradient AllReduce keeps the dense model equal on every rank.
    dense = torch.cat([v.reshape(-1) for k, v in params.items() if k != "shard"]).to(device)
    gathered = [torch.empty_like(dense) for _ in range(world_size)]
    dist.all_gather(gathered, dense, group=group)
    assert all(torch.equal(g, dense) for g in gathered)

    backend = "torch" if device_type == "cuda" else "host"
    wrong = []
    for v in step_variants():
        step = HstuStep(config, group, device)
        with Engine(v.schedule(step.bodies()), v.thread_map, backend=backend) as engine:
            got = [x.cpu() for x in drain(engine, ZipfLoader(NUM_BATCHES))]
        got_params = step.parameters()
        if not (len(got) == NUM_BATCHES and all(torch.equal(a, b) for a, b in zip(got, losses))
                and all(torch.equal(got_params[k], params[k]) for k in params)):
            wrong.append(v.name)
    assert not wrong, f"rank {rank}: variants whose losses or parameters differ: {wrong}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2])
def test_every_variant_gives_the_loops_bits_on_the_cpu(tmp_path, world_size):
    run_ranks(check_variants, world_size, tmp_path / "store", "cpu", timeout_s=100)


@needs_gpus(1)
@pytest.mark.timeout(180)
def test_every_variant_gives_the_loops_bits_on_one_gpu(tmp_path):
    run_ranks(check_variants, 1, tmp_path / "store", "cuda", backend="nccl", timeout_s=160)
