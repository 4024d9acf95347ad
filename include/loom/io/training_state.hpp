#pragma once
//! \file Training-state checkpoints: what a run needs to go on exactly where it stopped (the
//! parameters at the optimizer's precision, the optimizer's state, the steps done), written in
//! the whole model's layout (Trainer::whole_layout), so that a state saved on one mesh and
//! strategy resumes on any other: DP x TP x PP, DDP or ZeRO-1/2/3, one rank or many.
//!
//! The file (little-endian):
//!
//!     "LOOMSTAT" u32 version=1 u32 scalar_bytes (4: fp32, 8: double) i64 steps i32 state_slots
//!     i32 0  string optimizer  string meta  u64 parameters, each: string name, u32 rank,
//!     i64 extents[rank]  i64 elements
//!     then 1 + state_slots arrays of `elements` scalars (the parameters, then each state slot)
//!     then the trailer: u64 checksum of the header, u64 checksum of each array, "LOOMSTAT"
//!
//! where a string is a u64 byte count and the bytes. The checksums are 64-bit FNV-1a over
//! 8-byte words, so that a flipped or truncated byte is found before anything is loaded from it.

#include <array>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"
#include "loom/io/token_file.hpp"

namespace loom::io {

//! What a training-state file says about itself.
struct TrainingStateInfo {
  std::int64_t steps = 0;  //!< steps done when it was saved; a resumed run goes on with steps + 1
  std::string optimizer;   //!< the optimizer's name (AdamW::name); its state slots mean nothing to another
  int state_slots = 0;     //!< optimizer state arrays after the parameters
  int scalar_bytes = 4;    //!< 4 (fp32: float and bf16 models) or 8 (double)
  std::string meta;        //!< the saving program's text about the run (gpt2_train: JSON of the model config)
  std::vector<std::pair<std::string, Shape>> parameters;  //!< names and whole shapes, in layout order
  std::int64_t elements = 0;  //!< of each array
};

namespace detail {

inline constexpr std::array<char, 8> training_state_magic{'L', 'O', 'O', 'M', 'S', 'T', 'A', 'T'};
inline constexpr std::uint32_t training_state_version = 1;

//! 64-bit FNV-1a over 8-byte words (a final partial word zero-padded), continuing from `hash`.
inline std::uint64_t checksum(const void* data, std::size_t bytes,
                              std::uint64_t hash = 0xcbf29ce484222325ull) {
  constexpr std::uint64_t prime = 0x100000001b3ull;
  const auto* p = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + i, 8);
    hash = (hash ^ word) * prime;
  }
  if (i < bytes) {
    std::uint64_t word = 0;
    std::memcpy(&word, p + i, bytes - i);
    hash = (hash ^ word) * prime;
  }
  return hash;
}

//! The header's bytes, built in memory so that its checksum is taken before it is written.
class HeaderBytes {
 public:
  template <class V>
  void put(const V& value) {
    append(&value, sizeof(V));
  }
  void put_string(std::string_view text) {
    put(static_cast<std::uint64_t>(text.size()));
    append(text.data(), text.size());
  }
  const std::string& bytes() const noexcept { return bytes_; }

 private:
  // A std::string: GCC 12 warns falsely (-Wstringop-overflow) on growing a vector<char> here.
  void append(const void* data, std::size_t n) { bytes_.append(static_cast<const char*>(data), n); }
  std::string bytes_;
};

//! Reads the header's fields from a file, counting the bytes and their checksum as it goes.
class HeaderReader {
 public:
  HeaderReader(BinaryFile& file, std::uint64_t file_bytes) : file_(&file), file_bytes_(file_bytes) {}
  template <class V>
  V get(std::string_view what) {
    V value;
    read(&value, sizeof(V), what);
    return value;
  }
  std::string get_string(std::string_view what) {
    const auto n = get<std::uint64_t>(what);
    const std::uint64_t rest = file_bytes_ - bytes_read();
    if (n > rest)
      throw Error(file_->name() + ": length of " + std::string(what), n,
                  "longer than the rest of the file (" + loom::detail::to_text(rest) +
                      " bytes): the header is corrupt");
    std::string text(n, '\0');
    read(text.data(), n, what);
    return text;
  }
  std::uint64_t bytes_read() const noexcept { return bytes_.size(); }
  std::uint64_t hash() const noexcept { return checksum(bytes_.data(), bytes_.size()); }

 private:
  void read(void* data, std::size_t bytes, std::string_view what) {
    file_->read(data, bytes, what);
    const std::size_t at = bytes_.size();
    bytes_.resize(at + bytes);
    if (bytes > 0) std::memcpy(bytes_.data() + at, data, bytes);
  }
  BinaryFile* file_;
  std::uint64_t file_bytes_;
  std::vector<char> bytes_;
};

inline std::uint64_t trailer_bytes(int state_slots) {
  return 8 * (2 + static_cast<std::uint64_t>(state_slots)) + training_state_magic.size();
}

//! Eight bytes as text where they are printable, else as hex ("4c 4f ...").
inline std::string printable(const std::array<char, 8>& bytes) {
  std::string text, hex;
  bool plain = true;
  for (char c : bytes) {
    plain = plain && c >= 0x20 && c < 0x7f;
    text += c;
    constexpr char digits[] = "0123456789abcdef";
    const auto u = static_cast<unsigned char>(c);
    if (!hex.empty()) hex += ' ';
    hex += digits[u >> 4];
    hex += digits[u & 15];
  }
  return plain ? text : "bytes " + hex;
}

template <class O>
std::string optimizer_name() {
  if constexpr (requires { O::name; })
    return O::name;
  else
    return {};
}

//! Throws an Error naming the first difference between the file's parameters and `layout`'s.
inline void check_parameters(const std::string& file, const TrainingStateInfo& info, const ParameterLayout& layout) {
  const auto entries = layout.entries();
  const std::size_t common = std::min(entries.size(), info.parameters.size());
  for (std::size_t i = 0; i < common; ++i) {
    const auto& [name, shape] = info.parameters[i];
    const ParameterSpec& spec = entries[i].spec;
    if (name != spec.name)
      throw Error(file + ": parameter " + loom::detail::to_text(i), name,
                  "the model's parameter " + loom::detail::to_text(i) + " is " + spec.name +
                      " (the checkpoint is of another model)");
    if (!(shape == spec.shape))
      throw Error(file + ": shape of " + name, shape,
                  "the model's is " + loom::detail::to_text(spec.shape) +
                      " (another model config; the file holds whole, unsharded tensors)");
  }
  if (info.parameters.size() != entries.size())
    throw Error(file + ": parameters", info.parameters.size(),
                "the model has " + loom::detail::to_text(entries.size()) + " (the checkpoint is of another model)");
}

//! Reads and checks the header and the trailer of `file`; returns the info and the checksums.
inline TrainingStateInfo read_training_state_header(BinaryFile& file, std::vector<std::uint64_t>& array_sums) {
  const std::uint64_t size = file.size();
  HeaderReader in(file, size);
  const auto magic = in.get<std::array<char, 8>>("magic");
  if (magic != training_state_magic)
    throw Error(file.name() + ": magic", printable(magic),
                "expected LOOMSTAT (a loom training-state checkpoint; llm.c weight files are read by --init)");
  const auto version = in.get<std::uint32_t>("version");
  LOOM_CHECK(version == training_state_version, file.name() + ": version", version,
             "this loom reads version " + loom::detail::to_text(training_state_version));
  TrainingStateInfo info;
  info.scalar_bytes = static_cast<int>(in.get<std::uint32_t>("scalar bytes"));
  LOOM_CHECK(info.scalar_bytes == 4 || info.scalar_bytes == 8, file.name() + ": scalar bytes", info.scalar_bytes,
             "must be 4 (fp32) or 8 (double)");
  info.steps = in.get<std::int64_t>("steps");
  LOOM_CHECK(info.steps >= 0, file.name() + ": steps", info.steps, "must be >= 0");
  info.state_slots = in.get<std::int32_t>("state slots");
  LOOM_CHECK(info.state_slots >= 0 && info.state_slots <= 8, file.name() + ": state slots", info.state_slots,
             "must be in [0, 8]");
  (void)in.get<std::int32_t>("reserved");
  info.optimizer = in.get_string("optimizer name");
  info.meta = in.get_string("meta");
  const auto count = in.get<std::uint64_t>("parameter count");
  LOOM_CHECK(count <= size / 16, file.name() + ": parameter count", count, "more than the file can hold: corrupt");
  std::int64_t elements = 0;
  for (std::uint64_t p = 0; p < count; ++p) {
    std::string name = in.get_string("parameter name");
    const auto rank = in.get<std::uint32_t>("rank of " + name);
    LOOM_CHECK(rank <= 4, file.name() + ": rank of " + name, rank, "must be <= 4: corrupt");
    std::vector<std::int64_t> extents;
    for (std::uint32_t d = 0; d < rank; ++d) {
      extents.push_back(in.get<std::int64_t>("shape of " + name));
      LOOM_CHECK(extents.back() >= 0 && extents.back() <= (std::int64_t{1} << 40), file.name() + ": shape of " + name,
                 extents.back(), "must be in [0, 2^40]: corrupt");
    }
    Shape shape = Shape::of(extents);
    elements += shape.numel();
    info.parameters.emplace_back(std::move(name), shape);
  }
  info.elements = in.get<std::int64_t>("elements");
  LOOM_CHECK(info.elements == elements, file.name() + ": elements", info.elements,
             "the parameters' shapes add up to " + loom::detail::to_text(elements) + ": corrupt");
  const std::uint64_t header_sum = in.hash();
  const std::uint64_t arrays = 1 + static_cast<std::uint64_t>(info.state_slots);
  const std::uint64_t expected =
      in.bytes_read() + arrays * static_cast<std::uint64_t>(elements) * static_cast<std::uint64_t>(info.scalar_bytes) +
      trailer_bytes(info.state_slots);
  LOOM_CHECK(size == expected, file.name() + ": size", loom::detail::to_text(size) + " bytes",
             "expected " + loom::detail::to_text(expected) + " for its header (" +
                 (size < expected ? "the file is truncated: an interrupted copy?" : "extra bytes at the end") + ")");
  const std::uint64_t arrays_begin = in.bytes_read();
  file.seek(size - trailer_bytes(info.state_slots));
  std::uint64_t stored_header_sum = 0;
  file.read(&stored_header_sum, 8, "header checksum");
  array_sums.assign(arrays, 0);
  file.read(array_sums.data(), 8 * arrays, "array checksums");
  std::array<char, 8> end{};
  file.read(end.data(), end.size(), "closing magic");
  LOOM_CHECK(end == training_state_magic, file.name() + ": closing magic", printable(end),
             "expected LOOMSTAT: the file is corrupt");
  LOOM_CHECK(stored_header_sum == header_sum, file.name() + ": header checksum", header_sum,
             "the trailer records " + loom::detail::to_text(stored_header_sum) + ": the header is corrupt");
  file.seek(arrays_begin);
  return info;
}

}  // namespace detail

//! Reads the header of the training-state file at `path` (and checks its size and trailer)
//! without reading the arrays: what a program looks at before it builds the model.
inline TrainingStateInfo read_training_state_info(const std::filesystem::path& path) {
  detail::BinaryFile file(path, "rb", "training state");
  std::vector<std::uint64_t> sums;
  return detail::read_training_state_header(file, sums);
}

//! Saves `trainer`'s training state to `path`: collective over the trainer's mesh (every rank
//! calls it; each array is gathered from the ranks that own its pieces), written by the rank at
//! data-parallel, tensor-parallel and pipeline position 0 through `path + ".tmp"` and a rename,
//! so that a failure never leaves a partial file where a good one was. A failure to write
//! throws on every rank (the writer's own error there, a pointer to it elsewhere). `meta` is
//! free text kept in the file (e.g. the model config as JSON). Holds one array of the whole
//! model (4 bytes per parameter in fp32) on each rank at a time.
template <class Trainer>
void save_training_state(Trainer& trainer, const std::filesystem::path& path, std::string_view meta = {}) {
  using V = typename Trainer::state_type;
  using O = typename Trainer::optimizer_type;
  const bool writer =
      trainer.data_parallel_rank() == 0 && trainer.tensor_parallel_rank() == 0 && trainer.pipeline_rank() == 0;
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  std::optional<detail::BinaryFile> file;
  std::exception_ptr failure;
  auto attempt = [&](auto&& write) {
    if (!writer || failure) return;
    try {
      write();
    } catch (...) {
      failure = std::current_exception();
    }
  };
  std::vector<std::uint64_t> sums;
  attempt([&] {
    detail::HeaderBytes h;
    h.put(detail::training_state_magic);
    h.put(detail::training_state_version);
    h.put(static_cast<std::uint32_t>(sizeof(V)));
    h.put(static_cast<std::int64_t>(trainer.steps()));
    h.put(static_cast<std::int32_t>(O::state_slots));
    h.put(std::int32_t{0});
    h.put_string(detail::optimizer_name<O>());
    h.put_string(meta);
    const ParameterLayout& layout = trainer.whole_layout();
    h.put(static_cast<std::uint64_t>(layout.entries().size()));
    for (const ParameterLayout::Entry& e : layout.entries()) {
      h.put_string(e.spec.name);
      h.put(static_cast<std::uint32_t>(e.spec.shape.rank()));
      for (int d = 0; d < e.spec.shape.rank(); ++d) h.put(static_cast<std::int64_t>(e.spec.shape[d]));
    }
    h.put(static_cast<std::int64_t>(layout.total()));
    sums.push_back(detail::checksum(h.bytes().data(), h.bytes().size()));
    file.emplace(tmp, "wb", "training state");
    file->write(h.bytes().data(), h.bytes().size());
  });
  for (int array = 0; array < Trainer::state_arrays; ++array) {
    const std::vector<V> values = trainer.gather_state(array);
    attempt([&] {
      sums.push_back(detail::checksum(values.data(), values.size() * sizeof(V)));
      file->write(values.data(), values.size() * sizeof(V));
    });
  }
  attempt([&] {
    file->write(sums.data(), sums.size() * sizeof(std::uint64_t));
    file->write(detail::training_state_magic.data(), detail::training_state_magic.size());
    file->close();
    file.reset();
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec)
      throw Error("training state: renaming " + detail::quoted(tmp) + " to " + detail::quoted(path), ec.message(),
                  "the directory must be writable");
  });
  if (writer && failure) {
    file.reset();
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
  }
  const bool failed = trainer.any_of_ranks(failure != nullptr);
  if (failure) std::rethrow_exception(failure);
  if (failed)
    throw Error("training state " + detail::quoted(path), "not saved",
                "the writing rank (data-parallel, tensor-parallel and pipeline rank 0) failed; its error says why");
}

//! Loads the training state at `path` into `trainer` (every rank reads the file and keeps its
//! part; collective only to agree that all succeeded): the parameters, the optimizer state and
//! the steps done, so that the next step is the one after the saved run's last. The file must
//! be of the same model (names and whole shapes) and optimizer; mesh, strategy and schedule may
//! differ, and so may the precision (an fp32 state loads into a double model and back). Each
//! array is checked against its checksum before any of it is loaded. Returns the file's info.
template <class Trainer>
TrainingStateInfo load_training_state(Trainer& trainer, const std::filesystem::path& path) {
  using V = typename Trainer::state_type;
  using O = typename Trainer::optimizer_type;
  TrainingStateInfo info;
  std::exception_ptr failure;
  try {
    detail::BinaryFile file(path, "rb", "training state");
    std::vector<std::uint64_t> sums;
    info = detail::read_training_state_header(file, sums);
    detail::check_parameters(file.name(), info, trainer.whole_layout());
    const std::string optimizer = detail::optimizer_name<O>();
    LOOM_CHECK(info.optimizer == optimizer && info.state_slots == O::state_slots, file.name() + ": optimizer",
               info.optimizer + " (" + loom::detail::to_text(info.state_slots) + " state slots)",
               "the trainer's is " + optimizer + " (" + loom::detail::to_text(O::state_slots) +
                   "); an optimizer's state means nothing to another");
    const auto n = static_cast<std::size_t>(info.elements);
    std::vector<V> values(n);
    // The file's bytes land in `values` when its scalars are V; otherwise in `raw`, then widened
    // or narrowed into `values`.
    const bool same_width = info.scalar_bytes == static_cast<int>(sizeof(V));
    std::vector<char> raw(same_width ? 0 : n * static_cast<std::size_t>(info.scalar_bytes));
    void* const bytes = same_width ? static_cast<void*>(values.data()) : raw.data();
    const std::size_t byte_count = n * static_cast<std::size_t>(info.scalar_bytes);
    for (int array = 0; array < Trainer::state_arrays; ++array) {
      file.read(bytes, byte_count, array == 0 ? "parameters" : "optimizer state");
      const std::uint64_t sum = detail::checksum(bytes, byte_count);
      LOOM_CHECK(sum == sums[static_cast<std::size_t>(array)],
                 file.name() + ": checksum of array " + loom::detail::to_text(array) +
                     (array == 0 ? " (parameters)" : " (optimizer state slot " + loom::detail::to_text(array - 1) + ")"),
                 sum, "the trailer records " + loom::detail::to_text(sums[static_cast<std::size_t>(array)]) +
                          ": the file is corrupt");
      if (!same_width) {
        for (std::size_t i = 0; i < n; ++i) {
          if (info.scalar_bytes == 4) {
            float x;
            std::memcpy(&x, raw.data() + 4 * i, 4);
            values[i] = static_cast<V>(x);
          } else {
            double x;
            std::memcpy(&x, raw.data() + 8 * i, 8);
            values[i] = static_cast<V>(x);
          }
        }
      }
      trainer.load_state(array, values);
    }
    trainer.set_steps(info.steps);
  } catch (...) {
    failure = std::current_exception();
  }
  const bool failed = trainer.any_of_ranks(failure != nullptr);
  if (failure) std::rethrow_exception(failure);
  if (failed)
    throw Error("training state " + detail::quoted(path), "not loaded",
                "another rank failed to load it (a missing or different file there?); its error says why");
  return info;
}

}  // namespace loom::io
