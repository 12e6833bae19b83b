"""weft: overlap communication with computation in multi-GPU training.

    import weft
    weft.info()          # what was built, the NCCL it was compiled against and the one loaded
    import weft.ep       # expert-parallel dispatch/combine (DeepEP V1's intranode API and a native one)
    import weft.pipeline # the lookahead pipeline engine with Python task bodies
    import weft.plan     # its planner: simulate a schedule, write the HTML report, draw a trace

`import weft` needs no torch and loads no NCCL; `weft.ep` needs torch and binds the NCCL torch
uses, refusing one of another version than weft was built against (weft/_nccl.py).
"""

from ._weft import Error  # a RuntimeError whose message starts with the C++ file:line

from . import _weft

__version__ = _weft.version()


def info() -> dict:
    """What this build of weft contains and which libraries it runs with.

    Keys: version, built_with_cuda; with CUDA also cuda_architectures, nccl_compiled,
    nccl_loaded and nccl_library (the libnccl.so.2 this process holds, torch's, or None: weft.ep
    needs it equal to nccl_compiled), nccl_bound (weft's NCCL calls are bound to it: import
    weft.ep does that), cuda_runtime (weft's own, linked statically), cuda_driver (None without a
    driver) and num_gpus.
    """
    return dict(_weft.info())


__all__ = ["Error", "info", "__version__"]
