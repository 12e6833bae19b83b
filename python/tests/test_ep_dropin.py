"""weft.ep as DeepEP V1 (commit 567632d) for the code that imports deep_ep, without a GPU: the
constructor's signature and refusals, registration under DeepEP's name, the handle as a tuple,
the config tables and rules, and what weft refuses with a message."""

import inspect
import textwrap

import pytest

torch = pytest.importorskip("torch")
import weft  # noqa: E402
import weft.ep  # noqa: E402
from weft.ep import buffer as ep_buffer  # noqa: E402
from weft.ep.native import event_of  # noqa: E402

from conftest import run_python  # noqa: E402

# deep_ep.Buffer.__init__'s parameters and defaults at DeepEP 567632d.
DEEPEP_INIT = [("group", inspect.Parameter.empty), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
               ("low_latency_mode", False), ("num_qps_per_rank", 24),
               ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
               ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False),
               ("comm", None)]
def test_the_constructor_takes_deepeps_parameters_in_deepeps_order():
    params = list(inspect.signature(weft.ep.Buffer.__init__).parameters.values())[1:]
    positional = [p for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == DEEPEP_INIT
    assert all(p.kind == p.KEYWORD_ONLY for p in params[len(positional):])


@pytest.mark.parametrize("args,kwargs,name", [
    ((None, int(1e9), 1 << 20), {}, "num_rdma_bytes"),
    ((None, int(1e9), 0, True, 24, False), {}, "allow_nvlink_for_low_latency_mode"),
    ((None, int(1e9), 0, False, 24, True, True), {}, "allow_mnnvl"),
    ((None, int(1e9), 0, False, 24, True, False, True), {}, "use_fabric"),
    ((None, int(1e9)), {"use_fabric": True}, "use_fabric"),
    ((None, int(1e9)), {"enable_shrink": True}, "enable_shrink"),
    ((None, int(1e9)), {"comm": object()}, "comm"),
    ((None, 0), {}, "num_nvl_bytes"),
    ((None, int(1e9)), {"recv_x_headroom": -0.5}, "recv_x_headroom"),
    ((None, int(1e9)), {"recv_x_headroom": "0.1"}, "recv_x_headroom"),
    ((None, int(1e9)), {"recv_x_headroom": True}, "recv_x_headroom"),
])
def test_what_weft_cannot_honour_is_a_weft_error_naming_the_parameter(args, kwargs, name):
    with pytest.raises(weft.Error, match=name):
        weft.ep.Buffer(*args, **kwargs)


def test_deepeps_test_arguments_pass_the_checks():
    # DeepEP's test_intranode.py: Buffer(group, int(2e9), 0, low_latency_mode=False,
    # num_qps_per_rank=1, explicitly_destroy=True, allow_mnnvl=False, use_fabric=False). Without
    # a GPU the first thing refused is the missing device, not an argument.
    if torch.cuda.is_available():
        pytest.skip("the GPU tests make this Buffer")
    with pytest.raises(weft.Error, match="CUDA GPU"):
        weft.ep.Buffer(None, int(2e9), 0, low_latency_mode=False, num_qps_per_rank=1,
                       explicitly_destroy=True, allow_mnnvl=False, use_fabric=False)


def test_register_as_deep_ep_names_weft_eps_own_objects():
    r = run_python("""
        import torch, weft.ep
        weft.ep.register_as_deep_ep()
        import deep_ep
        from deep_ep import Buffer, Config, EventOverlap
        from deep_ep.utils import EventHandle, EventOverlap as UtilsEventOverlap
        import deep_ep.utils as utils
        assert deep_ep is weft.ep
        assert Buffer is weft.ep.Buffer and Config is weft.ep.Config
        assert EventOverlap is UtilsEventOverlap is weft.ep.EventOverlap
        assert EventHandle is weft.ep.EventHandle and utils is weft.ep.utils
        assert deep_ep.topk_idx_t is torch.int64
        weft.ep.register_as_deep_ep()  # twice is fine
        print("ok")
    """, timeout_s=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_register_refuses_when_a_real_deep_ep_is_imported(tmp_path):
    (tmp_path / "deep_ep").mkdir()
    (tmp_path / "deep_ep" / "__init__.py").write_text("REAL = True\n")
    r = run_python(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import deep_ep, weft, weft.ep
        try:
            weft.ep.register_as_deep_ep()
        except weft.Error as e:
            print("refused:", e)
        assert sys.modules["deep_ep"].REAL
    """, timeout_s=120)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "already imported" in r.stdout


def test_the_runner_serves_a_script_and_the_processes_it_spawns(tmp_path):
    script = tmp_path / "uses_deep_ep.py"
    script.write_text(textwrap.dedent("""
        import sys
        import multiprocessing
        import deep_ep
        from deep_ep.utils import EventOverlap

        def child(q):
            import deep_ep as d
            q.put(d.__name__ + " " + str(d.Buffer is d.Buffer) + " " + d.utils.__name__)

        if __name__ == "__main__":
            assert sys.argv[1:] == ["--flag", "7"], sys.argv
            ctx = multiprocessing.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,))
            p.start()
            print(deep_ep.__name__, q.get(timeout=60))
            p.join(60)
            assert p.exitcode == 0
    """))
    r = run_python(f"""
        import runpy, sys
        sys.argv = ["as_deep_ep", {str(script)!r}, "--flag", "7"]
        runpy.run_module("weft.ep.as_deep_ep", run_name="__main__")
    """, timeout_s=180)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "weft.ep weft.ep True weft.ep.utils"


def _handle():
    layout = ep_buffer._Layout(0, (128, 8, 8), None, 5, 3, 0, None,
                               torch.tensor([[0, 4], [0, 1], [0, 0]], dtype=torch.int32))
    prefix = torch.tensor([[3]], dtype=torch.int32)
    in_rank = torch.ones((5, 1), dtype=torch.bool)
    return ep_buffer.Handle(prefix, in_rank, layout), prefix, in_rank


def test_the_handle_is_deepeps_tuple():
    handle, prefix, in_rank = _handle()
    assert isinstance(handle, tuple) and len(handle) == 6
    assert handle[0] is prefix and handle[-2] is in_rank
    assert handle[1] is None and handle[2] is None and handle[5] is None
    assert handle[3].tolist() == [4, 1, 0]  # recv_src_idx: the source token of each row
    a, b, c, d, e, f = handle
    assert a is prefix and e is in_rank
    assert handle[1:3] == (None, None)
    assert list(handle)[0] is prefix and tuple(handle)[4] is in_rank
    assert handle.num_tokens == 5


def test_the_config_tables_are_deepeps():
    weft.ep.Buffer.set_num_sms(24)
    try:
        for ranks, (send, recv) in {2: (24, 256), 4: (6, 256), 8: (6, 256)}.items():
            c = weft.ep.Buffer.get_dispatch_config(ranks)
            assert (c.num_sms, c.num_max_nvl_chunked_send_tokens,
                    c.num_max_nvl_chunked_recv_tokens) == (24, send, recv)
        for ranks, send in {2: 10, 4: 9, 8: 4}.items():
            assert weft.ep.Buffer.get_combine_config(ranks).num_max_nvl_chunked_send_tokens == send
        assert weft.ep.Buffer.get_dispatch_config(1).num_sms == 24  # weft: one GPU
        for bad in (3, 16, 0):
            with pytest.raises(weft.Error, match="unsupported number of EP ranks"):
                weft.ep.Buffer.get_dispatch_config(bad)
            with pytest.raises(weft.Error, match="unsupported number of EP ranks"):
                weft.ep.Buffer.get_combine_config(bad)
    finally:
        weft.ep.Buffer.set_num_sms(20)
    assert weft.ep.Buffer.num_sms == 20  # DeepEP's class attribute and default


def test_config_follows_deepeps_rules():
    assert weft.ep.Config(0).num_sms == 0  # DeepEP allows 0 (weft: every SM)
    c = weft.ep.Config(24, 8, 256)
    assert (c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (6, 258)
    for args in [(-2,), (24, 0, 256), (24, 256, 256), (24, 8, 256, 0), (24, 8, 256, 6, 6),
                 (24.0,), (True,)]:
        with pytest.raises(weft.Error, match="Config"):
            weft.ep.Config(*args)
    for bad in (3, -2, 2.0):
        with pytest.raises(weft.Error, match="even"):
            weft.ep.Buffer.set_num_sms(bad)


def test_is_sm90_compiled_tells_the_truth():
    archs = str(weft.info().get("cuda_architectures", ""))
    want = weft.info()["built_with_cuda"] and any(a.startswith("90") for a in archs.split(";"))
    assert weft.ep.Buffer.is_sm90_compiled() == want


def test_an_event_overlap_without_an_event_is_no_previous_event():
    assert event_of(None) == 0
    assert event_of(weft.ep.EventOverlap(None)) == 0
    with pytest.raises(weft.Error, match="previous_event must be an EventOverlap"):
        event_of(object())


@pytest.mark.parametrize("method", ["get_local_buffer_tensor", "internode_dispatch",
                                    "internode_combine", "low_latency_update_mask_buffer",
                                    "low_latency_query_mask_buffer",
                                    "low_latency_clean_mask_buffer"])
def test_what_weft_lacks_is_refused_with_what_to_use(method):
    buf = weft.ep.Buffer.__new__(weft.ep.Buffer)  # the refusals need no window
    with pytest.raises(weft.Error, match=method):
        getattr(buf, method)(torch.bfloat16)


def test_runtime_is_refused_with_what_to_use():
    buf = weft.ep.Buffer.__new__(weft.ep.Buffer)
    with pytest.raises(weft.Error, match="NativeBuffer"):
        buf.runtime


def test_layout_slots_refuse_to_share_a_dispatcher_that_keeps_layouts():
    from weft import moe

    class Stateful:
        keeps_layouts = True

    with pytest.raises(ValueError, match="keeps no layout"):
        moe.LayoutSlots.shared(Stateful(), 2)
    assert moe.LayoutSlots.shared(moe.LocalDispatcher(8), 2).num_layers == 2
