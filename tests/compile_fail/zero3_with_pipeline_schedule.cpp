// expect: cannot run under a pipeline schedule
// ZeRO-3 gathers parameters and reduce-scatters gradients in every micro-batch's backward, which
// a pipeline schedule would repeat per micro-batch: a Trainer combining them does not compile
// (Zero<1>, the control, does).
#include "loom/loom.hpp"

#ifdef LOOM_COMPILE_FAIL
using Strategy = loom::Zero<3>;
#else
using Strategy = loom::Zero<1>;
#endif
using Trainer = loom::Trainer<loom::gpt2::Model<loom::cpu, float>, loom::AdamW, loom::OneFOneB, Strategy>;
[[maybe_unused]] constexpr std::size_t size = sizeof(Trainer);

int main() {}
