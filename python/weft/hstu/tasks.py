"""The HSTU training step as Python bodies of the HSTU preset's tasks (weft.hstu.hstu_schedule),
over torch and torch.distributed.

    step = HstuStep(config, group, device)
    engine = Engine(hstu_schedule(step.bodies(), cascade="d3"), "full_split", backend="torch")
    losses = drain(engine, ZipfLoader(num_batches))
    losses = list(step.sequential(ZipfLoader(num_batches)))   # the same bodies, no engine

What each task does (the collectives are the HSTU benchmark's inventory, src/hstu/schedule.cpp;
"sync" is a read back to the host that waits for the task's stream):

  h2d                      collate() the batch on the host (numpy), copy it to the device
  start_shuffle            AllGather of the ranks' token counts; sync
  finish_shuffle           AllGather of all sequence lengths; sync; a balanced assignment of the
                           global batch's sequences to ranks (Python); AllGatherV (one all_gather
                           padded to the largest rank) of the ids; this rank's sequences picked out
  start_input_dist         dedup of the item and action ids, bucketed by owner rank (id % world);
                           all_to_all of the bucket sizes
  wait_input_dist          sync of the bucket sizes; all_to_all of the action ids, of the item ids
  prefetch_embeddings      the owner's local row indices of what it received
  zero_grad                the dense gradients dropped
  global_tokens_allreduce  AllReduce of the number of targets
  compute_output_dist      the owner's rows gathered from its shard; all_to_all of them back
  forward                  jagged -> padded embeddings; the dense model; sampled-softmax loss sum
  backward                 loss / global tokens, backward; all_to_all of the row gradients to
                           their owners
  finalize_model_grads     AllReduce of the dense gradients in two buckets (the layers; the rest)
  optimizer_step           SGD on the dense parameters and on the received rows of the shard
  watchdog                 no body

Every body puts its work on the stream the engine makes current for it (the task context's
stream: torch's kernels, copies and the collectives, which torch.distributed orders after the
current stream), and records the AllGathers and AllReduces on that stream too, so a task the
schedule declares ``movable_to`` another stream (h2d, weft.hstu.variants) runs correctly there.

The embedding table (items and action types, one id space) is sharded row-wise: rank r owns ids
r, r + world, ... Values that later tasks of a batch use live in that batch's state object, the
``ctx`` slot's value, so the engine keeps them (and their device memory) alive until every stream
has finished with them. Nothing a task reads is written by another batch's task that may run
between them: the shard is read at lookahead 0 (compute_output_dist) and written by
optimizer_step, so every thread map gives the sequential loop's bits.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Dict, Iterable, Iterator, List

import numpy as np
import torch
import torch.distributed as dist

from .data import BatchKey, collate
from .model import HstuModel
from .schedule import hstu_schedule

__all__ = ["HstuConfig", "HstuStep", "SequentialContext"]


@dataclass(frozen=True)
class HstuConfig:
    batch_size: int = 8          # sequences per rank
    max_seq_len: int = 32
    num_items: int = 10_000
    num_actions: int = 16
    dim: int = 32
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 64
    num_negatives: int = 32
    events_per_token: int = 1    # the host preprocessing's amount (data.collate)
    zipf_a: float = 1.2
    lr: float = 0.05
    seed: int = 0
    bf16: bool = False           # the dense model under torch.autocast(bfloat16) (CUDA)


class SequentialContext:
    """What a body needs of weft.pipeline's TaskContext, for the loop without an engine."""

    stream = "default"  # the loop runs every body on one stream

    def __init__(self, batch_index: int, slots: dict) -> None:
        self.batch_index = batch_index
        self._slots = slots

    def get(self, slot: str):
        return self._slots[slot]

    def set(self, slot: str, value) -> None:
        self._slots[slot] = value

    def record_collective(self, kind: str, stream: str, num_bytes: int) -> None:
        pass


def _split(t: torch.Tensor, sizes: List[int]) -> List[torch.Tensor]:
    return list(torch.split(t, sizes))


class HstuStep:
    """The model, the shard and the bodies of one rank. Every rank of ``group`` builds one with
    the same config; the dense parameters start equal on every rank, the shard from
    (seed, rank)."""

    def __init__(self, config: HstuConfig, group, device: torch.device) -> None:
        self.config = c = config
        self.group = group
        self.world, self.rank = group.size(), group.rank()
        self.device = device
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(c.seed)
            model = HstuModel(c.dim, c.max_seq_len, c.num_layers, c.num_heads, c.head_dim,
                              c.mlp_dim)
        self.model = model.to(device)
        num_rows = -(-(c.num_items + c.num_actions) // self.world)
        g = torch.Generator(device=device).manual_seed(c.seed * 1000 + self.rank + 1)
        self.shard = torch.randn(num_rows, c.dim, generator=g, device=device) * 0.1
        self.params = list(self.model.parameters())
        layers = list(self.model.layers.parameters())
        ids = {id(p) for p in layers}
        self.buckets = [layers, [p for p in self.params if id(p) not in ids]]
        self._state: Dict[int, SimpleNamespace] = {}

    # -- helpers ---------------------------------------------------------------------------------

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t

    def _index(self, n: int) -> torch.Tensor:
        """[n] on the device, without a copy from the host."""
        return torch.full((1,), n, dtype=torch.int64, device=self.device)

    def _all_to_all(self, ctx, out: torch.Tensor, inp: torch.Tensor, out_sizes=None,
                    in_sizes=None) -> torch.Tensor:
        # The inventory's all-to-alls run on the comm stream, whatever stream their task is on.
        ctx.record_collective("SendRecv", "output_dist_comm", inp.numel() * inp.element_size())
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=self.group)
        return out

    def _all_gather(self, ctx, inp: torch.Tensor, kind: str = "AllGather") -> torch.Tensor:
        ctx.record_collective(kind, ctx.stream, inp.numel() * inp.element_size())
        out = inp.new_empty(self.world * inp.numel())
        dist.all_gather_into_tensor(out, inp.contiguous(), group=self.group)
        return out

    def _all_reduce(self, ctx, t: torch.Tensor) -> torch.Tensor:
        ctx.record_collective("AllReduce", ctx.stream, t.numel() * t.element_size())
        dist.all_reduce(t, group=self.group)
        return t

    def _by_owner(self, ids: torch.Tensor):
        """Unique ids sorted by owner rank, the inverse into them, and the count per owner."""
        unique, inverse = torch.unique(ids, return_inverse=True)
        owner = unique % self.world
        order = torch.argsort(owner, stable=True)
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel(), device=order.device)
        bounds = torch.arange(self.world + 1, device=owner.device)
        counts = torch.searchsorted(owner[order], bounds).diff()
        return unique[order], position[inverse], counts

    def _assign(self, lengths: List[int]) -> List[int]:
        """This rank's share of the global batch (sequence g = rank * batch_size + i): longest
        first, each to the rank with the fewest tokens so far (ties: lower rank), batch_size
        each. The same on every rank."""
        b = self.config.batch_size
        heap = [(0, r) for r in range(self.world)]
        taken = [0] * self.world
        mine = []
        for g in sorted(range(len(lengths)), key=lambda g: (-lengths[g], g)):
            tokens, r = heapq.heappop(heap)
            if r == self.rank:
                mine.append(g)
            taken[r] += 1
            if taken[r] < b:
                heapq.heappush(heap, (tokens + lengths[g], r))
        return sorted(mine)

    # -- the bodies ------------------------------------------------------------------------------

    def h2d(self, ctx) -> None:
        host = collate(self.config, self.rank, ctx.get("batch_cpu"))
        s = self._state[ctx.batch_index] = SimpleNamespace()
        s.negatives = self._to_device(host.negatives)
        ctx.set("batch_gpu", SimpleNamespace(lengths=self._to_device(host.lengths),
                                             items=self._to_device(host.items),
                                             actions=self._to_device(host.actions)))
        ctx.set("ctx", s)

    def start_shuffle(self, ctx) -> None:
        b = ctx.get("batch_gpu")
        totals = self._all_gather(ctx, b.lengths.sum().view(1))
        ctx.set("shuffle_handle", totals.tolist())

    def finish_shuffle(self, ctx) -> None:
        b = ctx.get("batch_gpu")
        totals = ctx.get("shuffle_handle")
        lengths = self._all_gather(ctx, b.lengths, "AllGather").tolist()
        m = max(totals)
        values = b.items.new_zeros(2, m)
        values[0, :b.items.numel()] = b.items
        values[1, :b.actions.numel()] = b.actions
        gathered = self._all_gather(ctx, values.view(-1), "AllGatherV")
        mine = self._assign(lengths)
        bsz, l = self.config.batch_size, self.config.max_seq_len
        all_lengths = np.asarray(lengths, dtype=np.int64).reshape(self.world, bsz)
        offsets = np.cumsum(all_lengths, axis=1) - all_lengths
        g = np.asarray(mine)
        my_lengths = all_lengths.reshape(-1)[g]
        starts = (g // bsz) * 2 * m + offsets.reshape(-1)[g]
        token_starts = np.cumsum(my_lengths) - my_lengths
        num_tokens = int(my_lengths.sum())
        positions = np.repeat(starts - token_starts, my_lengths) + np.arange(num_tokens)
        t = np.arange(l)
        inside = t[None, :] < my_lengths[:, None]
        pad_index = np.where(inside, token_starts[:, None] + t, num_tokens)
        has_target = t[None, :] + 1 < my_lengths[:, None]
        target_index = np.where(has_target, token_starts[:, None] + t + 1, num_tokens)
        positions = self._to_device(positions)
        ctx.set("shuffled_batch", SimpleNamespace(
            items=gathered[positions], actions=gathered[positions + m], num_tokens=num_tokens,
            pad_index=self._to_device(pad_index.reshape(-1)),
            target_index=self._to_device(target_index.reshape(-1))))

    def start_input_dist(self, ctx) -> None:
        sb, s = ctx.get("shuffled_batch"), ctx.get("ctx")
        c = self.config
        s.batch = sb
        s.item_ids, item_inverse, item_counts = self._by_owner(torch.cat([sb.items, s.negatives]))
        s.action_ids, action_inverse, action_counts = self._by_owner(sb.actions + c.num_items)
        # Token -> row of the received embeddings; num_unique (one past the last) is the zero
        # row that padding reads.
        s.item_of_token = torch.cat([item_inverse[:sb.num_tokens], self._index(s.item_ids.numel())])
        s.negative_rows = item_inverse[sb.num_tokens:]
        s.action_of_token = torch.cat([action_inverse, self._index(s.action_ids.numel())])
        s.send_counts = torch.stack([action_counts, item_counts], dim=1).view(-1)
        s.recv_counts = self._all_to_all(ctx, torch.empty_like(s.send_counts), s.send_counts)
        ctx.set("dist_request", s.recv_counts)

    def wait_input_dist(self, ctx) -> None:
        s = self._state[ctx.batch_index]
        counts = torch.cat([s.send_counts, s.recv_counts]).tolist()
        w = self.world
        s.send_action, s.send_item = counts[0:2 * w:2], counts[1:2 * w:2]
        s.recv_action, s.recv_item = counts[2 * w::2], counts[2 * w + 1::2]
        s.got_action = self._all_to_all(ctx, s.action_ids.new_empty(sum(s.recv_action)),
                                        s.action_ids, s.recv_action, s.send_action)
        s.got_item = self._all_to_all(ctx, s.item_ids.new_empty(sum(s.recv_item)), s.item_ids,
                                      s.recv_item, s.send_item)

    def prefetch_embeddings(self, ctx) -> None:
        s = self._state[ctx.batch_index]
        parts = []
        for a, i in zip(_split(s.got_action, s.recv_action), _split(s.got_item, s.recv_item)):
            parts += [a, i]
        s.local_rows = torch.cat(parts) // self.world  # per source rank: its actions, its items

    def zero_grad(self, ctx) -> None:
        for p in self.params:
            p.grad = None

    def global_tokens_allreduce(self, ctx) -> None:
        n = (ctx.get("batch_gpu").lengths - 1).sum().view(1)
        ctx.set("global_tokens", self._all_reduce(ctx, n))

    def compute_output_dist(self, ctx) -> None:
        s = self._state[ctx.batch_index]
        rows = self.shard.index_select(0, s.local_rows)
        send = [a + i for a, i in zip(s.send_action, s.send_item)]
        recv = [a + i for a, i in zip(s.recv_action, s.recv_item)]
        out = self._all_to_all(ctx, rows.new_empty(sum(send), rows.shape[1]), rows, send, recv)
        actions, items = [], []
        for part, a in zip(_split(out, send), s.send_action):
            actions.append(part[:a])
            items.append(part[a:])
        s.action_rows = torch.cat(actions).requires_grad_()
        s.item_rows = torch.cat(items).requires_grad_()
        ctx.set("embeddings", (s.action_rows, s.item_rows))

    def forward(self, ctx) -> None:
        s = self._state[ctx.batch_index]
        action_rows, item_rows = ctx.get("embeddings")
        c, sb = self.config, s.batch
        zero = item_rows.new_zeros(1, c.dim)
        items, actions = torch.cat([item_rows, zero]), torch.cat([action_rows, zero])
        # index_select, whose CUDA backward is deterministic under use_deterministic_algorithms.
        x = (items.index_select(0, s.item_of_token[sb.pad_index])
             + actions.index_select(0, s.action_of_token[sb.pad_index]))
        target = items.index_select(0, s.item_of_token[sb.target_index])
        valid = (sb.pad_index != sb.num_tokens).view(c.batch_size, c.max_seq_len)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=c.bf16):
            out = self.model(x.view(c.batch_size, c.max_seq_len, c.dim), valid)
        loss_sum = HstuModel.loss_sum(out.reshape(-1, c.dim), target,
                                      sb.target_index != sb.num_tokens,
                                      item_rows.index_select(0, s.negative_rows))
        ctx.set("losses", loss_sum)

    def backward(self, ctx) -> None:
        s = self._state[ctx.batch_index]
        loss = ctx.get("losses") / ctx.get("global_tokens")
        loss.backward()
        parts = []
        for a, i in zip(_split(s.action_rows.grad, s.send_action),
                        _split(s.item_rows.grad, s.send_item)):
            parts += [a, i]
        send = [a + i for a, i in zip(s.send_action, s.send_item)]
        recv = [a + i for a, i in zip(s.recv_action, s.recv_item)]
        grads = torch.cat(parts)
        s.row_grads = self._all_to_all(ctx, grads.new_empty(sum(recv), grads.shape[1]), grads,
                                       recv, send)
        s.loss = loss.detach()

    def finalize_model_grads(self, ctx) -> None:
        for bucket in self.buckets:
            grads = [p.grad for p in bucket]
            flat = self._all_reduce(ctx, torch.cat([g.reshape(-1) for g in grads]))
            for g, v in zip(grads, flat.split([g.numel() for g in grads])):
                g.copy_(v.view_as(g))

    def optimizer_step(self, ctx) -> None:
        s = self._state.pop(ctx.batch_index)
        lr = self.config.lr
        with torch.no_grad():
            torch._foreach_add_(self.params, [p.grad for p in self.params], alpha=-lr)
            self.shard.index_add_(0, s.local_rows, s.row_grads, alpha=-lr)
        ctx.set("step_result", s.loss)

    def bodies(self) -> Dict[str, Callable]:
        """Task name -> body, for hstu_schedule (watchdog has none)."""
        names = ["h2d", "start_shuffle", "finish_shuffle", "start_input_dist", "wait_input_dist",
                 "prefetch_embeddings", "zero_grad", "global_tokens_allreduce",
                 "compute_output_dist", "forward", "backward", "finalize_model_grads",
                 "optimizer_step"]
        return {name: getattr(self, name) for name in names}

    def sequential(self, batches: Iterable[BatchKey],
                   bodies: Dict[str, Callable] = None) -> Iterator[torch.Tensor]:
        """The step without an engine: per batch, every body in the schedule's run order."""
        bodies = bodies or self.bodies()
        order = [n for n in hstu_schedule(bodies).run_order() if n in bodies]
        for i, key in enumerate(batches):
            ctx = SequentialContext(i, {"batch_cpu": key})
            for name in order:
                bodies[name](ctx)
            yield ctx.get("step_result")

    def parameters(self) -> Dict[str, torch.Tensor]:
        """A copy of every parameter and of the shard, on the step's device."""
        out = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        out["shard"] = self.shard.clone()
        return out
