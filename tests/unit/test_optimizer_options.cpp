// The optimizers' hyper-parameters are checked when the optimizer is built: a value PyTorch
// refuses is refused here too, by name, before any step.
#include <doctest/doctest.h>

#include <string>

#include "loom/core/error.hpp"
#include "loom/optim/adafactor.hpp"
#include "loom/optim/adamw.hpp"
#include "loom/optim/sgd.hpp"

namespace test_optimizer_options {

using namespace loom;

namespace {
template <class Make>
std::string message_of(Make make) {
  try {
    make();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}
}  // namespace

TEST_CASE("AdamW: the options are checked when it is built") {
  CHECK(message_of([] { AdamW({.beta1 = 0.9, .beta2 = 0.999, .eps = 1e-6, .weight_decay = 0.01}); }) == "no error");
  CHECK(message_of([] { AdamW({.beta1 = 0.0, .beta2 = 0.0, .eps = 0.0, .weight_decay = 0.0}); }) == "no error");
  CHECK(message_of([] { AdamW({.beta1 = 1.0}); }) == "loom: AdamW: beta1: got 1; must be in [0, 1)");
  CHECK(message_of([] { AdamW({.beta1 = -0.1}); }) == "loom: AdamW: beta1: got -0.1; must be in [0, 1)");
  CHECK(message_of([] { AdamW({.beta2 = 1.5}); }) == "loom: AdamW: beta2: got 1.5; must be in [0, 1)");
  CHECK(message_of([] { AdamW({.eps = -1e-8}); }) == "loom: AdamW: eps: got -1e-08; must be >= 0");
  CHECK(message_of([] { AdamW({.weight_decay = -0.1}); }) == "loom: AdamW: weight_decay: got -0.1; must be >= 0");
  const AdamW adam({.beta2 = 0.999});
  CHECK(adam.options().beta2 == 0.999);
  CHECK(detail::to_text(adam.options()) == "{beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.1}");
}

TEST_CASE("SgdMomentum and Adafactor: the options are checked when they are built") {
  CHECK(message_of([] { SgdMomentum({.momentum = 0.0}); }) == "no error");
  CHECK(message_of([] { SgdMomentum({.momentum = -0.5}); }) == "loom: SgdMomentum: momentum: got -0.5; must be >= 0");
  CHECK(message_of([] { SgdMomentum({.weight_decay = -1}); }) ==
        "loom: SgdMomentum: weight_decay: got -1; must be >= 0");
  CHECK(message_of([] { SgdMomentum({.momentum = 0.0, .nesterov = true}); }) ==
        "loom: SgdMomentum: momentum: got 0; must be > 0 with nesterov");
  CHECK(message_of([] { Adafactor({.decay_rate = 0.0}); }).starts_with("loom: Adafactor: decay_rate: got 0"));
}

}  // namespace test_optimizer_options
