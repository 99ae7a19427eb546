#include "hash_index.h"

#include <cstring>

namespace mlkv {
namespace {

constexpr uint64_t kMask63 = (1ull << 63) - 1;
constexpr uint64_t kAddrMask = (1ull << 44) - 1;
constexpr int kFpLoBits = 20;
constexpr uint64_t kFpLoMask = (1ull << kFpLoBits) - 1;
constexpr int kMinBits = 12;            // fingerprints then fit in 51 bits
constexpr uint64_t kKeysPerBucket = 4;  // growth threshold, on average

constexpr uint64_t kMul1 = 0xff51afd7ed558ccdull;
constexpr uint64_t kMul2 = 0xc4ceb9fe1a85ec53ull;

}  // namespace

// Each step is a bijection of [0, 2^63): odd multiply mod 2^63 and xor-shift.
uint64_t HashIndex::Mix(uint64_t x) {
  x = (x * kMul1) & kMask63;
  x ^= x >> 31;
  x = (x * kMul2) & kMask63;
  x ^= x >> 29;
  return x;
}

HashIndex::HashIndex(uint64_t expected_keys) {
  bits_ = kMinBits;
  while ((uint64_t{1} << bits_) * kKeysPerBucket < expected_keys && bits_ < 40) ++bits_;
  buckets_.assign(uint64_t{1} << bits_, Bucket{});
  overflow_.resize(1);
}

void HashIndex::Clear() {
  std::memset(static_cast<void*>(buckets_.data()), 0, buckets_.size() * sizeof(Bucket));
  overflow_.assign(1, Bucket{});
  free_overflow_.clear();
  size_ = 0;
}

uint64_t HashIndex::MemoryBytes() const {
  return (buckets_.capacity() + overflow_.capacity()) * sizeof(Bucket) +
         free_overflow_.capacity() * sizeof(uint32_t);
}

void HashIndex::Locate(int64_t key, uint64_t* bucket, uint64_t* fingerprint) const {
  uint64_t h = Mix(static_cast<uint64_t>(key));
  *bucket = h & ((uint64_t{1} << bits_) - 1);
  *fingerprint = h >> bits_;
}

HashIndex::Bucket* HashIndex::BucketAt(uint64_t home, uint32_t link) {
  return link == 0 ? &buckets_[home] : &overflow_[link];
}
const HashIndex::Bucket* HashIndex::BucketAt(uint64_t home, uint32_t link) const {
  return link == 0 ? &buckets_[home] : &overflow_[link];
}

void HashIndex::Prefetch(int64_t key) const {
  uint64_t b, fp;
  Locate(key, &b, &fp);
  __builtin_prefetch(&buckets_[b]);
}

uint64_t HashIndex::Find(int64_t key) const {
  uint64_t home, fp;
  Locate(key, &home, &fp);
  const uint64_t lo_fp = (fp & kFpLoMask) << 44;
  const uint32_t hi_fp = static_cast<uint32_t>(fp >> kFpLoBits);
  const Bucket* b = &buckets_[home];
  while (true) {
    for (int i = 0; i < kSlotsPerBucket; ++i) {
      uint64_t lo = b->lo[i];
      if ((lo & kAddrMask) != 0 && (lo & ~kAddrMask) == lo_fp && b->hi[i] == hi_fp) {
        return (lo & kAddrMask) - 1;
      }
    }
    if (b->next == 0) return kNoAddress;
    b = &overflow_[b->next];
  }
}

uint64_t HashIndex::Upsert(int64_t key, uint64_t address) {
  uint64_t home, fp;
  Locate(key, &home, &fp);
  const uint64_t lo_fp = (fp & kFpLoMask) << 44;
  const uint32_t hi_fp = static_cast<uint32_t>(fp >> kFpLoBits);
  uint32_t link = 0;
  while (true) {
    Bucket* b = BucketAt(home, link);
    for (int i = 0; i < kSlotsPerBucket; ++i) {
      uint64_t lo = b->lo[i];
      if ((lo & kAddrMask) != 0 && (lo & ~kAddrMask) == lo_fp && b->hi[i] == hi_fp) {
        b->lo[i] = lo_fp | (address + 1);
        return (lo & kAddrMask) - 1;
      }
    }
    if (b->next == 0) break;
    link = b->next;
  }
  if (size_ + 1 > bucket_count() * kKeysPerBucket && bits_ < 40) {
    Grow();
    Locate(key, &home, &fp);
  }
  InsertNew(home, fp, address);
  ++size_;
  return kNoAddress;
}

void HashIndex::InsertNew(uint64_t home, uint64_t fp, uint64_t address) {
  const uint64_t lo_new = ((fp & kFpLoMask) << 44) | (address + 1);
  const uint32_t hi_new = static_cast<uint32_t>(fp >> kFpLoBits);
  uint32_t link = 0;
  while (true) {
    Bucket* b = BucketAt(home, link);
    for (int i = 0; i < kSlotsPerBucket; ++i) {
      if ((b->lo[i] & kAddrMask) == 0) {
        b->lo[i] = lo_new;
        b->hi[i] = hi_new;
        return;
      }
    }
    if (b->next == 0) {
      uint32_t fresh = NewOverflowBucket();  // may reallocate overflow_
      BucketAt(home, link)->next = fresh;
      link = fresh;
    } else {
      link = b->next;
    }
  }
}

uint32_t HashIndex::NewOverflowBucket() {
  if (!free_overflow_.empty()) {
    uint32_t link = free_overflow_.back();
    free_overflow_.pop_back();
    overflow_[link] = Bucket{};
    return link;
  }
  overflow_.push_back(Bucket{});
  return static_cast<uint32_t>(overflow_.size() - 1);
}

uint64_t HashIndex::Erase(int64_t key) {
  uint64_t home, fp;
  Locate(key, &home, &fp);
  const uint64_t lo_fp = (fp & kFpLoMask) << 44;
  const uint32_t hi_fp = static_cast<uint32_t>(fp >> kFpLoBits);
  uint32_t link = 0, prev_link = 0;
  while (true) {
    Bucket* b = BucketAt(home, link);
    for (int i = 0; i < kSlotsPerBucket; ++i) {
      uint64_t lo = b->lo[i];
      if ((lo & kAddrMask) != 0 && (lo & ~kAddrMask) == lo_fp && b->hi[i] == hi_fp) {
        b->lo[i] = 0;
        b->hi[i] = 0;
        --size_;
        // Unlink an overflow bucket that became empty, so chains stay short.
        bool empty = true;
        for (int j = 0; j < kSlotsPerBucket; ++j) empty &= (b->lo[j] & kAddrMask) == 0;
        if (empty && link != 0) {
          BucketAt(home, prev_link)->next = b->next;
          free_overflow_.push_back(link);
        }
        return (lo & kAddrMask) - 1;
      }
    }
    if (b->next == 0) return kNoAddress;
    prev_link = link;
    link = b->next;
  }
}

void HashIndex::Grow() {
  std::vector<Bucket> old_buckets;
  std::vector<Bucket> old_overflow;
  old_buckets.swap(buckets_);
  old_overflow.swap(overflow_);
  const int old_bits = bits_;
  ++bits_;
  buckets_.assign(uint64_t{1} << bits_, Bucket{});
  overflow_.assign(1, Bucket{});
  free_overflow_.clear();
  for (uint64_t home = 0; home < old_buckets.size(); ++home) {
    const Bucket* b = &old_buckets[home];
    while (true) {
      for (int i = 0; i < kSlotsPerBucket; ++i) {
        uint64_t lo = b->lo[i];
        if ((lo & kAddrMask) == 0) continue;
        uint64_t fp = (static_cast<uint64_t>(b->hi[i]) << kFpLoBits) | (lo >> 44);
        uint64_t h = (fp << old_bits) | home;
        InsertNew(h & ((uint64_t{1} << bits_) - 1), h >> bits_, (lo & kAddrMask) - 1);
      }
      if (b->next == 0) break;
      b = &old_overflow[b->next];
    }
  }
}

}  // namespace mlkv
