# cmake -DBUILD_DIR=<loom build> -DPREFIX=<dir> [-DCONFIG=<config>] -P InstallToPrefix.cmake
# Installs loom's "loom" install component into a fresh PREFIX (the package tests' fixture).
foreach(_var BUILD_DIR PREFIX)
  if(NOT ${_var})
    message(FATAL_ERROR "InstallToPrefix.cmake: ${_var} is not set")
  endif()
endforeach()

file(REMOVE_RECURSE "${PREFIX}")
set(_config_args "")
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}"
          --component loom ${_config_args}
  COMMAND_ECHO STDOUT
  RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  message(FATAL_ERROR "installing loom into ${PREFIX} failed (${_result})")
endif()

file(GLOB_RECURSE _configs "${PREFIX}/*/loomConfig.cmake")
if(NOT _configs)
  message(FATAL_ERROR "no loomConfig.cmake under ${PREFIX}")
endif()
message(STATUS "loom installed into ${PREFIX}: ${_configs}")
