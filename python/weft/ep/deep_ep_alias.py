"""weft.ep under DeepEP's name: `register_as_deep_ep()` (the runner is weft.ep.as_deep_ep)."""

from __future__ import annotations

import os
import sys

from .. import Error

# A folder holding a `deep_ep` package that registers weft.ep when imported: on sys.path (and
# PYTHONPATH), it reaches the processes that a script starts (multiprocessing's spawn gives a
# child the parent's sys.path; a subprocess gets PYTHONPATH).
SHIM_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_as_deep_ep")


def register_as_deep_ep() -> None:
    """Makes `deep_ep` and `deep_ep.utils` name weft.ep and weft.ep.utils in this interpreter.
    Raises weft.Error if a real DeepEP is already imported (two EP libraries in one process
    would each own a buffer and a communicator)."""
    import weft.ep
    import weft.ep.utils

    current = sys.modules.get("deep_ep")
    if current is not None and current is not weft.ep and \
            not getattr(current, "_weft_shim", False):
        raise Error(f"register_as_deep_ep: a DeepEP is already imported "
                    f"({getattr(current, '__file__', current)!r}); register weft.ep before any "
                    f"import of deep_ep, in a process without DeepEP")
    sys.modules["deep_ep"] = weft.ep
    sys.modules["deep_ep.utils"] = weft.ep.utils
