"""weft.ep from Python: what a caller pays per call, beside the kernel.

    python bench/python/ep_bench.py --tokens 8192 --hidden 7168 --experts 256 --top-k 8
    torchrun --nproc-per-node 2 bench/python/ep_bench.py ...        # one process per GPU
    torchrun --nproc-per-node 2 bench/python/ep_bench.py --backend deep_ep   # DeepEP itself

Per API form: host us per call (the Python call's wall time while the GPU is busy, median over
--iters back-to-back calls), the same for the bare extension call (weft's C++ host path), their
difference (what the Python layer adds), and GPU us per call (CUDA events over the same calls).
Bandwidth as weft-ep-bench defines it: logical GB/s = received rows x bf16 row bytes / GPU time
(so an fp8 form's figure is what its bf16 equivalent would need).

--backend deep_ep: the DeepEP-API forms (owned host-synced dispatch, num_worst_tokens, the fp8
pair, cached dispatch, combine) against the `deep_ep` package that `import deep_ep` finds, with
the same Buffer calls and the same timing; the weft-native forms are left out. Its configs are
DeepEP's own for the rank count (Buffer.get_dispatch_config / get_combine_config at --deepep-sms
SMs), its buffer sized by their hints, as Megatron-core sizes it. DeepEP's intranode kernels
need 2, 4 or 8 ranks: run it under torchrun.
"""

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.distributed as dist

import weft
import weft.ep
from weft.ep.native import fill_token_rows
from launch import process_group_from_env, world_group


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=3, help="runs of every measurement (a range)")
    p.add_argument("--backend", choices=("weft", "deep_ep"), default="weft",
                   help="weft: weft.ep, native and DeepEP-API forms (default); deep_ep: the\n"
                        "DeepEP-API forms on the deep_ep package")
    p.add_argument("--deepep-sms", type=int, default=24,
                   help="--backend deep_ep: SMs of DeepEP's kernels (Buffer.set_num_sms; its own\n"
                        "tests/test_intranode.py uses 24)")
    p.add_argument("--kernels", metavar="TEXT[,TEXT...]", default="",
                   help="also time the GPU kernels (torch.profiler) of each form whose name\n"
                        "contains a TEXT: us per call of each kernel")
    p.add_argument("--profile", metavar="TEXT[,TEXT...]", default="",
                   help="also profile (cProfile) each form whose name contains a TEXT: the top\n"
                        "functions by own time, in us per call (profiling overhead included)")
    p.add_argument("--default-device", action="store_true",
                   help="time every form under torch.set_default_device('cuda'), as DeepEP's\n"
                        "own tests run (a torch function mode over every torch call)")
    return p.parse_args()


def timed(fn, iters, warmup):
    """(host us per call: median, GPU us per call) over iters back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if dist.is_initialized():
        dist.barrier()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = []
    start.record()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    stop.record()
    stop.synchronize()
    return statistics.median(host), start.elapsed_time(stop) * 1e3 / iters


def wanted(profile_arg: str, name: str) -> bool:
    return any(text and text in name for text in profile_arg.split(","))


def kernel_times(name, fn, iters, warmup, show):
    """Each GPU kernel fn launches, with its time per call of fn (us), from torch.profiler. Every
    rank runs it (the calls are collectives); rank 0 prints (show)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    if not show:
        return
    print(f"# kernels of '{name}': GPU us per call (launches per call)")
    for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if e.device_time_total > 0:
            print(f"  {e.device_time_total / iters:8.2f}  ({e.count / iters:4.1f})  {e.key[:90]}")


def profile(name, fn, iters, warmup, show):
    """The functions that take the host's time in fn, by own time (us per call of fn). Every rank
    runs it (the calls are collectives); rank 0 prints (show)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    if not show:
        return
    stats = pstats.Stats(prof).stats
    rows = sorted(((tt, cc, f) for f, (_, cc, tt, _, _) in stats.items()), reverse=True)[:15]
    print(f"# profile of '{name}': own time per call, us (calls per call)")
    for tt, cc, (file, line, func) in rows:
        print(f"  {tt / iters * 1e6:8.2f}  ({cc / iters:4.1f})  {func}  {file.split('/')[-1]}:{line}")


def deepep_buffer(group, world, hidden, num_sms):
    """The deep_ep package's Buffer with its own dispatch and combine configs for world ranks at
    num_sms SMs, sized by their hints for bf16 rows (as Megatron-core sizes it)."""
    import deep_ep

    deep_ep.Buffer.set_num_sms(num_sms)
    dispatch_config = deep_ep.Buffer.get_dispatch_config(world)
    combine_config = deep_ep.Buffer.get_combine_config(world)
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden * 2, world)
                    for c in (dispatch_config, combine_config))
    return deep_ep, deep_ep.Buffer(group, nvl_bytes), dispatch_config, combine_config


def package_version(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main():
    a = parse()
    on_weft = a.backend == "weft"
    # weft.ep runs without a group at one rank; DeepEP's Buffer always needs one.
    group = process_group_from_env() if on_weft else world_group(torch.device("cuda"))
    rank = dist.get_rank() if group else 0
    world = dist.get_world_size() if group else 1
    torch.manual_seed(rank)
    T, H, E, K = a.tokens, a.hidden, a.experts, a.top_k
    x = torch.randn((T, H), device="cuda").bfloat16()
    idx = torch.rand((T, E), device="cuda").topk(K, dim=1).indices
    w = torch.rand((T, K), device="cuda")
    if on_weft:
        native = weft.ep.NativeBuffer(group, max_tokens=T, hidden=H, num_experts=E, top_k=K)
        compat = weft.ep.Buffer(group, weft.ep.sizing.window_bytes_for(T, H, world, K, E))
        config = combine_config = weft.ep.Config(
            torch.cuda.get_device_properties(0).multi_processor_count)
    else:
        deep_ep, compat, config, combine_config = deepep_buffer(group, world, H, a.deepep_sms)
    per_rank, _, per_expert, in_rank, _ = compat.get_dispatch_layout(idx, E)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                  num_tokens_per_expert=per_expert)
    if a.default_device:
        torch.set_default_device("cuda")
    forms = {}
    if on_weft:
        res = native.dispatch(x, idx, w, sync_count=True)
        n = res.num_recv
        y = res.recv_x[:n].clone()
        # The bare calls run on the current stream, where the events time them.
        stream = torch.cuda.current_stream().cuda_stream
        raw = native._native
        dargs = weft._weft.ep.DispatchArgs()
        fill_token_rows(dargs.x, x)
        dargs.topk_idx, dargs.topk_weights, dargs.stream = idx.data_ptr(), w.data_ptr(), stream

        def raw_dispatch():
            raw.dispatch(dargs, None)

        handle = native.dispatch(x, idx, w).handle
        cargs = weft._weft.ep.CombineArgs()

        def raw_combine():
            raw.combine(cargs, handle)

        out = torch.empty((T, H), dtype=torch.bfloat16, device="cuda")
        cargs.expert_out, cargs.expert_out_rows, cargs.out, cargs.stream = y.data_ptr(), n, \
            out.data_ptr(), stream
        forms.update({
            "bare extension dispatch (C++ host path)": raw_dispatch,
            "native dispatch, zero-copy, count on device": lambda: native.dispatch(x, idx, w),
            "native dispatch, zero-copy, on the current stream":
                lambda: native.dispatch(x, idx, w, on_current_stream=True),
            "native dispatch, zero-copy, count read (host sync)":
                lambda: native.dispatch(x, idx, w, sync_count=True),
        })
    recv_x = compat.dispatch(x, topk_idx=idx, topk_weights=w, config=config, **layout)[0]
    if not on_weft:  # the rows to combine: what this rank received
        n = recv_x.shape[0]
        y = recv_x.clone()
    # DeepEP's fp8 pair as its own test passes it: per-128 scales, column-major.
    amax = x.float().view(T, H // 128, 128).abs().amax(dim=2).clamp(min=1e-4)
    x_fp8 = ((x.float().view(T, H // 128, 128) * (448.0 / amax[..., None])).view(T, H)
             .to(torch.float8_e4m3fn), (amax / 448.0).t().contiguous().t())
    forms["DeepEP dispatch, owned tensors (host sync)"] = \
        lambda: compat.dispatch(x, topk_idx=idx, topk_weights=w, config=config, **layout)
    if on_weft:
        # The same call with recv_x made at the count: the copy kernel launched by a second
        # extension call once the host has the count and has made recv_x (the GPU waits).
        exact = weft.ep.Buffer(group, weft.ep.sizing.window_bytes_for(T, H, world, K, E),
                               explicitly_destroy=True, recv_x_headroom=None)
        forms["DeepEP dispatch, owned, recv_x made at the count"] = \
            lambda: exact.dispatch(x, topk_idx=idx, topk_weights=w, config=config, **layout)
    forms["DeepEP dispatch, owned, num_worst_tokens (no sync)"] = \
        lambda: compat.dispatch(x, topk_idx=idx, topk_weights=w, config=config,
                                num_worst_tokens=n, **layout)
    if on_weft:
        forms["native dispatch, fp8 pair, zero-copy, count on device"] = \
            lambda: native.dispatch(x_fp8, idx, w)
    forms["DeepEP dispatch, fp8 pair, owned tensors (host sync)"] = \
        lambda: compat.dispatch(x_fp8, topk_idx=idx, topk_weights=w, config=config, **layout)
    if on_weft:
        forms["DeepEP dispatch, fp8 pair, owned, recv_x made at the count"] = \
            lambda: exact.dispatch(x_fp8, topk_idx=idx, topk_weights=w, config=config,
                                   **layout)
    forms["DeepEP dispatch, fp8 pair, owned, num_worst_tokens (no sync)"] = \
        lambda: compat.dispatch(x_fp8, topk_idx=idx, topk_weights=w, config=config,
                                num_worst_tokens=n, **layout)
    forms["one copy of the received rows (torch clone): the floor's second pass"] = \
        lambda: y.clone()
    results = {}

    def measure(measured):
        for name, fn in measured.items():
            results[name] = [timed(fn, a.iters, a.warmup) for _ in range(a.repeats)]
            if wanted(a.profile, name):
                profile(name, fn, a.iters * 10, a.warmup, rank == 0)
            if wanted(a.kernels, name):
                kernel_times(name, fn, a.iters, a.warmup, rank == 0)

    measure(forms)
    # A cached dispatch and the combines need their layout to be the latest.
    _, _, _, _, chandle, _ = compat.dispatch(x, topk_idx=idx, topk_weights=w, config=config,
                                             **layout)
    measure({
        "DeepEP cached dispatch, owned": lambda: compat.dispatch(x, handle=chandle, config=config),
        "DeepEP cached dispatch, fp8 pair, owned":
            lambda: compat.dispatch(x_fp8, handle=chandle, config=config),
    })
    if on_weft:
        native.dispatch(x, idx, w)
        handle = native.dispatch(x, idx, w).handle
        results["bare extension combine (C++ host path)"] = [
            timed(raw_combine, a.iters, a.warmup) for _ in range(a.repeats)]
        results["native combine, into out=, on the current stream"] = [
            timed(lambda: native.combine(y, handle, out=out, on_current_stream=True), a.iters,
                  a.warmup) for _ in range(a.repeats)]
        results["native combine, into out="] = [
            timed(lambda: native.combine(y, handle, out=out), a.iters, a.warmup)
            for _ in range(a.repeats)]
    _, _, _, _, chandle, _ = compat.dispatch(x, topk_idx=idx, topk_weights=w, config=config,
                                             **layout)
    results["DeepEP combine, owned output"] = [
        timed(lambda: compat.combine(y, chandle, config=combine_config), a.iters, a.warmup)
        for _ in range(a.repeats)]
    if wanted(a.profile, "DeepEP combine, owned output"):
        profile("DeepEP combine, owned output",
                lambda: compat.combine(y, chandle, config=combine_config), a.iters * 10,
                a.warmup, rank == 0)
    if rank == 0:
        if on_weft:
            info = weft.info()
            library = f"weft {info['version']}, NCCL {info['nccl_loaded']}"
        else:
            # Buffer's module says which package answered `import deep_ep` (weft.ep's alias or
            # DeepEP itself).
            library = (f"deep_ep {package_version('deep_ep')} ({deep_ep.Buffer.__module__}), "
                       f"{a.deepep_sms} SMs, its configs for {world} ranks")
        print(f"# {library}, torch {torch.__version__}, "
              f"{torch.cuda.get_device_name()} x {world}; T={T} H={H} E={E} top-{K}; "
              f"received rows on rank 0: {n}; {a.repeats} runs of {a.iters} calls"
              f"{'; under torch.set_default_device(cuda)' if a.default_device else ''}")
        print(f"{'form':55s} {'host us/call':>14s} {'GPU us/call':>16s} {'logical GB/s':>14s}")
        row_bytes = H * 2
        for name, runs in results.items():
            hosts = [h for h, _ in runs]
            gpus = [g for _, g in runs]
            gbps = [n * row_bytes / (g * 1e-6) / 1e9 for g in gpus]
            print(f"{name:55s} {min(hosts):6.1f}-{max(hosts):<7.1f} {min(gpus):7.1f}-{max(gpus):<8.1f}"
                  f" {min(gbps):6.0f}-{max(gbps):<6.0f}")
    if on_weft:
        native.destroy()
        exact.destroy()
    if group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
