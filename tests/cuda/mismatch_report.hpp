#pragma once
// What a failing GPU layout test says about the failure, so that one run on a lent GPU (rare, and
// 15 minutes at most) is enough to find a wrong layout here: where in the result the wrong values
// are (a map of its 8 x 8 blocks), whether they are right values in wrong places (and at which
// offset, most often), and the values themselves, exactly, in a file that
// scripts/gpu_check.sh brings back (LOOM_TEST_DUMP_DIR).

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace loom::cuda_test {

//! Whether got[i] is within `tolerance` * max(|want[i]|, 1) of want[i] (false for NaN).
inline bool within(double got, double want, double tolerance) {
  return std::abs(got - want) <= tolerance * std::max(std::abs(want), 1.0);
}

//! A report on a [rows, cols] result against what was expected:
//! - a map of its 8 x 8 blocks (a character each; rows of blocks top to bottom): '.' every
//!   element within `tolerance`, 'n' some NaN (never written, where the output started as NaN),
//!   'x' some outside;
//! - for the elements outside, how many equal (within `match_tolerance`) the expected value at
//!   another position, and the commonest offsets (expected position minus got's) with counts:
//!   a permuted layout shows as a few offsets covering most of them, a wrong operand as none.
//! Empty when every element is within.
inline std::string mismatch_report(const std::vector<float>& got, const std::vector<double>& want, int rows,
                                   int cols, double tolerance, double match_tolerance = 1e-5) {
  const auto outside = [&](std::size_t i) { return !within(got[i], want[i], tolerance); };
  std::vector<std::size_t> wrong;
  for (std::size_t i = 0; i < got.size(); ++i)
    if (outside(i)) wrong.push_back(i);
  if (wrong.empty()) return {};
  std::ostringstream out;
  out << wrong.size() << " of " << got.size() << " outside; 8 x 8 blocks ('.' right, 'x' wrong, 'n' NaN):\n";
  for (int br = 0; br < (rows + 7) / 8; ++br) {
    out << "  ";
    for (int bc = 0; bc < (cols + 7) / 8; ++bc) {
      char mark = '.';
      for (int r = 8 * br; r < std::min(rows, 8 * br + 8); ++r)
        for (int c = 8 * bc; c < std::min(cols, 8 * bc + 8); ++c) {
          const std::size_t i = static_cast<std::size_t>(r) * cols + c;
          if (std::isnan(got[i]))
            mark = 'n';
          else if (mark == '.' && outside(i))
            mark = 'x';
        }
      out << mark;
    }
    out << '\n';
  }
  // The expected values sorted, to find each wrong value among them by binary search.
  std::vector<std::pair<double, std::size_t>> sorted;
  sorted.reserve(want.size());
  for (std::size_t i = 0; i < want.size(); ++i) sorted.emplace_back(want[i], i);
  std::sort(sorted.begin(), sorted.end());
  std::map<std::pair<int, int>, int> offsets;
  std::size_t matched = 0;
  for (const std::size_t i : wrong) {
    if (std::isnan(got[i])) continue;
    const double g = got[i];
    const double slack = match_tolerance * std::max(std::abs(g), 1.0);
    auto it = std::lower_bound(sorted.begin(), sorted.end(), std::make_pair(g - slack, std::size_t{0}));
    bool found = false;
    for (; it != sorted.end() && it->first <= g + slack; ++it) {
      if (it->second == i) continue;
      const int r = static_cast<int>(i) / cols, c = static_cast<int>(i) % cols;
      const int wr = static_cast<int>(it->second) / cols, wc = static_cast<int>(it->second) % cols;
      ++offsets[{wr - r, wc - c}];
      found = true;
    }
    matched += found;
  }
  out << "  " << matched << " of the " << wrong.size() << " equal an expected value elsewhere";
  std::vector<std::pair<int, std::pair<int, int>>> common;
  for (const auto& [offset, count] : offsets) common.emplace_back(count, offset);
  std::sort(common.begin(), common.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  if (!common.empty()) out << "; commonest offsets (rows, columns): ";
  for (std::size_t k = 0; k < std::min<std::size_t>(4, common.size()); ++k)
    out << (k ? ", " : "") << "(" << common[k].second.first << ", " << common[k].second.second << ") x"
        << common[k].first;
  out << '\n';
  return out.str();
}

//! Appends `values` [rows, cols] (C99 hex floats, exact) under the heading `name rows cols` to
//! $LOOM_TEST_DUMP_DIR/`file` when that variable is set; returns the file's path, or "" if unset
//! or not writable.
template <class T>
std::string dump_values(const std::string& file, const std::string& name, const std::vector<T>& values, int rows,
                        int cols) {
  const char* dir = std::getenv("LOOM_TEST_DUMP_DIR");
  if (dir == nullptr || *dir == '\0') return {};
  const std::string path = std::string(dir) + "/" + file;
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) return {};
  std::fprintf(f, "%s %d %d\n", name.c_str(), rows, cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      std::fprintf(f, "%a%c", static_cast<double>(static_cast<float>(values[static_cast<std::size_t>(r) * cols + c])),
                   c + 1 == cols ? '\n' : ' ');
  std::fclose(f);
  return path;
}

}  // namespace loom::cuda_test
