// expect: cannot run under a pipeline schedule
// A strategy whose type says it cannot run under a pipeline schedule (supports_pipeline = false)
// does not compile into a Trainer with one; the control, the same strategy saying it can, does.
#include "loom/loom.hpp"

struct NoPipelineDataParallel : loom::DataParallel {
#ifdef LOOM_COMPILE_FAIL
  static constexpr bool supports_pipeline = false;
#else
  static constexpr bool supports_pipeline = true;
#endif
};
static_assert(loom::Strategy<NoPipelineDataParallel>);
using Trainer =
    loom::Trainer<loom::gpt2::Model<loom::cpu, float>, loom::AdamW, loom::OneFOneB, NoPipelineDataParallel>;
[[maybe_unused]] constexpr std::size_t size = sizeof(Trainer);

int main() {}
