# cmake -DSOURCE_DIR=<consumer> -DBINARY_DIR=<dir> -DINITIAL_CACHE=<file> -DGENERATOR=<gen>
#       [-DCONFIG=<config>] [-DCTEST_COMMAND=<ctest>] [-DOPTION=-D...] [-DEXPECT=success|configure-failure]
#       [-DEXPECT_OUTPUT=<regex>] -P RunConsumer.cmake
#
# Configures a consumer project from scratch with the compiler, flags and search paths of the
# loom build (INITIAL_CACHE), then either builds it and runs its ctest (EXPECT=success, the
# default), or checks that configuring fails (EXPECT=configure-failure). EXPECT_OUTPUT, when
# given, must match the configure output.
foreach(_var SOURCE_DIR BINARY_DIR INITIAL_CACHE GENERATOR)
  if(NOT ${_var})
    message(FATAL_ERROR "RunConsumer.cmake: ${_var} is not set")
  endif()
endforeach()
if(NOT EXPECT)
  set(EXPECT success)
endif()

file(REMOVE_RECURSE "${BINARY_DIR}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${BINARY_DIR}" -G "${GENERATOR}"
          -C "${INITIAL_CACHE}" ${OPTION}
  RESULT_VARIABLE _result
  OUTPUT_VARIABLE _output
  ERROR_VARIABLE _output)
message("${_output}")

# CMake wraps long messages, so match against the output with whitespace runs made single spaces.
string(REGEX REPLACE "[ \t\r\n]+" " " _flat_output "${_output}")
if(EXPECT_OUTPUT AND NOT _flat_output MATCHES "${EXPECT_OUTPUT}")
  message(FATAL_ERROR "the consumer's configure output does not match '${EXPECT_OUTPUT}'")
endif()

if(EXPECT STREQUAL "configure-failure")
  if(_result EQUAL 0)
    message(FATAL_ERROR "configuring ${SOURCE_DIR} succeeded but was expected to fail")
  endif()
  message(STATUS "configuring the consumer failed, as expected")
  return()
elseif(NOT EXPECT STREQUAL "success")
  message(FATAL_ERROR "RunConsumer.cmake: EXPECT must be success or configure-failure")
endif()

if(NOT _result EQUAL 0)
  message(FATAL_ERROR "configuring the consumer ${SOURCE_DIR} failed (${_result})")
endif()

set(_config_args "")
if(CONFIG)
  set(_config_args --config "${CONFIG}")
endif()
execute_process(
  COMMAND "${CMAKE_COMMAND}" --build "${BINARY_DIR}" ${_config_args}
  COMMAND_ECHO STDOUT
  RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  message(FATAL_ERROR "building the consumer ${SOURCE_DIR} failed (${_result})")
endif()

set(_ctest_config "")
if(CONFIG)
  set(_ctest_config -C "${CONFIG}")
endif()
if(NOT CTEST_COMMAND)
  get_filename_component(_cmake_bin_dir "${CMAKE_COMMAND}" DIRECTORY)
  set(CTEST_COMMAND "${_cmake_bin_dir}/ctest")
endif()
execute_process(
  COMMAND "${CTEST_COMMAND}" --test-dir "${BINARY_DIR}" ${_ctest_config} --verbose --no-tests=error
  COMMAND_ECHO STDOUT
  RESULT_VARIABLE _result)
if(NOT _result EQUAL 0)
  message(FATAL_ERROR "running the consumer ${SOURCE_DIR} failed (${_result})")
endif()
