#pragma once
//! \file Device memory that asynchronous work on another stream still uses, each range until an
//! event of that stream completes. Plain C++ over the event type, so the bookkeeping is tested
//! on the host; detail::CommunicationStream holds it over cudaEvent_t.

#include <cstddef>
#include <span>
#include <utility>
#include <vector>

namespace loom::detail {

//! Bytes [data, data + bytes) of device memory.
struct DeviceRange {
  const void* data = nullptr;
  std::size_t bytes = 0;
};

//! Whether two byte ranges share a byte (empty ranges share none).
inline bool overlaps(DeviceRange a, DeviceRange b) noexcept {
  if (a.bytes == 0 || b.bytes == 0 || a.data == nullptr || b.data == nullptr) return false;
  const auto* a_begin = static_cast<const std::byte*>(a.data);
  const auto* b_begin = static_cast<const std::byte*>(b.data);
  return a_begin < b_begin + b.bytes && b_begin < a_begin + a.bytes;
}

//! Ranges of memory in use until an event completes, one entry per piece of asynchronous work
//! (a collective, or a group of sends and receives, with all the buffers it reads or writes).
template <class Event>
class InUseRanges {
 public:
  //! Records that `ranges` are in use until `until` completes (ranges of no bytes are left out).
  void add(std::span<const DeviceRange> ranges, Event until) {
    Entry entry{{}, std::move(until)};
    for (const DeviceRange& r : ranges)
      if (r.bytes > 0 && r.data != nullptr) entry.ranges.push_back(r);
    if (!entry.ranges.empty()) entries_.push_back(std::move(entry));
  }

  //! Forgets the entries whose event `done(event)` says has completed, handing each such event to
  //! `recycle` (its owner may record it again).
  template <class Done, class Recycle>
  void drop_done(Done&& done, Recycle&& recycle) {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      if (done(entries_[i].until)) {
        recycle(std::move(entries_[i].until));
        continue;
      }
      if (kept != i) entries_[kept] = std::move(entries_[i]);
      ++kept;
    }
    entries_.resize(kept);
  }

  //! Calls `fn(event)` once for each entry with a range sharing a byte with `range`.
  template <class Fn>
  void for_each_overlapping(DeviceRange range, Fn&& fn) const {
    for (const Entry& entry : entries_)
      for (const DeviceRange& r : entry.ranges)
        if (overlaps(r, range)) {
          fn(entry.until);
          break;
        }
  }

  //! Entries not yet dropped.
  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }

  //! Hands every event to `recycle` and forgets them all.
  template <class Recycle>
  void clear(Recycle&& recycle) {
    for (Entry& entry : entries_) recycle(std::move(entry.until));
    entries_.clear();
  }

 private:
  struct Entry {
    std::vector<DeviceRange> ranges;
    Event until;
  };
  std::vector<Entry> entries_;
};

}  // namespace loom::detail
