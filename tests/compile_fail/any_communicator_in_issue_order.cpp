// expect: AnyCommunicator cannot hold a communicator whose point-to-point runs in issue order
// AnyCommunicator refuses a communicator whose point-to-point runs in issue order (NCCL's): the
// pipeline executor reads that property from the communicator's type, and would not see it
// through the erasure. The control is the same communicator without the property.
#include "loom/comm/any.hpp"

struct InOrder : loom::CollectiveInterface<InOrder> {
  using loom_communicator = void;
#ifdef LOOM_COMPILE_FAIL
  static constexpr bool point_to_point_in_issue_order = true;
#endif
  int rank() const { return 0; }
  int size() const { return 1; }
  void run(const loom::CollectiveCall&) {}
  loom::Request start(const loom::CollectiveCall&) { return {}; }
  InOrder split(int, int) { return {}; }
};

int main() {
  loom::AnyCommunicator any{InOrder{}};
  return any.size() == 1 ? 0 : 1;
}
