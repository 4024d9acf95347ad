# Runs mpi_run_failure under mpiexec and checks what every rank said:
#   cmake -DMPIEXEC=... -DFLAGS="..." -DRANKS=8 -DPROGRAM=... -P check_run_failure.cmake
# Passes when the job ended with a non-zero status, the culprit printed its exception, and every
# other rank printed that rank 1 failed (each line once per rank).
separate_arguments(flags UNIX_COMMAND "${FLAGS}")
execute_process(COMMAND ${MPIEXEC} -n ${RANKS} ${flags} ${PROGRAM}
                OUTPUT_VARIABLE output ERROR_VARIABLE errors RESULT_VARIABLE status TIMEOUT 100)
set(text "${output}${errors}")
message("${text}")
if(status EQUAL 0)
  message(FATAL_ERROR "the job succeeded although rank 1 threw")
endif()
if(NOT text MATCHES "rank 1: boom on purpose")
  message(FATAL_ERROR "rank 1 did not report its exception")
endif()
math(EXPR last "${RANKS} - 1")
foreach(rank RANGE 0 ${last})
  if(NOT rank EQUAL 1 AND NOT text MATCHES "rank ${rank}: loom: rank 1 failed: boom on purpose")
    message(FATAL_ERROR "rank ${rank} did not report that rank 1 failed")
  endif()
endforeach()
message("mpi_run_failure: every rank reported (exit status ${status})")
