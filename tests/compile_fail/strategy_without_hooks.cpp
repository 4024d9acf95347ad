// expect: loom: the strategy's Engine does not offer the hooks the Trainer drives
// A Strategy tag whose Engine lacks the Trainer's hooks is rejected with a sentence.
#include "loom/loom.hpp"

struct BrokenStrategy {
  using loom_strategy = void;
  template <class B, class T>
  struct Engine {
#ifndef LOOM_COMPILE_FAIL
    Engine(const BrokenStrategy&, loom::EngineContext<B>) {}
    loom::ParameterView<const T> forward_params(int) { return {}; }
    void after_forward(int) {}
    loom::ParameterView<const T> backward_params(int) { return {}; }
    loom::ParameterView<T> backward_grads(int) { return {}; }
    void copy_parameters_to(T*) {}
    void load_parameters(const T*) {}
    void begin_step() {}
    void on_backward(int, bool) {}
    void finish_gradients() {}
    double global_sum(double x) { return x; }
    double grad_sum_of_squares(bool) { return 0; }
    template <class O>
    void update(const O&, double, std::int64_t, double) {}
#else
    Engine(const BrokenStrategy&, loom::EngineContext<B>) {}
#endif
  };
};

using Broken = loom::Trainer<loom::gpt2::Model<loom::cpu>, loom::AdamW, loom::GradientAccumulation,
                             BrokenStrategy>;
[[maybe_unused]] constexpr std::size_t size = sizeof(Broken);

int main() {}
