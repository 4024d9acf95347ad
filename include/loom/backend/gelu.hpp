#pragma once
//! \file Which GELU a model uses (loom::Gelu), and the per-element formulas of both forms as
//! host/device functions: the CUDA kernels run them element by element, the CPU kernels run the
//! same formulas as Eigen array expressions, and host tests check them directly. Device-clean:
//! nvcc compiles it in any translation unit (loom::Error is host-only code that nvcc's host pass
//! compiles, as it does through every kernel header).

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

#include "loom/core/error.hpp"
#include "loom/core/hd.hpp"

namespace loom {

//! The form of GELU(x) = x Φ(x) a model's MLP (and BERT's masked-LM head) uses. A value in a
//! model's Config (not a type): a checkpoint's config chooses it at run time.
enum class Gelu : std::uint8_t {
  //! GPT-2's approximation, Hugging Face's `gelu_new`: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
  tanh,
  //! The exact form, BERT's (Hugging Face's `gelu`): 0.5 x (1 + erf(x / sqrt(2))).
  erf,
};

//! "tanh" or "erf": the name gelu_from_name reads back.
constexpr const char* gelu_name(Gelu kind) noexcept {
  switch (kind) {
    case Gelu::tanh: return "tanh";
    case Gelu::erf: return "erf";
  }
  return "unknown";
}

//! Prints gelu_name(kind).
inline std::ostream& operator<<(std::ostream& out, Gelu kind) { return out << gelu_name(kind); }

//! The Gelu called `name` ("tanh" or "erf", as gelu_name writes them); otherwise throws
//! loom::Error naming `what` (e.g. "bert_train: --gelu") and the value.
inline Gelu gelu_from_name(std::string_view name, const std::string& what) {
  for (const Gelu kind : {Gelu::tanh, Gelu::erf})
    if (name == gelu_name(kind)) return kind;
  throw Error(what, std::string(name),
              "expected tanh (GPT-2's approximation, Hugging Face's gelu_new) or erf (the exact form, "
              "Hugging Face's gelu)");
}

}  // namespace loom

namespace loom::detail::gelu {

//! sqrt(2 / pi) and the cubic coefficient of GPT-2's GELU.
template <class T>
inline constexpr T scaling = static_cast<T>(0.7978845608028654);
template <class T>
inline constexpr T cubic = static_cast<T>(0.044715);
//! 1 / sqrt(2) and 1 / sqrt(2 pi) of the exact form.
template <class T>
inline constexpr T inv_sqrt2 = static_cast<T>(0.7071067811865476);
template <class T>
inline constexpr T inv_sqrt_2pi = static_cast<T>(0.3989422804014327);

// tanh, erf and exp in the argument's own precision on host and device (tanhf for float; an
// unqualified call could pick the double overload on the host).
LOOM_HD inline float tanh_of(float x) { return tanhf(x); }
LOOM_HD inline double tanh_of(double x) { return ::tanh(x); }
LOOM_HD inline float erf_of(float x) { return erff(x); }
LOOM_HD inline double erf_of(double x) { return ::erf(x); }
LOOM_HD inline float exp_of(float x) { return expf(x); }
LOOM_HD inline double exp_of(double x) { return ::exp(x); }

//! GELU(x) of the form `kind`, in T (float or double).
template <Gelu kind, class T>
LOOM_HD T value(T x) {
  if constexpr (kind == Gelu::erf) {
    return T(0.5) * x * (T(1) + erf_of(x * inv_sqrt2<T>));
  } else {
    return T(0.5) * x * (T(1) + tanh_of(scaling<T> * (x + cubic<T> * x * x * x)));
  }
}

//! d GELU / dx of the form `kind`, in T (float or double):
//! erf: 0.5 (1 + erf(x / sqrt(2))) + x exp(-x^2 / 2) / sqrt(2 pi);
//! tanh: 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2), th the forward's tanh.
template <Gelu kind, class T>
LOOM_HD T derivative(T x) {
  if constexpr (kind == Gelu::erf) {
    return T(0.5) * (T(1) + erf_of(x * inv_sqrt2<T>)) + x * exp_of(T(-0.5) * x * x) * inv_sqrt_2pi<T>;
  } else {
    const T th = tanh_of(scaling<T> * (x + cubic<T> * x * x * x));
    return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * scaling<T> * (T(1) + T(3) * cubic<T> * x * x);
  }
}

}  // namespace loom::detail::gelu
