#pragma once
// Test support: a unique temporary path, removed (with its ".tmp" sibling) when it goes away.

#include <atomic>
#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <system_error>

namespace loom::test {

namespace fs = std::filesystem;

struct TempPath {
  fs::path path;
  explicit TempPath(const std::string& stem) {
    static std::atomic<int> counter{0};
    const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
    path = fs::temp_directory_path() /
           ("loom_test_" + stem + "_" + std::to_string(now) + "_" +
            std::to_string(std::random_device{}()) + "_" + std::to_string(counter++) + ".bin");
  }
  ~TempPath() {
    std::error_code ec;
    fs::remove_all(path, ec);
    fs::remove_all(fs::path(path.string() + ".tmp"), ec);
  }
  std::string str() const { return path.string(); }
};

}  // namespace loom::test
