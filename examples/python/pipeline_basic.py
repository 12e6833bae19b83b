"""A training loop on weft.pipeline: the batch's host-side preparation runs a step ahead of the
model's step, on its own engine thread, as in a TorchRec TrainPipeline. Runs on a CPU (the host
backend); with backend="torch" on a GPU each task's stream is a torch stream, current in its body.

    python3 examples/python/pipeline_basic.py
"""

import torch

from weft.pipeline import Engine, Schedule, Task

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
target = torch.randn(16, 1)


def loader(num_batches):
    g = torch.Generator().manual_seed(1)
    for _ in range(num_batches):
        x = torch.randn(64, 16, generator=g)
        yield x, x @ target


def prepare(ctx):
    # Runs one step ahead (lookahead=1): the next batch is ready when the model needs it.
    x, y = ctx.get("batch_cpu")
    ctx.set("batch", ((x - x.mean(0)) / (x.std(0) + 1e-6), y))


def train(ctx):
    x, y = ctx.get("batch")
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    ctx.set("step_result", loss.item())


schedule = Schedule([
    Task.from_fn("prepare", prepare, stream="memcpy", lookahead=1, reads=["batch_cpu"],
                 writes=["batch"]),
    Task.from_fn("train", train, reads=["batch"], writes=["step_result"]),
])
engine = Engine(schedule, {"io": ["prepare"], "compute": ["train"]})

losses = []
it = iter(loader(200))
while True:
    try:
        losses.append(engine.progress(it))  # TorchRec's TrainPipeline.progress(dataloader_iter)
    except StopIteration:
        break
print(f"{len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
assert len(losses) == 200 and losses[-1] < losses[0]
