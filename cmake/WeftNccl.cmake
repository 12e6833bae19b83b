# weft_find_nccl(MIN_VERSION <x.y.z> [EXACT] [CUDA_ROOT <dir>] [PYTHON <exe>] [PYTHON_FIRST])
#   Sets WEFT_NCCL_FOUND, and in the cache WEFT_NCCL_INCLUDE_DIR, WEFT_NCCL_LIBRARY,
#   WEFT_NCCL_VERSION (read from nccl.h) and WEFT_NCCL_ORIGIN (where it came from, in words).
#   The device API header nccl_device.h must sit beside nccl.h. EXACT: only that version will do
#   (the installed package: the library weft was built against).
#   Looked for, first found wins: NCCL_ROOT (CMake or environment variable); then the CUDA
#   toolkit folder and the Python environment of PYTHON (default: python3 on the PATH), the
#   Python environment first with PYTHON_FIRST. In a Python environment: the nvidia/nccl folder
#   beside its torch (where torch's own RPATH finds libnccl.so.2), then the module nvidia.nccl.
#   The search runs at every configure, so a changed environment is noticed.
# weft_add_nccl_target(<include dir> <library> <version>)
#   Defines the imported targets weft::nccl_headers and weft::nccl (also used by the installed
#   package config). Contract of weft::nccl_headers: its include folder precedes every other
#   folder that may hold an nccl.h (the CUDA toolkit's does, where NCCL was installed into it),
#   for C++ and for CUDA, and every translation unit that includes weft's NCCL headers checks
#   that the nccl.h the compiler found is this version (WEFT_NCCL_EXPECTED_VERSION_CODE).

function(_weft_nccl_version header out_var)
  file(STRINGS "${header}" _lines REGEX "^#define NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  set(_ver "")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part}[ \t]+([0-9]+)" _m "${_lines}")
    list(APPEND _ver "${CMAKE_MATCH_1}")
  endforeach()
  string(REPLACE ";" "." _ver "${_ver}")
  set(${out_var} "${_ver}" PARENT_SCOPE)
endfunction()

# The NCCL folders of a Python environment, best first, as "folder|what it is" entries. Without
# importing torch: its package folder is found by importlib, and its version read from its
# metadata. Run once as the caller's environment has it, and once isolated (-I): a build under
# pip's build isolation hides the target environment's packages only through environment
# variables, and the interpreter is the target environment's own.
function(_weft_python_nccl_candidates python out_var)
  set(_script [=[
import importlib.util, os
out = []
def meta(name):
    try:
        import importlib.metadata as md
        return md.version(name)
    except Exception:
        return "?"
spec = importlib.util.find_spec("torch")
if spec and spec.submodule_search_locations:
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    out.append((os.path.join(site, "nvidia", "nccl"), "torch " + meta("torch") + "'s nvidia/nccl"))
try:
    spec = importlib.util.find_spec("nvidia.nccl")
except Exception:
    spec = None
if spec and spec.submodule_search_locations:
    for p in spec.submodule_search_locations:
        out.append((p, "the Python module nvidia.nccl"))
print("\n".join(p + "|" + w for p, w in out))
]=])
  set(_all "")
  foreach(_flags "" "-I")
    execute_process(COMMAND "${python}" ${_flags} -c "${_script}"
      OUTPUT_VARIABLE _out OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND _out)
      string(REPLACE "\n" ";" _out "${_out}")
      list(APPEND _all ${_out})
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _all)
  set(${out_var} "${_all}" PARENT_SCOPE)
endfunction()

function(weft_find_nccl)
  cmake_parse_arguments(ARG "EXACT;PYTHON_FIRST" "CUDA_ROOT;MIN_VERSION;PYTHON" "" ${ARGN})

  set(_root_candidates "")
  if(DEFINED NCCL_ROOT AND NOT NCCL_ROOT STREQUAL "")
    list(APPEND _root_candidates "${NCCL_ROOT}|NCCL_ROOT")
  elseif(DEFINED ENV{NCCL_ROOT} AND NOT "$ENV{NCCL_ROOT}" STREQUAL "")
    list(APPEND _root_candidates "$ENV{NCCL_ROOT}|NCCL_ROOT (environment)")
  endif()
  set(_cuda_candidates "")
  if(ARG_CUDA_ROOT)
    list(APPEND _cuda_candidates "${ARG_CUDA_ROOT}|the CUDA toolkit")
  endif()
  set(_python "${ARG_PYTHON}")
  if(NOT _python)
    find_program(_weft_python3 python3)
    set(_python "${_weft_python3}")
  endif()
  set(_python_candidates "")
  if(_python)
    _weft_python_nccl_candidates("${_python}" _python_candidates)
  endif()
  if(ARG_PYTHON_FIRST)
    set(_candidates ${_root_candidates} ${_python_candidates} ${_cuda_candidates})
  else()
    set(_candidates ${_root_candidates} ${_cuda_candidates} ${_python_candidates})
  endif()

  foreach(_candidate IN LISTS _candidates)
    string(REGEX REPLACE "\\|.*$" "" _root "${_candidate}")
    string(REGEX REPLACE "^[^|]*\\|" "" _origin "${_candidate}")
    if(NOT EXISTS "${_root}/include/nccl.h" OR NOT EXISTS "${_root}/include/nccl_device.h")
      message(STATUS "weft: no nccl.h + nccl_device.h under ${_root}/include (${_origin})")
      continue()
    endif()
    find_library(_lib NAMES nccl libnccl.so.2 PATHS "${_root}/lib64" "${_root}/lib"
                 "${_root}/targets/x86_64-linux/lib" NO_DEFAULT_PATH NO_CACHE)
    if(NOT _lib)
      message(STATUS "weft: nccl.h under ${_root}/include but no libnccl beside it (${_origin})")
      continue()
    endif()
    _weft_nccl_version("${_root}/include/nccl.h" _ver)
    if(_ver VERSION_LESS ARG_MIN_VERSION OR (ARG_EXACT AND NOT _ver VERSION_EQUAL ARG_MIN_VERSION))
      set(_wanted "${ARG_MIN_VERSION} or newer")
      if(ARG_EXACT)
        set(_wanted "${ARG_MIN_VERSION}")
      endif()
      message(STATUS "weft: NCCL ${_ver} at ${_root} (${_origin}) is not ${_wanted}")
      unset(_lib)
      continue()
    endif()
    message(STATUS "weft: NCCL ${_ver} found: ${_root}/include, ${_lib} (${_origin})")
    set(WEFT_NCCL_INCLUDE_DIR "${_root}/include" CACHE PATH "NCCL include folder" FORCE)
    set(WEFT_NCCL_LIBRARY "${_lib}" CACHE FILEPATH "NCCL library" FORCE)
    set(WEFT_NCCL_VERSION "${_ver}" CACHE STRING "NCCL version read from nccl.h" FORCE)
    set(WEFT_NCCL_ORIGIN "${_origin}" CACHE STRING "Where the NCCL weft builds with came from" FORCE)
    set(WEFT_NCCL_FOUND ON PARENT_SCOPE)
    return()
  endforeach()
  set(WEFT_NCCL_FOUND OFF PARENT_SCOPE)
endfunction()

function(weft_add_nccl_target include_dir library version)
  if(TARGET weft::nccl)
    return()
  endif()
  string(REPLACE "." ";" _parts "${version}")
  list(GET _parts 0 _major)
  list(GET _parts 1 _minor)
  list(GET _parts 2 _patch)
  math(EXPR _code "${_major} * 10000 + ${_minor} * 100 + ${_patch}")
  # Not a system include folder: nvcc puts the toolkit's include folder on the search path as a
  # plain -I, ahead of every -isystem, so only a plain -I (which comes first) takes precedence
  # over an nccl.h there. NCCL's headers are therefore compiled with weft's warnings.
  add_library(weft::nccl_headers INTERFACE IMPORTED GLOBAL)
  set_target_properties(weft::nccl_headers PROPERTIES
    SYSTEM OFF
    INTERFACE_INCLUDE_DIRECTORIES "${include_dir}"
    INTERFACE_COMPILE_DEFINITIONS "WEFT_NCCL_EXPECTED_VERSION_CODE=${_code}")
  add_library(weft::nccl SHARED IMPORTED GLOBAL)
  set_target_properties(weft::nccl PROPERTIES
    IMPORTED_LOCATION "${library}"
    IMPORTED_NO_SONAME OFF
    INTERFACE_LINK_LIBRARIES weft::nccl_headers)
endfunction()
