"""weft.moe.NativeEpDispatcher: the dispatch in two halves (dispatch_begin launches, finish()
waits for the count and copies the rows out) against LocalDispatcher, the reference, element by
element; begin returns while the GPU is still busy; a finish on another stream; abandonment; and
the same bits as EpDispatcher (weft.ep's DeepEP-compatible Buffer) in a whole layer."""

import pytest

torch = pytest.importorskip("torch")

import weft  # noqa: E402
import weft.moe as moe  # noqa: E402
from conftest import needs_gpus  # noqa: E402

pytestmark = [pytest.mark.timeout(300), needs_gpus(1)]

EXPERTS, TOP_K, HIDDEN = 16, 4, 256


def _inputs(g, tokens, drop=True):
    """x, topk_idx (int64, distinct experts per token; with drop some slots -1 and some tokens
    selecting nothing), topk_weights."""
    x = torch.randn(tokens, HIDDEN, generator=g, device="cuda").bfloat16()
    idx = torch.rand(tokens, EXPERTS, generator=g, device="cuda").topk(TOP_K, dim=1).indices
    if drop:
        dropped = torch.rand(tokens, TOP_K, generator=g, device="cuda") < 0.2
        dropped[::7] = True  # every seventh token selects nothing
        idx = torch.where(dropped, -1, idx)
    w = torch.rand(tokens, TOP_K, generator=g, device="cuda")
    return x, idx, w


def _assert_same_dispatch(got, want):
    for i, (a, b) in enumerate(zip(got[:3], want[:3])):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert torch.equal(a, b), i
    assert got[4] == want[4]


def test_begin_and_finish_match_the_local_dispatcher_call_after_call():
    """300 back-to-back dispatch, combine (with weights) and cached dispatch calls, fresh inputs
    and token counts each time, every result against LocalDispatcher's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    d = moe.NativeEpDispatcher(None, EXPERTS, max_tokens=128)
    ref = moe.LocalDispatcher(EXPERTS)
    for i in range(300):
        tokens = int(torch.randint(1, 129, (1,), generator=g, device="cuda"))
        x, idx, w = _inputs(g, tokens, drop=i % 3 != 0)
        got = d.dispatch_begin(x, idx, w).finish()
        want = ref.dispatch(x, idx, w)
        _assert_same_dispatch(got, want)
        y = torch.randn(got[0].shape, generator=g, device="cuda").bfloat16()
        gw = torch.rand(got[2].shape, generator=g, device="cuda")
        out, cw = d.combine(y, got[3], weights=gw)
        want_out, want_cw = ref.combine(y, want[3], weights=gw)
        assert torch.equal(out, want_out) and torch.equal(cw, want_cw), i
        grad = torch.randn(x.shape, generator=g, device="cuda").bfloat16()
        assert torch.equal(d.dispatch_cached(grad, got[3]), ref.dispatch_cached(grad, want[3])), i


def test_begin_returns_while_the_gpu_is_busy_and_finish_waits_for_it():
    g = torch.Generator(device="cuda").manual_seed(1)
    d = moe.NativeEpDispatcher(None, EXPERTS, max_tokens=64)
    x, idx, w = _inputs(g, 64)
    d.dispatch(x, idx, w)  # the Buffer made, the kernels loaded
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the dispatch
    begun = d.dispatch_begin(x, idx, w)
    assert not torch.cuda.current_stream().query(), "dispatch_begin waited for the GPU"
    got = begun.finish()
    _assert_same_dispatch(got, moe.LocalDispatcher(EXPERTS).dispatch(x, idx, w))


def test_finish_on_another_stream_gives_the_same_results():
    """Begun on one stream (behind a sleep), finished on another, the next begin back on the
    first: every result right. (At one rank the kernel ends microseconds after its count is out,
    so a missing stream wait would rarely show here; the orderings are by construction.)"""
    g = torch.Generator(device="cuda").manual_seed(2)
    d = moe.NativeEpDispatcher(None, EXPERTS, max_tokens=64)
    ref = moe.LocalDispatcher(EXPERTS)
    other = torch.cuda.Stream()
    for _ in range(20):
        x, idx, w = _inputs(g, 64)
        torch.cuda._sleep(2_000_000)  # the begin's stream is behind the host
        begun = d.dispatch_begin(x, idx, w)
        with torch.cuda.stream(other):
            got = begun.finish()
        torch.cuda.current_stream().wait_stream(other)
        _assert_same_dispatch(got, ref.dispatch(x, idx, w))


def test_a_later_call_abandons_an_unfinished_dispatch():
    g = torch.Generator(device="cuda").manual_seed(3)
    d = moe.NativeEpDispatcher(None, EXPERTS, max_tokens=64)
    x, idx, w = _inputs(g, 64)
    first = d.dispatch_begin(x, idx, w)
    second = d.dispatch_begin(x, idx, w)
    with pytest.raises(weft.Error, match="abandoned"):
        first.finish()
    got = second.finish()
    with pytest.raises(weft.Error, match="finished already"):
        second.finish()
    third = d.dispatch_begin(x, idx, w)
    with pytest.raises(weft.Error, match="stale"):  # got's layout is no longer in place
        d.combine(got[0], got[3])
    with pytest.raises(weft.Error, match="abandoned"):  # by the combine, refused or not
        third.finish()


def test_bad_calls_are_refused():
    g = torch.Generator(device="cuda").manual_seed(4)
    with pytest.raises(ValueError, match="multiple"):
        moe.NativeEpDispatcher(None, 0, max_tokens=8)
    with pytest.raises(ValueError, match="max_tokens"):
        moe.NativeEpDispatcher(None, EXPERTS, max_tokens=0)
    d = moe.NativeEpDispatcher(None, EXPERTS, max_tokens=64)
    x, idx, w = _inputs(g, 64)
    with pytest.raises(weft.Error, match="no dispatch"):
        d.combine(x, None)
    d.dispatch(x, idx, w)
    with pytest.raises(weft.Error, match="hidden"):
        d.dispatch_begin(x[:, :128].contiguous(), idx, w)
    with pytest.raises(weft.Error):
        d.dispatch_begin(x, idx[:, :2].contiguous(), w)  # top-k differs from the Buffer's
    with pytest.raises(weft.Error):
        d.dispatch_begin(x.float(), idx, w)
    old = d.dispatch(x, idx, w)
    d.dispatch(x, idx, w)
    with pytest.raises(weft.Error, match="stale"):  # one layout at a time: the latest
        d.combine(old[0], old[3])


def test_a_layer_gives_the_bits_of_the_deepep_compatible_dispatcher():
    import weft.ep

    # One layer: the dispatcher holds one layout (its Buffer's latest), a layer's forward and
    # backward use it.
    kw = dict(num_layers=1, hidden=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, ffn=128,
              device="cuda", seed=9)
    a = moe.MoEModel(dispatcher=moe.EpDispatcher(weft.ep.Buffer(None, 0, max_tokens=256),
                                                 EXPERTS), **kw)
    b = moe.MoEModel(dispatcher=moe.NativeEpDispatcher(None, EXPERTS, max_tokens=256), **kw)
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(3):
        x = torch.randn(256, HIDDEN, generator=g, device="cuda").bfloat16()
        target = torch.randn(256, HIDDEN, generator=g, device="cuda").bfloat16()
        assert torch.equal(moe.train_step(a, x, target, lr=0.02),
                           moe.train_step(b, x, target, lr=0.02))
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
