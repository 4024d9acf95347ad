#pragma once
// The shape of one attention test case, shared by the CUDA attention tests.

#include <cstdint>
#include <ostream>

#include "loom/backend/detail/attention_checks.hpp"

namespace loom::cuda_test {

//! B batch elements of T tokens, NH heads of hs channels (C = NH hs).
struct AttentionCase {
  std::int64_t B, T, NH, hs;
  std::int64_t C() const { return NH * hs; }
  detail::attention::Dims dims() const { return {B, T, C(), NH, hs}; }
  friend std::ostream& operator<<(std::ostream& out, const AttentionCase& c) {
    return out << "B = " << c.B << ", T = " << c.T << ", NH = " << c.NH << ", hs = " << c.hs;
  }
};

}  // namespace loom::cuda_test
