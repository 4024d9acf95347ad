// Optimizer update kernels: AdamW and SGD with momentum against scalar transcriptions of
// torch.optim's formulas over several steps, the first-step size, checks and determinism.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/backend/cpu/optimizer_updates.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_optimizer_updates {

namespace {

using loom::AdamWUpdate;
using loom::SgdUpdate;
using loom::Tensor;
using loom::cpu;

using loom::test::tolerance;

//! torch.optim.AdamW, one parameter, in double.
struct ScalarAdamW {
  double p, m = 0, v = 0;
  void step(double g, const AdamWUpdate& h) {
    p = p - h.lr * h.weight_decay * p;
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    const double m_hat = m / (1 - std::pow(h.beta1, static_cast<double>(h.step)));
    const double v_hat = v / (1 - std::pow(h.beta2, static_cast<double>(h.step)));
    p = p - h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
  }
};

//! torch.optim.SGD with momentum (no dampening), one parameter, in double.
struct ScalarSgd {
  double p, buf = 0;
  bool first = true;
  void step(double g, const SgdUpdate& h) {
    const double d = g + h.weight_decay * p;
    buf = first ? d : h.momentum * buf + d;  // torch starts the buffer at d
    first = false;
    p -= h.lr * (h.nesterov ? d + h.momentum * buf : buf);
  }
};

//! Gradients of step s (1-based) for n parameters.
template <class T>
std::vector<T> grads_of_step(std::size_t n, int s) {
  return loom::test::random_vector<T>(n, 100 + s, -2.0, 2.0);
}

}  // namespace

TEST_CASE_TEMPLATE("adamw_update matches torch's formula over three steps", T, float, double) {
  const cpu one(1), two(2);
  // 7 values; 100003 values spans many chunks, a ragged one and two threads.
  for (std::size_t n : {std::size_t{7}, std::size_t{100003}}) {
    for (double wd : {0.0, 0.1}) {
      CAPTURE(n);
      CAPTURE(wd);
      for (const cpu* be : {&one, &two}) {
        CAPTURE(be->threads());
        auto p = loom::test::random_vector<T>(n, 1);
        std::vector<T> m(n, T(0)), v(n, T(0));
        std::vector<ScalarAdamW> ref(n);
        for (std::size_t i = 0; i < n; ++i) ref[i].p = static_cast<double>(p[i]);
        for (int s = 1; s <= 3; ++s) {
          const AdamWUpdate h{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = wd, .step = s};
          const auto g = grads_of_step<T>(n, s);
          // Any shapes with equal element counts.
          loom::kernels::adamw_update<T>(*be, Tensor<T>(p.data(), {static_cast<std::int64_t>(n)}),
                                         Tensor<const T>(g.data(), {1, static_cast<std::int64_t>(n)}),
                                         Tensor<T>(m.data(), {static_cast<std::int64_t>(n), 1}),
                                         Tensor<T>(v.data(), {static_cast<std::int64_t>(n)}), h);
          for (std::size_t i = 0; i < n; ++i) ref[i].step(static_cast<double>(g[i]), h);
        }
        std::vector<double> ref_p(n), ref_m(n), ref_v(n);
        for (std::size_t i = 0; i < n; ++i) {
          ref_p[i] = ref[i].p;
          ref_m[i] = ref[i].m;
          ref_v[i] = ref[i].v;
        }
        CHECK(loom::test::max_relative_error(p, ref_p, 1.0) <= tolerance<T>());
        CHECK(loom::test::max_relative_error(m, ref_m, 1.0) <= tolerance<T>());
        CHECK(loom::test::max_relative_error(v, ref_v, 1.0) <= tolerance<T>());
      }
    }
  }
}

TEST_CASE("adamw_update's first step moves each parameter by lr (bias correction)") {
  const cpu be(1);
  // With m = v = 0, step 1 gives m_hat = g and v_hat = g^2: the step is lr * sign(g).
  std::vector<double> p{1.0, -2.0, 0.5}, g{3e-3, -7.0, 40.0}, m(3, 0.0), v(3, 0.0);
  loom::kernels::adamw_update<double>(be, Tensor<double>(p.data(), {3}), Tensor<const double>(g.data(), {3}),
                                      Tensor<double>(m.data(), {3}), Tensor<double>(v.data(), {3}),
                                      AdamWUpdate{.lr = 0.01, .eps = 1e-12, .step = 1});
  CHECK(p[0] == doctest::Approx(0.99).epsilon(1e-9));
  CHECK(p[1] == doctest::Approx(-1.99).epsilon(1e-9));
  CHECK(p[2] == doctest::Approx(0.49).epsilon(1e-9));
}

TEST_CASE_TEMPLATE("adamw_update gives the same bits on 1 and 2 threads", T, float, double) {
  const cpu one(1), two(2);
  const std::size_t n = 100003;
  const auto g = grads_of_step<T>(n, 1);
  const auto p0 = loom::test::random_vector<T>(n, 2);
  auto p1 = p0, p2 = p0;
  std::vector<T> m1(n, T(0.1)), v1(n, T(0.2)), m2 = m1, v2 = v1;
  const AdamWUpdate h{.lr = 1e-3, .weight_decay = 0.1, .step = 5};
  const auto N = static_cast<std::int64_t>(n);
  loom::kernels::adamw_update<T>(one, Tensor<T>(p1.data(), {N}), Tensor<const T>(g.data(), {N}),
                                 Tensor<T>(m1.data(), {N}), Tensor<T>(v1.data(), {N}), h);
  loom::kernels::adamw_update<T>(two, Tensor<T>(p2.data(), {N}), Tensor<const T>(g.data(), {N}),
                                 Tensor<T>(m2.data(), {N}), Tensor<T>(v2.data(), {N}), h);
  CHECK(p1 == p2);
  CHECK(m1 == m2);
  CHECK(v1 == v2);
}

TEST_CASE_TEMPLATE("sgd_momentum_update matches torch's formula over three steps", T, float, double) {
  const cpu one(1), two(2);
  for (std::size_t n : {std::size_t{7}, std::size_t{100003}}) {
    for (bool nesterov : {false, true}) {
      for (double wd : {0.0, 0.05}) {
        CAPTURE(n);
        CAPTURE(nesterov);
        CAPTURE(wd);
        for (const cpu* be : {&one, &two}) {
          CAPTURE(be->threads());
          auto p = loom::test::random_vector<T>(n, 3);
          std::vector<T> buf(n, T(0));
          std::vector<ScalarSgd> ref(n);
          for (std::size_t i = 0; i < n; ++i) ref[i].p = static_cast<double>(p[i]);
          const SgdUpdate h{.lr = 0.1, .momentum = 0.9, .weight_decay = wd, .nesterov = nesterov};
          for (int s = 1; s <= 3; ++s) {
            const auto g = grads_of_step<T>(n, s);
            const auto N = static_cast<std::int64_t>(n);
            loom::kernels::sgd_momentum_update<T>(*be, Tensor<T>(p.data(), {N}), Tensor<const T>(g.data(), {N}),
                                                  Tensor<T>(buf.data(), {N}), h);
            for (std::size_t i = 0; i < n; ++i) ref[i].step(static_cast<double>(g[i]), h);
          }
          std::vector<double> ref_p(n), ref_buf(n);
          for (std::size_t i = 0; i < n; ++i) {
            ref_p[i] = ref[i].p;
            ref_buf[i] = ref[i].buf;
          }
          CHECK(loom::test::max_relative_error(p, ref_p, 1.0) <= tolerance<T>());
          CHECK(loom::test::max_relative_error(buf, ref_buf, 1.0) <= tolerance<T>());
        }
      }
    }
  }
}

TEST_CASE("optimizer updates reject mismatched element counts and step 0") {
  const cpu be(1);
  std::vector<float> p(10), g(10), m(10), v(10), short_(9);
  using loom::test::expect_error;
  using loom::kernels::adamw_update;
  using loom::kernels::sgd_momentum_update;
  const Tensor<float> p_v(p.data(), {10}), m_v(m.data(), {10}), v_v(v.data(), {2, 5});
  const Tensor<const float> g_v(g.data(), {5, 2});
  CHECK_NOTHROW(adamw_update<float>(be, p_v, g_v, m_v, v_v, AdamWUpdate{}));
  CHECK_THROWS_AS(adamw_update<float>(be, p_v, Tensor<const float>(short_.data(), {9}), m_v, v_v, AdamWUpdate{}),
                  loom::Error);
  expect_error([&] { adamw_update<float>(be, p_v, Tensor<const float>(short_.data(), {9}), m_v, v_v, AdamWUpdate{}); },
               "adamw_update: argument grads");
  expect_error([&] { adamw_update<float>(be, p_v, g_v, Tensor<float>(short_.data(), {9}), v_v, AdamWUpdate{}); },
               "adamw_update: argument m");
  expect_error([&] { adamw_update<float>(be, p_v, g_v, m_v, Tensor<float>(short_.data(), {3, 3}), AdamWUpdate{}); },
               "adamw_update: argument v");
  expect_error([&] { adamw_update<float>(be, p_v, g_v, m_v, v_v, AdamWUpdate{.step = 0}); }, "adamw_update: step");
  CHECK_NOTHROW(sgd_momentum_update<float>(be, p_v, g_v, m_v, SgdUpdate{}));
  expect_error([&] { sgd_momentum_update<float>(be, p_v, Tensor<const float>(short_.data(), {9}), m_v, SgdUpdate{}); },
               "sgd_momentum_update: argument grads");
  expect_error([&] { sgd_momentum_update<float>(be, p_v, g_v, Tensor<float>(short_.data(), {9}), SgdUpdate{}); },
               "sgd_momentum_update: argument momentum");
}

}  // namespace test_kernel_optimizer_updates
