# weft_find_nccl(CUDA_ROOT <dir> MIN_VERSION <x.y.z> [EXACT])
#   Sets WEFT_NCCL_FOUND, WEFT_NCCL_INCLUDE_DIR, WEFT_NCCL_LIBRARY, WEFT_NCCL_VERSION (cache).
#   The version is read from nccl.h; the device API header nccl_device.h must sit beside it.
#   EXACT: only that version will do (the installed package: the library weft was built against).
# weft_add_nccl_target(<include dir> <library>)
#   Defines the imported target weft::nccl (also used by the installed package config).

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

function(weft_find_nccl)
  cmake_parse_arguments(ARG "EXACT" "CUDA_ROOT;MIN_VERSION" "" ${ARGN})
  if(WEFT_NCCL_INCLUDE_DIR AND WEFT_NCCL_LIBRARY AND WEFT_NCCL_VERSION AND
     (NOT ARG_EXACT OR WEFT_NCCL_VERSION VERSION_EQUAL ARG_MIN_VERSION))
    set(WEFT_NCCL_FOUND ON PARENT_SCOPE)
    return()
  endif()

  set(_candidates "")
  if(DEFINED NCCL_ROOT)
    list(APPEND _candidates "${NCCL_ROOT}")
  elseif(DEFINED ENV{NCCL_ROOT})
    list(APPEND _candidates "$ENV{NCCL_ROOT}")
  endif()
  if(ARG_CUDA_ROOT)
    list(APPEND _candidates "${ARG_CUDA_ROOT}")
  endif()
  find_program(_weft_python3 python3)
  if(_weft_python3)
    execute_process(
      COMMAND "${_weft_python3}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _py_nccl OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _py_rc)
    if(_py_rc EQUAL 0 AND _py_nccl)
      list(APPEND _candidates "${_py_nccl}")
    endif()
  endif()

  foreach(_root IN LISTS _candidates)
    if(NOT EXISTS "${_root}/include/nccl.h" OR NOT EXISTS "${_root}/include/nccl_device.h")
      message(STATUS "weft: no nccl.h + nccl_device.h under ${_root}/include")
      continue()
    endif()
    find_library(_lib NAMES nccl libnccl.so.2 PATHS "${_root}/lib64" "${_root}/lib"
                 "${_root}/targets/x86_64-linux/lib" NO_DEFAULT_PATH NO_CACHE)
    if(NOT _lib)
      message(STATUS "weft: nccl.h under ${_root}/include but no libnccl beside it")
      continue()
    endif()
    _weft_nccl_version("${_root}/include/nccl.h" _ver)
    if(_ver VERSION_LESS ARG_MIN_VERSION OR (ARG_EXACT AND NOT _ver VERSION_EQUAL ARG_MIN_VERSION))
      set(_wanted "${ARG_MIN_VERSION} or newer")
      if(ARG_EXACT)
        set(_wanted "${ARG_MIN_VERSION}")
      endif()
      message(STATUS "weft: NCCL ${_ver} at ${_root} is not ${_wanted}")
      unset(_lib)
      continue()
    endif()
    message(STATUS "weft: NCCL ${_ver} found: ${_root}/include, ${_lib}")
    set(WEFT_NCCL_INCLUDE_DIR "${_root}/include" CACHE PATH "NCCL include folder" FORCE)
    set(WEFT_NCCL_LIBRARY "${_lib}" CACHE FILEPATH "NCCL library" FORCE)
    set(WEFT_NCCL_VERSION "${_ver}" CACHE STRING "NCCL version read from nccl.h" FORCE)
    set(WEFT_NCCL_FOUND ON PARENT_SCOPE)
    return()
  endforeach()
  set(WEFT_NCCL_FOUND OFF PARENT_SCOPE)
endfunction()

function(weft_add_nccl_target include_dir library)
  if(TARGET weft::nccl)
    return()
  endif()
  add_library(weft::nccl SHARED IMPORTED GLOBAL)
  set_target_properties(weft::nccl PROPERTIES
    IMPORTED_LOCATION "${library}"
    IMPORTED_NO_SONAME OFF
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${include_dir}"
    INTERFACE_INCLUDE_DIRECTORIES "${include_dir}")
endfunction()
