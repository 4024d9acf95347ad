# FindNCCL
# --------
# Finds NVIDIA's collective communications library (NCCL).
#
# Imported target:
#   NCCL::NCCL          the library and its include directory (CUDA's runtime is not added;
#                       link CUDA::cudart, or loom::cuda, beside it)
# Result variables:
#   NCCL_FOUND, NCCL_VERSION, NCCL_INCLUDE_DIRS, NCCL_LIBRARIES
# Cache variables:
#   NCCL_INCLUDE_DIR, NCCL_LIBRARY
# Hints:
#   NCCL_ROOT (CMake or environment variable), NCCL_HOME, CUDA_PATH, CUDAToolkit_ROOT, the
#   CUDA toolkit that FindCUDAToolkit found, /usr/local/cuda, then the standard prefixes.

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME})
set(_nccl_paths ${CUDAToolkit_ROOT} $ENV{CUDAToolkit_ROOT} $ENV{CUDA_PATH} /usr/local/cuda /opt/cuda)
if(CUDAToolkit_LIBRARY_ROOT)
  list(APPEND _nccl_paths "${CUDAToolkit_LIBRARY_ROOT}")
endif()

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
  PATHS ${_nccl_paths}
  PATH_SUFFIXES include)

# The shared library: the static one needs its own list of system libraries.
find_library(NCCL_LIBRARY
  NAMES nccl
  HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
  PATHS ${_nccl_paths}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu
                targets/x86_64-linux/lib targets/sbsa-linux/lib)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_nccl_part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*#define NCCL_${_nccl_part}[ \t]+([0-9]+).*" "\\1"
           NCCL_VERSION_${_nccl_part} "${_nccl_version_lines}")
  endforeach()
  if(NCCL_VERSION_MAJOR MATCHES "^[0-9]+$" AND NCCL_VERSION_MINOR MATCHES "^[0-9]+$"
     AND NCCL_VERSION_PATCH MATCHES "^[0-9]+$")
    set(NCCL_VERSION "${NCCL_VERSION_MAJOR}.${NCCL_VERSION_MINOR}.${NCCL_VERSION_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  set(NCCL_LIBRARIES "${NCCL_LIBRARY}")
  if(NOT TARGET NCCL::NCCL)
    add_library(NCCL::NCCL UNKNOWN IMPORTED)
    set_target_properties(NCCL::NCCL PROPERTIES
      IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()

mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
unset(_nccl_hints)
unset(_nccl_paths)
unset(_nccl_version_lines)
unset(_nccl_part)
