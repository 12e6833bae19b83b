"""weft.ep's low-latency (decode) calls from Python: host and GPU time per call, one rank.

    python bench/python/ep_low_latency_bench.py --tokens 128 --hidden 7168 --experts 256 --top-k 8

DeepEP's low_latency_dispatch (fp8, and bf16) and low_latency_combine on a
`Buffer(None, 0, num_rdma_bytes, low_latency_mode=True)` sized by get_low_latency_rdma_size_hint
for --max-tokens per rank (num_max_dispatch_tokens_per_rank); per form: host us per call (the
Python call's wall time, median over --iters back-to-back calls) and GPU us per call (CUDA
events over the same calls), as bench/python/ep_bench.py times them.
"""

import argparse

import torch

import weft
import weft.ep
from ep_bench import kernel_times, profile, timed, wanted


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128,
                   help="num_max_dispatch_tokens_per_rank (>= --tokens)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kernels", metavar="TEXT[,TEXT...]", default="",
                   help="also time the GPU kernels (torch.profiler) of each form whose name\n"
                        "contains a TEXT: us per call of each kernel")
    p.add_argument("--profile", metavar="TEXT[,TEXT...]", default="",
                   help="also profile (cProfile) each form whose name contains a TEXT: the top\n"
                        "functions by own time, in us per call (profiling overhead included)")
    a = p.parse_args()
    T, M, H, E, K = a.tokens, a.max_tokens, a.hidden, a.experts, a.top_k
    torch.manual_seed(0)
    hint = weft.ep.Buffer.get_low_latency_rdma_size_hint(M, H, 1, E)
    buf = weft.ep.Buffer(None, 0, hint, low_latency_mode=True)
    x = torch.randn((T, H), device="cuda").bfloat16()
    idx = torch.rand((T, E), device="cuda").topk(K, dim=1).indices
    w = torch.rand((T, K), device="cuda")
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    y = recv.clone()
    forms = {
        "low_latency_dispatch, fp8": lambda: buf.low_latency_dispatch(x, idx, M, E),
        "low_latency_dispatch, bf16": lambda: buf.low_latency_dispatch(x, idx, M, E,
                                                                      use_fp8=False),
        "low_latency_dispatch, fp8, return_recv_hook (hook called)":
            lambda: buf.low_latency_dispatch(x, idx, M, E, return_recv_hook=True)[4](),
    }
    results = {}

    def measure(measured):
        for name, fn in measured.items():
            results[name] = [timed(fn, a.iters, a.warmup) for _ in range(a.repeats)]
            if wanted(a.profile, name):
                profile(name, fn, a.iters * 5, a.warmup, True)
            if wanted(a.kernels, name):
                kernel_times(name, fn, a.iters, a.warmup, True)

    measure(forms)
    _, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    measure({"low_latency_combine": lambda: buf.low_latency_combine(y, idx, w, handle)})
    info = weft.info()
    print(f"# weft {info['version']}, NCCL {info['nccl_loaded']}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()} x 1; T={T} M={M} H={H} E={E} top-{K}; "
          f"{a.repeats} runs of {a.iters} calls")
    print(f"{'form':60s} {'host us/call':>14s} {'GPU us/call':>16s}")
    for name, runs in results.items():
        hosts = [h for h, _ in runs]
        gpus = [g for _, g in runs]
        print(f"{name:60s} {min(hosts):6.1f}-{max(hosts):<7.1f} {min(gpus):7.1f}-{max(gpus):<8.1f}")


if __name__ == "__main__":
    main()
