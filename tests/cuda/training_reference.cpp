#include "training_reference.hpp"

#include "support/parity.hpp"

namespace loom::test {

ParityRun cpu_reference_run(std::int64_t global_batch, std::int64_t seq, double clip) {
  return single_rank_run(global_batch, seq, clip);
}

}  // namespace loom::test
