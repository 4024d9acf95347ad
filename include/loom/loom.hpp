#pragma once
//! \file The public surface of loom on the CPU backend: include this, or the headers you use.

#include "loom/backend/cpu/kernels.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/parameters.hpp"
#include "loom/core/rng.hpp"
#include "loom/core/tensor.hpp"
#include "loom/models/gpt2/config.hpp"
#include "loom/models/gpt2/model.hpp"
#include "loom/optim/adamw.hpp"
#include "loom/optim/lr_schedule.hpp"
#include "loom/optim/sgd.hpp"
#include "loom/parallel/single_rank.hpp"
#include "loom/parallel/trainer.hpp"
#include "loom/schedule/gradient_accumulation.hpp"
