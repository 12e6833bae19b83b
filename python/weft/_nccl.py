"""The NCCL that weft.ep runs with: the one torch loads (docs/python.md, "How NCCL is found").

weft's extension links no libnccl: `import weft` loads none, and weft.pipeline and weft.plan
never need one. weft.ep binds NCCL once, when it is imported (`require()`):
- a process that holds a libnccl.so.2 already (torch, imported first, loaded its own): that one;
- otherwise the library torch loads: the nvidia/nccl/lib beside the torch package (torch's
  libraries find it through their RPATH, $ORIGIN/../../nvidia/nccl/lib), located without
  importing torch; failing that, the first nvidia/nccl/lib on sys.path (torch's own fallback).
  Loading it before torch is harmless: torch's import then finds the library it wants already
  loaded (the dynamic linker matches it by its soname), so the process holds one NCCL.
LD_LIBRARY_PATH and the CUDA toolkit play no part. Only the NCCL version weft was compiled
against is bound (its device API's structs are shared with the library verbatim); any other is
refused with a weft.Error that names both versions and the fix, and nothing is left loaded.
"""

import glob
import importlib.util
import os
import sys
from typing import List, Optional

from . import _weft
from ._weft import Error


def _dist_version(name: str) -> Optional[str]:
    try:
        import importlib.metadata as metadata
        return metadata.version(name)
    except Exception:
        return None


def torch_nccl_candidates() -> List[str]:
    """The libnccl.so.2 files torch would load, best first (none of them is loaded here)."""
    found: List[str] = []
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None):
        torch_dirs = [os.path.dirname(torch.__file__)]
    else:
        spec = importlib.util.find_spec("torch")
        torch_dirs = list(spec.submodule_search_locations or []) if spec else []
    for torch_dir in torch_dirs:
        found.append(os.path.join(os.path.dirname(os.path.abspath(torch_dir)), "nvidia", "nccl",
                                  "lib", "libnccl.so.2"))
    for entry in sys.path:
        found += sorted(glob.glob(os.path.join(entry or ".", "nvidia", "nccl", "lib",
                                               "libnccl.so.*[0-9]")))
    unique: List[str] = []
    for path in found:
        if os.path.isfile(path) and os.path.realpath(path) not in map(os.path.realpath, unique):
            unique.append(path)
    return unique


def require() -> Optional[str]:
    """Binds weft's NCCL calls (see the module's docstring); returns the library's path.

    A build without CUDA has nothing to bind (None). Raises weft.Error where the NCCL present is
    not the one weft was built against, or where there is none.
    """
    info = _weft.info()
    if not info["built_with_cuda"]:
        return None
    compiled = info["nccl_compiled"]
    candidates = torch_nccl_candidates()
    # With a libnccl.so.2 in the process, nccl_bind takes that one and ignores the path.
    result = _weft.nccl_bind(candidates[0] if candidates else "")
    if result["bound"]:
        return result["path"]
    torch_version = _dist_version("torch")
    torch_text = f"torch {torch_version}" if torch_version else "no torch"
    rebuild = ("rebuild weft in this environment, which builds it against the NCCL beside its torch: "
               "pip install --no-build-isolation --force-reinstall --no-deps <weft's source folder>")
    if result["version"] is not None and result["version"] != compiled:
        raise Error(
            f"weft.ep needs NCCL {compiled}, the version weft was built against, but the NCCL "
            f"here is {result['version']} ({result['path']}; {torch_text}): weft's kernels use "
            f"NCCL's device API, which must match the library exactly. To fix, {rebuild}; or use "
            f"a torch that ships NCCL {compiled} (docs/python.md lists them).")
    if result["path"]:
        raise Error(f"weft.ep could not load NCCL from {result['path']} ({torch_text}): "
                    f"{result['error']}")
    raise Error(
        f"weft.ep needs NCCL {compiled}, but this process holds no libnccl.so.2 and none was found "
        f"beside torch ({torch_text}; looked in the nvidia/nccl/lib beside torch and on sys.path): "
        f"install a CUDA build of torch (its PyPI wheels bring nvidia-nccl), or {rebuild}.")


__all__ = ["require", "torch_nccl_candidates"]
