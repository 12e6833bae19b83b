"""weft.hstu holds the HSTU benchmark's preset schedule (also reachable from weft.pipeline, where
it used to live) and the PyTorch training step over it; the preset needs neither torch nor numpy."""

import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_the_preset_is_weft_hstus_and_weft_pipeline_names_it_too():
    import weft.hstu
    import weft.pipeline
    assert weft.pipeline.hstu_schedule is weft.hstu.hstu_schedule
    assert weft.pipeline.hstu_variants is weft.hstu.hstu_variants
    assert weft.pipeline.HSTU_TASK_NAMES == weft.hstu.HSTU_TASK_NAMES
    assert len(weft.hstu.HSTU_TASK_NAMES) == 14
    assert weft.hstu.hstu_variant("full_split_d6") == ("full_split_d6", "d6", "full_split")
    s = weft.hstu.hstu_schedule(cascade="d6")
    assert [t.name for t in s.tasks] == list(weft.hstu.HSTU_TASK_NAMES)
    assert s.task("h2d").lookahead == 5
    with pytest.raises(AttributeError):
        weft.pipeline.no_such_name  # noqa: B018


@pytest.mark.timeout(120)
def test_importing_the_preset_loads_no_torch_and_no_step_module():
    code = ("import sys, weft.pipeline, weft.hstu; weft.pipeline.hstu_schedule; "
            "print(sorted(m for m in ('torch', 'numpy', 'weft.hstu.tasks', 'weft.hstu.step') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
