"""Where the micro-batched MoE step's host time goes, on one GPU: per schedule, the step's wall
time (synchronised), the time until step() returns (the host's share: a step whose host is
busy for nearly all of its wall time is bound by the host, and no schedule hides what its
host work adds), the engine tasks' host spans summed per stage (one engine trace per step),
and the all_to_all dispatcher's host time per call kind (its sizes' exchange, wait included,
apart). The communication is emulated (2x H200 call times, weft.moe.emulated): every figure of
an emu row is an EMULATED one.

    python bench/python/moe_host_time.py --tokens 4096 --steps 6

Rows: the compute floor (serial step, weft.ep's native dispatcher without emulation); (a) the
serial step with the emulated all_to_all dispatcher; (c) PipelinedStep over it in its own family
(each dispatch a progress after its router, one engine thread) at its deepest depth and in the
family of the others (the dispatch beside its router, two threads) at theirs; (b) PipelinedStep
over emulated weft.ep at its deepest depth. Also the host time of one small torch op on this
machine (an in-place add on 16 elements), the unit the dispatcher's host time is made of.
"""

import argparse
import collections
import statistics
import time

import torch

import weft.moe as moe
from weft.moe.emulated import TARGETS

SHAPES = {"comm": (2048, 128, 8, 768), "tiny": (64, 16, 4, 32)}


class HostTimed(moe.AllToAllDispatcher):
    """The all_to_all dispatcher, its calls' host time summed per kind into `seconds`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = collections.Counter()

    def _timed(self, kind, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[kind] += time.perf_counter() - start

    def layout_begin(self, topk_idx):
        return self._timed("layout", super().layout_begin, topk_idx)

    def _exchange_sizes(self, layout):
        return self._timed("sizes (wait included)", super()._exchange_sizes, layout)

    def dispatch(self, *args, **kwargs):
        return self._timed("dispatch (sizes included)", super().dispatch, *args, **kwargs)

    def combine(self, *args, **kwargs):
        return self._timed("combine", super().combine, *args, **kwargs)

    def dispatch_cached(self, *args, **kwargs):
        return self._timed("cached dispatch", super().dispatch_cached, *args, **kwargs)


def small_op_us(n=2000):
    t = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        t.add_(1)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="comm", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a GPU")
    import weft.ep

    hidden, experts, top_k, ffn = SHAPES[a.shape]
    T, M, L = a.tokens, a.micro_batches, a.layers
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((T, hidden), generator=g, device="cuda").bfloat16()
    target = torch.randn((T, hidden), generator=g, device="cuda").bfloat16()
    num_sms = weft.ep.Buffer.num_sms
    tables = TARGETS["2xh200"]
    a2a = HostTimed(None, experts)
    a2a_slots = moe.LayoutSlots.shared(moe.EmulatedDispatcher(a2a, tables["a2a"], num_sms), L)

    def ep_slots(num_slots, emulated=True):
        def make(layer, s):
            d = moe.NativeEpDispatcher(None, experts, -(-T // M))
            return moe.EmulatedDispatcher(d, tables["weft.ep"], num_sms) if emulated else d
        return moe.LayoutSlots(make, num_slots)

    deep_ep, deep_a2a = moe.max_depth(L), moe.max_depth(L, True)
    rows = [("floor: serial weft.ep, no emulation", None, lambda: ep_slots([1] * L, False), {}),
            ("(a) serial emu a2a", None, lambda: a2a_slots, {}),
            (f"(c) emu a2a d{deep_a2a}, after its router", deep_a2a, lambda: a2a_slots, {}),
            (f"(c) emu a2a d{deep_ep}, beside its router", deep_ep, lambda: a2a_slots,
             {"dispatch_after_router": False}),
            (f"(b) emu weft.ep d{deep_ep}", deep_ep,
             lambda: ep_slots(moe.num_layout_slots(L, deep_ep)), {})]
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {a.shape}, T={T}, "
          f"{L} layers, {M} micro-batches, {a.steps} steps after {a.warmup}; EMULATED 2x H200 "
          f"communication; host us per small torch op: {small_op_us():.2f}", flush=True)
    for name, depth, make_slots, kwargs in rows:
        model = moe.MoEModel(L, hidden, experts, top_k, ffn, moe.AllToAllDispatcher(None, experts),
                             device="cuda")
        slots = make_slots()
        piped = None
        if depth is None:
            def step():
                moe.serial_step(model, x, target, 0.0, M, slots)
        else:
            piped = moe.PipelinedStep(model, slots, M, depth=depth, backend="torch", trace=True,
                                      **kwargs)

            def step():
                piped(x, target, 0.0)
        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        if piped is not None:
            piped.engine.take_trace()
        a2a.seconds.clear()
        walls, returns, stages = [], [], collections.Counter()
        for _ in range(a.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            returned = time.perf_counter()
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) * 1e3)
            returns.append((returned - start) * 1e3)
            if piped is not None:
                trace = piped.engine.take_trace()
                for span in trace.host_spans:
                    task = trace.task_names[span.task]
                    stages["loss" if task == "loss" else task.rsplit("_", 1)[0]] += (
                        span.end_us - span.begin_us) / 1e3
        line = (f"{name:40s} wall {min(walls):6.2f}-{max(walls):6.2f} ms, step() returns after "
                f"{statistics.median(returns):6.2f} ms (median)")
        if piped is not None:
            line += (f", {len(piped.engine.threads)} engine thread(s); task host spans "
                     f"{sum(stages.values()) / a.steps:.2f} ms a step: "
                     + ", ".join(f"{k} {v / a.steps:.2f}" for k, v in stages.most_common()))
            piped.close()
        if a2a.seconds:
            line += "; the all_to_all dispatcher's host ms a step: " + ", ".join(
                f"{k} {v * 1e3 / a.steps:.2f}" for k, v in a2a.seconds.items())
        print(line, flush=True)
        del model, slots, step, piped
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
