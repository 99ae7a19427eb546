// HashIndex: key -> log address, in 64-byte buckets of five 12-byte entries
// plus an overflow link (FASTER's bucket layout, adapted).
//
// Keys are non-negative int64. They go through a bijective 63-bit mix, so the
// bucket number (low `bits_` bits) and the fingerprint kept in the entry (the
// other 63 - bits_ bits) together identify the key exactly: lookups, upserts
// and deletes never read a record to compare keys, and growing rebuilds the
// hash from the entry alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace mlkv {

class HashIndex {
 public:
  static constexpr uint64_t kNoAddress = ~0ull;
  static constexpr uint64_t kMaxAddress = (1ull << 44) - 2;  // 44 address bits, 0 marks empty
  static constexpr int kSlotsPerBucket = 5;

  // Sized so that `expected_keys` fit at about four keys per bucket.
  explicit HashIndex(uint64_t expected_keys);

  // Returns the address of `key`, or kNoAddress.
  uint64_t Find(int64_t key) const;
  // Sets the address of `key`; returns the previous one or kNoAddress (a new key).
  uint64_t Upsert(int64_t key, uint64_t address);
  // Removes `key`; returns its address or kNoAddress when it was absent.
  uint64_t Erase(int64_t key);
  // Hints the CPU to load the bucket of `key` (for batched lookups).
  void Prefetch(int64_t key) const;

  void Clear();
  uint64_t size() const { return size_; }
  uint64_t bucket_count() const { return uint64_t{1} << bits_; }
  uint64_t MemoryBytes() const;

 private:
  struct alignas(64) Bucket {
    uint64_t lo[kSlotsPerBucket];  // address + 1 (44 bits) | fingerprint low 20 bits
    uint32_t hi[kSlotsPerBucket];  // fingerprint high 31 bits
    uint32_t next;                 // overflow bucket index (into overflow_), 0 = none
  };
  static_assert(sizeof(Bucket) == 64, "a bucket is one cache line");

  static uint64_t Mix(uint64_t x);
  void Locate(int64_t key, uint64_t* bucket, uint64_t* fingerprint) const;
  Bucket* BucketAt(uint64_t home, uint32_t link);
  const Bucket* BucketAt(uint64_t home, uint32_t link) const;
  void InsertNew(uint64_t bucket, uint64_t fingerprint, uint64_t address);
  uint32_t NewOverflowBucket();
  void Grow();

  int bits_;
  uint64_t size_ = 0;
  std::vector<Bucket> buckets_;
  std::vector<Bucket> overflow_;  // overflow_[0] unused: link 0 means none
  std::vector<uint32_t> free_overflow_;
};

}  // namespace mlkv
