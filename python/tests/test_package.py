"""The package without a GPU: import, version, info, errors, sizing, the layout and fp8 packing
helpers on CPU tensors."""

import re
from pathlib import Path

import pytest

import weft


def test_version_is_the_projects():
    cmake = (Path(__file__).parents[2] / "CMakeLists.txt").read_text()
    assert weft.__version__ == re.search(r"project\(weft VERSION ([0-9.]+)", cmake).group(1)


def test_info_reports_the_build():
    info = weft.info()
    assert info["version"] == weft.__version__
    if info["built_with_cuda"]:
        assert re.fullmatch(r"\d+\.\d+\.\d+", info["nccl_compiled"])
        assert info["nccl_loaded"] is None or re.fullmatch(r"\d+\.\d+\.\d+", info["nccl_loaded"])
        assert info["num_gpus"] >= 0


def test_error_is_a_runtime_error_with_the_cpp_location():
    assert issubclass(weft.Error, RuntimeError)
    if not weft.info()["built_with_cuda"]:
        pytest.skip("no weft.ep in this build")
    from weft import _weft
    with pytest.raises(weft.Error, match=r"src/ep/reference/reference\.cpp:\d+: .*multiple"):
        _weft.ep.window_bytes(128, 7168, 255, 8, 0, 2)  # 255 experts over 2 ranks


torch = pytest.importorskip("torch")
import weft.ep  # noqa: E402
from weft.ep import layout, sizing  # noqa: E402

import ep_reference  # noqa: E402


def test_window_sizing_is_monotonic_and_exact():
    a = sizing.window_bytes_for(1024, 7168, 2)
    b = sizing.window_bytes_for(2048, 7168, 2)
    assert 0 < a < b
    t = sizing.max_tokens_for(b, 7168, 2, 8, 256)
    assert t >= 2048 and sizing.window_bytes_for(t + 1, 7168, 2) > b
    assert sizing.max_tokens_for(10, 7168, 2, 8, 256) == 0


def test_dispatch_layout_matches_a_loop():
    g = torch.Generator().manual_seed(1)
    num_tokens, num_experts, num_ranks = 300, 64, 4
    idx = ep_reference.random_routing(num_tokens, num_experts, 6, g, mask_fraction=0.3)
    per_rank, per_expert, in_rank = layout.dispatch_layout(idx, num_experts, num_ranks)
    want_in = torch.zeros((num_tokens, num_ranks), dtype=torch.bool)
    want_expert = torch.zeros(num_experts, dtype=torch.int32)
    for t in range(num_tokens):
        for e in idx[t].tolist():
            if e >= 0:
                want_in[t, e // (num_experts // num_ranks)] = True
                want_expert[e] += 1
    assert torch.equal(in_rank, want_in)
    assert torch.equal(per_expert, want_expert)
    assert torch.equal(per_rank, want_in.sum(0).int())


def test_fp8_packing_round_trips():
    x = torch.randn(5, 256).bfloat16()
    x8, scales = ep_reference.per_token_cast_to_fp8(x)
    row_bytes = weft._weft.ep.fp8_row_bytes(256) if weft.info()["built_with_cuda"] else 272
    packed = weft.ep.pack_fp8(x8, scales.t().contiguous().t(), row_bytes)
    assert packed.shape == (5, row_bytes) and packed.dtype == torch.uint8
    assert not packed[:, 256 + 8:].any()
    y8, yscales = weft.ep.unpack_fp8(packed, 256)
    assert torch.equal(y8.view(torch.uint8), x8.view(torch.uint8))
    assert torch.equal(yscales, scales)


def test_size_hint_is_a_window_of_weft():
    if weft.info()["built_with_cuda"]:
        hint = weft.ep.Config(24).get_nvl_buffer_size_hint(7168 * 2, 2)
        assert hint == sizing.window_bytes_for(4096, 7168, 2)
        assert weft.ep.Config(24).get_rdma_buffer_size_hint(7168 * 2, 2) == 0


def test_buffer_refuses_a_group_that_is_not_nccl(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(weft.Error, match="needs an NCCL process group.*gloo"):
            weft.ep.Buffer(dist.group.WORLD, int(1e9))
    finally:
        dist.destroy_process_group()
