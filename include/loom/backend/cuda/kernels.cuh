#pragma once
//! \file Every CUDA kernel (loom::kernels overloads taking the `cuda` backend); needs nvcc.

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/elementwise.cuh"
#include "loom/backend/cuda/gelu.cuh"
#include "loom/backend/cuda/layernorm.cuh"
#include "loom/backend/cuda/matmul.cuh"
#include "loom/backend/cuda/optimizer_updates.cuh"
#include "loom/backend/cuda/reduction.cuh"
#include "loom/backend/cuda/residual.cuh"
