"""weft.pipeline's Engine under hostile but realistic use: two threads, calls back into the
engine from bodies and from slot values' __del__, reference cycles, interpreter exit, fork(),
odd exceptions, close(), the stall report and what the engine keeps after the end of data.
Each case that can crash or hang runs in its own interpreter, with a timeout."""

import pytest

from conftest import run_python

pytestmark = pytest.mark.timeout(120)

# A two-task schedule (la 1 -> la 0) whose result is the batch's value; BODY_HOOK(ctx) runs first
# in the la = 0 task.
PRELUDE = """
import gc, os, sys, threading, time, weakref
import weft
from weft.pipeline import Engine, Schedule, Task

def BODY_HOOK(ctx):
    pass

def load(ctx):
    ctx.set("x", ctx.get("batch_cpu"))

def train(ctx):
    BODY_HOOK(ctx)
    ctx.set("step_result", ctx.get("x"))

def two_tasks():
    return Schedule([
        Task.from_fn("load", load, stream="io", lookahead=1, reads=["batch_cpu"], writes=["x"]),
        Task.from_fn("train", train, reads=["x"], writes=["step_result"]),
    ])

def drain(engine, it):
    out = []
    while True:
        try:
            out.append(engine.progress(it))
        except StopIteration:
            return out
"""

MAPS = ["legacy", "per_task"]


def run(code, timeout_s=30):
    return run_python(PRELUDE + code, timeout_s)


# Two threads -------------------------------------------------------------------------------------

@pytest.mark.parametrize("thread_map", MAPS)
def test_a_second_thread_is_refused_while_progress_runs(thread_map):
    r = run(f"""
entered, release = threading.Event(), threading.Event()
def BODY_HOOK(ctx):
    if ctx.get("x") == 0:
        entered.set()
        release.wait(10)
engine = Engine(two_tasks(), "{thread_map}")
it = iter(range(3))
results = []
first = threading.Thread(target=lambda: results.append(engine.progress(it)))
first.start()
assert entered.wait(10)
for name in ["progress", "reset", "synchronize", "close", "take_trace",
             "collective_inventory"]:
    try:
        getattr(engine, name)(*([it] if name == "progress" else []))
        print(name, "ran")
    except weft.Error as e:
        print(name, "refused:", e)
release.set()
first.join(10)
print("results", results + drain(engine, it))
""")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 7, r.stdout
    for line in lines[:6]:
        assert "refused:" in line and "progress() is running on another thread" in line, line
    assert lines[6] == "results [0, 1, 2]"


@pytest.mark.parametrize("thread_map", MAPS)
def test_threads_driving_one_engine_get_every_result_once(thread_map):
    # Bodies that give the GIL away mid-step, so that the callers' calls overlap.
    r = run(f"""
def load(ctx):
    time.sleep(0)
    ctx.set("x", ctx.get("batch_cpu"))
def BODY_HOOK(ctx):
    time.sleep(0)
engine = Engine(two_tasks(), "{thread_map}")
it = iter(range(2000))
results, errors = [], []
def drive():
    while True:
        try:
            results.append(engine.progress(it))
        except StopIteration:
            return
        except weft.Error as e:
            if "running on another thread" not in str(e):
                errors.append(str(e))
                return
            time.sleep(0)
        except Exception as e:
            errors.append(repr(e))
            return
threads = [threading.Thread(target=drive) for _ in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join(40)
print(sorted(results) == list(range(2000)), errors[:2])
""", timeout_s=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True []"


# Reference cycles, and what the engine keeps after the end ---------------------------------------

TRAINER = """
class Trainer:
    # Bodies are bound methods and the source is the trainer's own generator: cycles through
    # the engine.
    def __init__(self, thread_map):
        self.engine = Engine(Schedule([
            Task.from_fn("load", self.load, stream="io", lookahead=1, reads=["batch_cpu"],
                         writes=["x"]),
            Task.from_fn("train", self.train, reads=["x"], writes=["step_result"]),
        ]), thread_map)
        self.data = self.batches()
    def batches(self):
        for i in range(NUM_BATCHES):
            yield (self, i)               # a slot value that refers to the trainer
    def load(self, ctx):
        ctx.set("x", ctx.get("batch_cpu"))
    def train(self, ctx):
        ctx.set("step_result", ctx.get("x")[1])
    def step(self):
        return self.engine.progress(self.data)

def num_os_threads():
    return len(os.listdir("/proc/self/task"))
"""


@pytest.mark.parametrize("thread_map", MAPS + ["default"])
@pytest.mark.parametrize("num_steps", [2, 6])  # mid-source, and after StopIteration
def test_cycles_through_the_engine_are_collected_with_its_threads(thread_map, num_steps):
    r = run(TRAINER + f"""
NUM_BATCHES = 5
before = num_os_threads()
refs = []
for _ in range(10):
    trainer = Trainer("{thread_map}")
    for _ in range({num_steps}):
        try:
            trainer.step()
        except StopIteration:
            pass
    refs += [weakref.ref(trainer), weakref.ref(trainer.engine)]
    del trainer
gc.collect()
print("alive", sum(ref() is not None for ref in refs), "threads", num_os_threads() - before)
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "alive 0 threads 0"  # trainers and engines
    assert "leaked" not in r.stderr, r.stderr


@pytest.mark.parametrize("thread_map", MAPS)
def test_the_last_batch_is_released_at_stop_iteration(thread_map):
    r = run(f"""
class Value:
    pass
refs = []
def make(n):
    for i in range(n):
        v = Value()
        refs.append(weakref.ref(v))
        yield v
def load(ctx):
    ctx.set("x", ctx.get("batch_cpu"))
engine = Engine(two_tasks(), "{thread_map}")
results = drain(engine, make(3))
del results
print("alive", sum(ref() is not None for ref in refs), "open", engine.num_in_flight)
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "alive 0 open 0"


# A body calling back into its engine -------------------------------------------------------------

@pytest.mark.parametrize("thread_map", MAPS)
@pytest.mark.parametrize("call", ["progress", "reset", "synchronize", "close"])
def test_a_body_calling_its_own_engine_gets_an_error(thread_map, call):
    r = run(f"""
def BODY_HOOK(ctx):
    if ctx.get("x") == 1:
        getattr(engine, "{call}")(*([it] if "{call}" == "progress" else []))
engine = Engine(two_tasks(), "{thread_map}")
it = iter(range(4))
print(engine.progress(it))
try:
    engine.progress(it)
except weft.Error as e:
    print("raised:", e)
engine.reset()
print(drain(engine, it))
""", timeout_s=20)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "0"
    assert lines[1].startswith("raised:")
    assert f"{call}() called from inside task 'train'" in lines[1]
    assert lines[2] == "[3]"  # the source goes on where it was


# A slot value's __del__ calling the engine -------------------------------------------------------

@pytest.mark.parametrize("thread_map", MAPS)
@pytest.mark.parametrize("call", ["progress", "reset", "synchronize", "close"])
def test_a_slot_value_whose_del_calls_the_engine_is_refused_cleanly(thread_map, call):
    r = run(f"""
refused = []
class Callback:
    def __del__(self):
        try:
            getattr(engine, "{call}")(*([it] if "{call}" == "progress" else []))
            refused.append("ran")
        except weft.Error as e:
            refused.append(str(e))
def load(ctx):
    ctx.set("x", ctx.get("batch_cpu"))
    ctx.set("keepalive", Callback())
schedule = Schedule([
    Task.from_fn("load", load, stream="io", lookahead=1, reads=["batch_cpu"],
                 writes=["x", "keepalive"]),
    Task.from_fn("train", train, reads=["x", "keepalive"], writes=["step_result"]),
])
engine = Engine(schedule, "{thread_map}")
it = iter(range(5))
print(drain(engine, it))
engine.close()
print(len(refused), sorted(set(refused)))
""")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "[0, 1, 2, 3, 4]"
    count, messages = lines[1].split(" ", 1)
    assert int(count) == 5
    assert "ran" not in messages and "while the engine runs" in messages, messages


# Interpreter exit --------------------------------------------------------------------------------

@pytest.mark.parametrize("thread_map", MAPS)
def test_interpreter_exit_with_progress_in_a_daemon_thread(thread_map):
    for _ in range(3):
        r = run(f"""
def BODY_HOOK(ctx):
    sum(range(2000))
    time.sleep(0)
engine = Engine(two_tasks(), "{thread_map}")
def loop():
    it = iter(range(10**9))
    while True:
        engine.progress(it)
threading.Thread(target=loop, daemon=True).start()
time.sleep(0.3)
print("exiting")
""")
        assert (r.returncode, r.stdout) == (0, "exiting\n"), r.stderr
        assert "terminate" not in r.stderr, r.stderr


# An exception that resists inspection ------------------------------------------------------------

@pytest.mark.parametrize("thread_map", MAPS)
def test_an_exception_whose_type_name_raises_arrives_intact(thread_map):
    r = run(f"""
class NoName(type):
    @property
    def __name__(cls):
        raise AttributeError("no __name__ today")
class Odd(Exception, metaclass=NoName):
    pass
def BODY_HOOK(ctx):
    if ctx.get("x") == 1:
        raise Odd("the original")
engine = Engine(two_tasks(), "{thread_map}")
it = iter(range(4))
print(engine.progress(it))
try:
    engine.progress(it)
except Odd as e:
    print("caught", e.args[0])
try:
    engine.progress(it)
except weft.Error as e:
    print("then", "failed in an earlier progress()" in str(e), "Odd" in str(e))
engine.reset()
print(drain(engine, it))
""", timeout_s=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["0", "caught the original", "then True True", "[3]"]


# fork() ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("thread_map", MAPS + ["default"])
@pytest.mark.parametrize("child_calls", [True, False])
def test_a_forked_child_refuses_the_inherited_engine_and_exits(thread_map, child_calls):
    r = run(f"""
engine = Engine(two_tasks(), "{thread_map}")
it = iter(range(4))
print(engine.progress(it), flush=True)
pid = os.fork()
if pid == 0:
    if {child_calls}:
        for call in [lambda: engine.progress(it), engine.reset, engine.close]:
            try:
                call()
                print("child: ran", flush=True)
            except weft.Error as e:
                print("child:", e, flush=True)
else:
    _, status = os.waitpid(pid, 0)
    print("child exit", os.waitstatus_to_exitcode(status))
    print(drain(engine, it))
""", timeout_s=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "0"
    children = [line for line in lines if line.startswith("child:")]
    assert len(children) == (3 if child_calls else 0), r.stdout
    for line in children:
        assert "built before this process was forked" in line, line
    assert lines[-2:] == ["child exit 0", "[1, 2, 3]"]
    assert "leaked" not in r.stderr, r.stderr


# close() -----------------------------------------------------------------------------------------

def test_every_call_after_close_says_the_engine_is_closed():
    r = run("""
with Engine(two_tasks(), "per_task") as engine:
    it = iter(range(3))
    engine.progress(it)
calls = {
    "progress": lambda: engine.progress(it), "reset": engine.reset,
    "synchronize": engine.synchronize, "take_trace": engine.take_trace,
    "collective_inventory": engine.collective_inventory,
    "threads": lambda: engine.threads, "failed": lambda: engine.failed,
    "num_in_flight": lambda: engine.num_in_flight,
    "last_batch_index": lambda: engine.last_batch_index, "backend": lambda: engine.backend,
    "stream_handle": lambda: engine.stream_handle("io"),
}
for name, call in calls.items():
    try:
        call()
        print(name, "ran")
    except weft.Error as e:
        print(name, "the engine is closed" in str(e))
engine.close()  # a second close is a no-op
print("closed twice")
""")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "closed twice"
    assert all(line.endswith(" True") for line in lines[:-1]), r.stdout
    assert len(lines) == 12


# The stall report --------------------------------------------------------------------------------

def test_the_stall_report_under_the_legacy_map():
    r = run("""
def BODY_HOOK(ctx):
    time.sleep(1.5)
engine = Engine(two_tasks(), "legacy", stall_report_s=0.5)
it = iter(range(1))
print(drain(engine, it))
""")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[0]"
    assert "progress() has run" in r.stderr, r.stderr
    assert "thread 'main': in task 'train', running its body" in r.stderr, r.stderr


@pytest.mark.parametrize("thread_map", MAPS)
def test_the_stall_report_times_the_whole_progress(thread_map):
    # Three la > 0 iterations of 0.4 s each before the first result: no single one reaches the
    # 1 s threshold, the progress() does.
    r = run(f"""
def slow(ctx):
    time.sleep(0.4)
schedule = Schedule([Task.from_fn("slow", slow, lookahead=3),
                     Task.from_fn("train", None, lookahead=0)])
engine = Engine(schedule, "{thread_map}", stall_report_s=1.0)
it = iter(range(10))
engine.progress(it)
print("done")
""")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("progress() has run") == 1, r.stderr
