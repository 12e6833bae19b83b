"""Dispatch, combine and cached dispatch as torch.library custom ops, so that torch.compile traces
an MoE layer into one graph (forward and backward) instead of breaking at every call.

    d = weft.moe.ops.register(dispatcher)            # an int: the dispatcher in the ops' schema
    recv_x, recv_w, recv_idx, handle, num_entries = weft.moe.ops.dispatch(x, idx, w, d)
    out = weft.moe.ops.combine(y, handle, d, x.shape[0])

The ops work over any dispatcher of dispatchers.py (the dispatcher protocol: dispatch, combine
with optional weights, dispatch_cached, num_ranks, rank), and give the bits the dispatcher gives:
each op's implementation is one call of it.

    weft::moe_dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int dispatcher)
        -> (Tensor recv_x, Tensor recv_idx, Tensor recv_weights, Tensor handle,
            Tensor num_entries)
    weft::moe_combine(Tensor y, Tensor handle, int dispatcher, SymInt num_tokens) -> Tensor
    weft::moe_combine_weighted(Tensor y, Tensor weights, Tensor handle, int dispatcher,
                               SymInt num_tokens) -> (Tensor, Tensor)
    weft::moe_dispatch_cached(Tensor x, Tensor handle, int dispatcher, SymInt num_rows)
        -> Tensor

State. A dispatcher and a layout handle are Python objects, which no op argument can be. A
dispatcher is registered once (register) and named by its int id, which torch.compile specialises
as a constant. A dispatch's handle stays in a table of this module; the op returns a 0-dim int64
CPU tensor naming it, which the later calls of that layout take (on the host: reading it never
waits for a device). The table entry lives as long as that tensor (autograd saves it for the
backward), and no longer.

Shapes. The received row count is data-dependent: an unbacked size in the fake implementation,
unless the dispatcher has a `num_worst_tokens` > 0 (weft.ep's worst-case dispatch: that many
rows, static, the rows past the received ones with expert -1 and weight 0). num_entries (the
received slots with a local expert, which the experts size their rows by) comes back as a 0-dim
int64 tensor: on the CPU where the dispatcher counted on the host, on x's device for a worst-case
dispatch (counted on the device, no host sync). combine and cached dispatch take the sizes of
their results (the dispatch's token count, its row count) as SymInt arguments, since a handle
tensor carries no shape.

Ordering and side effects. The ops are functional: they mutate no argument and return owned
tensors (never views of a communication window, which the next call overwrites). Their order is
their data dependencies: combine, weighted combine and cached dispatch take the handle of their
dispatch, so they run after it; the backward runs in the reverse order of the forward because each
gradient feeds the next. Calls with no dependency between them (two layers' dispatches in
independent branches) may be reordered by the compiler; every dispatcher gives the same results
in any order (weft.ep re-runs the layout of an older handle: one extra dispatch, counted in
Buffer.num_relayouts), and collectives stay matched across ranks because every rank runs the
same compiled program. Like any functional op, a dispatch none of whose results is used may be
removed.

Autograd, as layer.py's _Dispatch and _Combine: dispatch's backward is a weighted combine of the
rows' and weights' gradients; combine's backward is a cached dispatch of the output's gradient.
The weighted combine and the cached dispatch are themselves not differentiable (no double
backward).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Tuple

import torch

_dispatchers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_ids: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_next_dispatcher = itertools.count()
_handles: dict = {}  # handle serial -> (dispatcher id, the dispatcher's handle)
_next_handle = itertools.count()


def register(dispatcher) -> int:
    """The id that names dispatcher in the ops (the same id for the same object). The registry
    holds it weakly: it stays registered while the caller keeps it."""
    if dispatcher in _ids:
        return _ids[dispatcher]
    for attr in ("dispatch", "combine", "dispatch_cached"):
        if not callable(getattr(dispatcher, attr, None)):
            raise TypeError(f"{type(dispatcher).__name__} has no {attr}(): not a dispatcher")
    dispatcher_id = next(_next_dispatcher)
    _dispatchers[dispatcher_id] = dispatcher
    _ids[dispatcher] = dispatcher_id
    return dispatcher_id


def _dispatcher(dispatcher_id: int):
    try:
        return _dispatchers[dispatcher_id]
    except KeyError:
        raise RuntimeError(f"weft.moe.ops: no live dispatcher has id {dispatcher_id} (register "
                           f"it with weft.moe.ops.register and keep it alive)") from None


def _worst_rows(dispatcher_id: int) -> int:
    """The dispatcher's static row count, 0 where the received rows are data-dependent."""
    return getattr(_dispatcher(dispatcher_id), "num_worst_tokens", 0)


def _new_handle(dispatcher_id: int, handle) -> torch.Tensor:
    serial = next(_next_handle)
    _handles[serial] = (dispatcher_id, handle)
    token = torch.tensor(serial, dtype=torch.int64)
    weakref.finalize(token, _handles.pop, serial, None)
    return token


def _handle(token: torch.Tensor, dispatcher_id: int):
    if token.device.type != "cpu" or token.dtype != torch.int64 or token.dim() != 0:
        raise RuntimeError("weft.moe.ops: a handle is the 0-dim int64 CPU tensor that "
                           "weft::moe_dispatch returns")
    entry = _handles.get(int(token))
    if entry is None:
        raise RuntimeError(f"weft.moe.ops: handle {int(token)} is not live (its dispatch's "
                           f"handle tensor was freed, or it comes from another process)")
    if entry[0] != dispatcher_id:
        raise RuntimeError(f"weft.moe.ops: handle {int(token)} comes from dispatcher "
                           f"{entry[0]}, not {dispatcher_id}")
    return entry[1]


def _check_rows(what: str, t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] != rows:
        raise RuntimeError(f"weft.moe.ops: {what} has {t.shape[0]} rows, the call's layout "
                           f"{rows}")
    return t


# -- dispatch ----------------------------------------------------------------------------------
@torch.library.custom_op("weft::moe_dispatch", mutates_args=())
def _dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 dispatcher: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor, torch.Tensor]:
    d = _dispatcher(dispatcher)
    worst = _worst_rows(dispatcher)
    if not worst and x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("weft::moe_dispatch: this dispatcher reads its received row count on "
                           "the host, which a CUDA graph capture cannot wait for; capture a "
                           "dispatcher with num_worst_tokens (static rows, no host sync)")
    recv_x, recv_idx, recv_w, handle, num_entries = d.dispatch(x, topk_idx, topk_weights)
    if worst:
        _check_rows("the worst-case dispatch's recv_x", recv_x, worst)
    count_device = x.device if worst else torch.device("cpu")
    # A host int (the dispatcher counted on the host) or, for a worst-case dispatch, a 0-dim
    # device tensor.
    num_entries = torch.as_tensor(num_entries, dtype=torch.int64, device=count_device)
    return recv_x, recv_idx, recv_w, _new_handle(dispatcher, handle), num_entries


@_dispatch_op.register_fake
def _(x, topk_idx, topk_weights, dispatcher):
    worst = _worst_rows(dispatcher)
    rows = worst if worst else torch.library.get_ctx().new_dynamic_size()
    top_k = topk_idx.shape[1]
    count_device = x.device if worst else torch.device("cpu")
    return (x.new_empty((rows, x.shape[1])), topk_idx.new_empty((rows, top_k)),
            topk_weights.new_empty((rows, top_k)),
            torch.empty((), dtype=torch.int64, device="cpu"),
            torch.empty((), dtype=torch.int64, device=count_device))


def _dispatch_setup(ctx, inputs, output):
    x, _, _, dispatcher = inputs
    ctx.save_for_backward(output[3])
    ctx.dispatcher, ctx.num_tokens = dispatcher, x.shape[0]
    ctx.mark_non_differentiable(output[1], output[3], output[4])


def _dispatch_backward(ctx, grad_recv_x, _grad_idx, grad_recv_w, _grad_handle, _grad_count):
    (handle,) = ctx.saved_tensors
    grad_x, grad_w = _combine_weighted_op(grad_recv_x, grad_recv_w.contiguous(), handle,
                                          ctx.dispatcher, ctx.num_tokens)
    return grad_x, None, grad_w, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# -- combine -----------------------------------------------------------------------------------
@torch.library.custom_op("weft::moe_combine", mutates_args=())
def _combine_op(y: torch.Tensor, handle: torch.Tensor, dispatcher: int,
                num_tokens: int) -> torch.Tensor:
    out, _ = _dispatcher(dispatcher).combine(y, _handle(handle, dispatcher))
    return _check_rows("the combine's result", out, num_tokens)


@_combine_op.register_fake
def _(y, handle, dispatcher, num_tokens):
    return y.new_empty((num_tokens, y.shape[1]), dtype=torch.bfloat16)


def _combine_setup(ctx, inputs, output):
    y, handle, dispatcher, _ = inputs
    ctx.save_for_backward(handle)
    ctx.dispatcher, ctx.num_rows = dispatcher, y.shape[0]


def _combine_backward(ctx, grad_out):
    (handle,) = ctx.saved_tensors
    return (_dispatch_cached_op(grad_out.contiguous(), handle, ctx.dispatcher, ctx.num_rows),
            None, None, None)


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


@torch.library.custom_op("weft::moe_combine_weighted", mutates_args=())
def _combine_weighted_op(y: torch.Tensor, weights: torch.Tensor, handle: torch.Tensor,
                         dispatcher: int, num_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    out, combined_w = _dispatcher(dispatcher).combine(y, _handle(handle, dispatcher),
                                                      weights=weights)
    return (_check_rows("the combine's result", out, num_tokens),
            _check_rows("the combined weights", combined_w, num_tokens))


@_combine_weighted_op.register_fake
def _(y, weights, handle, dispatcher, num_tokens):
    return (y.new_empty((num_tokens, y.shape[1]), dtype=torch.bfloat16),
            weights.new_empty((num_tokens, weights.shape[1])))


# -- cached dispatch ---------------------------------------------------------------------------
@torch.library.custom_op("weft::moe_dispatch_cached", mutates_args=())
def _dispatch_cached_op(x: torch.Tensor, handle: torch.Tensor, dispatcher: int,
                        num_rows: int) -> torch.Tensor:
    recv = _dispatcher(dispatcher).dispatch_cached(x, _handle(handle, dispatcher))
    return _check_rows("the cached dispatch's result", recv, num_rows)


@_dispatch_cached_op.register_fake
def _(x, handle, dispatcher, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


# -- what the layer calls ----------------------------------------------------------------------
def dispatch(x, topk_idx, topk_weights, dispatcher: int):
    """Differentiable dispatch through weft::moe_dispatch: (recv_x, recv_weights,
    recv_expert_idx, handle, num_entries), layer.dispatch's order; handle and num_entries are
    0-dim int64 tensors (see the module's docstring)."""
    recv_x, recv_idx, recv_w, handle, num_entries = _dispatch_op(x, topk_idx, topk_weights,
                                                                 dispatcher)
    return recv_x, recv_w, recv_idx, handle, num_entries


def combine(y, handle, dispatcher: int, num_tokens: int):
    """Differentiable combine through weft::moe_combine: [num_tokens, hidden] bf16."""
    return _combine_op(y, handle, dispatcher, num_tokens)
