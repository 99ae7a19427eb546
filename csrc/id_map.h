// IdMap: the open-addressing hash map the embedding cache keeps its indexes in (key -> slot,
// key -> staging entry, key -> pending updates, ...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "row_ops.h"

namespace mlkv {

// The smallest power of two >= n (at least 16): sizes of hash tables and sketches.
inline size_t PowerOfTwoAtLeast(size_t n) {
  size_t p = 16;
  while (p < n) p <<= 1;
  return p;
}

// Open-addressing map from non-negative int64 ids to int32 values; linear
// probing with backward-shift deletion (no tombstones).
class IdMap {
 public:
  explicit IdMap(size_t expected = 16);
  int32_t Find(int64_t id) const;
  // Inserts id -> value when absent; returns the value now stored.
  int32_t Insert(int64_t id, int32_t value);
  int32_t* FindMutable(int64_t id);
  void Erase(int64_t id);
  size_t size() const { return size_; }
  void Clear();

 private:
  size_t Home(int64_t id) const { return static_cast<size_t>(SplitMix64(static_cast<uint64_t>(id))) & mask_; }
  void Grow();
  std::vector<int64_t> ids_;  // -1: empty
  std::vector<int32_t> values_;
  size_t mask_ = 0, size_ = 0;
};

}  // namespace mlkv
