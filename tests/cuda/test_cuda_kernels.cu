// The CUDA kernels against plain host loops in double, at odd sizes, with the CPU kernels'
// contracts: accumulation (+=) into gradients, empty tensors skipped, shape errors named.
//
// Without a GPU the host cases still run (the cuBLAS GEMM plans through a host emulation of
// cuBLAS, the per-element GELU and optimizer formulas, launch sizes and shape checks), then the
// program exits with 77 and ctest reports it skipped.
//
// Tolerances (|device - reference| <= tolerance * max(magnitude, floor)):
// - fp32 kernels: 1e-5, the magnitude being |reference| for element-wise results and the sum of
//   the absolute terms for sums (bias and layernorm parameter gradients, the layernorm row sums);
// - GEMMs run with TF32 products: 2e-3 of sum |a_i b_i|. TF32 keeps 10 mantissa bits, so each
//   product is off by less than 2 * 2^-10 of itself even when the hardware truncates; fp32
//   accumulation adds ~k * 2^-24. A wrong operand or transpose is off by O(1).
// - sum_of_squares accumulates in double: 1e-12 relative.
// A finite-difference check in double is not possible here (the kernels are float only); each
// backward is checked against the host formula of the derivative instead.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/backend/cuda/kernels.cuh"
#include "loom/core/buffer.hpp"
#include "device_check.hpp"
#include "host_block.hpp"

using namespace loom;
using namespace loom::cuda_test;

namespace {

// ------------------------------------------------------------------------------------------
// Host references (row-major, double).

struct MatmulCase {
  std::int64_t N, C, OC;
};

struct MatmulData {
  std::vector<float> in, weight, bias, dout, din0, dweight0, dbias0;
};

MatmulData make_matmul_data(const MatmulCase& c, std::uint32_t seed) {
  return {random_floats(c.N * c.C, seed),           random_floats(c.OC * c.C, seed + 1),
          random_floats(c.OC, seed + 2),            random_floats(c.N * c.OC, seed + 3),
          random_floats(c.N * c.C, seed + 4),       random_floats(c.OC * c.C, seed + 5),
          random_floats(c.OC, seed + 6)};
}

struct Reference {
  std::vector<double> value, magnitude;
};

//! out = in weight^T (+ bias), with the sum of |terms| per element.
Reference matmul_forward_reference(const MatmulCase& c, const MatmulData& d, bool with_bias) {
  Reference r{std::vector<double>(static_cast<std::size_t>(c.N * c.OC)),
              std::vector<double>(static_cast<std::size_t>(c.N * c.OC))};
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t o = 0; o < c.OC; ++o) {
      double sum = with_bias ? d.bias[o] : 0.0, mag = with_bias ? std::abs(d.bias[o]) : 0.0;
      for (std::int64_t k = 0; k < c.C; ++k) {
        const double term = static_cast<double>(d.in[n * c.C + k]) * d.weight[o * c.C + k];
        sum += term;
        mag += std::abs(term);
      }
      r.value[n * c.OC + o] = sum;
      r.magnitude[n * c.OC + o] = mag;
    }
  return r;
}

//! din0 + dout weight.
Reference matmul_input_grad_reference(const MatmulCase& c, const MatmulData& d) {
  Reference r{to_double(d.din0), abs_of(to_double(d.din0))};
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t k = 0; k < c.C; ++k)
      for (std::int64_t o = 0; o < c.OC; ++o) {
        const double term = static_cast<double>(d.dout[n * c.OC + o]) * d.weight[o * c.C + k];
        r.value[n * c.C + k] += term;
        r.magnitude[n * c.C + k] += std::abs(term);
      }
  return r;
}

//! dweight0 + dout^T in.
Reference matmul_weight_grad_reference(const MatmulCase& c, const MatmulData& d) {
  Reference r{to_double(d.dweight0), abs_of(to_double(d.dweight0))};
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t o = 0; o < c.OC; ++o) {
      const double g = d.dout[n * c.OC + o];
      for (std::int64_t k = 0; k < c.C; ++k) {
        const double term = g * d.in[n * c.C + k];
        r.value[o * c.C + k] += term;
        r.magnitude[o * c.C + k] += std::abs(term);
      }
    }
  return r;
}

//! dbias0 + column sums of dout.
Reference matmul_bias_grad_reference(const MatmulCase& c, const MatmulData& d) {
  Reference r{to_double(d.dbias0), abs_of(to_double(d.dbias0))};
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t o = 0; o < c.OC; ++o) {
      r.value[o] += d.dout[n * c.OC + o];
      r.magnitude[o] += std::abs(d.dout[n * c.OC + o]);
    }
  return r;
}

//! cuBLAS's column-major GEMM on the host: C = op(A) op(B) + beta C, with cuBLAS's rules on the
//! leading dimensions checked.
void emulate_cublas_gemm(const detail::cuda_matmul::Gemm& g, const float* a, const float* b, float* c,
                         float beta) {
  REQUIRE(g.lda >= std::max<std::int64_t>(1, g.op_a == CUBLAS_OP_N ? g.m : g.k));
  REQUIRE(g.ldb >= std::max<std::int64_t>(1, g.op_b == CUBLAS_OP_N ? g.k : g.n));
  REQUIRE(g.ldc >= std::max<std::int64_t>(1, g.m));
  for (std::int64_t j = 0; j < g.n; ++j)
    for (std::int64_t i = 0; i < g.m; ++i) {
      double sum = 0;
      for (std::int64_t l = 0; l < g.k; ++l) {
        const double x = g.op_a == CUBLAS_OP_N ? a[i + l * g.lda] : a[l + i * g.lda];
        const double y = g.op_b == CUBLAS_OP_N ? b[l + j * g.ldb] : b[j + l * g.ldb];
        sum += x * y;
      }
      c[i + j * g.ldc] = static_cast<float>(sum + beta * c[i + j * g.ldc]);
    }
}

struct LayernormCase {
  std::int64_t N, C;
  float offset;
};

struct LayernormStats {
  std::vector<double> out, out_magnitude;
  std::vector<float> mean, rstd;  // rounded to float: the backward's inputs on both sides
  std::vector<double> mean_exact, rstd_exact;
};

LayernormStats layernorm_forward_reference(std::int64_t N, std::int64_t C, const std::vector<float>& in,
                                           const std::vector<float>& weight, const std::vector<float>& bias,
                                           double eps) {
  LayernormStats s;
  s.out.resize(static_cast<std::size_t>(N * C));
  s.out_magnitude.resize(s.out.size());
  for (std::int64_t n = 0; n < N; ++n) {
    const float* x = in.data() + n * C;
    double mean = 0;
    for (std::int64_t i = 0; i < C; ++i) mean += x[i];
    mean /= static_cast<double>(C);
    double var = 0;
    for (std::int64_t i = 0; i < C; ++i) var += (x[i] - mean) * (x[i] - mean);
    var /= static_cast<double>(C);
    const double rstd = 1.0 / std::sqrt(var + eps);
    s.mean_exact.push_back(mean);
    s.rstd_exact.push_back(rstd);
    s.mean.push_back(static_cast<float>(mean));
    s.rstd.push_back(static_cast<float>(rstd));
    for (std::int64_t i = 0; i < C; ++i) {
      const double norm = (x[i] - mean) * rstd;
      s.out[n * C + i] = norm * weight[i] + bias[i];
      // The float kernel's error scales with |norm w| + |b| and with |x| / rstd (the mean's
      // rounding, relevant when the mean is large against the spread).
      s.out_magnitude[n * C + i] =
          std::abs(norm * weight[i]) + std::abs(bias[i]) + std::abs(x[i]) * rstd * std::abs(weight[i]);
    }
  }
  return s;
}

// ------------------------------------------------------------------------------------------
// Host cases: run with or without a GPU.

TEST_CASE("the cuBLAS GEMM plans compute the row-major products (host emulation of cuBLAS)") {
  namespace d = detail::cuda_matmul;
  for (const MatmulCase c : {MatmulCase{1, 1, 1}, MatmulCase{3, 5, 7}, MatmulCase{65, 33, 17}}) {
    CAPTURE(c.N);
    CAPTURE(c.C);
    CAPTURE(c.OC);
    const MatmulData data = make_matmul_data(c, 11);

    std::vector<float> out(static_cast<std::size_t>(c.N * c.OC), 123.0f);  // beta 0 ignores it
    emulate_cublas_gemm(d::forward_gemm(c.N, c.C, c.OC), data.weight.data(), data.in.data(), out.data(), 0.0f);
    const Reference forward = matmul_forward_reference(c, data, false);
    check_close(out, forward.value, forward.magnitude, float_tolerance, "forward");

    std::vector<float> din = data.din0;
    emulate_cublas_gemm(d::input_grad_gemm(c.N, c.C, c.OC), data.weight.data(), data.dout.data(), din.data(), 1.0f);
    const Reference din_ref = matmul_input_grad_reference(c, data);
    check_close(din, din_ref.value, din_ref.magnitude, float_tolerance, "din");

    std::vector<float> dweight = data.dweight0;
    emulate_cublas_gemm(d::weight_grad_gemm(c.N, c.C, c.OC), data.in.data(), data.dout.data(), dweight.data(), 1.0f);
    const Reference dweight_ref = matmul_weight_grad_reference(c, data);
    check_close(dweight, dweight_ref.value, dweight_ref.magnitude, float_tolerance, "dweight");
  }
}

namespace {

//! GELU(x) of the form `kind` in double: x Φ(x) with std::erf, or GPT-2's tanh approximation.
double gelu_reference(Gelu kind, double x) {
  if (kind == Gelu::erf) return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
  const double s = 0.7978845608028654, k = 0.044715;
  return 0.5 * x * (1 + std::tanh(s * (x + k * x * x * x)));
}

//! d GELU / dx of the form `kind` in double: Φ(x) + x φ(x), or the chain rule through tanh.
double gelu_derivative_reference(Gelu kind, double x) {
  if (kind == Gelu::erf)
    return 0.5 * (1 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2 * std::acos(-1.0));
  const double s = 0.7978845608028654, k = 0.044715, th = std::tanh(s * (x + k * x * x * x));
  return 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * s * (1 + 3 * k * x * x);
}

}  // namespace

TEST_CASE("the element formulas of GELU match both forms and their derivatives") {
  namespace d = detail::gelu;
  const std::vector<float> xs = random_floats(1001, 21, -5.0f, 5.0f);
  for (const Gelu kind : {Gelu::tanh, Gelu::erf}) {
    CAPTURE(std::string(loom::gelu_name(kind)));
    std::vector<float> forward, backward;
    std::vector<double> forward_ref, backward_ref;
    for (float xf : xs) {
      forward.push_back(kind == Gelu::erf ? d::value<Gelu::erf>(xf) : d::value<Gelu::tanh>(xf));
      backward.push_back(kind == Gelu::erf ? d::derivative<Gelu::erf>(xf) : d::derivative<Gelu::tanh>(xf));
      forward_ref.push_back(gelu_reference(kind, xf));
      backward_ref.push_back(gelu_derivative_reference(kind, xf));
    }
    check_close(forward, forward_ref, float_tolerance, "gelu");
    check_close(backward, backward_ref, float_tolerance, "gelu_derivative");
  }
  CHECK(d::value<Gelu::tanh>(0.0f) == 0.0f);
  CHECK(d::value<Gelu::tanh>(1.0f) == doctest::Approx(0.8411920).epsilon(1e-6));
  CHECK(d::value<Gelu::tanh>(-1.0f) == doctest::Approx(-0.1588080).epsilon(1e-5));
  CHECK(d::value<Gelu::tanh>(20.0f) == 20.0f);
  CHECK(d::value<Gelu::tanh>(-20.0f) == 0.0f);
  CHECK(d::derivative<Gelu::tanh>(0.0f) == 0.5f);
  CHECK(d::value<Gelu::erf>(0.0f) == 0.0f);
  CHECK(d::value<Gelu::erf>(1.0f) == doctest::Approx(0.8413447).epsilon(1e-6));
  CHECK(d::value<Gelu::erf>(-1.0f) == doctest::Approx(-0.1586553).epsilon(1e-5));
  CHECK(d::value<Gelu::erf>(20.0f) == 20.0f);
  CHECK(d::value<Gelu::erf>(-20.0f) == 0.0f);
  CHECK(d::derivative<Gelu::erf>(0.0f) == 0.5f);
}

//! torch.optim.AdamW, one element, in double.
struct AdamReference {
  double p, m = 0, v = 0, m_magnitude = 0;
  void step(double g, const AdamWUpdate& h) {
    p -= h.lr * h.weight_decay * p;
    m = h.beta1 * m + (1 - h.beta1) * g;
    m_magnitude = h.beta1 * m_magnitude + (1 - h.beta1) * std::abs(g);
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    const double m_hat = m / (1 - std::pow(h.beta1, static_cast<double>(h.step)));
    const double v_hat = v / (1 - std::pow(h.beta2, static_cast<double>(h.step)));
    p -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
  }
};

//! torch.optim.SGD (no dampening), one element, in double.
struct SgdReference {
  double p, buf = 0, buf_magnitude = 0;
  void step(double g, const SgdUpdate& h) {
    const double gd = g + h.weight_decay * p;
    buf = h.momentum * buf + gd;
    buf_magnitude = h.momentum * buf_magnitude + std::abs(g) + std::abs(h.weight_decay * p);
    p -= h.lr * (h.nesterov ? gd + h.momentum * buf : buf);
  }
};

TEST_CASE("the element steps of AdamW and SGD follow torch's formulas") {
  namespace d = detail::cuda_optimizer_updates;
  for (const double weight_decay : {0.0, 0.1}) {
    CAPTURE(weight_decay);
    const std::vector<float> p0 = random_floats(257, 31);
    std::vector<float> p = p0, m(p.size(), 0.0f), v(p.size(), 0.0f);
    std::vector<AdamReference> ref;
    for (float x : p0) ref.push_back({x});
    AdamWUpdate h{.lr = 1e-2, .weight_decay = weight_decay};
    for (h.step = 1; h.step <= 3; ++h.step) {
      const std::vector<float> g = random_floats(257, 32 + static_cast<std::uint32_t>(h.step));
      const d::AdamWFactors f = d::adamw_factors(h);
      for (std::size_t i = 0; i < p.size(); ++i) {
        d::adamw_element(p[i], g[i], m[i], v[i], f);
        ref[i].step(g[i], h);
      }
    }
    std::vector<double> p_ref, m_ref, m_mag, v_ref;
    for (const AdamReference& r : ref) {
      p_ref.push_back(r.p);
      m_ref.push_back(r.m);
      m_mag.push_back(r.m_magnitude);
      v_ref.push_back(r.v);
    }
    check_close(p, p_ref, float_tolerance, "adamw p");
    check_close(m, m_ref, m_mag, float_tolerance, "adamw m", 0.0);
    check_close(v, v_ref, abs_of(v_ref), float_tolerance, "adamw v", 0.0);

    for (const bool nesterov : {false, true}) {
      CAPTURE(nesterov);
      std::vector<float> q = p0, buf(q.size(), 0.0f);
      std::vector<SgdReference> sref;
      for (float x : p0) sref.push_back({x});
      const SgdUpdate s{.lr = 0.1, .momentum = 0.9, .weight_decay = weight_decay, .nesterov = nesterov};
      for (std::uint32_t step = 0; step < 3; ++step) {
        const std::vector<float> g = random_floats(257, 40 + step);
        const d::SgdFactors f = d::sgd_factors(s);
        for (std::size_t i = 0; i < q.size(); ++i) {
          d::sgd_element(q[i], g[i], buf[i], f);
          sref[i].step(g[i], s);
        }
      }
      std::vector<double> q_ref, b_ref, b_mag;
      for (const SgdReference& r : sref) {
        q_ref.push_back(r.p);
        b_ref.push_back(r.buf);
        b_mag.push_back(r.buf_magnitude);
      }
      check_close(q, q_ref, float_tolerance, "sgd p");
      check_close(buf, b_ref, b_mag, float_tolerance, "sgd momentum", 0.0);
    }
  }
}

TEST_CASE("launch sizes depend on the element count only and stay within CUDA's limits") {
  namespace k = detail::cuda_kernels;
  namespace r = detail::cuda_reduction;
  CHECK(k::elementwise_blocks(1) == 1);
  CHECK(k::elementwise_blocks(256) == 1);
  CHECK(k::elementwise_blocks(257) == 2);
  CHECK(k::elementwise_blocks(std::int64_t{1} << 40) == k::max_elementwise_blocks);
  CHECK(k::row_blocks(1) == 1);
  CHECK(k::row_blocks(8) == 1);
  CHECK(k::row_blocks(9) == 2);
  CHECK(k::column_blocks(32) == 1);
  CHECK(k::column_blocks(33) == 2);
  CHECK(k::column_tile * k::column_row_threads <= 1024);
  CHECK(r::blocks_for(1) == 1);
  CHECK(r::blocks_for(r::threads * r::elements_per_thread) == 1);
  CHECK(r::blocks_for(r::threads * r::elements_per_thread + 1) == 2);
  CHECK(r::blocks_for(std::int64_t{1} << 40) == r::max_blocks);
  CHECK(r::max_blocks <= 2 * r::threads);  // the second pass: at most two partials a thread
}

TEST_CASE("shape checks name the kernel and the argument (host side, before any CUDA call)") {
  float storage[64] = {};
  const Tensor<float> out(storage, Shape{4, 3});
  CHECK_THROWS_WITH_AS(detail::cuda_kernels::check_rows(out, 4, 5, "matmul_forward", "out"),
                       "loom: matmul_forward: argument out shape: got [4, 3]; expected 4 rows of 5 "
                       "(all axes but the last are rows)",
                       Error);
  CHECK_NOTHROW(detail::cuda_kernels::check_rows(Tensor<float>(storage, Shape{2, 2, 3}), 4, 3, "k", "x"));
  CHECK_THROWS_WITH_AS(detail::cuda_kernels::check_rows(Tensor<float>(nullptr, Shape{4, 3}), 4, 3, "k", "x"),
                       doctest::Contains("k: argument x: got a tensor without data"), Error);
  const Tensor<const float> in(storage, Shape{2, 5}), weight(storage, Shape{3, 4}), flat(storage, Shape{15});
  CHECK_THROWS_WITH_AS(detail::cuda_matmul::dims(in, weight, "matmul_forward"),
                       "loom: matmul_forward: argument weight shape: got [3, 4]; expected [3, 5]", Error);
  CHECK_THROWS_WITH_AS(detail::cuda_matmul::dims(in, flat, "matmul_forward"),
                       doctest::Contains("argument weight shape: got [15]; expected [OC, C = 5]"), Error);
  const detail::cuda_matmul::Dims dims = detail::cuda_matmul::dims(in, Tensor<const float>(storage, Shape{3, 5}), "k");
  CHECK(dims.rows == 2);
  CHECK(dims.in_features == 5);
  CHECK(dims.out_features == 3);
}

// ------------------------------------------------------------------------------------------
// Device cases: return at once without a GPU.

TEST_CASE("matmul_forward matches the host product, with and without bias, [N,C] and [B,T,C]") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const MatmulCase c : {MatmulCase{1, 1, 1}, MatmulCase{3, 5, 7}, MatmulCase{65, 33, 17},
                             MatmulCase{256, 768, 512}}) {
    for (const bool with_bias : {true, false}) {
      CAPTURE(c.N);
      CAPTURE(c.C);
      CAPTURE(c.OC);
      CAPTURE(with_bias);
      const MatmulData data = make_matmul_data(c, 100);
      // 65 rows as [5, 13, C] in and [65, OC] out: only rows and the last extent must agree.
      const Shape in_shape = c.N == 65 ? Shape{5, 13, c.C} : Shape{c.N, c.C};
      const DeviceTensor in(be, data.in, in_shape), weight(be, data.weight, Shape{c.OC, c.C}),
          bias(be, data.bias, Shape{c.OC});
      const DeviceTensor out(be, std::vector<float>(static_cast<std::size_t>(c.N * c.OC), 99.0f), Shape{c.N, c.OC});
      matmul_forward<float>(be, out.view(), in.cview(), weight.cview(),
                            with_bias ? bias.cview() : Tensor<const float>{});
      const Reference ref = matmul_forward_reference(c, data, with_bias);
      check_close(out.to_host(be), ref.value, ref.magnitude, tf32_tolerance, "out");
    }
  }
}

TEST_CASE("matmul_backward accumulates din, dweight and dbias; empty ones are skipped") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const MatmulCase c : {MatmulCase{1, 1, 1}, MatmulCase{3, 5, 7}, MatmulCase{65, 33, 17},
                             MatmulCase{256, 768, 512}}) {
    CAPTURE(c.N);
    CAPTURE(c.C);
    CAPTURE(c.OC);
    const MatmulData data = make_matmul_data(c, 200);
    const DeviceTensor in(be, data.in, Shape{c.N, c.C}), weight(be, data.weight, Shape{c.OC, c.C}),
        dout(be, data.dout, Shape{c.N, c.OC});
    const Reference din_ref = matmul_input_grad_reference(c, data);
    const Reference dweight_ref = matmul_weight_grad_reference(c, data);
    const Reference dbias_ref = matmul_bias_grad_reference(c, data);

    // One call with all three gradients, onto non-zero buffers (+=).
    const DeviceTensor din(be, data.din0, Shape{c.N, c.C}), dweight(be, data.dweight0, Shape{c.OC, c.C}),
        dbias(be, data.dbias0, Shape{c.OC});
    matmul_backward<float>(be, din.view(), dweight.view(), dbias.view(), dout.cview(), in.cview(), weight.cview());
    const std::vector<float> din_all = din.to_host(be), dweight_all = dweight.to_host(be),
                             dbias_all = dbias.to_host(be);
    check_close(din_all, din_ref.value, din_ref.magnitude, tf32_tolerance, "din");
    check_close(dweight_all, dweight_ref.value, dweight_ref.magnitude, tf32_tolerance, "dweight");
    check_close(dbias_all, dbias_ref.value, dbias_ref.magnitude, float_tolerance, "dbias");

    // The split backward: input gradient only, then weight and bias gradients only; the same bits.
    const DeviceTensor din_split(be, data.din0, Shape{c.N, c.C}),
        dweight_split(be, data.dweight0, Shape{c.OC, c.C}), dbias_split(be, data.dbias0, Shape{c.OC});
    matmul_backward<float>(be, din_split.view(), Tensor<float>{}, Tensor<float>{}, dout.cview(), in.cview(),
                           weight.cview());
    CHECK(dweight_split.to_host(be) == data.dweight0);
    CHECK(dbias_split.to_host(be) == data.dbias0);
    matmul_backward<float>(be, Tensor<float>{}, dweight_split.view(), dbias_split.view(), dout.cview(),
                           in.cview(), weight.cview());
    CHECK(din_split.to_host(be) == din_all);
    CHECK(dweight_split.to_host(be) == dweight_all);
    CHECK(dbias_split.to_host(be) == dbias_all);

    // din written over NaN (GradientWrite::overwrite, beta 0): the product alone.
    const DeviceTensor din_written(be, std::vector<float>(data.din0.size(), std::nanf("")), Shape{c.N, c.C});
    matmul_backward<float>(be, din_written.view(), Tensor<float>{}, Tensor<float>{}, dout.cview(), in.cview(),
                           weight.cview(), GradientWrite::overwrite);
    MatmulData from_zero = data;
    std::fill(from_zero.din0.begin(), from_zero.din0.end(), 0.0f);
    const Reference product_ref = matmul_input_grad_reference(c, from_zero);
    check_close(din_written.to_host(be), product_ref.value, product_ref.magnitude, tf32_tolerance, "din (overwrite)");

    // Without dbias (the tied LM head): din and dweight still computed.
    const DeviceTensor din_nobias(be, data.din0, Shape{c.N, c.C}),
        dweight_nobias(be, data.dweight0, Shape{c.OC, c.C});
    matmul_backward<float>(be, din_nobias.view(), dweight_nobias.view(), Tensor<float>{}, dout.cview(),
                           in.cview(), weight.cview());
    CHECK(din_nobias.to_host(be) == din_all);
    CHECK(dweight_nobias.to_host(be) == dweight_all);
  }
}

TEST_CASE("each backend gets its own cuBLAS handle, bound to its stream") {
  if (!have_gpu()) return;
  loom::cuda first(0), second(0);
  const cublasHandle_t a = first.cublas();
  CHECK(first.cublas() == a);
  const cublasHandle_t b = second.cublas();
  CHECK(b != a);
  cudaStream_t bound = nullptr;
  REQUIRE(cublasGetStream(a, &bound) == CUBLAS_STATUS_SUCCESS);
  CHECK(bound == first.stream());
  REQUIRE(cublasGetStream(b, &bound) == CUBLAS_STATUS_SUCCESS);
  CHECK(bound == second.stream());
}

TEST_CASE("matmul kernels reject wrong shapes, naming the argument") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  Buffer<float, loom::cuda> buffer(be, 64, MemoryCategory::workspace);
  const Tensor<float> in(buffer.data(), Shape{2, 5}), weight(buffer.data(), Shape{3, 5});
  const Tensor<float> out(buffer.data(), Shape{2, 3}), bad(buffer.data(), Shape{2, 4});
  CHECK_THROWS_WITH_AS(matmul_forward<float>(be, bad, in, weight, Tensor<const float>{}),
                       doctest::Contains("matmul_forward: argument out shape: got [2, 4]"), Error);
  CHECK_THROWS_WITH_AS(matmul_forward<float>(be, out, in, weight, Tensor<const float>(buffer.data(), Shape{4})),
                       doctest::Contains("matmul_forward: argument bias shape: got [4]; expected [3]"), Error);
  CHECK_THROWS_WITH_AS(matmul_backward<float>(be, bad, Tensor<float>{}, Tensor<float>{}, out, in, weight),
                       doctest::Contains("matmul_backward: argument din shape: got [2, 4]"), Error);
  CHECK_THROWS_WITH_AS(matmul_backward<float>(be, Tensor<float>{}, bad, Tensor<float>{}, out, in, weight),
                       doctest::Contains("matmul_backward: argument dweight shape: got [2, 4]; expected [3, 5]"),
                       Error);
  CHECK_THROWS_WITH_AS(matmul_backward<float>(be, Tensor<float>{}, Tensor<float>{}, Tensor<float>{}, bad, in, weight),
                       doctest::Contains("matmul_backward: argument dout shape: got [2, 4]"), Error);
}

TEST_CASE("layernorm_forward matches the two-pass host statistics") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  constexpr float eps = 1e-5f;
  for (const LayernormCase c : {LayernormCase{1, 1, 0}, LayernormCase{1, 7, 0}, LayernormCase{7, 1001, 0},
                                LayernormCase{65, 33, 0}, LayernormCase{65, 33, 10}, LayernormCase{256, 768, 0}}) {
    CAPTURE(c.N);
    CAPTURE(c.C);
    CAPTURE(c.offset);
    const std::vector<float> x = random_floats(c.N * c.C, 300, c.offset - 1, c.offset + 1);
    const std::vector<float> w = random_floats(c.C, 301, 0.5f, 1.5f), b = random_floats(c.C, 302);
    // 65 rows as [5, 13, C] with statistics [5, 13]: only the element counts of mean and rstd matter.
    const Shape in_shape = c.N == 65 ? Shape{5, 13, c.C} : Shape{c.N, c.C};
    const Shape stats_shape = c.N == 65 ? Shape{5, 13} : Shape{c.N};
    const DeviceTensor in(be, x, in_shape), weight(be, w, Shape{c.C}), bias(be, b, Shape{c.C});
    const DeviceTensor out(be, std::vector<float>(x.size(), 99.0f), in_shape),
        mean(be, std::vector<float>(static_cast<std::size_t>(c.N), 99.0f), stats_shape),
        rstd(be, std::vector<float>(static_cast<std::size_t>(c.N), 99.0f), stats_shape);
    layernorm_forward<float>(be, out.view(), mean.view(), rstd.view(), in.cview(), weight.cview(), bias.cview(), eps);
    const LayernormStats ref = layernorm_forward_reference(c.N, c.C, x, w, b, eps);
    check_close(out.to_host(be), ref.out, ref.out_magnitude, float_tolerance, "out");
    check_close(mean.to_host(be), ref.mean_exact, float_tolerance, "mean");
    check_close(rstd.to_host(be), ref.rstd_exact, abs_of(ref.rstd_exact), float_tolerance, "rstd", 0.0);
  }
}

TEST_CASE("layernorm_forward of a constant row gives the bias") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const std::vector<float> w = random_floats(7, 310), b = random_floats(7, 311);
  const DeviceTensor in(be, std::vector<float>(14, 3.0f), Shape{2, 7}), weight(be, w, Shape{7}),
      bias(be, b, Shape{7});
  const DeviceTensor out(be, std::vector<float>(14, 0.0f), Shape{2, 7}), mean(be, {0, 0}, Shape{2}),
      rstd(be, {0, 0}, Shape{2});
  layernorm_forward<float>(be, out.view(), mean.view(), rstd.view(), in.cview(), weight.cview(), bias.cview());
  std::vector<float> expected = b;
  expected.insert(expected.end(), b.begin(), b.end());
  CHECK(out.to_host(be) == expected);
  CHECK(mean.to_host(be) == std::vector<float>{3.0f, 3.0f});
  CHECK(rstd.to_host(be)[0] == doctest::Approx(1.0 / std::sqrt(1e-5)).epsilon(1e-6));
}

//! layernorm_backward's results in double from the float mean and rstd the kernel reads, and the
//! magnitudes the tolerance scales with.
struct LayernormGrads {
  std::vector<double> din, din_magnitude, dweight, dweight_magnitude, dbias, dbias_magnitude;
};

LayernormGrads layernorm_backward_reference(const LayernormCase& c, const std::vector<float>& x,
                                            const std::vector<float>& w, const std::vector<float>& g,
                                            const std::vector<float>& din0, const std::vector<float>& dw0,
                                            const std::vector<float>& db0, const LayernormStats& stats) {
  std::vector<double> din_ref = to_double(din0), din_mag = abs_of(din_ref);
  std::vector<double> dw_ref = to_double(dw0), dw_mag = abs_of(dw_ref);
  std::vector<double> db_ref = to_double(db0), db_mag = abs_of(db_ref);
  for (std::int64_t n = 0; n < c.N; ++n) {
    const double m = stats.mean[n], r = stats.rstd[n];
    double sum_dnorm = 0, sum_dnorm_norm = 0, abs_dnorm = 0, abs_dnorm_norm = 0;
    for (std::int64_t i = 0; i < c.C; ++i) {
      const double dnorm = static_cast<double>(w[i]) * g[n * c.C + i], norm = (x[n * c.C + i] - m) * r;
      sum_dnorm += dnorm;
      sum_dnorm_norm += dnorm * norm;
      abs_dnorm += std::abs(dnorm);
      abs_dnorm_norm += std::abs(dnorm * norm);
    }
    const double a = sum_dnorm / c.C, cc = sum_dnorm_norm / c.C;
    for (std::int64_t i = 0; i < c.C; ++i) {
      const std::int64_t at = n * c.C + i;
      const double dnorm = static_cast<double>(w[i]) * g[at], norm = (x[at] - m) * r;
      din_ref[at] += (dnorm - a - norm * cc) * r;
      din_mag[at] += (std::abs(dnorm) + abs_dnorm / c.C + std::abs(norm) * abs_dnorm_norm / c.C +
                      std::abs(x[at]) * r * std::abs(cc)) *
                     r;
      dw_ref[i] += norm * g[at];
      dw_mag[i] += std::abs(norm * g[at]) + std::abs(x[at] * r * g[at]);
      db_ref[i] += g[at];
      db_mag[i] += std::abs(g[at]);
    }
  }
  return {din_ref, din_mag, dw_ref, dw_mag, db_ref, db_mag};
}

//! The three gradients against the reference, at `tolerance` of their magnitudes.
void check_grads(const LayernormGrads& ref, const std::vector<float>& din, const std::vector<float>& dweight,
                 const std::vector<float>& dbias, double tolerance = float_tolerance) {
  check_close(din, ref.din, ref.din_magnitude, tolerance, "din");
  check_close(dweight, ref.dweight, ref.dweight_magnitude, tolerance, "dweight");
  check_close(dbias, ref.dbias, ref.dbias_magnitude, tolerance, "dbias");
}

TEST_CASE("layernorm_backward accumulates the host formula of the derivative, the same bits each run") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  constexpr double eps = 1e-5;
  // 128 and 512 columns take the fused kernel (1 and 4 vectors of 4 floats a lane; 70 rows are
  // three blocks, the last partial), 768 and 1024 (6 and 8 a lane) the two-pass vector one, 1152
  // (9 a lane) and the odd widths the scalar one.
  for (const LayernormCase c : {LayernormCase{1, 1, 0}, LayernormCase{1, 7, 0}, LayernormCase{7, 1001, 0},
                                LayernormCase{65, 33, 10}, LayernormCase{256, 768, 0}, LayernormCase{9, 128, 0},
                                LayernormCase{70, 512, 0}, LayernormCase{9, 1024, 0}, LayernormCase{3, 1152, 0}}) {
    CAPTURE(c.N);
    CAPTURE(c.C);
    const std::vector<float> x = random_floats(c.N * c.C, 400, c.offset - 1, c.offset + 1);
    const std::vector<float> w = random_floats(c.C, 401, 0.5f, 1.5f), b = random_floats(c.C, 402);
    const std::vector<float> g = random_floats(c.N * c.C, 403);
    const std::vector<float> din0 = random_floats(c.N * c.C, 404), dw0 = random_floats(c.C, 405),
                             db0 = random_floats(c.C, 406);
    const LayernormStats stats = layernorm_forward_reference(c.N, c.C, x, w, b, eps);

    const LayernormGrads ref = layernorm_backward_reference(c, x, w, g, din0, dw0, db0, stats);
    const DeviceTensor in(be, x, Shape{c.N, c.C}), weight(be, w, Shape{c.C}), dout(be, g, Shape{c.N, c.C}),
        mean(be, stats.mean, Shape{c.N}), rstd(be, stats.rstd, Shape{c.N});
    // With a residual, written over NaN (GPT-2's dres2), and added on: din starts from residual
    // (+ din0) in the reference.
    const std::vector<float> res = random_floats(c.N * c.C, 407, -4.0f, 4.0f);
    const DeviceTensor residual(be, res, Shape{c.N, c.C});
    for (const GradientWrite write : {GradientWrite::overwrite, GradientWrite::accumulate}) {
      const bool accumulate = write == GradientWrite::accumulate;
      CAPTURE(accumulate);
      std::vector<float> base(res);
      if (accumulate)
        for (std::size_t i = 0; i < base.size(); ++i) base[i] += din0[i];
      const DeviceTensor din(be, accumulate ? din0 : std::vector<float>(din0.size(), std::nanf("")),
                             Shape{c.N, c.C}),
          dweight(be, dw0, Shape{c.C}), dbias(be, db0, Shape{c.C});
      layernorm_backward<float>(be, din.view(), dweight.view(), dbias.view(), dout.cview(), in.cview(),
                                weight.cview(), mean.cview(), rstd.cview(), residual.cview(), write);
      check_grads(layernorm_backward_reference(c, x, w, g, base, dw0, db0, stats), din.to_host(be),
                  dweight.to_host(be), dbias.to_host(be));
    }
    std::vector<float> first_din, first_dw, first_db;
    for (int run = 0; run < 2; ++run) {
      CAPTURE(run);
      const DeviceTensor din(be, din0, Shape{c.N, c.C}), dweight(be, dw0, Shape{c.C}), dbias(be, db0, Shape{c.C});
      layernorm_backward<float>(be, din.view(), dweight.view(), dbias.view(), dout.cview(), in.cview(),
                                weight.cview(), mean.cview(), rstd.cview());
      const std::vector<float> got_din = din.to_host(be), got_dw = dweight.to_host(be), got_db = dbias.to_host(be);
      check_grads(ref, got_din, got_dw, got_db);
      if (run == 0) {
        first_din = got_din;
        first_dw = got_dw;
        first_db = got_db;
      } else {
        CHECK(got_din == first_din);
        CHECK(got_dw == first_dw);
        CHECK(got_db == first_db);
      }
    }
  }
}

//! layernorm_backward's fused path on the host (host_block.hpp): the fused body over every block,
//! then the column totals, for T with P vectors of 16 bytes a lane (C = 32 P of them); the
//! weight and bias gradients of G (T, or fp32 sums of bf16 layers).
template <class T, int P, class G = T>
void fused_backward_on_host(std::int64_t N, std::int64_t C, std::vector<T>& din, std::vector<G>& dweight,
                            std::vector<G>& dbias, const std::vector<T>& dout, const std::vector<T>& in,
                            const std::vector<T>& weight, const std::vector<float>& mean,
                            const std::vector<float>& rstd, const T* residual = nullptr, bool accumulate = true) {
  namespace ln = detail::cuda_layernorm;
  namespace k = detail::cuda_kernels;
  static_assert(ln::fused_vectors<T>(P));
  REQUIRE(C == 32 * P * k::Vector16<T>::elements);
  const std::int64_t blocks = ln::fused_blocks(N);
  // NaN: a partial the body does not write shows in the totals.
  std::vector<float> partials(static_cast<std::size_t>(2 * blocks * C), std::numeric_limits<float>::quiet_NaN());
  const ln::BackwardArgs<T> args{din.data(),  dout.data(), in.data(),       weight.data(), mean.data(),
                                 rstd.data(), partials.data(), N, C, residual, accumulate};
  run_grid(
      blocks, 1, 2 * C * sizeof(float),
      [&](HostThread& th) {
        ln::with_gradient_base(args, [&]<ln::GradientBase Base>() { ln::fused_backward_block<T, P, Base>(th, args); });
      },
      ln::fused_threads);
  const k::ColumnOutputs<G, 2> outputs{{dweight.data(), dbias.data()}};
  run_grid(
      k::column_blocks(C), 2, k::totals_shared<float>,
      [&](HostThread& th) { k::column_totals_block<2>(th, outputs, partials.data(), blocks, C); }, k::totals_threads);
}

//! One host case of the fused backward against the double reference: float at float_tolerance,
//! bf16 (inputs rounded first, each result rounded once: 2^-9 of its magnitude) at 1e-2. With
//! `residual`, din also gets a residual; with `write` = overwrite din starts as NaN and is written.
template <class T, int P>
void check_fused_backward_on_host(const LayernormCase& c, bool residual = false,
                                  GradientWrite write = GradientWrite::accumulate) {
  CAPTURE(c.N);
  CAPTURE(c.C);
  CAPTURE(residual);
  const bool accumulate = write == GradientWrite::accumulate;
  CAPTURE(accumulate);
  // Rounded to T first, so that the reference sees the kernel's inputs.
  const std::vector<float> x = floats_of(cast_to<T>(random_floats(c.N * c.C, 410, c.offset - 1, c.offset + 1)));
  const std::vector<float> w = floats_of(cast_to<T>(random_floats(c.C, 411, 0.5f, 1.5f)));
  const std::vector<float> g = floats_of(cast_to<T>(random_floats(c.N * c.C, 412)));
  const std::vector<float> din0 = floats_of(cast_to<T>(random_floats(c.N * c.C, 413)));
  const std::vector<float> dw0 = floats_of(cast_to<T>(random_floats(c.C, 414)));
  const std::vector<float> db0 = floats_of(cast_to<T>(random_floats(c.C, 415)));
  const LayernormStats stats = layernorm_forward_reference(c.N, c.C, x, w, std::vector<float>(static_cast<std::size_t>(c.C)), 1e-5);
  const std::vector<float> res = floats_of(cast_to<T>(random_floats(c.N * c.C, 416, -4.0f, 4.0f)));
  // What din starts from in the reference: its old value where accumulating, plus the residual.
  std::vector<float> base(din0.size(), 0.0f);
  for (std::size_t i = 0; i < base.size(); ++i) base[i] = (accumulate ? din0[i] : 0.0f) + (residual ? res[i] : 0.0f);
  const LayernormGrads ref = layernorm_backward_reference(c, x, w, g, base, dw0, db0, stats);
  std::vector<T> din = accumulate ? cast_to<T>(din0) : std::vector<T>(din0.size(), T(std::nanf(""))),
                 dweight = cast_to<T>(dw0), dbias = cast_to<T>(db0);
  const std::vector<T> res_t = cast_to<T>(res);
  fused_backward_on_host<T, P>(c.N, c.C, din, dweight, dbias, cast_to<T>(g), cast_to<T>(x), cast_to<T>(w), stats.mean,
                               stats.rstd, residual ? res_t.data() : nullptr, accumulate);
  check_grads(ref, floats_of(din), floats_of(dweight), floats_of(dbias),
              std::is_same_v<T, float> ? float_tolerance : 1e-2);
  if constexpr (std::is_same_v<T, bf16>) {
    // Into fp32 sums (fp32 gradient fusion): the same float totals stored unrounded, so they
    // round to the bf16 run's bits and sit within float accuracy of the reference; din as before.
    std::vector<T> din32 = accumulate ? cast_to<T>(din0) : std::vector<T>(din0.size(), T(std::nanf("")));
    std::vector<float> dweight32 = dw0, dbias32 = db0;
    fused_backward_on_host<T, P, float>(c.N, c.C, din32, dweight32, dbias32, cast_to<T>(g), cast_to<T>(x),
                                        cast_to<T>(w), stats.mean, stats.rstd, residual ? res_t.data() : nullptr,
                                        accumulate);
    CHECK(floats_of(din32) == floats_of(din));
    CHECK(floats_of(cast_to<T>(dweight32)) == floats_of(dweight));
    CHECK(floats_of(cast_to<T>(dbias32)) == floats_of(dbias));
    check_close(dweight32, ref.dweight, ref.dweight_magnitude, float_tolerance, "dweight (fp32 sums)");
    check_close(dbias32, ref.dbias, ref.dbias_magnitude, float_tolerance, "dbias (fp32 sums)");
  }
}

TEST_CASE("layernorm_backward's fused body and the column totals match the host formula (host emulation)") {
  // 32 rows a block: one partial block, two (the second of one row), three (the last partial),
  // ten (more than the totals' 8 row threads: two chunks for some).
  check_fused_backward_on_host<float, 1>({1, 128, 0});
  check_fused_backward_on_host<float, 1>({300, 128, 0});
  check_fused_backward_on_host<float, 4>({33, 512, 0});
  check_fused_backward_on_host<float, 5>({70, 640, 10});
  check_fused_backward_on_host<bf16, 1>({32, 256, 0});
  check_fused_backward_on_host<bf16, 3>({45, 768, 0});
  // A residual and an overwrite (GPT-2's dres2 = dout + ln2's gradient), and a residual added on.
  for (const bool residual : {false, true}) {
    check_fused_backward_on_host<float, 4>({33, 512, 0}, residual, GradientWrite::overwrite);
    check_fused_backward_on_host<bf16, 3>({45, 768, 0}, residual, GradientWrite::overwrite);
  }
  check_fused_backward_on_host<float, 5>({70, 640, 10}, true);
  check_fused_backward_on_host<bf16, 3>({45, 768, 0}, true);
}

TEST_CASE("layernorm kernels reject wrong shapes, naming the argument") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  Buffer<float, loom::cuda> buffer(be, 64, MemoryCategory::workspace);
  const Tensor<float> x(buffer.data(), Shape{2, 5}), c5(buffer.data(), Shape{5}), n2(buffer.data(), Shape{2});
  const Tensor<float> n3(buffer.data(), Shape{3}), c4(buffer.data(), Shape{4});
  CHECK_THROWS_WITH_AS(layernorm_forward<float>(be, x, n3, n2, x, c5, c5),
                       doctest::Contains("layernorm_forward: argument mean element count: got 3; expected 2"), Error);
  CHECK_THROWS_WITH_AS(layernorm_forward<float>(be, x, n2, n2, x, c4, c5),
                       doctest::Contains("layernorm_forward: argument weight shape: got [4]; expected [5]"), Error);
  CHECK_THROWS_WITH_AS(layernorm_backward<float>(be, x, c5, c4, x, x, c5, n2, n2),
                       doctest::Contains("layernorm_backward: argument dbias shape: got [4]; expected [5]"), Error);
  CHECK_THROWS_WITH_AS(layernorm_backward<float>(be, x, c5, c5, x, x, c5, n2, n3),
                       doctest::Contains("layernorm_backward: argument rstd element count: got 3"), Error);
}

TEST_CASE("gelu_forward and gelu_backward (accumulating) match both forms") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const Gelu kind : {Gelu::tanh, Gelu::erf}) {
    for (const std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1001}, std::int64_t{70001},
                                 std::int64_t{1} << 21}) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(n);
      const std::vector<float> x = random_floats(n, 500, -5.0f, 5.0f), g = random_floats(n, 501),
                               din0 = random_floats(n, 502);
      std::vector<double> out_ref(x.size()), din_ref(x.size()), din_mag(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) {
        out_ref[i] = gelu_reference(kind, x[i]);
        const double term = g[i] * gelu_derivative_reference(kind, x[i]);
        din_ref[i] = din0[i] + term;
        din_mag[i] = std::abs(din0[i]) + std::abs(term);
      }
      const DeviceTensor in(be, x, Shape{n}), dout(be, g, Shape{n}), din(be, din0, Shape{n});
      const DeviceTensor out(be, std::vector<float>(x.size(), 99.0f), Shape{n});
      gelu_forward<float>(be, out.view(), in.cview(), kind);
      gelu_backward<float>(be, din.view(), in.cview(), dout.cview(), kind);
      check_close(out.to_host(be), out_ref, float_tolerance, "out");
      check_close(din.to_host(be), din_ref, din_mag, float_tolerance, "din");
    }
  }
  Buffer<float, loom::cuda> buffer(be, 16, MemoryCategory::workspace);
  CHECK_THROWS_WITH_AS(gelu_forward<float>(be, Tensor<float>(buffer.data(), Shape{3}),
                                           Tensor<const float>(buffer.data(), Shape{4})),
                       doctest::Contains("gelu_forward: argument out element count: got 3; expected 4"), Error);
  CHECK_THROWS_WITH_AS(gelu_backward<float>(be, Tensor<float>(buffer.data(), Shape{4}),
                                            Tensor<const float>(buffer.data(), Shape{4}),
                                            Tensor<const float>(buffer.data(), Shape{5})),
                       doctest::Contains("gelu_backward: argument dout element count: got 5; expected 4"), Error);
}

TEST_CASE("residual_forward and residual_backward are the exact float sums") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1001}, std::int64_t{300007}}) {
    CAPTURE(n);
    const std::vector<float> a = random_floats(n, 600), b = random_floats(n, 601), g = random_floats(n, 602),
                             da0 = random_floats(n, 603), db0 = random_floats(n, 604);
    std::vector<float> sum(a.size()), da_ref(a.size()), db_ref(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      sum[i] = a[i] + b[i];
      da_ref[i] = da0[i] + g[i];
      db_ref[i] = db0[i] + g[i];
    }
    const DeviceTensor da(be, a, Shape{n}), db(be, b, Shape{n}), out(be, std::vector<float>(a.size(), 99.0f), Shape{n});
    residual_forward<float>(be, out.view(), da.cview(), db.cview());
    CHECK(out.to_host(be) == sum);
    residual_forward<float>(be, da.view(), da.cview(), db.cview());  // in place: out aliases a
    CHECK(da.to_host(be) == sum);

    const DeviceTensor dout(be, g, Shape{n}), ga(be, da0, Shape{n}), gb(be, db0, Shape{n});
    residual_backward<float>(be, ga.view(), gb.view(), dout.cview());
    CHECK(ga.to_host(be) == da_ref);
    CHECK(gb.to_host(be) == db_ref);
  }
  Buffer<float, loom::cuda> buffer(be, 16, MemoryCategory::workspace);
  CHECK_THROWS_WITH_AS(residual_forward<float>(be, Tensor<float>(buffer.data(), Shape{4}),
                                               Tensor<const float>(buffer.data(), Shape{3}),
                                               Tensor<const float>(buffer.data(), Shape{4})),
                       doctest::Contains("residual_forward: argument a element count: got 3; expected 4"), Error);
  CHECK_THROWS_WITH_AS(residual_backward<float>(be, Tensor<float>(buffer.data(), Shape{4}),
                                                Tensor<float>(buffer.data(), Shape{5}),
                                                Tensor<const float>(buffer.data(), Shape{4})),
                       doctest::Contains("residual_backward: argument db element count: got 5; expected 4"), Error);
}

TEST_CASE("gelu_forward and gelu_backward give the same bits at any alignment (vectors, tail, elements)") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  // Views at offsets of 1 to 3 floats into the buffers run element by element; the same inputs
  // in buffers of their own run as 16-byte vectors and a tail. Each element is one formula.
  const std::int64_t n = 1003;
  const std::vector<float> x = random_floats(n + 3, 510, -5.0f, 5.0f), g = random_floats(n + 3, 511),
                           din0 = random_floats(n + 3, 512);
  auto part = [n](const std::vector<float>& v, std::int64_t offset) {
    return std::vector<float>(v.begin() + offset, v.begin() + offset + n);
  };
  for (const Gelu kind : {Gelu::tanh, Gelu::erf}) {
    for (const std::int64_t offset : {1, 2, 3}) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(offset);
      const DeviceTensor in(be, x, Shape{n + 3}), dout(be, g, Shape{n + 3}), din(be, din0, Shape{n + 3});
      const DeviceTensor out(be, std::vector<float>(x.size(), 99.0f), Shape{n + 3});
      auto at = [&](const DeviceTensor& t) { return Tensor<float>(t.view().data() + offset, Shape{n}); };
      gelu_forward<float>(be, at(out), Tensor<const float>(at(in)), kind);
      gelu_backward<float>(be, at(din), Tensor<const float>(at(in)), Tensor<const float>(at(dout)), kind);
      const DeviceTensor in_own(be, part(x, offset), Shape{n}), dout_own(be, part(g, offset), Shape{n}),
          din_own(be, part(din0, offset), Shape{n}), out_own(be, std::vector<float>(n, 0.0f), Shape{n});
      gelu_forward<float>(be, out_own.view(), in_own.cview(), kind);
      gelu_backward<float>(be, din_own.view(), in_own.cview(), dout_own.cview(), kind);
      const std::vector<float> got_out = out.to_host(be), got_din = din.to_host(be);
      CHECK(part(got_out, offset) == out_own.to_host(be));
      CHECK(part(got_din, offset) == din_own.to_host(be));
      // Nothing outside the view is written.
      CHECK(got_out[offset - 1] == 99.0f);
      CHECK(got_din[offset - 1] == din0[offset - 1]);
    }
  }
}

TEST_CASE("copy, add_to and zero") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1001}, std::int64_t{300007}}) {
    CAPTURE(n);
    const std::vector<float> a = random_floats(n, 700), b = random_floats(n, 701);
    std::vector<float> sum(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) sum[i] = a[i] + b[i];
    const DeviceTensor x(be, a, Shape{n}), y(be, b, Shape{n});
    add_to<float>(be, y.view(), x.cview());
    CHECK(y.to_host(be) == sum);
    copy<float>(be, y.view(), x.cview());
    CHECK(y.to_host(be) == a);
    zero<float>(be, y.view());
    CHECK(y.to_host(be) == std::vector<float>(a.size(), 0.0f));
  }
  // add_to moves 16-byte vectors where both pointers allow: offsets of 0 to 3 floats into the
  // buffers give each mix of vector, tail and element-by-element paths.
  {
    const std::int64_t n = 1003;
    const std::vector<float> a = random_floats(n + 3, 702), b = random_floats(n + 3, 703);
    for (const std::int64_t dst_offset : {0, 1, 2, 3})
      for (const std::int64_t src_offset : {0, 1, 3}) {
        CAPTURE(dst_offset);
        CAPTURE(src_offset);
        std::vector<float> sum = b;
        for (std::int64_t i = 0; i < n; ++i) sum[dst_offset + i] += a[src_offset + i];
        const DeviceTensor x(be, a, Shape{n + 3}), y(be, b, Shape{n + 3});
        add_to<float>(be, Tensor<float>(y.view().data() + dst_offset, Shape{n}),
                      Tensor<const float>(x.view().data() + src_offset, Shape{n}));
        CHECK(y.to_host(be) == sum);
      }
  }
  zero<float>(be, Tensor<float>{});  // empty: nothing to do, nothing thrown
  Buffer<float, loom::cuda> buffer(be, 16, MemoryCategory::workspace);
  CHECK_THROWS_WITH_AS(add_to<float>(be, Tensor<float>(buffer.data(), Shape{3}),
                                     Tensor<const float>(buffer.data(), Shape{4})),
                       doctest::Contains("add_to: argument dst element count: got 3; expected 4"), Error);
  CHECK_THROWS_WITH_AS(copy<float>(be, Tensor<float>(buffer.data(), Shape{5}),
                                   Tensor<const float>(buffer.data(), Shape{4})),
                       doctest::Contains("copy: argument dst element count: got 5; expected 4"), Error);
}

TEST_CASE("dropout keeps the elements the host mask keeps, scaled, at any offset into the global tensor") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const DropoutMask mask(DropoutKey{.seed = 7, .step = 3}, 2, 1, 0.3);
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1001}, std::int64_t{300007}})
    for (const std::int64_t first : {std::int64_t{0}, std::int64_t{1}, std::int64_t{3}, std::int64_t{1} << 33}) {
      CAPTURE(n);
      CAPTURE(first);
      const std::vector<float> a = random_floats(n, 704);
      std::vector<float> want(a.size());
      for (std::int64_t i = 0; i < n; ++i)
        want[i] = mask.keep(static_cast<std::uint64_t>(first + i)) ? a[i] * static_cast<float>(mask.scale()) : 0.0f;
      const DeviceTensor x(be, a, Shape{n});
      dropout<float>(be, x.view(), mask, first);
      CHECK(x.to_host(be) == want);
      // An inactive mask leaves the values alone.
      dropout<float>(be, x.view(), DropoutMask(), first);
      CHECK(x.to_host(be) == want);
    }
}

TEST_CASE("adamw_update and sgd_momentum_update follow torch's formulas over three steps") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1001}, std::int64_t{100003}}) {
    for (const double weight_decay : {0.0, 0.1}) {
      CAPTURE(n);
      CAPTURE(weight_decay);
      const std::vector<float> p0 = random_floats(n, 800);
      const DeviceTensor p(be, p0, Shape{n}), m(be, std::vector<float>(p0.size(), 0.0f), Shape{n}),
          v(be, std::vector<float>(p0.size(), 0.0f), Shape{n});
      std::vector<AdamReference> ref;
      for (float x : p0) ref.push_back({x});
      AdamWUpdate h{.lr = 1e-2, .weight_decay = weight_decay};
      for (h.step = 1; h.step <= 3; ++h.step) {
        const std::vector<float> g = random_floats(n, 801 + static_cast<std::uint32_t>(h.step));
        const DeviceTensor grads(be, g, Shape{n});
        adamw_update<float>(be, p.view(), grads.cview(), m.view(), v.view(), h);
        for (std::size_t i = 0; i < p0.size(); ++i) ref[i].step(g[i], h);
      }
      std::vector<double> p_ref, m_ref, m_mag, v_ref;
      for (const AdamReference& r : ref) {
        p_ref.push_back(r.p);
        m_ref.push_back(r.m);
        m_mag.push_back(r.m_magnitude);
        v_ref.push_back(r.v);
      }
      check_close(p.to_host(be), p_ref, float_tolerance, "adamw p");
      check_close(m.to_host(be), m_ref, m_mag, float_tolerance, "adamw m", 0.0);
      check_close(v.to_host(be), v_ref, abs_of(v_ref), float_tolerance, "adamw v", 0.0);

      for (const bool nesterov : {false, true}) {
        CAPTURE(nesterov);
        const DeviceTensor q(be, p0, Shape{n}), buf(be, std::vector<float>(p0.size(), 0.0f), Shape{n});
        std::vector<SgdReference> sref;
        for (float x : p0) sref.push_back({x});
        const SgdUpdate s{.lr = 0.1, .momentum = 0.9, .weight_decay = weight_decay, .nesterov = nesterov};
        for (std::uint32_t step = 0; step < 3; ++step) {
          const std::vector<float> g = random_floats(n, 810 + step);
          const DeviceTensor grads(be, g, Shape{n});
          sgd_momentum_update<float>(be, q.view(), grads.cview(), buf.view(), s);
          for (std::size_t i = 0; i < p0.size(); ++i) sref[i].step(g[i], s);
        }
        std::vector<double> q_ref, b_ref, b_mag;
        for (const SgdReference& r : sref) {
          q_ref.push_back(r.p);
          b_ref.push_back(r.buf);
          b_mag.push_back(r.buf_magnitude);
        }
        check_close(q.to_host(be), q_ref, float_tolerance, "sgd p");
        check_close(buf.to_host(be), b_ref, b_mag, float_tolerance, "sgd momentum", 0.0);
      }
    }
  }
}

TEST_CASE("adamw's first step moves every parameter by lr (bias correction); bad arguments throw") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const std::int64_t n = 1001;
  std::vector<float> g = random_floats(n, 820, 0.1f, 1.0f);
  for (std::size_t i = 0; i < g.size(); i += 2) g[i] = -g[i];  // both signs, |g| >= 0.1
  const std::vector<float> p0 = random_floats(n, 821);
  const DeviceTensor p(be, p0, Shape{n}), grads(be, g, Shape{n}), m(be, std::vector<float>(g.size(), 0.0f), Shape{n}),
      v(be, std::vector<float>(g.size(), 0.0f), Shape{n});
  const AdamWUpdate h{.lr = 1e-3, .step = 1};
  adamw_update<float>(be, p.view(), grads.cview(), m.view(), v.view(), h);
  const std::vector<float> p1 = p.to_host(be);
  std::vector<float> moved;
  std::vector<double> expected;
  for (std::size_t i = 0; i < p1.size(); ++i) {
    moved.push_back(p0[i] - p1[i]);
    expected.push_back(g[i] > 0 ? 1e-3 : -1e-3);
  }
  // |p| <= 1 in float: a difference of two such values is exact to ~6e-8, i.e. 6e-5 of lr.
  check_close(moved, expected, abs_of(expected), 1e-4, "first step", 0.0);

  CHECK_THROWS_WITH_AS(adamw_update<float>(be, p.view(), grads.cview(), m.view(), v.view(), AdamWUpdate{.step = 0}),
                       doctest::Contains("adamw_update: step: got 0; steps count from 1"), Error);
  CHECK_THROWS_WITH_AS(adamw_update<float>(be, p.view(), grads.cview(), Tensor<float>(m.buffer.data(), Shape{7}),
                                           v.view(), h),
                       doctest::Contains("adamw_update: argument m element count: got 7; expected 1001"), Error);
  CHECK_THROWS_WITH_AS(sgd_momentum_update<float>(be, p.view(), Tensor<const float>(grads.buffer.data(), Shape{3}),
                                                  m.view(), SgdUpdate{}),
                       doctest::Contains("sgd_momentum_update: argument grads element count: got 3"), Error);
}

TEST_CASE("sum_of_squares and sum_elements accumulate in double, deterministically; scale is the float product") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{1001}, std::int64_t{100003},
                               (std::int64_t{1} << 20) + 3}) {
    CAPTURE(n);
    const std::vector<float> x = random_floats(n, 900);
    long double exact = 0;  // 64-bit mantissa: the reference's own rounding stays below 1e-14
    for (float v : x) exact += static_cast<long double>(v) * v;
    const double expected = static_cast<double>(exact);
    const DeviceTensor dx(be, x, Shape{n});
    const double got = sum_of_squares<float>(be, dx.cview());
    CHECK(std::abs(got - expected) <= 1e-12 * expected);
    CHECK(sum_of_squares<float>(be, dx.cview()) == got);  // the same bits again
    // Split ranges add up to the whole.
    const std::int64_t half = n / 2;
    const double parts = sum_of_squares<float>(be, Tensor<const float>(dx.buffer.data(), Shape{half})) +
                         sum_of_squares<float>(be, Tensor<const float>(dx.buffer.data() + half, Shape{n - half}));
    CHECK(std::abs(parts - expected) <= 1e-12 * expected);
    // The same ranges (and an empty one) in one call, one wait: the sum of the two, in double.
    const Tensor<const float> ranges[] = {Tensor<const float>(dx.buffer.data(), Shape{half}), Tensor<const float>{},
                                          Tensor<const float>(dx.buffer.data() + half, Shape{n - half})};
    const double batched = sum_of_squares<float>(be, std::span<const Tensor<const float>>(ranges));
    CHECK(std::abs(batched - expected) <= 1e-12 * expected);
    CHECK(sum_of_squares<float>(be, std::span<const Tensor<const float>>(ranges)) == batched);

    const double factor = 0.37;
    std::vector<float> scaled(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) scaled[i] = x[i] * static_cast<float>(factor);
    scale<float>(be, dx.view(), factor);
    CHECK(dx.to_host(be) == scaled);
  }
  // sum_elements: the same passes without the squares, against a long double sum.
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{1001}, (std::int64_t{1} << 20) + 3}) {
    CAPTURE(n);
    const std::vector<float> x = random_floats(n, 901);
    long double exact = 0, magnitude = 0;
    for (float v : x) {
      exact += v;
      magnitude += std::abs(v);
    }
    const DeviceTensor dx(be, x, Shape{n});
    const double got = sum_elements<float>(be, dx.cview());
    CHECK(std::abs(got - static_cast<double>(exact)) <= 1e-12 * static_cast<double>(magnitude));
    CHECK(sum_elements<float>(be, dx.cview()) == got);
  }
  // 2^24 + 1 ones: a float accumulator would stop at 2^24.
  const std::int64_t ones = (std::int64_t{1} << 24) + 1;
  const DeviceTensor one(be, std::vector<float>(static_cast<std::size_t>(ones), 1.0f), Shape{ones});
  CHECK(sum_of_squares<float>(be, one.cview()) == 16777217.0);
  CHECK(sum_elements<float>(be, one.cview()) == 16777217.0);
  CHECK(sum_elements<float>(be, Tensor<const float>{}) == 0.0);
  CHECK(sum_of_squares<float>(be, Tensor<const float>{}) == 0.0);
  CHECK(sum_of_squares<float>(be, Tensor<const float>(one.buffer.data(), Shape{0})) == 0.0);
  scale<float>(be, Tensor<float>{}, 2.0);  // empty: left alone
  CHECK(be.memory().current(MemoryCategory::workspace) == one.buffer.bytes());  // the scratch was returned
}

TEST_CASE("sum_of_squares over many parts: blocks of each part, 127 parts a launch, one total in order") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  // 300 parts (three launches' tables) of sizes that end inside a block, on a block's edge, one
  // past it, and empty ones, cut from one buffer out of order (the parts need not be adjacent).
  constexpr std::int64_t block = loom::detail::cuda_reduction::part_block_elements;
  std::vector<std::int64_t> sizes;
  for (int i = 0; i < 300; ++i) {
    const std::int64_t pattern[] = {1, 7, 0, block, block + 1, 3 * block - 5, 1001, 2 * block};
    sizes.push_back(pattern[(i * 5) % 8]);
  }
  std::int64_t n = 0;
  for (const std::int64_t s : sizes) n += s;
  const std::vector<float> x = random_floats(n, 902);
  const DeviceTensor dx(be, x, Shape{n});
  std::vector<Tensor<const float>> parts;
  long double exact = 0;
  std::int64_t offset = n;
  for (const std::int64_t s : sizes) {  // from the end of the buffer backwards
    offset -= s;
    parts.emplace_back(dx.buffer.data() + offset, Shape{s});
    for (std::int64_t i = offset; i < offset + s; ++i)
      exact += static_cast<long double>(x[static_cast<std::size_t>(i)]) * x[static_cast<std::size_t>(i)];
  }
  const double expected = static_cast<double>(exact);
  const double got = sum_of_squares<float>(be, std::span<const Tensor<const float>>(parts));
  CHECK(std::abs(got - expected) <= 1e-12 * expected);
  CHECK(sum_of_squares<float>(be, std::span<const Tensor<const float>>(parts)) == got);  // the same bits
  // Only empty parts, and none at all: 0.
  const std::vector<Tensor<const float>> empty(3, Tensor<const float>(dx.buffer.data(), Shape{0}));
  CHECK(sum_of_squares<float>(be, std::span<const Tensor<const float>>(empty)) == 0.0);
  CHECK(sum_of_squares<float>(be, std::span<const Tensor<const float>>()) == 0.0);
  CHECK(be.memory().current(MemoryCategory::workspace) == dx.buffer.bytes());  // the scratch was returned
}

}  // namespace

int main(int argc, char** argv) { return loom::cuda_test::run_tests(argc, argv); }
