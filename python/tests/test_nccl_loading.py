"""One NCCL in the process, torch's, whichever of weft and torch is imported first; the extension
depends on no library of the machine that built it; a weft built against another NCCL refuses
weft.ep alone. Each import order runs in a fresh interpreter (the order is the point). No GPU
needed. docs/python.md ("How NCCL is found") states what is checked here."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import weft

info = weft.info()
needs_cuda_build = pytest.mark.skipif(not info["built_with_cuda"], reason="a build without CUDA")
torch_spec = __import__("importlib.util").util.find_spec("torch")
needs_torch = pytest.mark.skipif(torch_spec is None, reason="no torch in this environment")

# The libraries a Linux extension may need from the machine it runs on (glibc's own).
GLIBC_LIBRARIES = {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                   "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def torch_nccl_dir():
    """The nvidia/nccl folder beside torch (where torch's RPATH finds libnccl.so.2), or None."""
    if torch_spec is None:
        return None
    site = os.path.dirname(list(torch_spec.submodule_search_locations)[0])
    path = os.path.join(site, "nvidia", "nccl")
    return path if os.path.isfile(os.path.join(path, "include", "nccl.h")) else None


def header_version(nccl_dir):
    text = open(os.path.join(nccl_dir, "include", "nccl.h")).read()
    parts = [re.search(rf"#define NCCL_{p}\s+(\d+)", text).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def matches_environment():
    return torch_nccl_dir() is not None and header_version(torch_nccl_dir()) == info.get(
        "nccl_compiled")


PROBE = textwrap.dedent("""
    import json, sys
    out = {"errors": {}}
    for name in sys.argv[1].split(","):
        try:
            __import__(name)
        except Exception as e:
            out["errors"][name] = f"{type(e).__name__}: {e}"
    import weft
    out["info"] = weft.info()
    if "torch" in sys.modules:
        import torch
        out["torch_nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    with open("/proc/self/maps") as f:
        out["maps"] = sorted({l.split(None, 5)[5].strip() for l in f if len(l.split(None, 5)) == 6})
    print("PROBE" + json.dumps(out))
""")


def probe(order, env=None):
    """Imports the modules of order (comma-separated) in a fresh interpreter; what it saw."""
    run = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    line = [l for l in run.stdout.splitlines() if l.startswith("PROBE")][-1]
    return json.loads(line[len("PROBE"):])


def nccl_files(maps):
    return sorted({os.path.realpath(p) for p in maps if "libnccl" in os.path.basename(p)})


def toolkit_roots():
    """The CUDA toolkit folders of this machine, if any (nothing of theirs may be loaded)."""
    roots = set()
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            roots.add(os.path.realpath(os.environ[var]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.add(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    if os.path.isdir("/usr/local/cuda"):
        roots.add(os.path.realpath("/usr/local/cuda"))
    return roots


def test_extension_depends_on_no_library_of_the_build_machine():
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("no readelf")
    so = weft._weft.__file__
    dynamic = subprocess.run([readelf, "-d", so], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
    assert needed <= GLIBC_LIBRARIES, f"{so} needs {needed - GLIBC_LIBRARIES}"
    assert not re.search(r"\((RPATH|RUNPATH)\)", dynamic), dynamic
    symbols = subprocess.run([readelf, "--dyn-syms", "-W", so], capture_output=True, text=True,
                             check=True).stdout
    undefined = re.findall(r"\bUND\s+(\S+)", symbols)
    foreign = [s for s in undefined if re.match(r"(nccl|cuda|cu[A-Z]|cublas)", s)]
    assert not foreign, f"{so} leaves undefined: {foreign}"


@needs_cuda_build
@needs_torch
def test_built_against_the_nccl_beside_torch():
    if torch_nccl_dir() is None:
        pytest.skip("torch brings no nvidia/nccl here")
    if os.environ.get("WEFT_TEST_CROSS_NCCL"):
        pytest.skip("this weft was built for another environment on purpose")
    assert info["nccl_compiled"] == header_version(torch_nccl_dir())


@needs_cuda_build
@needs_torch
@pytest.mark.parametrize("order", ["weft,torch", "torch,weft", "weft.ep,torch", "torch,weft.ep",
                                   "weft.pipeline,weft.plan,weft.ep,torch"])
def test_one_nccl_whichever_is_imported_first(order):
    if torch_nccl_dir() is None:
        pytest.skip("torch brings no nvidia/nccl here")
    # The toolkit's lib folder (with an NCCL of its own on this CI machine) on LD_LIBRARY_PATH
    # must change nothing.
    env = dict(os.environ)
    toolkit_libs = [os.path.join(r, d) for r in toolkit_roots() for d in ("lib64", "lib")]
    env["LD_LIBRARY_PATH"] = ":".join(toolkit_libs + [env.get("LD_LIBRARY_PATH", "")])
    seen = probe(order, env)
    torch_nccl = os.path.realpath(os.path.join(torch_nccl_dir(), "lib", "libnccl.so.2"))
    assert "torch" not in seen["errors"], seen["errors"]
    assert nccl_files(seen["maps"]) == [torch_nccl], "one NCCL, torch's"
    assert os.path.realpath(seen["info"]["nccl_library"]) == torch_nccl
    assert seen["info"]["nccl_loaded"] == seen["torch_nccl"]
    for root in toolkit_roots():
        # The driver (libcuda, libnvidia-*) may live under a toolkit's compat/ folder: it is the
        # machine's, not something weft or torch ships.
        loaded = [p for p in seen["maps"] if os.path.realpath(p).startswith(root + os.sep) and
                  not re.match(r"lib(cuda|nvidia-)", os.path.basename(p))]
        assert not loaded, f"libraries of the CUDA toolkit at {root} were loaded: {loaded}"
    if "weft.ep" in order and matches_environment():
        assert not seen["errors"], seen["errors"]
        assert seen["info"]["nccl_bound"] and seen["info"]["nccl_loaded"] == info["nccl_compiled"]


@needs_cuda_build
def test_weft_alone_loads_no_nccl():
    seen = probe("weft.pipeline,weft.plan")
    assert nccl_files(seen["maps"]) == []
    assert seen["info"]["nccl_loaded"] is None and not seen["info"]["nccl_bound"]


@needs_cuda_build
@needs_torch
@pytest.mark.parametrize("order", ["weft.ep,torch", "torch,weft.ep"])
def test_a_weft_built_against_another_nccl_refuses_weft_ep_alone(order):
    if torch_nccl_dir() is None:
        pytest.skip("torch brings no nvidia/nccl here")
    if matches_environment():
        pytest.skip("weft was built against this environment's NCCL (scripts/test.sh runs this "
                    "test with a weft built for another torch)")
    torch_version = header_version(torch_nccl_dir())
    code = textwrap.dedent(f"""
        import sys
        error = None
        for name in {order.split(",")!r}:
            try:
                __import__(name)
            except Exception as e:
                error = e
        import torch, weft
        assert isinstance(error, weft.Error), repr(error)
        message = str(error)
        for part in ({info['nccl_compiled']!r}, {torch_version!r}, "rebuild"):
            assert part in message, (part, message)
        assert torch.cuda.nccl.version() >= (2, 0, 0)
        x = torch.ones(3) * 2                 # torch keeps working
        from weft import pipeline, plan       # and so do weft.pipeline and weft.plan
        assert len(pipeline.hstu_variants()) == 9
        plan.simulate("full_split_d3")
        assert not weft.info()["nccl_bound"]
        print("REFUSED " + message)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "REFUSED" in run.stdout
