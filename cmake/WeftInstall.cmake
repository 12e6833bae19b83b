# Installs the headers, the libraries and a package config so that a downstream project can say
#   find_package(weft REQUIRED)  and link  weft::core  (and weft::cuda when it was built).
include(CMakePackageConfigHelpers)

install(DIRECTORY include/weft TYPE INCLUDE)
set(_weft_targets weft_core)
if(WEFT_ENABLE_CUDA)
  list(APPEND _weft_targets weft_cuda)
endif()
install(TARGETS ${_weft_targets} EXPORT weftTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT weftTargets NAMESPACE weft:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/weft)
configure_package_config_file(cmake/weftConfig.cmake.in
  "${CMAKE_CURRENT_BINARY_DIR}/weftConfig.cmake"
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/weft)
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/weftConfigVersion.cmake"
  COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/weftConfig.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/weftConfigVersion.cmake"
              cmake/WeftNccl.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/weft)
