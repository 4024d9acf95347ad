#pragma once
//! \file LOOM_HD: marks functions callable from host and device. Empty without nvcc, so index
//! maps, shard ranges and the RNG are plain C++ that CPU tests exercise directly.

#if defined(__CUDACC__)
#define LOOM_HD __host__ __device__
#else
#define LOOM_HD
#endif
