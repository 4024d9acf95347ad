// expect: max_optimizer_state_slots
// An optimizer asking for more state slots than the flat optimizer-state buffer provides is
// not an Optimizer.
#include "loom/loom.hpp"

struct ThreeMoments {
  using loom_optimizer = void;
  struct Options {};
#ifdef LOOM_COMPILE_FAIL
  static constexpr int state_slots = 3;
#else
  static constexpr int state_slots = 2;
#endif
  Options options() const { return {}; }
};

using Trainer = loom::Trainer<loom::gpt2::Model<loom::cpu>, ThreeMoments>;
[[maybe_unused]] constexpr std::size_t size = sizeof(Trainer);

int main() {}
