# How loom's own tests launch MPI programs (tests/mpi, the MPI example tests): the flags mpiexec
# needs here (loom_mpiexec_flags) and the environment every MPI test runs with
# (loom_mpi_environment). For loom's build only; nothing of this reaches consumers.

# OpenMPI refuses to run as root, and refuses more ranks than cores, unless told otherwise: a
# container on a 2-core machine is both.
set(loom_mpiexec_flags "")
if(MPIEXEC_EXECUTABLE)
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE loom_mpiexec_version
                  ERROR_VARIABLE loom_mpiexec_version RESULT_VARIABLE loom_mpiexec_status)
  if(loom_mpiexec_version MATCHES "Open MPI|OpenRTE|open-mpi")
    list(APPEND loom_mpiexec_flags --oversubscribe)
    execute_process(COMMAND id -u OUTPUT_VARIABLE loom_user_id OUTPUT_STRIP_TRAILING_WHITESPACE
                    ERROR_QUIET)
    if(loom_user_id STREQUAL "0")
      list(APPEND loom_mpiexec_flags --allow-run-as-root)
    endif()
  endif()
endif()

# Environment of every MPI test. OpenMPI's shared-memory transport copies large messages with
# CMA (process_vm_readv). It works in this container, but Docker's default seccomp profile and
# ptrace-restricted hosts forbid it, and then every large message fails ("Read -1, expected
# ..."): "none" copies through OpenMPI's own shared buffers, which works everywhere. Ranks
# yield when idle because they outnumber the cores.
set(loom_mpi_environment
    OMPI_MCA_btl_vader_single_copy_mechanism=none
    OMPI_MCA_mpi_yield_when_idle=1)
