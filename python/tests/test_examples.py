"""The Python examples run as a user runs them."""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_gpus

EXAMPLES = Path(__file__).parents[2] / "examples" / "python"


@needs_gpus(1)
@pytest.mark.timeout(300)
def test_ep_moe_layer_example_runs():
    run = subprocess.run([sys.executable, str(EXAMPLES / "ep_moe_layer.py")],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "combine max |error|" in run.stdout


def _run_with_torch(example, expected):
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, str(EXAMPLES / example)],
                         capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    assert expected in run.stdout


@pytest.mark.timeout(300)
def test_pipeline_basic_example_runs_on_cpu():
    _run_with_torch("pipeline_basic.py", "200 steps, loss")


@pytest.mark.timeout(300)
def test_moe_pipeline_example_runs():
    _run_with_torch("moe_pipeline.py", "20 steps, pipelined == serial bit for bit")
