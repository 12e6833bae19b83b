"""A pure-Python lookahead executor with the mechanics of the HSTU benchmark's engine, the
baseline of engine_overhead.py: a threading.Event per task, collective tickets on a
threading.Condition, and each thread's chain of tasks submitted to a ThreadPoolExecutor every step.

It runs a weft.pipeline.Schedule under a thread map with the engine's step rule (a task of
lookahead k runs at iteration i on batch i - (L - k) while that batch exists) and its host waits
(a within-progress producer on another thread: slot and depends_on edges of equal lookahead,
cross_iter edges of progress distance 0, same_progress_sync edges). It has no streams.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from weft.pipeline import Schedule, ThreadMap


class PythonExecutor:
    def __init__(self, schedule: Schedule, thread_map) -> None:
        native = schedule._to_native(with_bodies=False)
        order = native.run_order()
        tasks = {t.name: t for t in schedule.tasks}
        self._tasks = [tasks[n] for n in order]
        self._max_la = max(t.lookahead for t in self._tasks)
        self._in_flight = self._max_la + 1
        tmap = ThreadMap.of(thread_map)
        self._sequential = tmap.name == "legacy"
        chains = [list(names) for _, names in tmap._native.assign(native)]
        thread_of = {n: i for i, names in enumerate(chains) for n in names}
        writer = {s: t.name for t in self._tasks for s in t.writes}
        self._waits = {}
        for t in self._tasks:
            producers = []
            for p in {writer[s] for s in t.reads if s in writer} | set(t.depends_on):
                if tasks[p].lookahead == t.lookahead:
                    producers.append(p)
            for p, offset in t.cross_iter_depends_on:
                if tasks[p].lookahead - t.lookahead - offset == 0:
                    producers.append(p)
            producers += [p for p, _ in t.same_progress_sync]
            self._waits[t.name] = [p for p in producers if thread_of[p] != thread_of[t.name]]
        self._chains = [[tasks[n] for n in names] for names in chains]
        self._collective_order = [t.name for t in self._tasks if t.collective]
        self._events = {t.name: threading.Event() for t in self._tasks}
        self._tickets = threading.Condition()
        self._serving = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self._chains)))
        self._ring = [dict() for _ in range(self._in_flight)]
        self._iteration = 0
        self._num_pulled = 0
        self._exhausted = False

    def _active(self, task) -> bool:
        batch = self._iteration - (self._max_la - task.lookahead)
        return 0 <= batch < self._num_pulled

    def _run(self, task, tickets) -> None:
        if not self._active(task):
            self._events[task.name].set()
            return
        for p in self._waits[task.name]:
            self._events[p].wait()
        ticket = tickets.get(task.name)
        if ticket is not None:
            with self._tickets:
                while self._serving != ticket:
                    self._tickets.wait()
        body = task._body()
        if body is not None:
            body(self._ring[(self._iteration - (self._max_la - task.lookahead)) % self._in_flight])
        if ticket is not None:
            with self._tickets:
                self._serving += 1
                self._tickets.notify_all()
        self._events[task.name].set()

    def _chain(self, chain, tickets) -> None:
        for task in chain:
            self._run(task, tickets)

    def progress(self, data_iter):
        while True:
            if not self._exhausted:
                try:
                    item = next(data_iter)
                    self._ring[self._iteration % self._in_flight] = {"batch_cpu": item}
                    self._num_pulled += 1
                except StopIteration:
                    self._exhausted = True
            if self._exhausted and self._iteration >= self._num_pulled + self._max_la:
                raise StopIteration
            for e in self._events.values():
                e.clear()
            active = [n for n in self._collective_order
                      if self._active(next(t for t in self._tasks if t.name == n))]
            tickets = {n: self._serving + i for i, n in enumerate(active)}
            if self._sequential:
                self._chain(self._tasks, tickets)
            else:
                for f in [self._pool.submit(self._chain, c, tickets) for c in self._chains]:
                    f.result()
            batch = self._iteration - self._max_la
            self._iteration += 1
            if batch >= 0:
                return self._ring[batch % self._in_flight].get("step_result")

    def close(self) -> None:
        self._pool.shutdown()
