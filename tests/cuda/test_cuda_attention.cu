// The CUDA self-attention kernels, causal and bidirectional, against a plain host reference in
// double, at odd sizes (B in {1,2,3}, T in {1,7,33,65}, NH in {1,3}, hs in {1,5,16}, and one
// GPT-2-like shape), with the CPU kernel's contract: att exactly 0 above the diagonal (causal) or
// nowhere (bidirectional), the backward accumulating (+=), the same bits on every run, shape and
// mask errors named. Both contracts: att saved (attention_forward/backward) and only the row
// log-sum-exp saved (attention_forward_lse/backward_lse, whose backward recomputes the
// probabilities).
//
// Without a GPU the host cases still run: the argument checks, and the kernels' own sequences of
// steps (detail::cuda_attention::forward_steps, backward_steps, forward_lse_steps and
// backward_lse_steps: plans, offsets, order) with cuBLAS emulated on the host (which also checks
// cuBLAS's rules on the leading dimensions and that no two GEMMs of a batch write the same
// element) and the row steps in float, as the kernels do them. Then the program exits with 77
// (ctest: skipped).
//
// Tolerances. A result passes when |got - want| <= tolerance * magnitude + rounding, where
// `magnitude` is the first-order error scale of the products, propagated through the softmax:
// - a GEMM with TF32 products is off by at most 2e-3 of sum |a_i b_i| (tf32_tolerance: TF32
//   keeps 10 mantissa bits, so each product is off by < 2 * 2^-10 of itself even when the
//   hardware truncates; fp32 accumulation adds ~k * 2^-24 of the same sum);
// - scores off by dS_s give probabilities off by p_s * scale * (dS_s - sum_j p_j dS_j), so att's
//   magnitude is p_s * scale * (M_s + sum_j p_j M_j) with M_s = sum_i |q_i k_si|; out and the
//   gradients add sum |terms| of their own GEMM and carry the errors of their inputs the same way;
// - `rounding` is the fp32 rounding of the softmax steps (exp, the row sum of up to T terms, the
//   scaling), bounded by (T + 64) * 2^-24 of the same scale; it does not shrink with TF32's bound;
// - lse = log sum_s exp(x_s scale) moves by sum_s p_s dx_s scale, so its magnitude is
//   scale * sum_s p_s M_s, its rounding (T + 64) * 2^-24 * (1 + |max * scale|);
// - probabilities recomputed from scores and lse carry the forward's att errors (the softmax's
//   first-order error is the same), which the backward reference propagates into the gradients.
// The host emulation (products in double, results rounded to float) is held to float_tolerance
// (1e-5) with the same magnitudes; a wrong stride, offset or transpose is off by O(1). With
// dropout on the probabilities the host steps (DropoutMask::keep for DeviceDropout) are held to
// 1e-5 of each tensor's largest element against a by-definition reference in double.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/cuda/attention.cuh"
#include "loom/core/buffer.hpp"
#include "loom/core/dropout.hpp"
#include "attention_case.hpp"
#include "device_check.hpp"

using namespace loom;
using namespace loom::cuda_test;

namespace {

namespace ca = detail::cuda_attention;

using Case = AttentionCase;

//! Every combination of the odd sizes.
std::vector<Case> odd_cases() {
  std::vector<Case> cases;
  for (const std::int64_t B : {1, 2, 3})
    for (const std::int64_t T : {1, 7, 33, 65})
      for (const std::int64_t NH : {1, 3})
        for (const std::int64_t hs : {1, 5, 16}) cases.push_back({B, T, NH, hs});
  return cases;
}

//! Value, first-order error scale (multiplied by the tolerance) and fp32 rounding allowance.
struct Reference {
  std::vector<double> value, magnitude, rounding;
  explicit Reference(std::size_t n) : value(n, 0.0), magnitude(n, 0.0), rounding(n, 0.0) {}
};

//! |got - want| <= tolerance * magnitude + rounding, element by element.
void check_reference(const std::vector<float>& got, const Reference& r, double tolerance, const std::string& what) {
  std::vector<double> scale(r.magnitude.size());
  for (std::size_t i = 0; i < scale.size(); ++i) scale[i] = r.magnitude[i] + r.rounding[i] / tolerance;
  check_close(got, r.value, scale, tolerance, what, 0.0);
}

double softmax_rounding(std::int64_t T) { return static_cast<double>(T + 64) * std::ldexp(1.0, -24); }

//! Element (b, t, part, h, i) of qkv-like data: part 0, 1, 2 = q, k, v.
struct QkvIndex {
  Case c;
  std::int64_t operator()(std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h, std::int64_t i) const {
    return (b * c.T + t) * 3 * c.C() + part * c.C() + h * c.hs + i;
  }
};

//! The keys [0, keys_seen) that query t sees: t + 1 (causal) or T (bidirectional).
std::int64_t keys_seen(AttentionMask mask, std::int64_t t, std::int64_t T) {
  return mask == AttentionMask::causal ? t + 1 : T;
}

//! The kernels' Dims of case c with `mask`.
detail::attention::Dims dims(const Case& c, AttentionMask mask) {
  detail::attention::Dims d = c.dims();
  d.mask = mask;
  return d;
}

constexpr AttentionMask both_masks[] = {AttentionMask::causal, AttentionMask::bidirectional};

struct ForwardReference {
  Reference att, out, lse;
};

ForwardReference forward_reference(const Case& c, const std::vector<float>& qkv,
                                   AttentionMask mask = AttentionMask::causal) {
  const QkvIndex at{c};
  const std::int64_t T = c.T, C = c.C();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.hs)), rounding = softmax_rounding(T);
  ForwardReference r{Reference(static_cast<std::size_t>(c.B * c.NH * T * T)),
                     Reference(static_cast<std::size_t>(c.B * T * C)),
                     Reference(static_cast<std::size_t>(c.B * c.NH * T))};
  std::vector<double> score(static_cast<std::size_t>(T)), mag(static_cast<std::size_t>(T));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.NH; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t keys = keys_seen(mask, t, T);
        double max = -std::numeric_limits<double>::infinity();
        for (std::int64_t s = 0; s < keys; ++s) {
          score[s] = mag[s] = 0;
          for (std::int64_t i = 0; i < c.hs; ++i) {
            const double term = static_cast<double>(qkv[at(b, t, 0, h, i)]) * qkv[at(b, s, 1, h, i)];
            score[s] += term;
            mag[s] += std::abs(term);
          }
          max = std::max(max, score[s]);
        }
        const std::int64_t row = ((b * c.NH + h) * T + t) * T;
        double sum = 0;
        for (std::int64_t s = 0; s < keys; ++s) sum += std::exp((score[s] - max) * scale);
        double weighted = 0;  // sum_j p_j M_j
        for (std::int64_t s = 0; s < keys; ++s) {
          r.att.value[row + s] = std::exp((score[s] - max) * scale) / sum;
          weighted += r.att.value[row + s] * mag[s];
        }
        for (std::int64_t s = 0; s < keys; ++s) {
          const double p = r.att.value[row + s];
          r.att.magnitude[row + s] = p * scale * (mag[s] + weighted);
          r.att.rounding[row + s] = p * rounding;
        }
        const std::int64_t lse = (b * c.NH + h) * T + t;
        r.lse.value[lse] = max * scale + std::log(sum);
        r.lse.magnitude[lse] = scale * weighted;
        r.lse.rounding[lse] = rounding * (1.0 + std::abs(max * scale));
        // Entries s > t (causal) stay 0 with magnitude 0: they must come out exactly 0.
        for (std::int64_t i = 0; i < c.hs; ++i) {
          const std::int64_t o = (b * T + t) * C + h * c.hs + i;
          for (std::int64_t s = 0; s < keys; ++s) {
            const double v = qkv[at(b, s, 2, h, i)];
            r.out.value[o] += r.att.value[row + s] * v;
            r.out.magnitude[o] += (r.att.value[row + s] + r.att.magnitude[row + s]) * std::abs(v);
            r.out.rounding[o] += r.att.rounding[row + s] * std::abs(v);
          }
        }
      }
  return r;
}

//! dqkv0 + the gradient w.r.t. qkv, from the float att the kernel reads. Where `att_error` is
//! given, the kernel computes att itself (the lse backward recomputes it) with that error, which
//! is propagated into the gradients' magnitude and rounding.
Reference backward_reference(const Case& c, const std::vector<float>& qkv, const std::vector<float>& att,
                             const std::vector<float>& dout, const std::vector<float>& dqkv0,
                             const Reference* att_error = nullptr, AttentionMask mask = AttentionMask::causal) {
  const QkvIndex at{c};
  const std::int64_t T = c.T, C = c.C();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.hs)), rounding = softmax_rounding(T);
  Reference r(dqkv0.size());
  for (std::size_t i = 0; i < dqkv0.size(); ++i) {
    r.value[i] = dqkv0[i];
    r.magnitude[i] = std::abs(dqkv0[i]);
  }
  std::vector<double> datt(static_cast<std::size_t>(T)), dmag(static_cast<std::size_t>(T)),
      dpre(static_cast<std::size_t>(T)), dpre_mag(static_cast<std::size_t>(T)),
      dpre_round(static_cast<std::size_t>(T)), att_mag(static_cast<std::size_t>(T), 0.0),
      att_round(static_cast<std::size_t>(T), 0.0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.NH; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t row = ((b * c.NH + h) * T + t) * T, keys = keys_seen(mask, t, T);
        const float* a = att.data() + row;
        if (att_error != nullptr)
          for (std::int64_t s = 0; s < keys; ++s) {
            att_mag[s] = att_error->magnitude[row + s];
            att_round[s] = att_error->rounding[row + s];
          }
        const float* g = dout.data() + (b * T + t) * C + h * c.hs;
        double shift = 0, weighted = 0;
        for (std::int64_t s = 0; s < keys; ++s) {
          datt[s] = dmag[s] = 0;
          for (std::int64_t i = 0; i < c.hs; ++i) {
            const double term = static_cast<double>(g[i]) * qkv[at(b, s, 2, h, i)];
            datt[s] += term;
            dmag[s] += std::abs(term);
          }
          shift += a[s] * datt[s];
          weighted += a[s] * dmag[s];
        }
        double shift_mag = 0, shift_round = 0;  // of sum_s att datt from att's errors
        for (std::int64_t s = 0; s < keys; ++s) {
          shift_mag += att_mag[s] * std::abs(datt[s]);
          shift_round += att_round[s] * std::abs(datt[s]);
        }
        for (std::int64_t s = 0; s < keys; ++s) {
          dpre[s] = a[s] * (datt[s] - shift) * scale;
          dpre_mag[s] = scale * (a[s] * (dmag[s] + weighted + shift_mag) + att_mag[s] * std::abs(datt[s] - shift));
          dpre_round[s] = scale * (a[s] * shift_round + att_round[s] * std::abs(datt[s] - shift));
        }
        for (std::int64_t s = 0; s < keys; ++s)
          for (std::int64_t i = 0; i < c.hs; ++i) {
            const std::int64_t dq = at(b, t, 0, h, i), dk = at(b, s, 1, h, i), dv = at(b, s, 2, h, i);
            const double q = qkv[dq], k = qkv[dk], value_term = static_cast<double>(a[s]) * g[i];
            r.value[dv] += value_term;
            r.magnitude[dv] += std::abs(value_term) + att_mag[s] * std::abs(g[i]);
            r.rounding[dv] += att_round[s] * std::abs(g[i]);
            r.value[dq] += dpre[s] * k;
            r.magnitude[dq] += (std::abs(dpre[s]) + dpre_mag[s]) * std::abs(k);
            r.rounding[dq] += (rounding * dpre_mag[s] + dpre_round[s]) * std::abs(k);
            r.value[dk] += dpre[s] * q;
            r.magnitude[dk] += (std::abs(dpre[s]) + dpre_mag[s]) * std::abs(q);
            r.rounding[dk] += (rounding * dpre_mag[s] + dpre_round[s]) * std::abs(q);
          }
      }
  return r;
}

std::vector<float> to_float(const std::vector<double>& v) { return {v.begin(), v.end()}; }

const float not_a_number = std::numeric_limits<float>::quiet_NaN();

// ------------------------------------------------------------------------------------------
// The kernels' step sequences on the host: cuBLAS emulated, the softmax steps in float as the
// kernels do them.

//! cuBLAS's strided-batched GEMM on the host, in double, rounded to float: C = op(A) op(B)
//! (beta 0: C is not read, as in cuBLAS) or C += op(A) op(B). Checks cuBLAS's rules on the
//! leading dimensions and that no element is written twice in one call.
void emulate_cublas(const ca::BatchedGemm& bg, const float* a, const float* b, float* c, float beta) {
  const detail::cuda_matmul::Gemm& g = bg.gemm;
  REQUIRE(g.lda >= std::max<std::int64_t>(1, g.op_a == CUBLAS_OP_N ? g.m : g.k));
  REQUIRE(g.ldb >= std::max<std::int64_t>(1, g.op_b == CUBLAS_OP_N ? g.k : g.n));
  REQUIRE(g.ldc >= std::max<std::int64_t>(1, g.m));
  std::set<const float*> written;
  std::int64_t written_twice = 0;
  for (std::int64_t batch = 0; batch < bg.batch; ++batch) {
    const float* A = a + batch * bg.stride_a;
    const float* B = b + batch * bg.stride_b;
    float* out = c + batch * bg.stride_c;
    for (std::int64_t j = 0; j < g.n; ++j)
      for (std::int64_t i = 0; i < g.m; ++i) {
        double sum = 0;
        for (std::int64_t l = 0; l < g.k; ++l) {
          const double x = g.op_a == CUBLAS_OP_N ? A[i + l * g.lda] : A[l + i * g.lda];
          const double y = g.op_b == CUBLAS_OP_N ? B[l + j * g.ldb] : B[j + l * g.ldb];
          sum += x * y;
        }
        float& dst = out[i + j * g.ldc];
        written_twice += !written.insert(&dst).second;
        dst = beta == 0.0f ? static_cast<float>(sum) : static_cast<float>(sum + static_cast<double>(beta) * dst);
      }
  }
  CHECK(written_twice == 0);
}

//! softmax_forward_kernel's arithmetic on one row whose query sees keys [0, keys), sequentially
//! (the log-sum-exp into `lse` where it is not null).
void host_softmax_row(float* a, std::int64_t keys, std::int64_t tokens, float scale, float* lse = nullptr) {
  float max = a[0];
  for (std::int64_t s = 0; s < keys; ++s) max = std::fmax(max, a[s]);
  float sum = 0;
  for (std::int64_t s = 0; s < keys; ++s) sum += a[s] = std::exp((a[s] - max) * scale);
  if (lse != nullptr) *lse = keys > 0 ? max * scale + std::log(sum) : 0.0f;  // a padded query sees no key
  const float inverse = keys > 0 ? 1.0f / sum : 0.0f;
  for (std::int64_t s = 0; s < keys; ++s) a[s] *= inverse;
  for (std::int64_t s = keys; s < tokens; ++s) a[s] = 0.0f;
}

//! probabilities_kernel's arithmetic on one row.
void host_probabilities_row(float* a, float lse, std::int64_t keys, std::int64_t tokens, float scale) {
  for (std::int64_t s = 0; s < keys; ++s) a[s] = std::exp(std::fma(a[s], scale, -lse));
  for (std::int64_t s = keys; s < tokens; ++s) a[s] = 0.0f;
}

//! softmax_backward_kernel's arithmetic on one row, sequentially.
void host_softmax_grad_row(float* g, const float* a, std::int64_t keys, std::int64_t tokens, float scale) {
  float dot = 0;
  for (std::int64_t s = 0; s < keys; ++s) dot += a[s] * g[s];
  for (std::int64_t s = 0; s < keys; ++s) g[s] = a[s] * (g[s] - dot) * scale;
  for (std::int64_t s = keys; s < tokens; ++s) g[s] = 0.0f;
}

//! attention_forward's steps on the host: the same plans, offsets and order.
void emulate_forward(const Case& c, const std::vector<float>& qkv, std::vector<float>& att, std::vector<float>& out,
                     AttentionMask mask = AttentionMask::causal) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.hs));
  ca::forward_steps(dims(c, mask), out.data(), att.data(), qkv.data(), emulate_cublas,
                    [&](float* scores, std::int64_t, std::int64_t rows) {
                      for (std::int64_t row = 0; row < rows; ++row)
                        host_softmax_row(scores + row * c.T, keys_seen(mask, row % c.T, c.T), c.T, scale);
                    });
}

//! softmax_backward_kernel's steps on the host, as the steps' run_softmax_grad.
auto host_softmax_grad(const Case& c, AttentionMask mask) {
  return [c, mask, scale = 1.0f / std::sqrt(static_cast<float>(c.hs))](float* grad, const float* probabilities,
                                                                        std::int64_t, std::int64_t rows) {
    for (std::int64_t row = 0; row < rows; ++row)
      host_softmax_grad_row(grad + row * c.T, probabilities + row * c.T, keys_seen(mask, row % c.T, c.T), c.T,
                            scale);
  };
}

//! One [NH,T,T] scratch block of NaNs: the steps must write every element they read.
std::vector<float> scratch_block(const Case& c) {
  return std::vector<float>(static_cast<std::size_t>(c.NH * c.T * c.T), not_a_number);
}

//! attention_backward's steps on the host: the same plans, offsets and order.
void emulate_backward(const Case& c, std::vector<float>& dqkv, const std::vector<float>& dout,
                      const std::vector<float>& qkv, const std::vector<float>& att,
                      AttentionMask mask = AttentionMask::causal, GradientWrite write = GradientWrite::accumulate) {
  std::vector<float> dpre = scratch_block(c);
  ca::backward_steps(dims(c, mask), dqkv.data(), dout.data(), qkv.data(), att.data(), dpre.data(), emulate_cublas,
                     host_softmax_grad(c, mask), ca::NoDropout{}, write);
}

//! attention_forward_lse's steps on the host.
void emulate_forward_lse(const Case& c, const std::vector<float>& qkv, std::vector<float>& lse,
                         std::vector<float>& out, AttentionMask mask = AttentionMask::causal) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.hs));
  std::vector<float> att = scratch_block(c);
  ca::forward_lse_steps(dims(c, mask), out.data(), lse.data(), qkv.data(), att.data(), emulate_cublas,
                        [&](float* scores, float* lse_b, std::int64_t, std::int64_t rows) {
                          for (std::int64_t row = 0; row < rows; ++row)
                            host_softmax_row(scores + row * c.T, keys_seen(mask, row % c.T, c.T), c.T, scale,
                                             lse_b + row);
                        });
}

//! attention_backward_lse's steps on the host.
void emulate_backward_lse(const Case& c, std::vector<float>& dqkv, const std::vector<float>& dout,
                          const std::vector<float>& qkv, const std::vector<float>& lse,
                          AttentionMask mask = AttentionMask::causal, GradientWrite write = GradientWrite::accumulate) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.hs));
  std::vector<float> att = scratch_block(c), dpre = scratch_block(c);
  ca::backward_lse_steps(
      dims(c, mask), dqkv.data(), dout.data(), qkv.data(), lse.data(), att.data(), dpre.data(), emulate_cublas,
      [&](float* scores, const float* lse_b, std::int64_t, std::int64_t rows) {
        for (std::int64_t row = 0; row < rows; ++row)
          host_probabilities_row(scores + row * c.T, lse_b[row], keys_seen(mask, row % c.T, c.T), c.T, scale);
      },
      host_softmax_grad(c, mask), ca::NoDropout{}, write);
}

struct Data {
  std::vector<float> qkv, dout, dqkv0;
};

Data make_data(const Case& c, std::uint32_t seed) {
  return {random_floats(c.B * c.T * 3 * c.C(), seed), random_floats(c.B * c.T * c.C(), seed + 1),
          random_floats(c.B * c.T * 3 * c.C(), seed + 2)};
}

//! How many entries s > t of att are not exactly +0.
std::int64_t nonzero_above_diagonal(const Case& c, const std::vector<float>& att) {
  std::int64_t count = 0;
  for (std::int64_t row = 0; row < c.B * c.NH * c.T; ++row)
    for (std::int64_t s = row % c.T + 1; s < c.T; ++s) {
      const float x = att[row * c.T + s];
      count += !(x == 0.0f && !std::signbit(x));
    }
  return count;
}

//! How many entries of att are not > 0 (with the bidirectional mask, every key has a probability).
std::int64_t not_positive(const std::vector<float>& att) {
  return std::count_if(att.begin(), att.end(), [](float x) { return !(x > 0.0f); });
}

//! att's mask property: exact zeros above the diagonal (causal) or no zero at all (bidirectional).
void check_masked(const Case& c, const std::vector<float>& att, AttentionMask mask) {
  if (mask == AttentionMask::causal) CHECK(nonzero_above_diagonal(c, att) == 0);
  else CHECK(not_positive(att) == 0);
}

// ------------------------------------------------------------------------------------------
// Host cases: run with or without a GPU.

TEST_CASE("the attention algorithm with the cuBLAS plans matches the reference (host emulation of cuBLAS)") {
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : odd_cases()) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, 11);
      const ForwardReference ref = forward_reference(c, data.qkv, mask);
      std::vector<float> att(ref.att.value.size(), not_a_number), out(ref.out.value.size(), not_a_number);
      emulate_forward(c, data.qkv, att, out, mask);
      check_reference(att, ref.att, float_tolerance, "att");
      check_masked(c, att, mask);
      check_reference(out, ref.out, float_tolerance, "out");

      const std::vector<float> att_in = to_float(ref.att.value);
      const Reference dref = backward_reference(c, data.qkv, att_in, data.dout, data.dqkv0, nullptr, mask);
      std::vector<float> dqkv = data.dqkv0;
      emulate_backward(c, dqkv, data.dout, data.qkv, att_in, mask);
      check_reference(dqkv, dref, float_tolerance, "dqkv");

      // Only lse saved: the forward's lse, then the backward recomputing att from it.
      std::vector<float> lse(ref.lse.value.size(), not_a_number), lse_out(ref.out.value.size(), not_a_number);
      emulate_forward_lse(c, data.qkv, lse, lse_out, mask);
      check_reference(lse, ref.lse, float_tolerance, "lse");
      check_reference(lse_out, ref.out, float_tolerance, "out (lse)");
      const Reference lse_dref = backward_reference(c, data.qkv, att_in, data.dout, data.dqkv0, &ref.att, mask);
      std::vector<float> lse_dqkv = data.dqkv0;
      emulate_backward_lse(c, lse_dqkv, data.dout, data.qkv, lse, mask);
      check_reference(lse_dqkv, lse_dref, float_tolerance, "dqkv (lse)");

      // Overwriting (GradientWrite::overwrite, beta 0): dqkv starts as NaN and ends as the gradient.
      const std::vector<float> zeros(data.dqkv0.size(), 0.0f);
      std::vector<float> written(zeros.size(), not_a_number), lse_written(zeros.size(), not_a_number);
      emulate_backward(c, written, data.dout, data.qkv, att_in, mask, GradientWrite::overwrite);
      check_reference(written, backward_reference(c, data.qkv, att_in, data.dout, zeros, nullptr, mask),
                      float_tolerance, "dqkv (overwrite)");
      emulate_backward_lse(c, lse_written, data.dout, data.qkv, lse, mask, GradientWrite::overwrite);
      check_reference(lse_written, backward_reference(c, data.qkv, att_in, data.dout, zeros, &ref.att, mask),
                      float_tolerance, "dqkv (lse, overwrite)");
    }
  }
}

namespace {

//! The steps' `drop` on the host: DropoutMask::keep over batch element b's [NH,T,T] block, whose
//! elements are the global tensor's from head_origin(b, 0, T) on (as DeviceDropout draws them).
struct HostDropout {
  AttentionDropout dropout;
  std::int64_t tokens, block;
  mutable std::vector<float> dropped;

  float through(float x, std::uint64_t element) const {
    return dropout.mask.keep(element) ? x * static_cast<float>(dropout.mask.scale()) : 0.0f;
  }
  const float* probabilities(const float* att_b, std::int64_t b) const {
    dropped.resize(static_cast<std::size_t>(block));
    for (std::int64_t i = 0; i < block; ++i) dropped[i] = through(att_b[i], dropout.head_origin(b, 0, tokens) + i);
    return dropped.data();
  }
  void gradient(float* g, std::int64_t b) const {
    for (std::int64_t i = 0; i < block; ++i) g[i] = through(g[i], dropout.head_origin(b, 0, tokens) + i);
  }
};

//! out and dqkv (from 0) of attention with dropout on the probabilities, by the definitions, in
//! double: out = dropout(P)·v; dv = dropout(P)^T dout; dP = mask(dout·v^T); dS = P ∘ (dP - Σ P dP).
//! (Also the padded reference: with `lengths`, query t of sequence b sees keys below lengths[b] only.)
std::pair<std::vector<double>, std::vector<double>> dropout_reference(
    const Case& c, const std::vector<float>& qkv, const std::vector<float>& dout, AttentionMask mask,
    const AttentionDropout& drop, const std::vector<std::int32_t>* lengths = nullptr) {
  const QkvIndex at{c};
  const std::int64_t T = c.T, C = c.C();
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.hs));
  std::vector<double> out(static_cast<std::size_t>(c.B * T * C), 0.0), dqkv(qkv.size(), 0.0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.NH; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t length = lengths != nullptr ? (*lengths)[b] : T;
        const std::int64_t keys = t < length ? std::min<std::int64_t>(keys_seen(mask, t, T), length) : 0;
        std::vector<double> p(static_cast<std::size_t>(keys)), kept(p.size()), dp(p.size());
        double max = -std::numeric_limits<double>::infinity(), sum = 0, shift = 0;
        for (std::int64_t s = 0; s < keys; ++s) {
          p[s] = 0;
          for (std::int64_t i = 0; i < c.hs; ++i) p[s] += static_cast<double>(qkv[at(b, t, 0, h, i)]) * qkv[at(b, s, 1, h, i)];
          max = std::max(max, p[s]);
        }
        for (auto& x : p) sum += (x = std::exp((x - max) * scale));
        for (std::int64_t s = 0; s < keys; ++s) {
          p[s] /= sum;
          const bool keep = drop.mask.keep(drop.head_origin(b, h, T) + static_cast<std::uint64_t>(t * T + s));
          kept[s] = keep ? drop.mask.scale() : 0.0;
          dp[s] = 0;
          for (std::int64_t i = 0; i < c.hs; ++i) {
            const double g = dout[(b * T + t) * C + h * c.hs + i], v = qkv[at(b, s, 2, h, i)];
            out[(b * T + t) * C + h * c.hs + i] += p[s] * kept[s] * v;
            dqkv[at(b, s, 2, h, i)] += p[s] * kept[s] * g;
            dp[s] += g * v * kept[s];
          }
          shift += p[s] * dp[s];
        }
        for (std::int64_t s = 0; s < keys; ++s)
          for (std::int64_t i = 0; i < c.hs; ++i) {
            const double ds = p[s] * (dp[s] - shift) * scale;
            dqkv[at(b, t, 0, h, i)] += ds * qkv[at(b, s, 1, h, i)];
            dqkv[at(b, s, 1, h, i)] += ds * qkv[at(b, t, 0, h, i)];
          }
      }
  return {out, dqkv};
}

//! max |got - want| over max |want|.
double scaled_error(const std::vector<float>& got, const std::vector<double>& want) {
  double error = 0, size = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    error = std::max(error, std::abs(static_cast<double>(got[i]) - want[i]));
    size = std::max(size, std::abs(want[i]));
  }
  return error / size;
}

}  // namespace

TEST_CASE("with dropout the steps multiply V by the dropped probabilities and pass datt through the mask (host "
          "emulation of cuBLAS)") {
  for (const AttentionMask mask : both_masks)
    for (const Case& c : {Case{2, 7, 3, 5}, Case{2, 33, 3, 16}}) {
      INFO(loom::name(mask));
      CAPTURE(c);
      // Heads 1..3 of a model with 5, the micro-batch from the global batch's fourth sequence on.
      const AttentionDropout dropout{.mask = DropoutMask(DropoutKey{.seed = 9, .step = 2}, 3, 2, 0.3),
                                     .first_sequence = 3,
                                     .heads = 5,
                                     .first_head = 1};
      const HostDropout drop{dropout, c.T, c.NH * c.T * c.T, {}};
      const Data data = make_data(c, 13);
      const auto [want_out, want_dqkv] = dropout_reference(c, data.qkv, data.dout, mask, dropout);
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.hs));
      const auto softmax = [&](float* scores, std::int64_t, std::int64_t rows) {
        for (std::int64_t row = 0; row < rows; ++row)
          host_softmax_row(scores + row * c.T, keys_seen(mask, row % c.T, c.T), c.T, scale);
      };
      std::vector<float> att(static_cast<std::size_t>(c.B * c.NH * c.T * c.T), not_a_number),
          out(want_out.size(), not_a_number), dqkv(data.qkv.size(), 0.0f), dpre = scratch_block(c);
      ca::forward_steps(dims(c, mask), out.data(), att.data(), data.qkv.data(), emulate_cublas, softmax, drop);
      ca::backward_steps(dims(c, mask), dqkv.data(), data.dout.data(), data.qkv.data(), att.data(), dpre.data(),
                         emulate_cublas, host_softmax_grad(c, mask), drop);
      CHECK(scaled_error(out, want_out) < 1e-5);
      CHECK(scaled_error(dqkv, want_dqkv) < 1e-5);
      // Only lse kept: the same out and gradient.
      std::vector<float> lse(static_cast<std::size_t>(c.B * c.NH * c.T), not_a_number), lse_out(out.size(), not_a_number),
          lse_dqkv(dqkv.size(), 0.0f), probabilities = scratch_block(c), lse_dpre = scratch_block(c);
      ca::forward_lse_steps(
          dims(c, mask), lse_out.data(), lse.data(), data.qkv.data(), probabilities.data(), emulate_cublas,
          [&](float* scores, float* lse_b, std::int64_t, std::int64_t rows) {
            for (std::int64_t row = 0; row < rows; ++row)
              host_softmax_row(scores + row * c.T, keys_seen(mask, row % c.T, c.T), c.T, scale, lse_b + row);
          },
          drop);
      ca::backward_lse_steps(
          dims(c, mask), lse_dqkv.data(), data.dout.data(), data.qkv.data(), lse.data(), probabilities.data(),
          lse_dpre.data(), emulate_cublas,
          [&](float* scores, const float* lse_b, std::int64_t, std::int64_t rows) {
            for (std::int64_t row = 0; row < rows; ++row)
              host_probabilities_row(scores + row * c.T, lse_b[row], keys_seen(mask, row % c.T, c.T), c.T, scale);
          },
          host_softmax_grad(c, mask), drop);
      CHECK(scaled_error(lse_out, want_out) < 1e-5);
      CHECK(scaled_error(lse_dqkv, want_dqkv) < 1e-5);
      // And the mask matters: without it the steps give another out.
      std::vector<float> plain(out.size(), not_a_number);
      ca::forward_steps(dims(c, mask), plain.data(), att.data(), data.qkv.data(), emulate_cublas, softmax);
      CHECK(scaled_error(plain, want_out) > 1e-2);
    }
}

TEST_CASE("padded sequences: the steps hand each row kernel its first sequence, whose lengths mask the keys (host "
          "emulation of cuBLAS)") {
  for (const AttentionMask mask : both_masks)
    for (const Case& c : {Case{3, 7, 2, 5}, Case{2, 33, 3, 16}}) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const std::vector<std::int32_t> lengths =
          c.B == 3 ? std::vector<std::int32_t>{1, 7, 4} : std::vector<std::int32_t>{20, 33};
      const Data data = make_data(c, 14);
      const auto [want_out, want_dqkv] = dropout_reference(c, data.qkv, data.dout, mask, {}, &lengths);
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.hs));
      const std::int64_t per_sequence = c.NH * c.T;
      // The device kernels' rule (RowKeys): row r of a block from sequence `first` is sequence
      // first + r / (NH T)'s query r % T, which sees no key if it is padding.
      const auto keys_of = [&](std::int64_t first, std::int64_t row) -> std::int64_t {
        const std::int64_t t = row % c.T, length = lengths[first + row / per_sequence];
        return t < length ? std::min<std::int64_t>(keys_seen(mask, t, c.T), length) : 0;
      };
      detail::attention::Dims d = dims(c, mask);
      d.lengths = lengths.data();
      std::vector<float> att(static_cast<std::size_t>(c.B * c.NH * c.T * c.T), not_a_number),
          out(want_out.size(), not_a_number), dqkv(data.qkv.size(), 0.0f), dpre = scratch_block(c);
      const auto softmax_grad = [&](float* grad, const float* probabilities, std::int64_t first, std::int64_t rows) {
        for (std::int64_t row = 0; row < rows; ++row)
          host_softmax_grad_row(grad + row * c.T, probabilities + row * c.T, keys_of(first, row), c.T, scale);
      };
      ca::forward_steps(d, out.data(), att.data(), data.qkv.data(), emulate_cublas,
                        [&](float* scores, std::int64_t first, std::int64_t rows) {
                          for (std::int64_t row = 0; row < rows; ++row)
                            host_softmax_row(scores + row * c.T, keys_of(first, row), c.T, scale);
                        });
      ca::backward_steps(d, dqkv.data(), data.dout.data(), data.qkv.data(), att.data(), dpre.data(), emulate_cublas,
                         softmax_grad);
      CHECK(scaled_error(out, want_out) < 1e-5);
      CHECK(scaled_error(dqkv, want_dqkv) < 1e-5);
      std::vector<float> lse(static_cast<std::size_t>(c.B * c.NH * c.T), not_a_number),
          lse_out(out.size(), not_a_number), lse_dqkv(dqkv.size(), 0.0f), probabilities = scratch_block(c),
          lse_dpre = scratch_block(c);
      ca::forward_lse_steps(d, lse_out.data(), lse.data(), data.qkv.data(), probabilities.data(), emulate_cublas,
                            [&](float* scores, float* lse_b, std::int64_t first, std::int64_t rows) {
                              for (std::int64_t row = 0; row < rows; ++row)
                                host_softmax_row(scores + row * c.T, keys_of(first, row), c.T, scale, lse_b + row);
                            });
      ca::backward_lse_steps(d, lse_dqkv.data(), data.dout.data(), data.qkv.data(), lse.data(), probabilities.data(),
                             lse_dpre.data(), emulate_cublas,
                             [&](float* scores, const float* lse_b, std::int64_t first, std::int64_t rows) {
                               for (std::int64_t row = 0; row < rows; ++row)
                                 host_probabilities_row(scores + row * c.T, lse_b[row], keys_of(first, row), c.T,
                                                        scale);
                             },
                             softmax_grad);
      CHECK(scaled_error(lse_out, want_out) < 1e-5);
      CHECK(scaled_error(lse_dqkv, want_dqkv) < 1e-5);
      // The lengths matter: the unpadded reference is another out.
      CHECK(scaled_error(out, dropout_reference(c, data.qkv, data.dout, mask, {}).first) > 1e-2);
    }
}

TEST_CASE("the bidirectional steps change every query's out but the last one's (host emulation of cuBLAS)") {
  // Steps that ignored the mask would give the causal out, which differs from the bidirectional
  // one far beyond the tolerance for every query but the last (which sees every key either way).
  const Case c{2, 33, 3, 5};
  const Data data = make_data(c, 12);
  const ForwardReference causal = forward_reference(c, data.qkv);
  std::vector<float> att(causal.att.value.size(), not_a_number), out(causal.out.value.size(), not_a_number);
  emulate_forward(c, data.qkv, att, out, AttentionMask::bidirectional);
  const std::int64_t C = c.C();
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < c.T; ++t) {
      double diff = 0;
      for (std::int64_t i = 0; i < C; ++i) {
        const std::size_t o = static_cast<std::size_t>((b * c.T + t) * C + i);
        diff = std::max(diff, std::abs(static_cast<double>(out[o]) - causal.out.value[o]));
      }
      CAPTURE(b);
      CAPTURE(t);
      if (t + 1 < c.T) CHECK(diff > 1e-3);
      else CHECK(diff <= 1e-5);
    }
}

TEST_CASE("attention checks name the kernel and the argument, in the CPU kernel's order (host side)") {
  namespace a = detail::attention;
  std::vector<float> storage(1024, 0.0f);
  float* p = storage.data();
  const std::int64_t B = 2, T = 5, C = 6;
  const Tensor<const float> qkv(p, {B, T, 3 * C}), dout(p, {B, T, C}), att_c(p, {B, 2, T, T});
  const Tensor<float> out(p, {B, T, C}), att(p, {B, 2, T, T}), dqkv(p, {B, T, 3 * C});

  const a::Dims d = a::check_forward(out, att, qkv, 2);
  CHECK(d.batch == B);
  CHECK(d.tokens == T);
  CHECK(d.channels == C);
  CHECK(d.heads == 2);
  CHECK(d.head_size == 3);
  CHECK_NOTHROW(a::check_backward(dqkv, dout, qkv, att_c, 2));

  CHECK_THROWS_WITH_AS(a::check_forward(out, att, Tensor<const float>(p, {B * T, 3 * C}), 2),
                       "loom: attention_forward: argument qkv shape: got [10, 18]; expected [B, T, 3C] (rank 3, "
                       "last extent a multiple of 3)",
                       Error);
  CHECK_THROWS_WITH_AS(a::check_forward(out, att, Tensor<const float>(p, {B, T, 20}), 2),
                       doctest::Contains("attention_forward: argument qkv shape: got [2, 5, 20]"), Error);
  CHECK_THROWS_WITH_AS(a::check_forward(out, att, qkv, 0),
                       "loom: attention_forward: argument num_heads: got 0; must be > 0", Error);
  CHECK_THROWS_WITH_AS(a::check_forward(out, att, qkv, 4),
                       "loom: attention_forward: argument num_heads: got 4; must divide the channels C = 6", Error);
  // out before att, as on the CPU.
  CHECK_THROWS_WITH_AS(a::check_forward(Tensor<float>(p, {B * T, C}), Tensor<float>(p, {B, 3, T, T}), qkv, 2),
                       "loom: attention_forward: argument out shape: got [10, 6]; expected [2, 5, 6]", Error);
  CHECK_THROWS_WITH_AS(a::check_forward(out, Tensor<float>(p, {B, 3, T, T}), qkv, 2),
                       "loom: attention_forward: argument att shape: got [2, 3, 5, 5]; expected [2, 2, 5, 5]", Error);
  CHECK_THROWS_WITH_AS(a::check_forward(Tensor<float>(nullptr, {B, T, C}), att, qkv, 2),
                       "loom: attention_forward: argument out: got a tensor without data; a required argument "
                       "needs 60 elements of storage",
                       Error);

  CHECK_THROWS_WITH_AS(a::check_backward(dqkv, dout, qkv, att_c, 4),
                       "loom: attention_backward: argument num_heads: got 4; must divide the channels C = 6", Error);
  CHECK_THROWS_WITH_AS(a::check_backward(Tensor<float>(p, {B, 3 * C, T}), dout, qkv, att_c, 2),
                       "loom: attention_backward: argument dqkv shape: got [2, 18, 5]; expected [2, 5, 18]", Error);
  CHECK_THROWS_WITH_AS(a::check_backward(dqkv, Tensor<const float>(p, {B, C, T}), qkv, att_c, 2),
                       "loom: attention_backward: argument dout shape: got [2, 6, 5]; expected [2, 5, 6]", Error);
  CHECK_THROWS_WITH_AS(a::check_backward(dqkv, dout, qkv, Tensor<const float>(p, {B, 2, T, T + 1}), 2),
                       "loom: attention_backward: argument att shape: got [2, 2, 5, 6]; expected [2, 2, 5, 5]", Error);
  CHECK_THROWS_WITH_AS(a::check_backward(dqkv, dout, qkv, Tensor<const float>(nullptr, {B, 2, T, T}), 2),
                       doctest::Contains("attention_backward: argument att: got a tensor without data"), Error);

  // The mask: carried in Dims (causal by default), checked first.
  CHECK(a::check_forward(out, att, qkv, 2).mask == AttentionMask::causal);
  CHECK(a::check_forward(out, att, qkv, 2, AttentionMask::bidirectional).mask == AttentionMask::bidirectional);
  CHECK(a::check_backward(dqkv, dout, qkv, att_c, 2, AttentionMask::bidirectional).keys(1) == T);
  CHECK(a::check_backward(dqkv, dout, qkv, att_c, 2).keys(1) == 2);
  // Padded: the lengths ride in Dims too ([B] or refused), and cap every query's keys.
  const std::vector<std::int32_t> lengths{3, 5}, three{3, 5, 5};
  const AttentionKeys keys(AttentionMask::bidirectional, Tensor<const std::int32_t>(lengths.data(), {B}));
  const a::Dims padded = a::check_backward(dqkv, dout, qkv, att_c, 2, keys);
  CHECK(padded.lengths == lengths.data());
  CHECK(padded.keys(0, padded.length(0)) == 3);
  CHECK(padded.keys(4, padded.length(1)) == T);
  const AttentionKeys three_keys(AttentionMask::causal, Tensor<const std::int32_t>(three.data(), {3}));
  CHECK_THROWS_WITH_AS(a::check_forward(out, att, qkv, 2, three_keys),
                       doctest::Contains("attention_forward: argument lengths shape: got [3]; expected [2]"), Error);
  CHECK_THROWS_WITH_AS(a::check_forward(out, att, qkv, 4, static_cast<AttentionMask>(7)),
                       "loom: attention_forward: argument mask: got 7; expected AttentionMask::causal or "
                       "AttentionMask::bidirectional",
                       Error);
  CHECK_THROWS_WITH_AS(a::check_backward(dqkv, dout, qkv, att_c, 2, static_cast<AttentionMask>(2)),
                       doctest::Contains("attention_backward: argument mask: got 2"), Error);
}

TEST_CASE("attention_lse checks name the kernel and the argument, lse [B, NH, T] (host side)") {
  namespace a = detail::attention;
  std::vector<float> storage(1024, 0.0f);
  float* p = storage.data();
  const std::int64_t B = 2, T = 5, C = 6;
  const Tensor<const float> qkv(p, {B, T, 3 * C}), dout(p, {B, T, C}), lse_c(p, {B, 2, T});
  const Tensor<float> out(p, {B, T, C}), lse(p, {B, 2, T}), dqkv(p, {B, T, 3 * C});

  const a::Dims d = a::check_forward_lse(out, lse, qkv, 2);
  CHECK(d.heads == 2);
  CHECK(d.head_size == 3);
  CHECK_NOTHROW(a::check_backward_lse(dqkv, dout, qkv, dout, lse_c, 2));

  CHECK_THROWS_WITH_AS(a::check_forward_lse(out, lse, qkv, 4),
                       "loom: attention_forward_lse: argument num_heads: got 4; must divide the channels C = 6",
                       Error);
  CHECK_THROWS_WITH_AS(a::check_forward_lse(out, Tensor<float>(p, {B, 2, T, T}), qkv, 2),
                       "loom: attention_forward_lse: argument lse shape: got [2, 2, 5, 5]; expected [2, 2, 5]",
                       Error);
  CHECK_THROWS_WITH_AS(a::check_forward_lse(out, Tensor<float>(nullptr, {B, 2, T}), qkv, 2),
                       doctest::Contains("attention_forward_lse: argument lse: got a tensor without data"), Error);
  CHECK_THROWS_WITH_AS(a::check_backward_lse(Tensor<float>(p, {B, 3 * C, T}), dout, qkv, dout, lse_c, 2),
                       "loom: attention_backward_lse: argument dqkv shape: got [2, 18, 5]; expected [2, 5, 18]",
                       Error);
  CHECK_THROWS_WITH_AS(a::check_backward_lse(dqkv, dout, qkv, Tensor<const float>(p, {B, C, T}), lse_c, 2),
                       "loom: attention_backward_lse: argument out shape: got [2, 6, 5]; expected [2, 5, 6]", Error);
  CHECK_THROWS_WITH_AS(a::check_backward_lse(dqkv, dout, qkv, dout, Tensor<const float>(p, {B, 3, T}), 2),
                       "loom: attention_backward_lse: argument lse shape: got [2, 3, 5]; expected [2, 2, 5]", Error);
  CHECK(a::check_forward_lse(out, lse, qkv, 2, AttentionMask::bidirectional).mask == AttentionMask::bidirectional);
  CHECK_THROWS_WITH_AS(a::check_forward_lse(out, lse, qkv, 2, static_cast<AttentionMask>(3)),
                       doctest::Contains("attention_forward_lse: argument mask: got 3"), Error);
  CHECK_THROWS_WITH_AS(a::check_backward_lse(dqkv, dout, qkv, dout, lse_c, 2, static_cast<AttentionMask>(3)),
                       doctest::Contains("attention_backward_lse: argument mask: got 3"), Error);
}

// ------------------------------------------------------------------------------------------
// Device cases: return at once without a GPU.

std::vector<Case> device_cases() {
  std::vector<Case> cases = odd_cases();
  cases.push_back({2, 256, 4, 64});  // GPT-2's head size, aligned rows: the tensor-core paths
  cases.push_back({2, 40, 3, 5});    // rows of whole vectors: the softmax's vector kernels, odd head size
  return cases;
}

//! A device tensor of NaNs: every element must be written, and the beta-0 GEMMs must not read it.
DeviceTensor nans(cuda& be, const Shape& shape) {
  return DeviceTensor(be, std::vector<float>(static_cast<std::size_t>(shape.numel()), not_a_number), shape);
}

//! Runs `launch` (one kernel call) and checks that it gave back its workspace after a peak of
//! `scratch` floats.
template <class Launch>
void check_scratch(cuda& be, std::int64_t scratch, Launch&& launch) {
  const std::size_t workspace = be.memory().current(MemoryCategory::workspace);
  be.memory().reset_peaks();
  launch();
  CHECK(be.memory().current(MemoryCategory::workspace) == workspace);
  CHECK(be.memory().peak(MemoryCategory::workspace) == workspace + static_cast<std::size_t>(scratch) * sizeof(float));
}

//! Run 0 records `got`; every later run must give the same bits, tensor by tensor.
void check_same_bits(int run, std::vector<std::vector<float>>& first, std::vector<std::vector<float>> got) {
  if (run == 0) {
    first = std::move(got);
    return;
  }
  REQUIRE(got.size() == first.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i] == first[i]);
  }
}

TEST_CASE("attention_forward matches the reference (both masks); att is exactly 0 above the diagonal (causal) or "
          "nowhere (bidirectional); same bits each run") {
  if (!have_gpu()) return;
  cuda be(0);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : device_cases()) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, 100);
      const ForwardReference ref = forward_reference(c, data.qkv, mask);
      const DeviceTensor qkv(be, data.qkv, Shape{c.B, c.T, 3 * c.C()});
      std::vector<std::vector<float>> first;
      for (int run = 0; run < 2; ++run) {
        CAPTURE(run);
        const DeviceTensor att = nans(be, {c.B, c.NH, c.T, c.T}), out = nans(be, {c.B, c.T, c.C()});
        attention_forward<float>(be, out.view(), att.view(), qkv.cview(), static_cast<int>(c.NH), mask);
        std::vector<float> got_att = att.to_host(be), got_out = out.to_host(be);
        check_reference(got_att, ref.att, tf32_tolerance, "att");
        check_masked(c, got_att, mask);
        check_reference(got_out, ref.out, tf32_tolerance, "out");
        check_same_bits(run, first, {std::move(got_att), std::move(got_out)});
      }
    }
  }
}

TEST_CASE("attention_backward accumulates the reference gradient (both masks), the same bits each run, scratch "
          "returned") {
  if (!have_gpu()) return;
  cuda be(0);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : device_cases()) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, 200);
      const std::vector<float> att_in = to_float(forward_reference(c, data.qkv, mask).att.value);
      const Reference ref = backward_reference(c, data.qkv, att_in, data.dout, data.dqkv0, nullptr, mask);
      const Shape qkv_shape{c.B, c.T, 3 * c.C()};
      const DeviceTensor qkv(be, data.qkv, qkv_shape), dout(be, data.dout, Shape{c.B, c.T, c.C()}),
          att(be, att_in, Shape{c.B, c.NH, c.T, c.T});
      std::vector<std::vector<float>> first;
      for (int run = 0; run < 2; ++run) {
        CAPTURE(run);
        const DeviceTensor dqkv(be, data.dqkv0, qkv_shape);
        check_scratch(be, c.NH * c.T * c.T, [&] {
          attention_backward<float>(be, dqkv.view(), dout.cview(), qkv.cview(), att.cview(), static_cast<int>(c.NH),
                                    mask);
        });
        std::vector<float> got = dqkv.to_host(be);
        check_reference(got, ref, tf32_tolerance, "dqkv");
        check_same_bits(run, first, {std::move(got)});
      }
    }
  }
}

TEST_CASE("attention_backward from attention_forward's own att (the training path, both masks)") {
  if (!have_gpu()) return;
  cuda be(0);
  // The reference reads the same (device) att, so only the backward's own error is measured.
  const Case c{2, 33, 3, 16};
  const Data data = make_data(c, 300);
  const DeviceTensor qkv(be, data.qkv, Shape{c.B, c.T, 3 * c.C()}), dout(be, data.dout, Shape{c.B, c.T, c.C()});
  for (const AttentionMask mask : both_masks) {
    INFO(loom::name(mask));
    const DeviceTensor att = nans(be, {c.B, c.NH, c.T, c.T}), out = nans(be, {c.B, c.T, c.C()});
    attention_forward<float>(be, out.view(), att.view(), qkv.cview(), static_cast<int>(c.NH), mask);
    const DeviceTensor dqkv(be, data.dqkv0, Shape{c.B, c.T, 3 * c.C()});
    attention_backward<float>(be, dqkv.view(), dout.cview(), qkv.cview(), att.cview(), static_cast<int>(c.NH), mask);
    const Reference ref = backward_reference(c, data.qkv, att.to_host(be), data.dout, data.dqkv0, nullptr, mask);
    check_reference(dqkv.to_host(be), ref, tf32_tolerance, "dqkv");
  }
}

TEST_CASE("attention_forward_lse matches the reference (out and lse, both masks); same bits each run; NH T^2 "
          "workspace") {
  if (!have_gpu()) return;
  cuda be(0);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : device_cases()) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, 400);
      const ForwardReference ref = forward_reference(c, data.qkv, mask);
      const DeviceTensor qkv(be, data.qkv, Shape{c.B, c.T, 3 * c.C()});
      std::vector<std::vector<float>> first;
      for (int run = 0; run < 2; ++run) {
        CAPTURE(run);
        const DeviceTensor lse = nans(be, {c.B, c.NH, c.T}), out = nans(be, {c.B, c.T, c.C()});
        check_scratch(be, c.NH * c.T * c.T, [&] {
          attention_forward_lse<float>(be, out.view(), lse.view(), qkv.cview(), static_cast<int>(c.NH), mask);
        });
        std::vector<float> got_lse = lse.to_host(be), got_out = out.to_host(be);
        check_reference(got_lse, ref.lse, tf32_tolerance, "lse");
        check_reference(got_out, ref.out, tf32_tolerance, "out");
        check_same_bits(run, first, {std::move(got_lse), std::move(got_out)});
      }
    }
  }
}

TEST_CASE("attention_backward_lse accumulates the reference gradient (both masks), the same bits each run, "
          "2 NH T^2 workspace") {
  if (!have_gpu()) return;
  cuda be(0);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : device_cases()) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, 500);
      const ForwardReference forward = forward_reference(c, data.qkv, mask);
      // The kernel recomputes att from TF32 scores and the exact lse: att's errors, propagated.
      const Reference ref = backward_reference(c, data.qkv, to_float(forward.att.value), data.dout, data.dqkv0,
                                               &forward.att, mask);
      const Shape qkv_shape{c.B, c.T, 3 * c.C()};
      const DeviceTensor qkv(be, data.qkv, qkv_shape), dout(be, data.dout, Shape{c.B, c.T, c.C()}),
          out(be, to_float(forward.out.value), Shape{c.B, c.T, c.C()}),
          lse(be, to_float(forward.lse.value), Shape{c.B, c.NH, c.T});
      std::vector<std::vector<float>> first;
      for (int run = 0; run < 2; ++run) {
        CAPTURE(run);
        const DeviceTensor dqkv(be, data.dqkv0, qkv_shape);
        check_scratch(be, 2 * c.NH * c.T * c.T, [&] {
          attention_backward_lse<float>(be, dqkv.view(), dout.cview(), qkv.cview(), out.cview(), lse.cview(),
                                        static_cast<int>(c.NH), mask);
        });
        std::vector<float> got = dqkv.to_host(be);
        check_reference(got, ref, tf32_tolerance, "dqkv");
        check_same_bits(run, first, {std::move(got)});
      }
    }
  }
}

TEST_CASE("attention_backward and attention_backward_lse with GradientWrite::overwrite write the reference gradient "
          "over NaN (both masks)") {
  if (!have_gpu()) return;
  cuda be(0);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : device_cases()) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, 600);
      const ForwardReference forward = forward_reference(c, data.qkv, mask);
      const std::vector<float> att_in = to_float(forward.att.value), zeros(data.dqkv0.size(), 0.0f),
                               nans(zeros.size(), not_a_number);
      const Shape qkv_shape{c.B, c.T, 3 * c.C()};
      const DeviceTensor qkv(be, data.qkv, qkv_shape), dout(be, data.dout, Shape{c.B, c.T, c.C()}),
          att(be, att_in, Shape{c.B, c.NH, c.T, c.T}), out(be, to_float(forward.out.value), Shape{c.B, c.T, c.C()}),
          lse(be, to_float(forward.lse.value), Shape{c.B, c.NH, c.T});
      const DeviceTensor stored(be, nans, qkv_shape), recomputed(be, nans, qkv_shape);
      attention_backward<float>(be, stored.view(), dout.cview(), qkv.cview(), att.cview(), static_cast<int>(c.NH),
                                mask, {}, GradientWrite::overwrite);
      attention_backward_lse<float>(be, recomputed.view(), dout.cview(), qkv.cview(), out.cview(), lse.cview(),
                                    static_cast<int>(c.NH), mask, {}, GradientWrite::overwrite);
      check_reference(stored.to_host(be), backward_reference(c, data.qkv, att_in, data.dout, zeros, nullptr, mask),
                      tf32_tolerance, "dqkv");
      check_reference(recomputed.to_host(be),
                      backward_reference(c, data.qkv, att_in, data.dout, zeros, &forward.att, mask), tf32_tolerance,
                      "dqkv (lse)");
    }
  }
}

TEST_CASE("attention_backward_lse from attention_forward_lse's own lse (the training path, both masks)") {
  if (!have_gpu()) return;
  cuda be(0);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : {Case{2, 33, 3, 16}, Case{2, 256, 4, 64}}) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, 600);
      const ForwardReference forward = forward_reference(c, data.qkv, mask);
      const DeviceTensor qkv(be, data.qkv, Shape{c.B, c.T, 3 * c.C()}), dout(be, data.dout, Shape{c.B, c.T, c.C()});
      const DeviceTensor lse = nans(be, {c.B, c.NH, c.T}), out = nans(be, {c.B, c.T, c.C()});
      attention_forward_lse<float>(be, out.view(), lse.view(), qkv.cview(), static_cast<int>(c.NH), mask);
      const DeviceTensor dqkv(be, data.dqkv0, Shape{c.B, c.T, 3 * c.C()});
      attention_backward_lse<float>(be, dqkv.view(), dout.cview(), qkv.cview(), out.cview(), lse.cview(),
                                    static_cast<int>(c.NH), mask);
      // The recomputed att moves with the forward's lse as the forward's att does with its scores.
      const Reference ref = backward_reference(c, data.qkv, to_float(forward.att.value), data.dout, data.dqkv0,
                                               &forward.att, mask);
      check_reference(out.to_host(be), forward.out, tf32_tolerance, "out");
      check_reference(dqkv.to_host(be), ref, tf32_tolerance, "dqkv");
    }
  }
}

TEST_CASE("with dropout the four kernels give the by-definition out and gradient (fp32 products, both masks)") {
  if (!have_gpu()) return;
  cuda be(0);
  be.set_tf32(false);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : {Case{2, 33, 3, 16}, Case{2, 130, 2, 64}}) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const AttentionDropout dropout{.mask = DropoutMask(DropoutKey{.seed = 9, .step = 2}, 3, 2, 0.3),
                                     .first_sequence = 3,
                                     .heads = 2 * c.NH,
                                     .first_head = c.NH};
      const Data data = make_data(c, 601);
      const auto [want_out, want_dqkv] = dropout_reference(c, data.qkv, data.dout, mask, dropout);
      const DeviceTensor qkv(be, data.qkv, Shape{c.B, c.T, 3 * c.C()}), dout(be, data.dout, Shape{c.B, c.T, c.C()});
      const DeviceTensor att = nans(be, {c.B, c.NH, c.T, c.T}), out = nans(be, {c.B, c.T, c.C()});
      const DeviceTensor dqkv(be, std::vector<float>(data.qkv.size(), 0.0f), Shape{c.B, c.T, 3 * c.C()});
      attention_forward<float>(be, out.view(), att.view(), qkv.cview(), static_cast<int>(c.NH), mask, dropout);
      attention_backward<float>(be, dqkv.view(), dout.cview(), qkv.cview(), att.cview(), static_cast<int>(c.NH), mask,
                                dropout);
      CHECK(scaled_error(out.to_host(be), want_out) < 1e-5);
      CHECK(scaled_error(dqkv.to_host(be), want_dqkv) < 1e-5);
      const DeviceTensor lse = nans(be, {c.B, c.NH, c.T}), lse_out = nans(be, {c.B, c.T, c.C()});
      const DeviceTensor lse_dqkv(be, std::vector<float>(data.qkv.size(), 0.0f), Shape{c.B, c.T, 3 * c.C()});
      attention_forward_lse<float>(be, lse_out.view(), lse.view(), qkv.cview(), static_cast<int>(c.NH), mask, dropout);
      attention_backward_lse<float>(be, lse_dqkv.view(), dout.cview(), qkv.cview(), lse_out.cview(), lse.cview(),
                                    static_cast<int>(c.NH), mask, dropout);
      CHECK(scaled_error(lse_out.to_host(be), want_out) < 1e-5);
      CHECK(scaled_error(lse_dqkv.to_host(be), want_dqkv) < 1e-5);
    }
  }
}

TEST_CASE("padded sequences on the device: the four kernels give the reference (fp32 products, both masks, float "
          "and the vector row kernels)") {
  if (!have_gpu()) return;
  cuda be(0);
  be.set_tf32(false);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : {Case{3, 33, 3, 16}, Case{2, 130, 2, 64}}) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const std::vector<std::int32_t> lengths =
          c.B == 3 ? std::vector<std::int32_t>{1, 33, 17} : std::vector<std::int32_t>{65, 130};
      const Data data = make_data(c, 602);
      const auto [want_out, want_dqkv] = dropout_reference(c, data.qkv, data.dout, mask, {}, &lengths);
      const DeviceArray<std::int32_t> device_lengths(be, lengths, Shape{c.B});
      const AttentionKeys keys(mask, device_lengths.cview());
      const DeviceTensor qkv(be, data.qkv, Shape{c.B, c.T, 3 * c.C()}), dout(be, data.dout, Shape{c.B, c.T, c.C()});
      const DeviceTensor att = nans(be, {c.B, c.NH, c.T, c.T}), out = nans(be, {c.B, c.T, c.C()});
      const DeviceTensor dqkv(be, std::vector<float>(data.qkv.size(), 0.0f), Shape{c.B, c.T, 3 * c.C()});
      attention_forward<float>(be, out.view(), att.view(), qkv.cview(), static_cast<int>(c.NH), keys);
      attention_backward<float>(be, dqkv.view(), dout.cview(), qkv.cview(), att.cview(), static_cast<int>(c.NH), keys);
      CHECK(scaled_error(out.to_host(be), want_out) < 1e-5);
      CHECK(scaled_error(dqkv.to_host(be), want_dqkv) < 1e-5);
      // Padding gets probability exactly 0.
      const std::vector<float> probabilities = att.to_host(be);
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t r = 0; r < c.NH * c.T; ++r)
          for (std::int64_t s = lengths[b]; s < c.T; ++s)
            REQUIRE(probabilities[static_cast<std::size_t>((b * c.NH * c.T + r) * c.T + s)] == 0.0f);
      const DeviceTensor lse = nans(be, {c.B, c.NH, c.T}), lse_out = nans(be, {c.B, c.T, c.C()});
      const DeviceTensor lse_dqkv(be, std::vector<float>(data.qkv.size(), 0.0f), Shape{c.B, c.T, 3 * c.C()});
      attention_forward_lse<float>(be, lse_out.view(), lse.view(), qkv.cview(), static_cast<int>(c.NH), keys);
      attention_backward_lse<float>(be, lse_dqkv.view(), dout.cview(), qkv.cview(), lse_out.cview(), lse.cview(),
                                    static_cast<int>(c.NH), keys);
      CHECK(scaled_error(lse_out.to_host(be), want_out) < 1e-5);
      CHECK(scaled_error(lse_dqkv.to_host(be), want_dqkv) < 1e-5);
    }
  }
}

TEST_CASE("attention_lse kernels reject wrong shapes before any CUDA call, and skip empty batches") {
  if (!have_gpu()) return;
  cuda be(0);
  Buffer<float, cuda> buffer(be, 1024, MemoryCategory::workspace);
  float* p = buffer.data();
  const std::int64_t B = 2, T = 5, C = 6;
  const Tensor<const float> qkv(p, {B, T, 3 * C}), dout(p, {B, T, C}), lse_c(p, {B, 2, T});
  const Tensor<float> out(p, {B, T, C}), lse(p, {B, 2, T}), dqkv(p, {B, T, 3 * C});
  const std::size_t workspace = be.memory().current(MemoryCategory::workspace);
  be.memory().reset_peaks();
  CHECK_THROWS_WITH_AS(attention_forward_lse<float>(be, out, lse, qkv, 4),
                       doctest::Contains("attention_forward_lse: argument num_heads: got 4"), Error);
  CHECK_THROWS_WITH_AS(attention_forward_lse<float>(be, out, Tensor<float>(p, {B, 3, T}), qkv, 2),
                       doctest::Contains("attention_forward_lse: argument lse shape: got [2, 3, 5]"), Error);
  CHECK_THROWS_WITH_AS(attention_forward_lse<float>(be, out, lse, Tensor<const float>(nullptr, {B, T, 3 * C}), 2),
                       doctest::Contains("attention_forward_lse: argument qkv: got a tensor without data"), Error);
  CHECK_THROWS_WITH_AS(
      attention_backward_lse<float>(be, dqkv, Tensor<const float>(p, {B, C, T}), qkv, dout, lse_c, 2),
      doctest::Contains("attention_backward_lse: argument dout shape: got [2, 6, 5]"), Error);
  CHECK_THROWS_WITH_AS(
      attention_backward_lse<float>(be, dqkv, dout, qkv, dout, Tensor<const float>(p, {B, 2, T, T}), 2),
      doctest::Contains("attention_backward_lse: argument lse shape: got [2, 2, 5, 5]"), Error);
  CHECK_THROWS_WITH_AS(
      attention_backward_lse<float>(be, dqkv, dout, Tensor<const float>(nullptr, {B, T, 3 * C}), dout, lse_c, 2),
      doctest::Contains("attention_backward_lse: argument qkv: got a tensor without data"), Error);
  CHECK(be.memory().peak(MemoryCategory::workspace) == workspace);  // nothing allocated before the checks
  // B = 0 or T = 0: nothing to do, nothing read.
  attention_forward_lse<float>(be, Tensor<float>(nullptr, {0, T, C}), Tensor<float>(nullptr, {0, 2, T}),
                               Tensor<const float>(nullptr, {0, T, 3 * C}), 2);
  attention_backward_lse<float>(be, Tensor<float>(nullptr, {B, 0, 3 * C}), Tensor<const float>(nullptr, {B, 0, C}),
                                Tensor<const float>(nullptr, {B, 0, 3 * C}), Tensor<const float>(nullptr, {B, 0, C}),
                                Tensor<const float>(nullptr, {B, 2, 0}), 2);
  be.synchronize();
}

TEST_CASE("attention kernels reject wrong shapes on the device too, and skip empty batches") {
  if (!have_gpu()) return;
  cuda be(0);
  Buffer<float, cuda> buffer(be, 1024, MemoryCategory::workspace);
  float* p = buffer.data();
  const std::int64_t B = 2, T = 5, C = 6;
  const Tensor<const float> qkv(p, {B, T, 3 * C}), dout(p, {B, T, C}), att_c(p, {B, 2, T, T});
  const Tensor<float> out(p, {B, T, C}), att(p, {B, 2, T, T}), dqkv(p, {B, T, 3 * C});
  CHECK_THROWS_WITH_AS(attention_forward<float>(be, out, att, qkv, 4),
                       doctest::Contains("attention_forward: argument num_heads: got 4"), Error);
  CHECK_THROWS_WITH_AS(attention_forward<float>(be, out, Tensor<float>(p, {B, 3, T, T}), qkv, 2),
                       doctest::Contains("attention_forward: argument att shape: got [2, 3, 5, 5]"), Error);
  CHECK_THROWS_WITH_AS(attention_forward<float>(be, out, att, Tensor<const float>(nullptr, {B, T, 3 * C}), 2),
                       doctest::Contains("attention_forward: argument qkv: got a tensor without data"), Error);
  CHECK_THROWS_WITH_AS(attention_backward<float>(be, dqkv, Tensor<const float>(p, {B, C, T}), qkv, att_c, 2),
                       doctest::Contains("attention_backward: argument dout shape: got [2, 6, 5]"), Error);
  CHECK_THROWS_WITH_AS(attention_backward<float>(be, dqkv, dout, Tensor<const float>(nullptr, {B, T, 3 * C}), att_c, 2),
                       doctest::Contains("attention_backward: argument qkv: got a tensor without data"), Error);
  // B = 0 or T = 0: nothing to do, nothing read.
  attention_forward<float>(be, Tensor<float>(nullptr, {0, T, C}), Tensor<float>(nullptr, {0, 2, T, T}),
                           Tensor<const float>(nullptr, {0, T, 3 * C}), 2);
  attention_backward<float>(be, Tensor<float>(nullptr, {B, 0, 3 * C}), Tensor<const float>(nullptr, {B, 0, C}),
                            Tensor<const float>(nullptr, {B, 0, 3 * C}), Tensor<const float>(nullptr, {B, 2, 0, 0}), 2);
  be.synchronize();
}

}  // namespace

int main(int argc, char** argv) { return loom::cuda_test::run_tests(argc, argv); }
