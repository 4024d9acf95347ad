// The GEMMs with fused cuBLASLt epilogues (cuda::set_gemm_epilogues): matmul_forward's bias and
// residual (cuBLASLt's C), matmul_gelu_forward (bias and GELU, the pre-activation written
// beside), gelu_matmul_backward (the GELU gradient applied to dout · weight) and the bias
// gradient taken from the dweight GEMM (BGRADB), each with epilogues off and on, against loops
// in double over the same (float or bf16) inputs, and with the counts saying which path ran:
// the fused one wherever cuBLASLt allows it (GPT-2's shapes), the separate kernels where the
// epilogue matrix's leading dimension is not a multiple of 8.
//
// Tolerances, |device - reference| <= tolerance * (|reference| + M) + delta * A with M the sum
// of the absolute GEMM terms behind the element (times |GELU'| where a GELU follows), and A the
// scale of evaluating GELU or its derivative in float (below):
// - float data, full fp32 products (set_tf32(false)): tolerance 1e-5, the fp32 kernels' bound.
// - bf16 data: 2^-7, two bf16 roundings (an operand or an intermediate, and the result).
// - GELU(x) = x (1 + tanh u) / 2: 1 + tanh u carries an absolute error of a few float ulps of 1,
//   so A = |x| and delta = 2^-21. It matters where GELU(x) is far smaller than x (x < -3): there
//   the first term's bound was under the rounding of 1 + tanh u (on an H100, got -0 for
//   -1.6e-15).
// - GELU'(x): the rounding of tanh u is multiplied by up to 1 + |x| (1 + 0.134 x^2) 0.4, so
//   A = |dout · weight| (1 + 0.4 |x| (1 + 0.134 x^2)). Our kernels: delta = 2^-20.
// - cuBLASLt's GELU and DGELU epilogues are approximations, not fp32-exact: on an H100 (CUDA 13)
//   with float data its GELU was off by 3.1e-6 at x = -0.0019 (1.6e-3 |x|) and its DGELU by
//   1.6e-4 of the value. Fused results get delta = 2^-7 (GELU) and 1e-3 (DGELU), still far
//   under a wrong formula's error, and the test prints the worst it measured. For bf16 data
//   both are under the bf16 rounding of the output.
// The 64 x 8 x 64 case keeps M small (8 terms of inputs in [-2, 2]), so that 1e-5 also tells
// GPT-2's tanh GELU from the erf one in loom's own forward (they differ by up to 2e-4 near
// |x| = 2).
//
// The exact GELU (Gelu::erf) runs every case too: cuBLASLt's GELU epilogues are the tanh form, so
// it must never fuse them (only the bias and the bias gradient may fuse), and its results are
// loom's element-wise kernel's, with loom's deltas (erff's error is a few float ulps of 1, as
// tanhf's is, and its derivative is better conditioned than the tanh form's).
//
// bf16 operands with fp32 weight and bias gradient sums (Megatron-LM's gradient-accumulation
// fusion) are checked at float's tolerance: only the fp32 accumulation rounds them.
//
// Without a GPU the host case runs and the program exits with 77 (ctest: skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "device_check.hpp"
#include "loom/backend/cuda/kernels.cuh"
#include "loom/core/bf16.hpp"

using namespace loom;
using namespace loom::cuda_test;

namespace {

const double sqrt_2_over_pi = std::sqrt(2.0 / std::acos(-1.0));

//! GELU(x) of the form `kind`: x Φ(x) with std::erf, or GPT-2's tanh approximation.
double gelu(Gelu kind, double x) {
  if (kind == Gelu::erf) return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
  return 0.5 * x * (1.0 + std::tanh(sqrt_2_over_pi * (x + 0.044715 * x * x * x)));
}
double gelu_derivative(Gelu kind, double x) {
  if (kind == Gelu::erf)
    return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) * sqrt_2_over_pi / 2;
  const double u = sqrt_2_over_pi * (x + 0.044715 * x * x * x);
  const double sech = 1.0 / std::cosh(u);
  return 0.5 * (1.0 + std::tanh(u)) + 0.5 * x * sech * sech * sqrt_2_over_pi * (1.0 + 3.0 * 0.044715 * x * x);
}

struct Case {
  std::int64_t N, C, OC;
  //! Whether the bias, GELU and GELU-gradient epilogues must fuse. Where OC or C is not a
  //! multiple of 8 the GELU and its gradient must not (cuBLASLt's rule for the epilogue matrix);
  //! the bias may or may not.
  bool fusable;
};
const Case cases[] = {
    {1, 1, 1, false},       {65, 33, 17, false}, {64, 8, 64, true},
    {256, 768, 3072, true},  // GPT-2 small's mlp.fc
    {256, 3072, 768, true},  // and mlp.proj
    {37, 24, 40, true},      // rows that fill no tile
};

template <class E>
std::vector<E> random_values(std::int64_t n, std::uint32_t seed, float lo, float hi) {
  std::vector<E> out;
  for (const float x : random_floats(n, seed, lo, hi)) out.push_back(static_cast<E>(x));
  return out;
}

template <class E>
std::vector<float> as_floats(const std::vector<E>& v) {
  std::vector<float> out;
  for (const E x : v) out.push_back(static_cast<float>(x));
  return out;
}

template <class E>
double tolerance() {
  return std::is_same_v<E, bf16> ? 1.0 / 128 : 1e-5;
}

//! Checks got against want within tolerance<E>() * (|want| + scale) + delta * absolute (where
//! `absolute` is given).
template <class E>
void check(const std::vector<E>& got, const std::vector<double>& want, const std::vector<double>& scale,
           const std::string& what, const std::vector<double>& absolute = {}, double delta = 0) {
  std::vector<double> magnitude(want.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    magnitude[i] = std::abs(want[i]) + scale[i] + (absolute.empty() ? 0.0 : absolute[i] * delta / tolerance<E>());
  check_close(as_floats(got), want, magnitude, tolerance<E>(), what, 0.0);
}

//! The largest |got - want| / absolute: how far a GELU evaluation was off, in units of its scale.
template <class E>
double worst_relative_to(const std::vector<E>& got, const std::vector<double>& want,
                         const std::vector<double>& absolute) {
  double worst = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (absolute[i] > 0) worst = std::max(worst, std::abs(static_cast<double>(static_cast<float>(got[i])) - want[i]) / absolute[i]);
  return worst;
}

//! The scale by which a float evaluation of GELU'(x) multiplies the rounding of tanh u.
double gelu_derivative_scale(double x) { return 1.0 + 0.4 * std::abs(x) * (1.0 + 0.134 * x * x); }

//! The references in double over the inputs as stored.
struct References {
  std::vector<double> pre, pre_scale, out, out_scale, dpre, dpre_scale, dweight, dweight_scale, dbias, dbias_scale;
  std::vector<double> out_absolute, dpre_absolute;  //!< the GELU evaluations' scales (file comment)
};

References reference_results(const Case& k, const std::vector<float>& in_pre, const std::vector<float>& in,
                             const std::vector<float>& weight, const std::vector<float>& bias,
                             const std::vector<float>& dout, const std::vector<float>& dweight0,
                             const std::vector<float>& dbias0, Gelu kind) {
  References r;
  const auto n_out = static_cast<std::size_t>(k.N * k.OC), n_in = static_cast<std::size_t>(k.N * k.C);
  r.pre.resize(n_out);
  r.pre_scale.resize(n_out);
  r.out.resize(n_out);
  r.out_scale.resize(n_out);
  r.out_absolute.resize(n_out);
  for (std::int64_t n = 0; n < k.N; ++n)
    for (std::int64_t o = 0; o < k.OC; ++o) {
      double sum = bias[o], mag = std::abs(bias[o]);
      for (std::int64_t i = 0; i < k.C; ++i) {
        const double term = static_cast<double>(in[n * k.C + i]) * weight[o * k.C + i];
        sum += term;
        mag += std::abs(term);
      }
      const std::size_t j = n * k.OC + o;
      r.pre[j] = sum;
      r.pre_scale[j] = mag;
      r.out[j] = gelu(kind, sum);
      r.out_scale[j] = mag * std::abs(gelu_derivative(kind, sum));
      r.out_absolute[j] = std::abs(sum);
    }
  // Backward of out = in_gelu · weight^T + bias with in_gelu = GELU(in_pre) (the stored `in`).
  r.dpre.resize(n_in);
  r.dpre_scale.resize(n_in);
  r.dpre_absolute.resize(n_in);
  for (std::int64_t n = 0; n < k.N; ++n)
    for (std::int64_t i = 0; i < k.C; ++i) {
      double sum = 0, mag = 0;
      for (std::int64_t o = 0; o < k.OC; ++o) {
        const double term = static_cast<double>(dout[n * k.OC + o]) * weight[o * k.C + i];
        sum += term;
        mag += std::abs(term);
      }
      const double g = gelu_derivative(kind, in_pre[n * k.C + i]);
      r.dpre[n * k.C + i] = sum * g;
      r.dpre_scale[n * k.C + i] = mag * std::abs(g);
      r.dpre_absolute[n * k.C + i] = std::abs(sum) * gelu_derivative_scale(in_pre[n * k.C + i]);
    }
  r.dweight = {dweight0.begin(), dweight0.end()};
  r.dweight_scale.assign(r.dweight.size(), 0.0);
  for (std::int64_t n = 0; n < k.N; ++n)
    for (std::int64_t o = 0; o < k.OC; ++o)
      for (std::int64_t i = 0; i < k.C; ++i) {
        const double term = static_cast<double>(dout[n * k.OC + o]) * in[n * k.C + i];
        r.dweight[o * k.C + i] += term;
        r.dweight_scale[o * k.C + i] += std::abs(term);
      }
  r.dbias = {dbias0.begin(), dbias0.end()};
  r.dbias_scale.assign(r.dbias.size(), 0.0);
  for (std::int64_t n = 0; n < k.N; ++n)
    for (std::int64_t o = 0; o < k.OC; ++o) {
      r.dbias[o] += dout[n * k.OC + o];
      r.dbias_scale[o] += std::abs(dout[n * k.OC + o]);
    }
  return r;
}

//! One case's inputs, stored as E. Inputs in [-2, 2] reach the part of GELU where its tanh and
//! erf forms differ most. `in` (the linear layer's input) is the tanh GELU of `in_pre` for either
//! form: the backward's formulas do not depend on how it was made.
template <class E>
struct Inputs {
  std::vector<E> in_pre, in, weight, bias, dout, dweight0, dbias0, residual;

  explicit Inputs(const Case& k)
      : in_pre(random_values<E>(k.N * k.C, 1, -2.0f, 2.0f)),
        weight(random_values<E>(k.OC * k.C, 2, -2.0f, 2.0f)),
        bias(random_values<E>(k.OC, 3, -1.0f, 1.0f)),
        dout(random_values<E>(k.N * k.OC, 4, -1.0f, 1.0f)),
        dweight0(random_values<E>(k.OC * k.C, 5, -1.0f, 1.0f)),
        dbias0(random_values<E>(k.OC, 6, -1.0f, 1.0f)),
        residual(random_values<E>(k.N * k.OC, 7, -2.0f, 2.0f)) {
    for (const E x : in_pre)
      in.push_back(static_cast<E>(static_cast<float>(gelu(Gelu::tanh, static_cast<float>(x)))));
  }
  References references(const Case& k, Gelu kind) const {
    return reference_results(k, as_floats(in_pre), as_floats(in), as_floats(weight), as_floats(bias),
                             as_floats(dout), as_floats(dweight0), as_floats(dbias0), kind);
  }
};

template <class E>
void run_case(const Case& k, const Inputs<E>& inputs, const References& r, bool epilogues, Gelu kind) {
  CAPTURE(std::string(loom::gelu_name(kind)));
  CAPTURE(k.N);
  CAPTURE(k.C);
  CAPTURE(k.OC);
  CAPTURE(epilogues);
  loom::cuda be(0);
  be.set_tf32(false);
  be.set_gemm_epilogues(epilogues);
  const std::vector<E>& dweight0 = inputs.dweight0;
  const std::vector<E>& dbias0 = inputs.dbias0;
  const DeviceArray<E> d_in(be, inputs.in, Shape{k.N, k.C}), d_in_pre(be, inputs.in_pre, Shape{k.N, k.C}),
      d_weight(be, inputs.weight, Shape{k.OC, k.C}), d_bias(be, inputs.bias, Shape{k.OC}),
      d_dout(be, inputs.dout, Shape{k.N, k.OC});
  const std::vector<E> garbage_out(static_cast<std::size_t>(k.N * k.OC), static_cast<E>(99.0f)),
      garbage_in(static_cast<std::size_t>(k.N * k.C), static_cast<E>(99.0f));
  // Which path each call took: `attempts` GEMMs may fuse, at least `must_fuse` of them must.
  const auto path = [&](const char* what, int attempts, int must_fuse, auto&& call) {
    const detail::LtEpilogueCounts before = be.lt_gemms().counts();
    call();
    const detail::LtEpilogueCounts after = be.lt_gemms().counts();
    const std::int64_t fused = after.fused - before.fused, unfused = after.unfused - before.unfused;
    INFO(what << ": " << fused << " fused, " << unfused << " fell back");
    if (!epilogues) {
      CHECK(fused + unfused == 0);
    } else {
      CHECK(fused + unfused == attempts);
      CHECK(fused >= must_fuse);
    }
  };
  const bool fusable = k.fusable;
  // cuBLASLt's GELU and DGELU are the tanh form's: the erf form never tries them.
  const bool tanh_form = kind == Gelu::tanh;

  const DeviceArray<E> out(be, garbage_out, Shape{k.N, k.OC});
  path("matmul_forward", 1, fusable ? 1 : 0,
       [&] { matmul_forward<E>(be, out.view(), d_in.cview(), d_weight.cview(), d_bias.cview()); });
  check(out.to_host(be), r.pre, r.pre_scale, "matmul_forward with bias");

  // With a residual (a block's res2 = input + proj(...)): the GEMM's C where it fuses (with the
  // BIAS epilogue, or DEFAULT without a bias), else add_to after the GEMM.
  const std::vector<float> residual = as_floats(inputs.residual), bias = as_floats(inputs.bias);
  const DeviceArray<E> d_residual(be, inputs.residual, Shape{k.N, k.OC});
  for (const bool with_bias : {true, false}) {
    CAPTURE(with_bias);
    std::vector<double> want(r.pre.size()), scale(r.pre.size());
    for (std::size_t j = 0; j < want.size(); ++j) {
      const double b = with_bias ? 0.0 : bias[j % static_cast<std::size_t>(k.OC)];
      want[j] = r.pre[j] - b + residual[j];
      scale[j] = r.pre_scale[j] - std::abs(b) + std::abs(residual[j]);
    }
    const DeviceArray<E> sum(be, garbage_out, Shape{k.N, k.OC});
    path("matmul_forward with residual", 1, fusable ? 1 : 0, [&] {
      matmul_forward<E>(be, sum.view(), d_in.cview(), d_weight.cview(), with_bias ? d_bias.cview() : Tensor<const E>{},
                        d_residual.cview());
    });
    check(sum.to_host(be), want, scale, "matmul_forward with residual");
  }

  const DeviceArray<E> gelu_out(be, garbage_out, Shape{k.N, k.OC}), pre(be, garbage_out, Shape{k.N, k.OC});
  // Where GELU cannot fuse, matmul_forward then tries the bias epilogue: two attempts (the erf
  // form: that one alone).
  path("matmul_gelu_forward", tanh_form ? (fusable ? 1 : 2) : 1, fusable ? 1 : 0, [&] {
    matmul_gelu_forward<E>(be, gelu_out.view(), pre.view(), d_in.cview(), d_weight.cview(), d_bias.cview(), kind);
  });
  check(pre.to_host(be), r.pre, r.pre_scale, "matmul_gelu_forward pre");
  const bool gelu_fused = epilogues && fusable && tanh_form;
  const std::vector<E> gelu_got = gelu_out.to_host(be);
  MESSAGE("GELU " << std::string(gelu_fused ? "(cuBLASLt)" : "(loom)")
                  << " error / |x|: " << worst_relative_to(gelu_got, r.out, r.out_absolute));
  check(gelu_got, r.out, r.out_scale, "matmul_gelu_forward out", r.out_absolute,
        gelu_fused ? std::ldexp(1.0, -7) : std::ldexp(1.0, -21));

  // The GELU gradient (DGELU), and dweight with dbias (BGRADB). cuBLASLt's BGRADB is not required
  // to fuse (it may fall back to the column sums); DGELU is, where the shape allows.
  const DeviceArray<E> dpre(be, garbage_in, Shape{k.N, k.C}), dweight(be, dweight0, Shape{k.OC, k.C}),
      dbias(be, dbias0, Shape{k.OC});
  path("gelu_matmul_backward", tanh_form ? 2 : 1, fusable && tanh_form ? 1 : 0, [&] {
    gelu_matmul_backward<E>(be, dpre.view(), dweight.view(), dbias.view(), d_dout.cview(), d_in.cview(),
                            d_weight.cview(), d_in_pre.cview(), kind);
  });
  const std::vector<E> dpre_got = dpre.to_host(be);
  MESSAGE("GELU' " << std::string(gelu_fused ? "(cuBLASLt DGELU)" : "(loom)") << " error / scale: "
                   << worst_relative_to(dpre_got, r.dpre, r.dpre_absolute));
  check(dpre_got, r.dpre, r.dpre_scale, "gelu_matmul_backward dpre (written over garbage)", r.dpre_absolute,
        gelu_fused ? 1e-3 : std::ldexp(1.0, -20));
  check(dweight.to_host(be), r.dweight, r.dweight_scale, "gelu_matmul_backward dweight (accumulated)");
  check(dbias.to_host(be), r.dbias, r.dbias_scale, "gelu_matmul_backward dbias (accumulated)");

  // The split backward: the input pass gives the same dpre bits and touches nothing else; the
  // weight pass (matmul_backward without din) gives the same dweight and dbias bits.
  const DeviceArray<E> split(be, garbage_in, Shape{k.N, k.C}), split_dweight(be, dweight0, Shape{k.OC, k.C}),
      split_dbias(be, dbias0, Shape{k.OC});
  path("gelu_matmul_backward, input pass", tanh_form ? 1 : 0, fusable && tanh_form ? 1 : 0, [&] {
    gelu_matmul_backward<E>(be, split.view(), Tensor<E>{}, Tensor<E>{}, d_dout.cview(), d_in.cview(),
                            d_weight.cview(), d_in_pre.cview(), kind);
  });
  CHECK(as_floats(split.to_host(be)) == as_floats(dpre.to_host(be)));
  path("matmul_backward, weight pass", 1, 0, [&] {
    matmul_backward<E>(be, Tensor<E>{}, split_dweight.view(), split_dbias.view(), d_dout.cview(), d_in.cview(),
                       d_weight.cview());
  });
  CHECK(as_floats(split_dweight.to_host(be)) == as_floats(dweight.to_host(be)));
  CHECK(as_floats(split_dbias.to_host(be)) == as_floats(dbias.to_host(be)));
}

}  // namespace

TEST_CASE("common_alignment is the largest of 16, 8, 4, 2 bytes dividing every pointer") {
  using detail::cuda_matmul::common_alignment;
  alignas(16) static char bytes[64];
  CHECK(common_alignment({bytes, bytes + 32}) == 16);
  CHECK(common_alignment({bytes, bytes + 8, nullptr}) == 8);
  CHECK(common_alignment({bytes + 4}) == 4);
  CHECK(common_alignment({bytes + 2, bytes + 16}) == 2);
  CHECK(common_alignment({bytes + 6}) == 2);
  CHECK(common_alignment({nullptr}) == 16);
}

TEST_CASE("a GEMM plan key tells every field apart") {
  const detail::LtGemmKey key{CUBLAS_OP_T, CUBLAS_OP_N, 3072, 256, 768, 768, 768, 3072, CUDA_R_16BF,
                              CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, 3072, 16};
  const detail::LtGemmKeyHash hash;
  detail::LtGemmKey other = key;
  CHECK(other == key);
  CHECK(hash(other) == hash(key));
  other.alignment = 8;
  CHECK(!(other == key));
  other = key;
  other.output_type = CUDA_R_32F;  // fp32 gradient sums of bf16 operands
  CHECK(!(other == key));
  CHECK(hash(other) != hash(key));
  other = key;
  other.epilogue = CUBLASLT_EPILOGUE_GELU_AUX;
  CHECK(!(other == key));
  CHECK(hash(other) != hash(key));
}

TEST_CASE_TEMPLATE("fused epilogues compute the separate kernels' results; the erf GELU never fuses", E, float,
                   bf16) {
  if (!have_gpu()) return;
  for (const Case& k : cases) {
    // The double references once per case and form (GPT-2's shapes take seconds), both paths
    // against them.
    const Inputs<E> inputs(k);
    for (const Gelu kind : {Gelu::tanh, Gelu::erf}) {
      const References r = inputs.references(k, kind);
      for (const bool epilogues : {false, true}) run_case<E>(k, inputs, r, epilogues, kind);
    }
  }
}

// fp32 gradient sums of a bf16 layer (TrainerOptions::fp32_gradient_fusion): bf16 operands, and
// dweight and dbias in float, which the GEMM (fp32 C) and the bias sums add to unrounded. The
// results carry fp32 accumulation only, so they meet float's 1e-5, not bf16's 2^-7, with
// epilogues off and on (BGRADB then writes fp32 sums), through matmul_backward and
// gelu_matmul_backward.
TEST_CASE("bf16 layers add their weight and bias gradients into fp32 sums at fp32 accuracy") {
  if (!have_gpu()) return;
  for (const Case& k : cases) {
    CAPTURE(k.N);
    CAPTURE(k.C);
    CAPTURE(k.OC);
    const Inputs<bf16> inputs(k);
    const References r = inputs.references(k, Gelu::tanh);
    const std::vector<float> dweight0 = as_floats(inputs.dweight0), dbias0 = as_floats(inputs.dbias0);
    for (const bool epilogues : {false, true}) {
      CAPTURE(epilogues);
      loom::cuda be(0);
      be.set_gemm_epilogues(epilogues);
      const DeviceArray<bf16> d_in(be, inputs.in, Shape{k.N, k.C}), d_in_pre(be, inputs.in_pre, Shape{k.N, k.C}),
          d_weight(be, inputs.weight, Shape{k.OC, k.C}), d_dout(be, inputs.dout, Shape{k.N, k.OC});
      const DeviceArray<float> dweight(be, dweight0, Shape{k.OC, k.C}), dbias(be, dbias0, Shape{k.OC});
      matmul_backward<bf16>(be, Tensor<bf16>{}, dweight.view(), dbias.view(), d_dout.cview(), d_in.cview(),
                            d_weight.cview());
      check(dweight.to_host(be), r.dweight, r.dweight_scale, "matmul_backward fp32 dweight");
      check(dbias.to_host(be), r.dbias, r.dbias_scale, "matmul_backward fp32 dbias");

      // Through the GELU: dpre in bf16 as before, the sums in fp32.
      const DeviceArray<bf16> dpre(be, std::vector<bf16>(static_cast<std::size_t>(k.N * k.C)), Shape{k.N, k.C});
      const DeviceArray<float> gelu_dweight(be, dweight0, Shape{k.OC, k.C}), gelu_dbias(be, dbias0, Shape{k.OC});
      gelu_matmul_backward<bf16>(be, dpre.view(), gelu_dweight.view(), gelu_dbias.view(), d_dout.cview(),
                                 d_in.cview(), d_weight.cview(), d_in_pre.cview(), Gelu::tanh);
      check(gelu_dweight.to_host(be), r.dweight, r.dweight_scale, "gelu_matmul_backward fp32 dweight");
      check(gelu_dbias.to_host(be), r.dbias, r.dbias_scale, "gelu_matmul_backward fp32 dbias");
      check(dpre.to_host(be), r.dpre, r.dpre_scale, "gelu_matmul_backward dpre beside fp32 sums", r.dpre_absolute,
            epilogues && k.fusable ? 1e-3 : std::ldexp(1.0, -20));
    }
  }
}

TEST_CASE("the GEMM plans are made once per shape and reused") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  be.set_gemm_epilogues(true);
  const Case k{128, 64, 256, true};
  const DeviceArray<bf16> in(be, random_values<bf16>(k.N * k.C, 7, -1.0f, 1.0f), Shape{k.N, k.C}),
      weight(be, random_values<bf16>(k.OC * k.C, 8, -1.0f, 1.0f), Shape{k.OC, k.C}),
      bias(be, random_values<bf16>(k.OC, 9, -1.0f, 1.0f), Shape{k.OC});
  const DeviceArray<bf16> out(be, std::vector<bf16>(k.N * k.OC), Shape{k.N, k.OC}),
      pre(be, std::vector<bf16>(k.N * k.OC), Shape{k.N, k.OC});
  matmul_gelu_forward<bf16>(be, out.view(), pre.view(), in.cview(), weight.cview(), bias.cview());
  const std::vector<bf16> first = out.to_host(be);
  for (int i = 0; i < 3; ++i)
    matmul_gelu_forward<bf16>(be, out.view(), pre.view(), in.cview(), weight.cview(), bias.cview());
  CHECK(as_floats(out.to_host(be)) == as_floats(first));
  CHECK(be.lt_gemms().counts().fused == 4);
  CHECK(be.lt_gemms().counts().unfused == 0);
  CHECK(be.lt_gemms().plan_count() == 1);
}

int main(int argc, char** argv) { return run_tests(argc, argv); }
