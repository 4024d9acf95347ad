// expect: splits each backward
// ZeroBubbleH1 needs a Model whose backward splits into backward_input and backward_weight. A
// Model wrapping GPT-2 that forwards only the plain Model members is rejected under it with a
// sentence, while the same wrapper trains under OneFOneB (the control).
#include <cstdint>
#include <vector>

#include "loom/loom.hpp"

//! GPT-2 seen through the Model concept only: no stash_elements, backward_input, backward_weight.
class WholeBackwardGpt {
 public:
  using loom_model = void;
  using backend_type = loom::cpu;
  using scalar_type = float;
  using Inner = loom::gpt2::Model<loom::cpu, float>;

  explicit WholeBackwardGpt(loom::gpt2::Config config) : inner_(config) {}

  const loom::ParameterLayout& layout() const noexcept { return inner_.layout(); }
  int num_layers() const noexcept { return inner_.num_layers(); }
  double layer_cost(int layer) const noexcept { return inner_.layer_cost(layer); }
  std::vector<loom::ElementRange> layer_parameters(int layer) const { return inner_.layer_parameters(layer); }
  std::int64_t hidden_elements(loom::MicroBatchShape s) const { return inner_.hidden_elements(s); }
  std::int64_t activation_elements(int layer, loom::MicroBatchShape s) const {
    return inner_.activation_elements(layer, s);
  }
  std::int64_t workspace_elements(int layer, loom::MicroBatchShape s) const {
    return inner_.workspace_elements(layer, s);
  }
  double flops_per_token(std::int64_t seq) const { return inner_.flops_per_token(seq); }
  double forward(loom::cpu& be, int layer, loom::ParameterView<const float> params,
                 const loom::ForwardArgs<float>& a) const {
    return inner_.forward(be, layer, params, a);
  }
  void backward(loom::cpu& be, int layer, loom::ParameterView<const float> params, loom::ParameterView<float> grads,
                const loom::BackwardArgs<float>& a) const {
    inner_.backward(be, layer, params, grads, a);
  }

 private:
  Inner inner_;
};

static_assert(loom::Model<WholeBackwardGpt>);
static_assert(!loom::SplitBackwardModel<WholeBackwardGpt>);

#ifdef LOOM_COMPILE_FAIL
using Schedule = loom::ZeroBubbleH1;
#else
using Schedule = loom::OneFOneB;
#endif
using Trainer = loom::Trainer<WholeBackwardGpt, loom::AdamW, Schedule, loom::DataParallel>;
[[maybe_unused]] constexpr std::size_t size = sizeof(Trainer);

int main() {}
