#include "hash_index.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

namespace mlkv {
namespace {

constexpr uint64_t kAddrMask = (1ull << 44) - 1;
constexpr int kFpLoBits = 20;
constexpr uint64_t kFpLoMask = (1ull << kFpLoBits) - 1;
constexpr uint32_t kAlternateBit = 1u << 31;
constexpr int kFingerprintBits = 51;     // 20 in lo, 31 in hi
constexpr uint64_t kKeysPerBucket = 4;   // growth threshold (plus a half), on average; sizing aims at 4.25
constexpr uint64_t kMul1 = 0xff51afd7ed558ccdull;
constexpr uint64_t kMul2 = 0xc4ceb9fe1a85ec53ull;

// The inverse of an odd number mod 2^64 (so mod 2^63 too), by Newton's iteration.
constexpr uint64_t InverseOf(uint64_t odd) {
  uint64_t inv = odd;
  for (int i = 0; i < 6; ++i) inv *= 2 - odd * inv;
  return inv;
}

uint64_t UndoXorShift(uint64_t y, int shift, int bits) {
  if (shift == 0) return y;
  uint64_t x = y;
  for (int done = shift; done < bits; done += shift) x = y ^ (x >> shift);
  return x;
}

bool Occupied(uint64_t lo) { return (lo & kAddrMask) != 0; }

}  // namespace

// At 63 bits the shifts are 31 and 29: the mix of indexes written before keys had a limit.
HashIndex::Mixer::Mixer(int key_bits)
    : bits(key_bits), mask(~0ull >> (64 - key_bits)), shift1(key_bits / 2), shift2(key_bits * 29 / 63) {}

uint64_t HashIndex::Mixer::Mix(uint64_t x) const {
  x = (x * kMul1) & mask;
  if (shift1) x ^= x >> shift1;
  x = (x * kMul2) & mask;
  if (shift2) x ^= x >> shift2;
  return x;
}

uint64_t HashIndex::Mixer::Unmix(uint64_t x) const {
  x = UndoXorShift(x, shift2, bits);
  x = (x * InverseOf(kMul2)) & mask;
  x = UndoXorShift(x, shift1, bits);
  return (x * InverseOf(kMul1)) & mask;
}

int HashIndex::KeyBitsBelow(uint64_t key_limit) {
  if (key_limit == 0 || key_limit > (1ull << kMaxKeyBits)) return kMaxKeyBits;
  int bits = 1;
  while (bits < kMaxKeyBits && (1ull << bits) < key_limit) ++bits;
  return bits;
}

HashIndex::BucketArray::BucketArray(uint64_t n) : size_(n) {
  constexpr uint64_t kHuge = 2ull << 20;
  bytes_ = n * sizeof(Bucket);
  const bool huge = bytes_ >= kHuge;
  const uint64_t alloc = huge ? (bytes_ + kHuge - 1) / kHuge * kHuge : bytes_;
  data_ = static_cast<Bucket*>(std::aligned_alloc(huge ? kHuge : alignof(Bucket), alloc));
  if (!data_) throw std::bad_alloc();
  if (huge) madvise(data_, alloc, MADV_HUGEPAGE);
  std::memset(static_cast<void*>(data_), 0, bytes_);
}

HashIndex::BucketArray::~BucketArray() { std::free(data_); }

void HashIndex::BucketArray::swap(BucketArray& other) {
  std::swap(data_, other.data_);
  std::swap(size_, other.size_);
  std::swap(bytes_, other.bytes_);
}

HashIndex::HashIndex(uint64_t expected_keys, int key_bits)
    : mix_(key_bits),
      min_buckets_(key_bits > kFingerprintBits ? 1ull << (key_bits - kFingerprintBits) : 1),
      buckets_(std::max(min_buckets_, std::min(expected_keys, mix_.mask) * 4 / 17 + 1)) {
  overflow_.resize(1);
}

HashIndex::~HashIndex() = default;

uint64_t HashIndex::MemoryBytes() const {
  return buckets_.bytes() + overflow_.capacity() * sizeof(Bucket) + free_overflow_.capacity() * sizeof(uint32_t);
}

// The alternate bucket's offset depends on the fingerprint only, so either
// bucket and the fingerprint give back the other. Multiply-shift, no division.
uint64_t HashIndex::AlternateOffset(uint64_t fp) const {
  const uint64_t r = (fp * kMul2) >> 32;  // 32 well-mixed bits
  return 1 + ((r * (buckets_.size() - 1)) >> 32);
}

HashIndex::Where HashIndex::LocateHash(uint64_t h) const {
  const uint64_t n = buckets_.size();
  Where w;
  w.hash = h;
  w.buckets = n;
  const uint64_t fp = h / n;
  w.home = h - fp * n;
  w.alternate = w.home + AlternateOffset(fp);
  if (w.alternate >= n) w.alternate -= n;
  w.lo_fp = (fp & kFpLoMask) << 44;
  w.hi_fp = static_cast<uint32_t>(fp >> kFpLoBits);
  return w;
}

HashIndex::Where HashIndex::Locate(int64_t key) const { return LocateHash(mix_.Mix(static_cast<uint64_t>(key))); }

void HashIndex::Prefetch(const Where& w) const {
  __builtin_prefetch(&buckets_[w.home]);
  __builtin_prefetch(&buckets_[w.alternate]);
}

bool HashIndex::FindEntry(const Where& w, Bucket** bucket, int* slot, uint32_t* link_of_bucket,
                          uint64_t* chain_home) const {
  for (int side = 0; side < 2; ++side) {
    const uint64_t home = side == 0 ? w.home : w.alternate;
    const uint32_t hi = w.hi_fp | (side ? kAlternateBit : 0);
    uint32_t link = 0;
    const Bucket* b = &buckets_[home];
    while (true) {
      for (int i = 0; i < kSlotsPerBucket; ++i) {
        uint64_t lo = b->lo[i];
        if (Occupied(lo) && (lo & ~kAddrMask) == w.lo_fp && b->hi[i] == hi) {
          *bucket = const_cast<Bucket*>(b);
          *slot = i;
          if (link_of_bucket) *link_of_bucket = link;
          if (chain_home) *chain_home = home;
          return true;
        }
      }
      if (b->next == 0) break;
      link = b->next;
      b = &overflow_[link];
    }
  }
  return false;
}

uint64_t HashIndex::Find(const Where& w) const {
  if (w.buckets != buckets_.size()) return Find(LocateHash(w.hash));
  Bucket* b;
  int slot;
  if (!FindEntry(w, &b, &slot, nullptr, nullptr)) return kNoAddress;
  return (b->lo[slot] & kAddrMask) - 1;
}

uint64_t HashIndex::Upsert(int64_t key, uint64_t address) {
  Where w = Locate(key);
  Bucket* b;
  int slot;
  if (FindEntry(w, &b, &slot, nullptr, nullptr)) {
    uint64_t old = (b->lo[slot] & kAddrMask) - 1;
    b->lo[slot] = w.lo_fp | (address + 1);
    return old;
  }
  if (size_ + 1 > buckets_.size() * kKeysPerBucket + buckets_.size() / 2) {
    const uint64_t grown = bucket_limit_ ? std::min(buckets_.size() * 2, bucket_limit_) : buckets_.size() * 2;
    if (grown > buckets_.size()) {
      Resize(grown);
      w = Locate(key);
    }
  }
  InsertNew(w, address);
  ++size_;
  return kNoAddress;
}

bool HashIndex::UpdateIf(int64_t key, uint64_t expected, uint64_t address) {
  const Where w = Locate(key);
  Bucket* b;
  int slot;
  if (!FindEntry(w, &b, &slot, nullptr, nullptr) || (b->lo[slot] & kAddrMask) - 1 != expected) return false;
  b->lo[slot] = w.lo_fp | (address + 1);
  return true;
}

int HashIndex::FreeSlots(const Bucket& b) const {
  int free = 0;
  for (int i = 0; i < kSlotsPerBucket; ++i) free += !Occupied(b.lo[i]);
  return free;
}

// Places a new entry in the emptier of its two buckets, chaining an overflow
// bucket onto the home bucket only when both are full.
void HashIndex::InsertNew(const Where& w, uint64_t address) {
  const uint64_t lo_new = w.lo_fp | (address + 1);
  const bool use_alternate = FreeSlots(buckets_[w.alternate]) > FreeSlots(buckets_[w.home]);
  const uint64_t home = use_alternate ? w.alternate : w.home;
  const uint32_t hi_new = w.hi_fp | (use_alternate ? kAlternateBit : 0);
  uint32_t link = 0;
  while (true) {
    Bucket* b = link == 0 ? &buckets_[home] : &overflow_[link];
    for (int i = 0; i < kSlotsPerBucket; ++i) {
      if (!Occupied(b->lo[i])) {
        b->lo[i] = lo_new;
        b->hi[i] = hi_new;
        return;
      }
    }
    if (b->next == 0) {
      uint32_t fresh = NewOverflowBucket();  // may reallocate overflow_
      (link == 0 ? buckets_[home] : overflow_[link]).next = fresh;
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
  // Grows by a quarter, not the vector's doubling: overflow memory counts per key.
  if (overflow_.size() == overflow_.capacity()) overflow_.reserve(overflow_.size() + overflow_.size() / 4 + 16);
  overflow_.push_back(Bucket{});
  return static_cast<uint32_t>(overflow_.size() - 1);
}

uint64_t HashIndex::Erase(int64_t key) {
  uint64_t old = kNoAddress;
  EraseIf(Locate(key), kNoAddress, &old);
  return old;
}

bool HashIndex::EraseIf(const Where& located, uint64_t expected, uint64_t* erased) {
  const Where w = located.buckets == buckets_.size() ? located : LocateHash(located.hash);
  Bucket* b;
  int slot;
  uint32_t link;
  uint64_t home;
  if (!FindEntry(w, &b, &slot, &link, &home)) return false;
  const uint64_t old = (b->lo[slot] & kAddrMask) - 1;
  if (expected != kNoAddress && old != expected) return false;
  b->lo[slot] = 0;
  b->hi[slot] = 0;
  --size_;
  // Unlinks an overflow bucket that became empty, so chains stay short.
  if (link != 0 && FreeSlots(*b) == kSlotsPerBucket) {
    Bucket* prev = &buckets_[home];
    while (prev->next != link) prev = &overflow_[prev->next];
    prev->next = b->next;
    free_overflow_.push_back(link);
  }
  if (erased) *erased = old;
  return true;
}

HashIndex::ImageCounts HashIndex::Counts() const {
  return ImageCounts{size_, buckets_.size(), overflow_.size(), free_overflow_.size()};
}

std::vector<HashIndex::Region> HashIndex::Regions() const {
  auto region = [](const void* p, uint64_t bytes) { return Region{const_cast<void*>(p), bytes}; };
  return {region(&buckets_[0], buckets_.bytes()), region(overflow_.data(), overflow_.size() * sizeof(Bucket)),
          region(free_overflow_.data(), free_overflow_.size() * sizeof(uint32_t))};
}

bool HashIndex::Reset(const ImageCounts& counts, std::vector<Region>* regions) {
  // A bucket count is a power of two times nothing in particular: any count >= the minimum is
  // valid; the overflow list holds its unused bucket 0, and every free link points into it.
  if (counts.buckets < min_buckets_ || counts.buckets > kMaxBuckets || counts.overflow < 1 ||
      counts.overflow > kMaxOverflowBuckets || counts.free >= counts.overflow ||
      counts.size > (counts.buckets + counts.overflow) * kSlotsPerBucket) {
    return false;
  }
  BucketArray buckets(counts.buckets);
  buckets_.swap(buckets);
  overflow_.assign(counts.overflow, Bucket{});
  free_overflow_.assign(counts.free, 0);
  size_ = counts.size;
  *regions = Regions();
  return true;
}

uint64_t HashIndex::HashOf(const Bucket& b, int slot, uint64_t index, uint64_t n) const {
  const uint64_t fp = (static_cast<uint64_t>(b.hi[slot] & ~kAlternateBit) << kFpLoBits) | (b.lo[slot] >> 44);
  uint64_t home = index;
  if (b.hi[slot] & kAlternateBit) {  // index is the alternate: undo its offset
    const uint64_t r = (fp * kMul2) >> 32;
    home = (index + n - 1 - ((r * (n - 1)) >> 32)) % n;
  }
  return fp * n + home;
}

int64_t HashIndex::KeyOf(const Bucket& b, int slot, uint64_t index, uint64_t n) const {
  return static_cast<int64_t>(mix_.Unmix(HashOf(b, slot, index, n)));
}

void HashIndex::ShrinkToFit() {
  const uint64_t needed = std::max(min_buckets_, size_ * 4 / 17 + 1);
  if (needed * 2 <= buckets_.size() || free_overflow_.size() > 64) Resize(needed);
  overflow_.shrink_to_fit();
  free_overflow_.shrink_to_fit();
}

void HashIndex::Resize(uint64_t bucket_count) {
  BucketArray old_buckets(bucket_count);
  std::vector<Bucket> old_overflow(1, Bucket{});
  old_buckets.swap(buckets_);
  old_overflow.swap(overflow_);
  free_overflow_.clear();
  const uint64_t old_n = old_buckets.size();
  for (uint64_t index = 0; index < old_n; ++index) {
    const Bucket* b = &old_buckets[index];
    while (true) {
      for (int i = 0; i < kSlotsPerBucket; ++i) {
        uint64_t lo = b->lo[i];
        if (!Occupied(lo)) continue;
        InsertNew(LocateHash(HashOf(*b, i, index, old_n)), (lo & kAddrMask) - 1);
      }
      if (b->next == 0) break;
      b = &old_overflow[b->next];
    }
  }
}

}  // namespace mlkv
