# Script mode (cmake -P). Fails with FATAL_ERROR at the first step that does not succeed.
function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
set(prefix "${WORK_DIR}/prefix")
run_step("install weft" ${CMAKE_COMMAND} --install "${WEFT_BUILD_DIR}" --prefix "${prefix}")
# The installed package names no library by the build machine's path: NCCL is found again where
# the package is used (and must be the version weft was built against).
file(GLOB_RECURSE package_files "${prefix}/lib*/cmake/weft/*.cmake")
foreach(package_file IN LISTS package_files)
  file(READ "${package_file}" package_text)
  if(package_text MATCHES "/[^ \"]*libnccl[^ \"]*")
    message(FATAL_ERROR "${package_file} hard-codes ${CMAKE_MATCH_0}")
  endif()
endforeach()
set(extra "")
if(CUDA_COMPILER)
  list(APPEND extra "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}"
                    "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}")
endif()
run_step("configure consumer" ${CMAKE_COMMAND} -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}/build"
         "-DCMAKE_PREFIX_PATH=${prefix}" ${extra})
run_step("build consumer" ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
run_step("run consumer" "${WORK_DIR}/build/consumer")
if(NOT step_output MATCHES "consumer ok")
  message(FATAL_ERROR "consumer printed: ${step_output}")
endif()
