#pragma once
// Test support: the message of the loom::Error a call throws, for checks on its text.

#include <string>
#include <string_view>

#include "loom/core/error.hpp"

namespace loom::test {

//! The what() of the loom::Error that `f` throws ("" if it throws nothing).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const loom::Error& e) {
    return e.what();
  }
  return "";
}

//! Whether `text` contains `part`.
inline bool contains(std::string_view text, std::string_view part) {
  return text.find(part) != std::string_view::npos;
}

}  // namespace loom::test
