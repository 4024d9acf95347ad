# Helpers of the example scripts run with cmake -P: TRAIN is the program, `common` its flags for
# every run of the script.

# Runs TRAIN with `common` and ARGN; fails the script if it fails; `out_var` gets its output.
function(train out_var)
  execute_process(COMMAND ${TRAIN} ${common} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${TRAIN} ${ARGN} failed (${rc}):\n${out}\n${err}")
  endif()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

# The last loss of a run's output ("-> 4.0173 over"), in units of 1e-4.
function(last_loss out_var text)
  if(NOT text MATCHES "-> ([0-9]+)\\.([0-9][0-9][0-9][0-9]) over")
    message(FATAL_ERROR "no final loss in:\n${text}")
  endif()
  math(EXPR value "${CMAKE_MATCH_1} * 10000 + 1${CMAKE_MATCH_2} - 10000")
  set(${out_var} ${value} PARENT_SCOPE)
endfunction()

# Fails unless the resumed run's last loss is the uninterrupted run's within 2e-4 (the printed 4
# decimals may differ in the last place from reassociation on another mesh); `what` says how
# the run was cut.
function(expect_resumed_loss whole resumed what)
  last_loss(expected "${whole}")
  last_loss(got "${resumed}")
  math(EXPR diff "${got} - ${expected}")
  if(diff GREATER 2 OR diff LESS -2)
    message(FATAL_ERROR "resumed run ends at loss ${got}e-4, the uninterrupted one at ${expected}e-4:\n${whole}\n${resumed}")
  endif()
  message(STATUS "uninterrupted ${expected}e-4, ${what} ${got}e-4")
endfunction()
