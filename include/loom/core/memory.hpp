#pragma once
//! \file Memory accounting per category, with current and peak bytes (what a ZeRO or pipeline
//! user checks against the formulas in DESIGN.md).

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>

namespace loom {

//! What a block of memory holds.
enum class MemoryCategory : int {
  parameters,
  gradients,
  optimizer_state,
  activations,
  communication,
  workspace,
};

inline constexpr int memory_category_count = 6;

//! The category's name as printed in reports and JSON ("optimizer_state", ...).
constexpr std::string_view name(MemoryCategory c) noexcept {
  constexpr std::array<std::string_view, memory_category_count> names = {
      "parameters", "gradients", "optimizer_state", "activations", "communication", "workspace"};
  return names[static_cast<int>(c)];
}

//! What an out-of-memory error suggests, after what the rank holds.
inline constexpr std::string_view out_of_memory_hint =
    "smaller micro-batches, recomputed activations (TrainerOptions::recompute_layers) or ZeRO's sharding "
    "(Zero<N>) hold less";

//! Bytes held now and at peak, per category and in total. One tracker per rank's backend.
class MemoryTracker {
 public:
  //! Records `bytes` newly held in `category`.
  void add(MemoryCategory category, std::size_t bytes) noexcept {
    auto& c = current_[index(category)];
    c += bytes;
    if (c > peak_[index(category)]) peak_[index(category)] = c;
    total_ += bytes;
    if (total_ > peak_total_) peak_total_ = total_;
  }
  //! Records `bytes` of `category` released.
  void remove(MemoryCategory category, std::size_t bytes) noexcept {
    current_[index(category)] -= bytes;
    total_ -= bytes;
  }

  std::size_t current(MemoryCategory c) const noexcept { return current_[index(c)]; }
  std::size_t peak(MemoryCategory c) const noexcept { return peak_[index(c)]; }
  std::size_t current_total() const noexcept { return total_; }
  //! The largest total ever held at once (not the sum of per-category peaks).
  std::size_t peak_total() const noexcept { return peak_total_; }
  //! Forgets peaks: they restart from what is held now.
  void reset_peaks() noexcept {
    peak_ = current_;
    peak_total_ = total_;
  }

  //! One line per category: "parameters  12.50 MiB (peak 12.50 MiB)", then the total.
  friend std::ostream& operator<<(std::ostream& out, const MemoryTracker& m) {
    for (int i = 0; i < memory_category_count; ++i) {
      const auto c = static_cast<MemoryCategory>(i);
      out << std::left << std::setw(16) << name(c) << std::right << std::fixed
          << std::setprecision(2) << std::setw(10) << mib(m.current(c)) << " MiB (peak "
          << mib(m.peak(c)) << " MiB)\n";
    }
    return out << std::left << std::setw(16) << "total" << std::right << std::setw(10)
               << mib(m.current_total()) << " MiB (peak " << mib(m.peak_total()) << " MiB)\n";
  }

  static double mib(std::size_t bytes) noexcept { return static_cast<double>(bytes) / (1 << 20); }

  //! What is held now, on one line for error messages: "1234.5 MiB (activations 1000.0,
  //! parameters 200.0, ...)", the categories largest first, empty ones left out.
  std::string held() const {
    std::array<MemoryCategory, memory_category_count> order{};
    for (int i = 0; i < memory_category_count; ++i) order[static_cast<std::size_t>(i)] = static_cast<MemoryCategory>(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](MemoryCategory a, MemoryCategory b) { return current(a) > current(b); });
    std::ostringstream out;
    out << std::fixed << std::setprecision(1) << mib(total_) << " MiB";
    const char* separator = " (";
    for (MemoryCategory c : order) {
      if (current(c) == 0) continue;
      out << separator << name(c) << ' ' << mib(current(c));
      separator = ", ";
    }
    if (total_ > 0) out << ')';
    return out.str();
  }

 private:
  static constexpr int index(MemoryCategory c) noexcept { return static_cast<int>(c); }
  std::array<std::size_t, memory_category_count> current_{}, peak_{};
  std::size_t total_ = 0, peak_total_ = 0;
};

}  // namespace loom
