// IdMap: the open-addressing hash map the embedding cache keeps its indexes in (key -> slot,
// key -> staging entry, key -> pending updates, ...).
#pragma once

#include <algorithm>
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

// The bucket where the probe for `id` starts in a map of `buckets` buckets (any number: the hash
// scaled to it, Lemire's multiply-shift), and the one after `bucket`. The cache's copy of its key
// -> slot map in device memory (device_index.h) probes alike.
MLKV_HOST_DEVICE inline uint64_t IdMapHome(int64_t id, uint64_t buckets) {
  const uint64_t hash = SplitMix64(static_cast<uint64_t>(id));
#ifdef __CUDA_ARCH__
  return __umul64hi(hash, buckets);
#else
  return static_cast<uint64_t>((static_cast<unsigned __int128>(hash) * buckets) >> 64);
#endif
}
MLKV_HOST_DEVICE inline uint64_t IdMapNext(uint64_t bucket, uint64_t buckets) {
  return bucket + 1 == buckets ? 0 : bucket + 1;
}

// Open-addressing map from non-negative int64 ids to int32 values; linear
// probing with backward-shift deletion (no tombstones), at most three quarters full: a lookup
// probes about 2.5 buckets for a present id, 8.5 for an absent one, and the cache's index, the
// largest, takes 16 bytes a row rather than 24. Its buckets are as many as that bound needs, not
// a power of two (which would take up to twice the memory at some sizes).
class IdMap {
 public:
  explicit IdMap(size_t expected = 16);
  // Buckets a map made for `expected` ids starts with, and the bytes of one (its memory).
  static size_t BucketsFor(size_t expected) { return std::max<size_t>(16, (expected * 4 + 2) / 3); }
  static bool Overfull(size_t ids, size_t buckets) { return ids * 4 > buckets * 3; }
  static constexpr size_t kBucketBytes = sizeof(int64_t) + sizeof(int32_t);
  static size_t BytesFor(size_t expected) { return BucketsFor(expected) * kBucketBytes; }
  int32_t Find(int64_t id) const;
  // Hints the CPU to load the buckets where the probe for `id` starts: a loop over a batch's ids
  // asks a few ids ahead, so their probes find the buckets in cache.
  void Prefetch(int64_t id) const {
    const size_t home = Home(id);
    __builtin_prefetch(&ids_[home]);
    __builtin_prefetch(&values_[home]);
  }
  // Inserts id -> value when absent; returns the value now stored.
  int32_t Insert(int64_t id, int32_t value);
  int32_t* FindMutable(int64_t id);
  void Erase(int64_t id);
  size_t size() const { return size_; }
  void Clear();

  // The buckets, for a copy of the map elsewhere: id (-1: empty) and value per bucket.
  size_t buckets() const { return ids_.size(); }
  const int64_t* bucket_ids() const { return ids_.data(); }
  const int32_t* bucket_values() const { return values_.data(); }
  // With `changed` set, every bucket written is appended to it (a copy updates those alone), and
  // `*regrown` is set when the map grows or is cleared (every bucket changes). Writes through
  // FindMutable are not tracked.
  void TrackChanges(std::vector<int64_t>* changed, bool* regrown) {
    changed_ = changed;
    regrown_ = regrown;
  }

 private:
  size_t Home(int64_t id) const { return static_cast<size_t>(IdMapHome(id, ids_.size())); }
  size_t After(size_t bucket) const { return static_cast<size_t>(IdMapNext(bucket, ids_.size())); }
  void Set(size_t bucket, int64_t id, int32_t value) {
    ids_[bucket] = id;
    values_[bucket] = value;
    if (changed_ != nullptr) changed_->push_back(static_cast<int64_t>(bucket));
  }
  void Grow();
  std::vector<int64_t> ids_;  // -1: empty
  std::vector<int32_t> values_;
  size_t size_ = 0;
  std::vector<int64_t>* changed_ = nullptr;
  bool* regrown_ = nullptr;
};

}  // namespace mlkv
