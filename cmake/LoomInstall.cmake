# Installation and the exported package: headers, loom::loom, loomConfig.cmake (which defines
# loom::mpi, loom::cuda and loom::nccl per requested component), loomConfigVersion.cmake, and
# FindNCCL.cmake for the nccl component. Everything goes in the install component "loom".
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# Header-only and architecture-independent, so the package lives under share/.
set(LOOM_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/loom"
    CACHE STRING "Where loom's CMake package files are installed, relative to the prefix")
mark_as_advanced(LOOM_INSTALL_CMAKEDIR)

install(TARGETS loom EXPORT loomTargets COMPONENT loom)
install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        COMPONENT loom)
install(EXPORT loomTargets
        NAMESPACE loom::
        FILE loomTargets.cmake
        DESTINATION "${LOOM_INSTALL_CMAKEDIR}"
        COMPONENT loom)

configure_package_config_file(
  "${PROJECT_SOURCE_DIR}/cmake/loomConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/loomConfig.cmake"
  INSTALL_DESTINATION "${LOOM_INSTALL_CMAKEDIR}"
  NO_SET_AND_CHECK_MACRO
  NO_CHECK_REQUIRED_COMPONENTS_MACRO)
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/loomConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMajorVersion
  ARCH_INDEPENDENT)
install(FILES
          "${PROJECT_BINARY_DIR}/loomConfig.cmake"
          "${PROJECT_BINARY_DIR}/loomConfigVersion.cmake"
          "${PROJECT_SOURCE_DIR}/cmake/FindNCCL.cmake"
        DESTINATION "${LOOM_INSTALL_CMAKEDIR}"
        COMPONENT loom)
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE"
        DESTINATION "${CMAKE_INSTALL_DOCDIR}"
        COMPONENT loom)
