#pragma once
//! \file Every CUDA kernel (loom::kernels overloads taking the `cuda` backend); needs nvcc.
//! CUB (which the vocabulary-parallel kernels use) declares a global namespace `cuda`: code that
//! says `using namespace loom;` writes the backend as `loom::cuda`.

#include "loom/backend/cuda/adafactor.cuh"
#include "loom/backend/cuda/attention.cuh"
#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/elementwise.cuh"
#include "loom/backend/cuda/gelu.cuh"
#include "loom/backend/cuda/layernorm.cuh"
#include "loom/backend/cuda/matmul.cuh"
#include "loom/backend/cuda/matmul_gelu.cuh"
#include "loom/backend/cuda/optimizer_updates.cuh"
#include "loom/backend/cuda/reduction.cuh"
#include "loom/backend/cuda/residual.cuh"
#include "loom/backend/cuda/vocab_parallel.cuh"
