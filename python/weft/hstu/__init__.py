"""weft.hstu: the HSTU benchmark's preset schedule (schedule.py, also exported by weft.pipeline)
and an HSTU-shaped PyTorch training step over it, beside weft.moe:

    from weft.hstu import hstu_schedule, hstu_variant     # the preset (no torch needed)
    from weft.hstu.tasks import HstuConfig, HstuStep      # the step's task bodies (torch)
    from weft.hstu.data import ZipfLoader                 # its batches (numpy)
    from weft.hstu.variants import step_variants          # what it runs under
    from weft.hstu.step import run_once                   # one timed run
    from weft.hstu.planning import suggest_variant        # the planner's pick for measured costs

    step = HstuStep(config, group, device)
    engine = Engine(hstu_schedule(step.bodies(), cascade="d3"), "full_split", backend="torch")

Only the preset is imported here: the step's modules need torch and numpy, and weft.pipeline,
which imports this package, needs neither. bench/python/hstu_step.py is the benchmark over it
(docs/python.md).
"""

from .schedule import HSTU_TASK_NAMES, HstuVariant, hstu_schedule, hstu_variant, hstu_variants

__all__ = ["HSTU_TASK_NAMES", "HstuVariant", "hstu_schedule", "hstu_variant", "hstu_variants"]
