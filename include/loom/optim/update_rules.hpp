#pragma once
//! \file Hyper-parameters of the element-wise optimizer update kernels, shared by every backend.

#include <cstdint>

namespace loom {

//! One AdamW update (PyTorch's formula, decoupled weight decay): `step` counts from 1.
struct AdamWUpdate {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  std::int64_t step = 1;
};

//! One SGD-with-momentum update (PyTorch's formula: weight decay added to the gradient).
struct SgdUpdate {
  double lr = 1e-2;
  double momentum = 0.9;
  double weight_decay = 0.0;
  bool nesterov = false;
};

//! The element-wise part of one Adafactor update, its per-tensor factors computed on the host:
//! p = p * decay - step * u, where u is the gradient over the root of its factored second moment.
struct AdafactorUpdate {
  double decay = 1.0;  //!< 1 - rho * weight_decay (decoupled weight decay)
  double step = 0.0;   //!< the step size over the update-clipping divisor
};

}  // namespace loom
