# Finds loom's required and optional dependencies. Each optional one can be switched off with
# CMake's own -DCMAKE_DISABLE_FIND_PACKAGE_<Name>=ON (MPI, CUDAToolkit, NCCL, OpenMP).
include(GNUInstallDirs)

# Required: Eigen (the CPU kernels) and threads (the threads communicator, the CPU backend).
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(Threads REQUIRED)

# OpenMP where the compiler has it; the installed config asks for it only if it was used here.
find_package(OpenMP COMPONENTS CXX)
set(LOOM_USES_OPENMP OFF)
if(OpenMP_CXX_FOUND)
  set(LOOM_USES_OPENMP ON)
endif()

# MPI -> loom::mpi.
find_package(MPI COMPONENTS CXX)

# CUDA toolkit (runtime, cuBLAS, cuBLASLt) -> loom::cuda; NCCL on top of it -> loom::nccl.
# Only the toolkit's libraries are needed for these targets; nvcc is not.
find_package(CUDAToolkit)
if(CUDAToolkit_FOUND)
  find_package(NCCL)
endif()

# The CUDA language is for loom's own CUDA sources (tests, examples, benchmarks). It is on by
# default when nvcc is there and loom is the top-level project; a project that adds loom with
# add_subdirectory() decides about CUDA itself.
set(_loom_cuda_default OFF)
if(LOOM_TOP_LEVEL AND CUDAToolkit_NVCC_EXECUTABLE)
  set(_loom_cuda_default ON)
endif()
option(LOOM_ENABLE_CUDA "Enable the CUDA language for loom's own CUDA sources" ${_loom_cuda_default})
unset(_loom_cuda_default)

set(LOOM_CUDA_LANGUAGE OFF)
if(LOOM_ENABLE_CUDA)
  # check_language() tries the compiler in a child project; point it at the nvcc that
  # FindCUDAToolkit found when nothing else names one.
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND CUDAToolkit_NVCC_EXECUTABLE)
    set(ENV{CUDACXX} "${CUDAToolkit_NVCC_EXECUTABLE}")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    set(LOOM_CUDA_LANGUAGE ON)
  else()
    message(WARNING "loom: LOOM_ENABLE_CUDA is ON but no working CUDA compiler was found; "
                    "CUDA sources will not be built (set CMAKE_CUDA_COMPILER or "
                    "-DLOOM_ENABLE_CUDA=OFF)")
  endif()
endif()
