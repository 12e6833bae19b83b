"""weft.plan.trace_costs on synthetic traces whose GPU busy times are known by construction: a
span that holds a wait for another stream's producer (a schedule edge, the collective order,
stream order) is charged what follows the release; a span without a wait is charged whole; a
release outside the span changes nothing; the same trace gives the same costs."""

import json
import random
from types import SimpleNamespace

import pytest

import weft
from weft import plan
from weft.pipeline import Schedule, SyncSide, Task


def host(task, batch, iteration, begin_us, end_us, ticket=-1):
    return SimpleNamespace(task=task, thread=0, batch=batch, lookahead=0, iteration=iteration,
                           ticket=ticket, begin_us=begin_us, end_us=end_us, failed=False)


def gpu(task, stream, batch, begin_us, end_us, failed=False):
    return SimpleNamespace(task=task, stream=stream, batch=batch, begin_us=begin_us,
                           end_us=end_us, failed=failed)


def trace(tasks, streams, host_spans, gpu_spans):
    return SimpleNamespace(task_names=list(tasks), stream_names=list(streams),
                           host_spans=list(host_spans), gpu_spans=list(gpu_spans))


def gpu_us(costs, task):
    return {g["stream"]: g["us"] for g in costs["tasks"][task]["gpu"]}


# A writes x on s1, B reads it on s2: B's GPU work waits for A's.
PRODUCER_CONSUMER = Schedule([Task("A", stream="s1", writes=["x"]),
                              Task("B", stream="s2", reads=["x"])],
                             streams=["s1", "s2"], inputs=[])


def producer_consumer_trace(b_begin_us, b_end_us):
    # One run each, batch 0: A's GPU span [0, 300] on s1, B's [b_begin_us, b_end_us] on s2.
    return trace(["A", "B"], ["s1", "s2"],
                 [host(0, 0, 0, 0, 10), host(1, 0, 0, 10, 15)],
                 [gpu(0, 0, 0, 0, 300), gpu(1, 1, 0, b_begin_us, b_end_us)])


def test_a_span_that_holds_a_wait_for_a_producer_on_another_stream_is_charged_its_busy_time():
    # B's span starts at 100 but its work could start only when A ended at 300: 50 us busy.
    t = producer_consumer_trace(100, 350)
    costs = plan.trace_costs(t, PRODUCER_CONSUMER)
    assert gpu_us(costs, "B") == {"s2": 50}
    assert gpu_us(costs, "A") == {"s1": 300}
    assert costs["tasks"]["B"]["host_us"] == 5
    # The span itself, and what the trace alone shows (no schedule: the edge is unknown).
    assert gpu_us(plan.trace_costs(t, PRODUCER_CONSUMER, gpu="span"), "B") == {"s2": 250}
    assert gpu_us(plan.trace_costs(t), "B") == {"s2": 250}


@pytest.mark.parametrize("b_begin_us, b_end_us", [(300, 350), (400, 450), (100, 250)])
def test_a_release_outside_the_span_leaves_the_span(b_begin_us, b_end_us):
    # A ended at B's begin or before it (no wait), or after B ended (B did not wait for it).
    t = producer_consumer_trace(b_begin_us, b_end_us)
    assert gpu_us(plan.trace_costs(t, PRODUCER_CONSUMER), "B") == {"s2": b_end_us - b_begin_us}


def test_a_gpu_wait_is_left_out_of_the_waiting_tasks_host_time_and_simulated_instead():
    # B's body waits for A's GPU work of its batch (a count A's kernel writes). Batch 0's span
    # [10, 140] holds the wait to 110 (30 us of host work), batch 1's began after A's GPU work
    # ended (40 whole), batch 2's ended before it (45 whole): the median 40, against 45 without.
    t = trace(["A", "B"], ["s1", "s2"],
              [host(0, 0, 0, 0, 10), host(1, 0, 0, 10, 140), host(0, 1, 1, 140, 150),
               host(1, 1, 1, 300, 340), host(0, 2, 2, 340, 350), host(1, 2, 2, 450, 495)],
              [gpu(0, 0, 0, 10, 110), gpu(0, 0, 1, 150, 250), gpu(0, 0, 2, 400, 500)])
    costs = plan.trace_costs(t, PRODUCER_CONSUMER, gpu_waits={"B": "A"})
    assert costs["tasks"]["B"] == {"host_us": 40, "waits_for_gpu_of": "A"}
    assert "waits_for_gpu_of" not in costs["tasks"]["A"]
    assert plan.trace_costs(t, PRODUCER_CONSUMER)["tasks"]["B"] == {"host_us": 45}
    # The simulator then starts B's host work when A's GPU work of its batch ends: one thread,
    # A 10 us of host and 100 of GPU (the medians): B at 110, after a wait of 100 us.
    report = plan.simulate(PRODUCER_CONSUMER, "legacy", costs, name="waits", num_batches=1)
    starts = {s.task: s.start_us for s in report.timeline.host}
    assert starts == {"A": 0, "B": 110}
    waits = [w for w in report.timeline.waits if w.rule == "gpu_wait"]
    assert [(w.producer, w.consumer, w.producer_thread, w.waited_us) for w in waits] == \
        [("A", "B", "stream s1", 100)]
    with pytest.raises(weft.Error, match="gpu_waits producer 'ghost' is not a task"):
        plan.trace_costs(t, PRODUCER_CONSUMER, gpu_waits={"B": "ghost"})
    with pytest.raises(weft.Error, match="waits for its own GPU work"):
        plan.trace_costs(t, PRODUCER_CONSUMER, gpu_waits={"B": "B"})
    with pytest.raises(TypeError, match="gpu_waits maps task names"):
        plan.trace_costs(t, PRODUCER_CONSUMER, gpu_waits={"B": 0})


def test_a_task_without_waits_keeps_its_spans_median():
    t = trace(["A"], ["default"],
              [host(0, b, b, 1000 * b, 1000 * b + 7) for b in range(3)],
              [gpu(0, 0, 0, 0, 100), gpu(0, 0, 1, 1000, 1130), gpu(0, 0, 2, 2000, 2090)])
    for kind in plan.GPU_COST_KINDS:
        costs = plan.trace_costs(t, gpu=kind)
        assert costs == {"default_host_us": 0,
                         "tasks": {"A": {"host_us": 7, "gpu": [{"stream": "default", "us": 100}]}}}


def test_a_collective_queued_behind_an_earlier_collective_is_charged_what_follows_it():
    # C1 (ticket 0) is enqueued first; its GPU work on s1 ends at 500. C2 (ticket 1), enqueued
    # after it, has its span on s2 from 10 to 520: its collective ran behind C1's, 20 us busy.
    # N, not collective, overlaps C1 the same way and waited for nothing.
    t = trace(["C1", "C2", "N"], ["s1", "s2", "s3"],
              [host(0, 0, 0, 0, 5, ticket=0), host(1, 0, 0, 5, 9, ticket=1), host(2, 0, 0, 9, 10)],
              [gpu(0, 0, 0, 0, 500), gpu(1, 1, 0, 10, 520), gpu(2, 2, 0, 10, 520)])
    costs = plan.trace_costs(t)
    assert gpu_us(costs, "C2") == {"s2": 20}
    assert gpu_us(costs, "C1") == {"s1": 500}
    assert gpu_us(costs, "N") == {"s3": 510}


def test_a_collective_enqueued_first_does_not_wait_for_a_later_one():
    # The same spans with C2 enqueued first: C1's end inside C2's span is no release for it.
    t = trace(["C1", "C2"], ["s1", "s2"],
              [host(1, 0, 0, 0, 4, ticket=0), host(0, 0, 0, 5, 9, ticket=1)],
              [gpu(0, 0, 0, 0, 500), gpu(1, 1, 0, 10, 520)])
    assert gpu_us(plan.trace_costs(t), "C2") == {"s2": 510}


def test_the_latest_release_counts_and_stream_order_is_one():
    # B's span [0, 400] on s2 holds the end of the previous span on s2 (P, at 100) and of its
    # producer A on s1 (at 300): busy from 300.
    schedule = Schedule([Task("A", stream="s1", writes=["x"]), Task("P", stream="s2"),
                         Task("B", stream="s2", reads=["x"])], streams=["s1", "s2"], inputs=[])
    t = trace(["A", "P", "B"], ["s1", "s2"],
              [host(0, 0, 0, 0, 1), host(1, 0, 0, 1, 2), host(2, 0, 0, 2, 3)],
              [gpu(0, 0, 0, 0, 300), gpu(1, 1, 0, -50, 100), gpu(2, 1, 0, 0, 400)])
    assert gpu_us(plan.trace_costs(t, schedule), "B") == {"s2": 100}
    # Without the schedule only stream order is known: busy from P's end.
    assert gpu_us(plan.trace_costs(t), "B") == {"s2": 300}


def test_cross_iteration_and_same_progress_producers_are_matched_by_batch_and_progress():
    # C waits for A of the previous batch (cross_iter_depends_on -1) and, GPU side, for S of the
    # same progress() call; the CPU-side sync with Q orders only the bodies.
    schedule = Schedule([Task("A", stream="s1"), Task("S", stream="s3", lookahead=1),
                         Task("Q", stream="s4", lookahead=1),
                         Task("C", stream="s2", cross_iter_depends_on=[("A", -1)],
                              same_progress_sync=[("S", SyncSide.GPU), ("Q", SyncSide.CPU)])],
                        streams=["s1", "s2", "s3", "s4"], inputs=[])
    # Progress 1: A and C work on batch 1, S and Q on batch 2. A(0) ends at 200, A(1) at 390,
    # S(2) at 250, S(1) (the previous progress's) at 330, Q(2) at 350; C(1)'s span is [100, 400].
    tasks = ["A", "S", "Q", "C"]
    hosts = [host(0, 0, 0, 0, 1), host(1, 1, 0, 1, 2), host(2, 1, 0, 2, 3),
             host(0, 1, 1, 10, 11), host(1, 2, 1, 11, 12), host(2, 2, 1, 12, 13),
             host(3, 1, 1, 13, 14)]
    gpus = [gpu(0, 0, 0, 0, 200), gpu(1, 2, 1, 0, 330), gpu(2, 3, 1, 0, 5),
            gpu(0, 0, 1, 200, 390), gpu(1, 2, 2, 0, 250), gpu(2, 3, 2, 100, 350),
            gpu(3, 1, 1, 100, 400)]
    t = trace(tasks, ["s1", "s2", "s3", "s4"], hosts, gpus)
    # Releases: A(0) at 200, S(2) at 250; not A(1) (the same batch), S(1) or Q(2).
    assert gpu_us(plan.trace_costs(t, schedule), "C") == {"s2": 150}


def test_the_median_is_over_the_runs_busy_times_and_failed_spans_are_left_out():
    # Three runs of B: one waited 200 us for A inside its span, two did not; a fourth failed.
    hosts, gpus = [], []
    for b, (begin, end) in enumerate([(0, 400), (1200, 1500), (2250, 2530)]):
        hosts += [host(0, b, b, 1000 * b, 1000 * b + 1), host(1, b, b, 1000 * b + 1, 1000 * b + 2)]
        gpus += [gpu(0, 0, b, 1000 * b, 1000 * b + 200), gpu(1, 1, b, begin, end)]
    gpus.append(gpu(1, 1, 3, 3000, 9000, failed=True))
    t = trace(["A", "B"], ["s1", "s2"], hosts, gpus)
    # Busy: 200 (waited from 0 to A's end at 200), 300 and 280 (both began after A's end).
    assert gpu_us(plan.trace_costs(t, PRODUCER_CONSUMER), "B") == {"s2": 280}
    # The spans: 400, 300, 280; without the schedule none holds a release it knows of.
    assert gpu_us(plan.trace_costs(t, PRODUCER_CONSUMER, gpu="span"), "B") == {"s2": 300}
    assert gpu_us(plan.trace_costs(t), "B") == {"s2": 300}


def test_the_same_trace_in_any_order_gives_the_same_costs():
    rng = random.Random(7)
    hosts, gpus = [], []
    for b in range(20):
        for task in range(3):
            base = 1000 * b + 300 * task
            hosts.append(host(task, b, b, base, base + rng.uniform(1, 50),
                              ticket=task if task else -1))
            gpus.append(gpu(task, task % 2, b, base + rng.uniform(0, 40),
                            base + rng.uniform(100, 900)))
    tasks, streams = ["A", "B", "C"], ["s1", "s2"]
    schedule = Schedule([Task("A", stream="s1", writes=["x"]), Task("B", stream="s2", reads=["x"]),
                         Task("C", stream="s1", depends_on=["B"])], streams=streams, inputs=[])
    first = plan.trace_costs(trace(tasks, streams, hosts, gpus), schedule)
    for _ in range(5):
        rng.shuffle(hosts)
        rng.shuffle(gpus)
        again = plan.trace_costs(trace(tasks, streams, hosts, gpus), schedule)
        assert json.dumps(again, sort_keys=True) == json.dumps(first, sort_keys=True)
    # Busy never exceeds the span, and the costs are what simulate() takes.
    spans = plan.trace_costs(trace(tasks, streams, hosts, gpus), schedule, gpu="span")
    for task in tasks:
        for stream, us in gpu_us(first, task).items():
            assert 0 <= us <= gpu_us(spans, task)[stream]
    plan.simulate(schedule, "per_task", first)


def test_bad_arguments_are_refused():
    t = producer_consumer_trace(100, 350)
    with pytest.raises(weft.Error, match="gpu is one of"):
        plan.trace_costs(t, gpu="kernels")
    other = Schedule([Task("A", stream="s1", writes=["x"]), Task("Z", stream="s1", reads=["x"])],
                     streams=["s1"], inputs=[])
    with pytest.raises(weft.Error, match="schedule task 'Z' is not a task of the trace"):
        plan.trace_costs(t, other)
