include(GoogleTest)

# weft_add_test(<name> SOURCES <files...> [LIBS <targets...>] [GPU] [TIMEOUT <seconds>] [LABELS ...])
#   One GoogleTest executable; each TEST becomes its own ctest entry (discovered before the run,
#   so a binary that cannot start on a machine shows up as a failure, not as zero tests).
#   Every test carries a timeout (default 120 s): a scheduler's bug shows up as a hang.
#   GPU: the test gets the label `gpu`; it must GTEST_SKIP() when the machine has too few GPUs.
function(weft_add_test name)
  cmake_parse_arguments(ARG "GPU" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  set(labels ${ARG_LABELS})
  if(ARG_GPU)
    list(APPEND labels gpu)
  else()
    list(APPEND labels cpu)
  endif()
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gtest_main GTest::gmock
                                        Threads::Threads weft_warnings)
  gtest_discover_tests(${name}
    DISCOVERY_MODE PRE_TEST
    DISCOVERY_TIMEOUT 60
    PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${labels}")
endfunction()
