"""weft.ep under DeepEP's name, for code that imports `deep_ep`.

In a script, one line before the code that imports deep_ep:

    import weft.ep; weft.ep.register_as_deep_ep()

or run an unchanged script (its spawned worker processes included) with

    python -m weft.ep.as_deep_ep script.py [args...]

Either way `import deep_ep`, `from deep_ep import Buffer, Config, EventOverlap`,
`from deep_ep.utils import EventHandle, EventOverlap` and `deep_ep.topk_idx_t` resolve to weft.ep's
own objects (the same module and classes, not copies).
"""

from __future__ import annotations

import os
import runpy
import sys

from .deep_ep_alias import SHIM_PATH, register_as_deep_ep


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m weft.ep.as_deep_ep script.py [args...]\n"
              "Runs script.py with `import deep_ep` resolving to weft.ep (in the processes it "
              "spawns too).")
        sys.exit(0 if argv else 2)
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = SHIM_PATH + (os.pathsep + path if path else "")
    sys.path.insert(0, SHIM_PATH)
    register_as_deep_ep()
    script = argv[0]
    sys.argv = argv
    # The script's folder first on sys.path, as `python script.py` would have it.
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
