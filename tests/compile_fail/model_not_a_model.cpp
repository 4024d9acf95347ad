// expect: loom_model
// A Trainer over a type that is not a Model (here a GPT-2 config) does not compile, and the
// diagnostic names the opt-in tag it lacks.
#include "loom/loom.hpp"

#ifdef LOOM_COMPILE_FAIL
using Wrong = loom::Trainer<loom::gpt2::Config, loom::AdamW>;
#else
using Wrong = loom::Trainer<loom::gpt2::Model<loom::cpu>, loom::AdamW>;
#endif
[[maybe_unused]] constexpr std::size_t size = sizeof(Wrong);

int main() {}
