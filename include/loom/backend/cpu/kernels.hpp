#pragma once
//! \file Every CPU kernel (loom::kernels overloads taking `const cpu&`).

#include "loom/backend/cpu/adafactor.hpp"
#include "loom/backend/cpu/attention.hpp"
#include "loom/backend/cpu/attention_decode.hpp"
#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/dropout.hpp"
#include "loom/backend/cpu/elementwise.hpp"
#include "loom/backend/cpu/embedding.hpp"
#include "loom/backend/cpu/gelu.hpp"
#include "loom/backend/cpu/layernorm.hpp"
#include "loom/backend/cpu/matmul.hpp"
#include "loom/backend/cpu/matmul_gelu.hpp"
#include "loom/backend/cpu/optimizer_updates.hpp"
#include "loom/backend/cpu/reduction.hpp"
#include "loom/backend/cpu/residual.hpp"
#include "loom/backend/cpu/softmax_cross_entropy.hpp"
#include "loom/backend/cpu/vocab_parallel.hpp"
