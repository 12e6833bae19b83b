"""weft.moe under torch.compile: the custom ops of weft.moe.ops (fake shapes, opcheck), an
MoELayer traced into one graph, and the compiled layer against eager bit for bit, forward and
backward. On the CPU over LocalDispatcher (and a worst-case variant of it: static rows); on a GPU
over weft.ep at one rank, with CUDA-graph capture."""

import copy

import pytest

torch = pytest.importorskip("torch")

import weft.moe as moe  # noqa: E402
from weft.moe import ops  # noqa: E402
from conftest import needs_gpus  # noqa: E402

pytestmark = pytest.mark.timeout(600)

HIDDEN, EXPERTS, TOP_K, FFN = 64, 8, 3, 32


@pytest.fixture(autouse=True)
def compile_config():
    """What compiling a layer needs: the data-dependent row count and entry count traced as
    unbacked sizes; a fresh compile cache per test."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True,
                                    capture_dynamic_output_shape_ops=True):
        yield
    torch._dynamo.reset()


class WorstCaseLocalDispatcher(moe.LocalDispatcher):
    """LocalDispatcher padded to num_worst_tokens rows (expert -1, weight 0), its count a tensor:
    weft.ep's worst-case dispatch contract, on the CPU."""

    def __init__(self, num_experts: int, num_worst_tokens: int) -> None:
        super().__init__(num_experts)
        self.num_worst_tokens = num_worst_tokens

    def _pad(self, t, value):
        pad = t.new_full((self.num_worst_tokens - t.shape[0], *t.shape[1:]), value)
        return torch.cat([t, pad])

    def dispatch(self, x, topk_idx, topk_weights):
        recv_x, recv_idx, recv_w, handle, _ = super().dispatch(x, topk_idx, topk_weights)
        recv_idx = self._pad(recv_idx, -1)
        return (self._pad(recv_x, 0), recv_idx, self._pad(recv_w, 0), handle,
                (recv_idx >= 0).sum())

    def combine(self, y, handle, weights=None):
        rows = handle[0].shape[0]
        return super().combine(y[:rows], handle, None if weights is None else weights[:rows])

    def dispatch_cached(self, x, handle):
        return self._pad(super().dispatch_cached(x, handle), 0)


class DroppingLayer(moe.MoELayer):
    """An MoELayer whose router drops selections: tokens whose first feature is below -0.7 select
    nothing (topk_idx -1 in every slot), and every third token's last slot is dropped."""

    def route(self, x):
        idx, weights = super().route(x)
        drop = (x[:, :1] < -0.7).expand_as(idx).clone()
        drop[::3, -1] = True
        return torch.where(drop, -1, idx), torch.where(drop, 0.0, weights)


def inputs(num_tokens, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((num_tokens, HIDDEN), generator=g).bfloat16().to(device)
    idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(num_tokens)])
    idx = torch.where(torch.rand((num_tokens, TOP_K), generator=g) < 0.2, -1, idx).to(device)
    w = torch.rand((num_tokens, TOP_K), generator=g).to(device)
    return x, idx, w


def check_layer_matches_eager(layer, compiled, sizes, device="cpu", seed=0):
    """compiled(x) (compiled from layer) against layer(x) run eagerly, over fresh inputs of each
    size: the output, x's gradient and every parameter's gradient, bit for bit. One layer serves
    both (a copy could not share a weft.ep Buffer), its gradients taken and cleared in turn."""
    for i, num_tokens in enumerate(sizes):
        g = torch.Generator().manual_seed(seed + i)
        x = torch.randn((num_tokens, layer.hidden), generator=g).bfloat16().to(device)
        grad = torch.randn((num_tokens, layer.hidden), generator=g).bfloat16().to(device)
        runs = []
        for f in (compiled, layer):
            xi = x.clone().requires_grad_()
            y = f(xi)
            y.backward(grad)
            runs.append((y, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
            for p in layer.parameters():
                p.grad = None
        (ya, ga, pa), (yb, gb, pb) = runs
        assert torch.equal(ya, yb), num_tokens
        assert torch.equal(ga, gb), num_tokens
        for name in pa:
            assert torch.equal(pa[name], pb[name]), (num_tokens, name)


# -- CPU ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("worst", [0, 48])
def test_fake_implementations_give_the_shapes_and_dtypes(worst):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    d = WorstCaseLocalDispatcher(EXPERTS, worst) if worst else moe.LocalDispatcher(EXPERTS)
    did = ops.register(d)
    with FakeTensorMode(shape_env=ShapeEnv(allow_dynamic_output_shape_ops=True)):
        x = torch.empty((40, HIDDEN), dtype=torch.bfloat16)
        idx = torch.empty((40, TOP_K), dtype=torch.int64)
        w = torch.empty((40, TOP_K), dtype=torch.float32)
        recv_x, recv_idx, recv_w, handle, count = torch.ops.weft.moe_dispatch(x, idx, w, did)
        rows = recv_x.shape[0]
        if worst:
            assert rows == worst
        else:
            assert isinstance(rows, torch.SymInt) and not isinstance(rows, int)
        assert (recv_x.shape, recv_x.dtype) == ((rows, HIDDEN), torch.bfloat16)
        assert (recv_idx.shape, recv_idx.dtype) == ((rows, TOP_K), torch.int64)
        assert (recv_w.shape, recv_w.dtype) == ((rows, TOP_K), torch.float32)
        for t in (handle, count):
            assert (t.shape, t.dtype, t.device.type) == ((), torch.int64, "cpu")
        out = torch.ops.weft.moe_combine(recv_x, handle, did, 40)
        assert (out.shape, out.dtype) == ((40, HIDDEN), torch.bfloat16)
        out, cw = torch.ops.weft.moe_combine_weighted(recv_x, recv_w, handle, did, 40)
        assert (out.shape, out.dtype, cw.shape, cw.dtype) == \
            ((40, HIDDEN), torch.bfloat16, (40, TOP_K), torch.float32)
        again = torch.ops.weft.moe_dispatch_cached(x, handle, did, rows)
        assert (again.shape, again.dtype) == ((rows, HIDDEN), torch.bfloat16)


def opcheck_all(dispatcher, device):
    """torch.library.opcheck of every op (schema, autograd registration, fake vs real, AOT
    dispatch with dynamic shapes) over the dispatcher."""
    did = ops.register(dispatcher)
    x, idx, w = inputs(40, seed=1, device=device)
    # Each dispatch names its layout with a fresh handle, so two calls' outputs differ in that
    # one value, which test_aot_dispatch_dynamic compares; the compile tests below cover AOT
    # dispatch with dynamic shapes.
    torch.library.opcheck(torch.ops.weft.moe_dispatch.default,
                          (x.requires_grad_(), idx, w.requires_grad_(), did),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    recv_x, recv_idx, recv_w, handle, _ = torch.ops.weft.moe_dispatch(x.detach(), idx,
                                                                     w.detach(), did)
    rows = recv_x.shape[0]
    y = (recv_x.float() * 0.5).bfloat16()
    torch.library.opcheck(torch.ops.weft.moe_combine.default, (y.requires_grad_(), handle, did, 40))
    torch.library.opcheck(torch.ops.weft.moe_combine_weighted.default,
                          (y.detach(), recv_w, handle, did, 40))
    torch.library.opcheck(torch.ops.weft.moe_dispatch_cached.default,
                          (x.detach(), handle, did, rows))


@pytest.mark.parametrize("worst", [0, 48])
def test_opcheck_of_every_op_on_the_cpu(worst):
    opcheck_all(WorstCaseLocalDispatcher(EXPERTS, worst) if worst else
                moe.LocalDispatcher(EXPERTS), "cpu")


def test_ops_in_eager_give_the_layer_functions_bits():
    d = moe.LocalDispatcher(EXPERTS)
    did = ops.register(d)
    x, idx, w = inputs(50, seed=2)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    ra = ops.dispatch(xa, idx, wa, did)
    rb = moe.dispatch(xb, idx, wb, d)
    for a, b in zip(ra[:3], rb[:3]):
        assert torch.equal(a, b)
    assert int(ra[4]) == rb[4]
    scale = torch.randn(ra[0].shape[0], 1).bfloat16()
    out_a = ops.combine(ra[0] * scale + ra[1].sum(1, keepdim=True).bfloat16(), ra[3], did, 50)
    out_b = moe.combine(rb[0] * scale + rb[1].sum(1, keepdim=True).bfloat16(), rb[3], d)
    assert torch.equal(out_a, out_b)
    grad = torch.randn_like(out_a)
    out_a.backward(grad)
    out_b.backward(grad)
    assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)


def test_a_freed_handle_and_an_unknown_dispatcher_raise():
    d = moe.LocalDispatcher(EXPERTS)
    did = ops.register(d)
    assert ops.register(d) == did
    x, idx, w = inputs(10, seed=3)
    handle = torch.ops.weft.moe_dispatch(x, idx, w, did)[3]
    stale = handle.clone()
    del handle
    with pytest.raises(RuntimeError, match="is not live"):
        torch.ops.weft.moe_combine(x, stale, did, 10)
    with pytest.raises(RuntimeError, match="no live dispatcher"):
        torch.ops.weft.moe_dispatch(x, idx, w, 10**9)
    with pytest.raises(TypeError, match="not a dispatcher"):
        ops.register(object())


def test_a_copied_layer_names_its_own_dispatcher():
    layer = moe.MoELayer(HIDDEN, EXPERTS, TOP_K, FFN, moe.LocalDispatcher(EXPERTS))
    copied = copy.deepcopy(layer)
    assert copied.dispatcher is not layer.dispatcher
    assert copied._dispatcher_id == ops.register(copied.dispatcher) != layer._dispatcher_id


def test_explain_finds_one_graph_and_no_break():
    layer = DroppingLayer(HIDDEN, EXPERTS, TOP_K, FFN, moe.LocalDispatcher(EXPERTS), seed=1)
    explained = torch._dynamo.explain(layer)(torch.randn(40, HIDDEN).bfloat16())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons


@pytest.mark.parametrize("layer_cls", [moe.MoELayer, DroppingLayer])
def test_fullgraph_aot_eager_matches_eager_bit_for_bit_as_t_changes(layer_cls):
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = layer_cls(HIDDEN, EXPERTS, TOP_K, FFN, moe.LocalDispatcher(EXPERTS), seed=4)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    check_layer_matches_eager(layer, compiled, [40, 40, 17, 64, 1, 33, 50, 1, 9])
    # One compile for the first T, one with T dynamic, one for T = 1 (torch specialises sizes 0
    # and 1), then no more.
    assert counter.frame_count <= 3, counter.frame_count


def test_fullgraph_aot_eager_with_static_rows_matches_eager():
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = DroppingLayer(HIDDEN, EXPERTS, TOP_K, FFN, WorstCaseLocalDispatcher(EXPERTS, 64),
                          seed=5)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    check_layer_matches_eager(layer, compiled, [48, 48, 20, 64])
    assert counter.frame_count <= 2, counter.frame_count


def dispatch_scale_combine(x, idx, w, did):
    """The ops alone, with exact arithmetic beside them (power-of-two scales, no rounding, no
    reduction), so that a compiler cannot change its bits: (the combined rows, the received
    weights)."""
    recv_x, recv_w, _, handle, _ = ops.dispatch(x, idx, w, did)
    return ops.combine(recv_x * 2, handle, did, x.shape[0]), recv_w * 4


def check_ops_match_eager(fn, did, sizes, device="cpu"):
    """fn against dispatch_scale_combine eagerly, over fresh inputs of each size: both results
    and the gradients of x and of the weights, bit for bit."""
    for i, num_tokens in enumerate(sizes):
        x, idx, w = inputs(num_tokens, seed=10 + i, device=device)
        grad_out = torch.randn((num_tokens, HIDDEN)).bfloat16().to(device)
        args = [(x.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
        results = []
        for f, (xi, wi) in zip((fn, dispatch_scale_combine), args):
            out, recv_w = f(xi, idx, wi, did)
            g = torch.Generator().manual_seed(40 + i)  # the same for both calls
            grad_w = torch.randn(recv_w.shape, generator=g).to(device)
            torch.autograd.backward([out, recv_w], [grad_out, grad_w])
            results.append((out, recv_w, xi.grad, wi.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b), num_tokens


def test_inductor_compiles_the_ops_and_keeps_their_bits():
    did = ops.register(dispatcher := moe.LocalDispatcher(EXPERTS))
    compiled = torch.compile(dispatch_scale_combine, fullgraph=True)
    check_ops_match_eager(compiled, did, [40, 23])
    del dispatcher


def test_inductor_compiles_the_layer_into_one_graph():
    """Inductor fuses the router's softmax and the experts' SwiGLU with other roundings than
    eager's kernels, so the compiled layer's bits differ from eager (by bf16 roundings) even
    where the ops' bits do not (the test above): this checks the whole layer compiles, runs
    forward and backward, and stays within those roundings."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = DroppingLayer(HIDDEN, EXPERTS, TOP_K, FFN, moe.LocalDispatcher(EXPERTS), seed=6)
    ref = copy.deepcopy(layer)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for num_tokens in (40, 25):
        x = torch.randn((num_tokens, HIDDEN)).bfloat16()
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = compiled(xa), ref(xb)
        ya.float().sum().backward()
        yb.float().sum().backward()
        assert torch.allclose(ya.float(), yb.float(), rtol=2e-2, atol=2e-2)
        assert torch.allclose(xa.grad.float(), xb.grad.float(), rtol=5e-2, atol=5e-2)
    assert counter.frame_count <= 2


# -- GPU: weft.ep at one rank ------------------------------------------------------------------
def ep_dispatcher(num_worst_tokens=0):
    import weft.ep

    return moe.EpDispatcher(weft.ep.Buffer(None, int(1e9)), EXPERTS, num_worst_tokens)


@needs_gpus(1)
@pytest.mark.parametrize("worst", [0, 64])
def test_opcheck_of_every_op_over_weft_ep(worst):
    opcheck_all(ep_dispatcher(worst), "cuda")


@needs_gpus(1)
def test_explain_over_weft_ep_finds_one_graph():
    layer = DroppingLayer(HIDDEN, EXPERTS, TOP_K, FFN, ep_dispatcher(), device="cuda", seed=1)
    explained = torch._dynamo.explain(layer)(torch.randn(40, HIDDEN, device="cuda").bfloat16())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
        explained.break_reasons


@needs_gpus(1)
@pytest.mark.parametrize("layer_cls", [moe.MoELayer, DroppingLayer])
def test_fullgraph_over_weft_ep_matches_eager_bit_for_bit(layer_cls):
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = layer_cls(HIDDEN, EXPERTS, TOP_K, FFN, ep_dispatcher(), device="cuda", seed=7)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    check_layer_matches_eager(layer, compiled, [40, 40, 17, 64, 33], device="cuda")
    assert counter.frame_count <= 2, counter.frame_count


@needs_gpus(1)
def test_inductor_over_weft_ep_keeps_the_ops_bits():
    did = ops.register(dispatcher := ep_dispatcher())
    compiled = torch.compile(dispatch_scale_combine, fullgraph=True)
    check_ops_match_eager(compiled, did, [40, 23], device="cuda")
    del dispatcher


@needs_gpus(1)
def test_cuda_graph_of_compiled_worst_case_ops_replays_new_inputs():
    """A worst-case dispatch waits on nothing on the host: the compiled ops are captured in a
    CUDA graph, and each replay with new inputs gives what the eager ops give."""
    num_tokens = 48
    dispatcher = ep_dispatcher(num_worst_tokens=num_tokens)
    did = ops.register(dispatcher)
    compiled = torch.compile(dispatch_scale_combine, backend="aot_eager", fullgraph=True)
    static = [t.clone() for t in inputs(num_tokens, seed=20, device="cuda")]
    compiled(*static, did)  # compiles and lays out the window outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(*static, did)
    # The eager reference: the same worst-case ops on a Buffer of their own (num_tokens rows,
    # padding rows included; an eager call on the captured Buffer would lay out another layout
    # and make the next replay refuse to run).
    reference_dispatcher = ep_dispatcher(num_worst_tokens=num_tokens)  # the registry's is weak
    reference = ops.register(reference_dispatcher)
    sent = 0
    for seed in range(3):
        fresh = inputs(num_tokens, seed=30 + seed, device="cuda")
        for captured, value in zip(static, fresh):
            captured.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        want = dispatch_scale_combine(*fresh, reference)
        for got, expected in zip(out, want):  # the combined rows, the received weights
            assert torch.equal(got, expected), seed
        # Independently of weft.ep: at one rank a token with a selection comes back as its
        # doubled row (one received row, scaled by 2, summed once), one without as zeros.
        x, idx, _ = fresh
        has_selection = (idx >= 0).any(dim=1, keepdim=True)
        assert torch.equal(out[0], torch.where(has_selection, 2 * x, 0)), seed
        sent += int((out[0] != 0).any(dim=1).sum())
    assert sent > 0  # rows came back: the comparisons were not of zeros alone


@needs_gpus(1)
def test_cuda_graph_capture_of_a_host_synced_dispatch_is_refused():
    """The host-synced dispatch reads its row count on the host: capturing the compiled layer
    raises the op's error instead of waiting for a kernel that has not run."""
    layer = moe.MoELayer(HIDDEN, EXPERTS, TOP_K, FFN, ep_dispatcher(), device="cuda", seed=8)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(40, HIDDEN, device="cuda").bfloat16()
    compiled(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA graph capture cannot wait"):
        with torch.cuda.graph(graph):
            compiled(x)
