#pragma once
//! \file loom::Error and the LOOM_CHECK macro: every rejected input says what failed, the
//! offending value and the rule it broke.

#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace loom {

namespace detail {
//! Renders any streamable value as text for an error message.
template <class T>
std::string to_text(const T& value) {
  std::ostringstream out;
  out << value;
  return out.str();
}
}  // namespace detail

//! The one exception type loom throws: `what()` reads "loom: <what>: got <value>; <rule>".
class Error : public std::runtime_error {
 public:
  Error(std::string what, std::string value, std::string rule)
      : std::runtime_error(format(what, value, rule)),
        what_(std::move(what)),
        value_(std::move(value)),
        rule_(std::move(rule)) {}
  //! Same, with any streamable offending value.
  template <class V>
    requires(!std::is_convertible_v<const V&, std::string>)
  Error(std::string what, const V& value, std::string rule)
      : Error(std::move(what), detail::to_text(value), std::move(rule)) {}

  //! What failed, e.g. "gpt2 config: num_heads".
  const std::string& subject() const noexcept { return what_; }
  //! The offending value as text.
  const std::string& value() const noexcept { return value_; }
  //! The rule the value broke, e.g. "must divide channels (768)".
  const std::string& rule() const noexcept { return rule_; }

 private:
  static std::string format(const std::string& what, const std::string& value,
                            const std::string& rule) {
    std::string text = "loom: " + what;
    if (!value.empty()) text += ": got " + value;
    if (!rule.empty()) text += "; " + rule;
    return text;
  }
  std::string what_, value_, rule_;
};

}  // namespace loom

//! Throws loom::Error(what, value, rule) unless `cond` holds. `value` is any streamable value.
#define LOOM_CHECK(cond, what, value, rule)                                     \
  do {                                                                          \
    if (!(cond)) [[unlikely]]                                                   \
      throw ::loom::Error((what), ::loom::detail::to_text(value), (rule));      \
  } while (0)
