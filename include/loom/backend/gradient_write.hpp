#pragma once
//! \file How a backward kernel writes an input gradient (loom::GradientWrite), for the kernels of
//! every backend. Device-clean: a plain enum the CUDA kernels take by value.

#include <cstdint>

namespace loom {

//! How a backward kernel writes the input gradient it computes: added to what the tensor holds
//! (accumulate, the default and the kernels' convention: see docs/kernels.md), or written over it
//! (overwrite: what the tensor held on entry, NaN included, is never read). A model whose input
//! gradient has one producer passes overwrite, which spares zeroing the tensor and reading it
//! back; the bits are those of accumulating into zeros.
enum class GradientWrite : std::uint8_t {
  accumulate,  //!< din += gradient
  overwrite,   //!< din = gradient
};

}  // namespace loom
