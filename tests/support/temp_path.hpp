#pragma once
// Test support: a unique temporary path, removed (with its ".tmp" sibling) when it goes away, and
// a byte of a file flipped in place (a corrupt checkpoint).

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
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

//! Flips bit 4 of the byte at `offset` of the file at `path`.
inline void flip_byte(const fs::path& path, std::uintmax_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x10);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace loom::test
