// HashIndex: key -> log address, in 64-byte buckets of five 12-byte entries
// plus an overflow link (FASTER's bucket layout, adapted).
//
// Keys are non-negative int64 below 2^key_bits and go through a bijective
// mix h of key_bits bits. With n buckets, a key's home bucket is h % n and its
// fingerprint h / n (at most 51 bits: n is at least 2^(key_bits - 51)), so
// (bucket, fingerprint) identifies the key exactly: lookups, upserts and
// deletes never read a record to compare keys, and growing rebuilds h from the
// entry alone. Each key may also live in one alternate bucket (two-choice
// placement, marked by a bit), which keeps buckets evenly filled so that
// overflow buckets stay rare at four keys per bucket: about 16 bytes per key
// when sized for the expected count.
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
  static constexpr uint64_t kBucketBytes = 64;
  // The most buckets (home and overflow) an index holds, and so the most keys it is sized for.
  static constexpr uint64_t kMaxBuckets = 1ull << 40, kMaxOverflowBuckets = 1ull << 32;
  static constexpr uint64_t kMaxExpectedKeys = kMaxBuckets / 4 * 17 - 17;

  static constexpr int kMaxKeyBits = 63;
  // The fewest key bits that hold every key below `key_limit` (0: any non-negative int64).
  static int KeyBitsBelow(uint64_t key_limit);

  // Sized so that `expected_keys` fit at four keys per bucket. Keys must be below 2^key_bits: a
  // table of few rows then needs as few buckets as its keys fill.
  explicit HashIndex(uint64_t expected_keys, int key_bits = kMaxKeyBits);

  struct Where {  // the two buckets of a key and its packed fingerprint
    uint64_t hash, buckets;  // to redo the rest if the index has grown since
    uint64_t home, alternate;
    uint64_t lo_fp;   // fingerprint bits as they sit in lo
    uint32_t hi_fp;   // fingerprint bits as they sit in hi, alternate bit clear
  };
  Where Locate(int64_t key) const;

  // Returns the address of `key`, or kNoAddress.
  uint64_t Find(int64_t key) const { return Find(Locate(key)); }
  uint64_t Find(const Where& w) const;
  // Sets the address of `key`; returns the previous one or kNoAddress (a new key).
  uint64_t Upsert(int64_t key, uint64_t address);
  // Sets the address of `key` to `address` only if it is `expected`; returns whether it was.
  bool UpdateIf(int64_t key, uint64_t expected, uint64_t address);
  // Removes `key`; returns its address or kNoAddress when it was absent.
  uint64_t Erase(int64_t key);
  // Removes the key `w` locates when its address is `expected` (any address: kNoAddress); true when
  // it did, its address then in *erased (may be null). One lookup, where Find then Erase take two.
  bool EraseIf(const Where& w, uint64_t expected, uint64_t* erased = nullptr);
  // Hints the CPU to load the buckets of a key (for batched lookups).
  void Prefetch(const Where& w) const;
  // Calls fn(i, Locate(key_of(i))) for i in [0, n) in order, the buckets of the keys a few places on
  // loaded meanwhile: lookups of many random keys overlap their cache misses.
  template <typename KeyOf, typename F>
  void ForEachLocated(size_t n, KeyOf&& key_of, F&& fn) const {
    constexpr size_t kAhead = 8;
    Where ahead[kAhead];
    for (size_t i = 0; i < n && i < kAhead; ++i) Prefetch(ahead[i] = Locate(key_of(i)));
    for (size_t i = 0; i < n; ++i) {
      const Where w = ahead[i % kAhead];
      if (i + kAhead < n) Prefetch(ahead[i % kAhead] = Locate(key_of(i + kAhead)));
      fn(i, w);
    }
  }

  // Growth stops at `buckets` (0: no limit); keys past them go to overflow buckets. A store with an
  // index budget sets it so the array stays within the budget at its fullest.
  void set_bucket_limit(uint64_t buckets) { bucket_limit_ = buckets; }
  uint64_t size() const { return size_; }
  uint64_t bucket_count() const { return buckets_.size(); }
  int key_bits() const { return mix_.bits; }
  ~HashIndex();
  HashIndex(const HashIndex&) = delete;
  HashIndex& operator=(const HashIndex&) = delete;
  uint64_t MemoryBytes() const;

  // The index as an image (a store's index checkpoint): the counts, then three regions written
  // and read back byte for byte: the bucket array, the overflow buckets, the free overflow list.
  struct ImageCounts {
    uint64_t size, buckets, overflow, free;
  };
  struct Region {
    void* data;
    uint64_t bytes;
  };
  ImageCounts Counts() const;
  std::vector<Region> Regions() const;  // to write, in order
  // Resizes to an image's counts and returns the regions to read it into (in order); false when
  // the counts cannot be an image of an index (nothing changed then).
  bool Reset(const ImageCounts& counts, std::vector<Region>* regions);
  // Calls fn(key, address) for every key: the key comes back from its bucket and fingerprint.
  template <typename F>
  void ForEachEntry(F&& fn) const {
    const uint64_t n = buckets_.size();
    auto visit = [&](const Bucket& b, uint64_t index) {
      for (int i = 0; i < kSlotsPerBucket; ++i) {
        if (b.lo[i] & kAddressBits) fn(KeyOf(b, i, index, n), (b.lo[i] & kAddressBits) - 1);
      }
    };
    for (uint64_t i = 0; i < n; ++i) {
      for (const Bucket* b = &buckets_[i];; b = &overflow_[b->next]) {
        visit(*b, i);
        if (b->next == 0) break;
      }
    }
  }
  // Gives back the memory of keys erased: the buckets resized to what the keys need.
  void ShrinkToFit();

  // Calls fn(address) for every key's address.
  template <typename F>
  void ForEachAddress(F&& fn) const {
    auto visit = [&](const Bucket& b) {
      for (int i = 0; i < kSlotsPerBucket; ++i) {
        if (b.lo[i] & kAddressBits) fn((b.lo[i] & kAddressBits) - 1);
      }
    };
    for (uint64_t i = 0; i < buckets_.size(); ++i) visit(buckets_[i]);
    for (size_t i = 1; i < overflow_.size(); ++i) visit(overflow_[i]);  // free ones are empty
  }

 private:
  static constexpr uint64_t kAddressBits = (1ull << 44) - 1;  // of lo: address + 1, 0 when empty
  struct alignas(64) Bucket {
    uint64_t lo[kSlotsPerBucket];  // address + 1 (44 bits) | fingerprint low 20 bits
    uint32_t hi[kSlotsPerBucket];  // fingerprint high bits (31) | in-alternate-bucket bit
    uint32_t next;                 // overflow bucket index (into overflow_), 0 = none
  };
  static_assert(sizeof(Bucket) == kBucketBytes, "a bucket is one cache line");

  // A bijection of [0, 2^bits): odd multiplies and xor-shifts (a shift of 0 is left out).
  struct Mixer {
    int bits;
    uint64_t mask;
    int shift1, shift2;
    explicit Mixer(int key_bits);
    uint64_t Mix(uint64_t x) const;
    uint64_t Unmix(uint64_t x) const;
  };

  Where LocateHash(uint64_t h) const;
  // The key of entry `slot` of bucket `b`, found in the chain of bucket `index` of `n`.
  int64_t KeyOf(const Bucket& b, int slot, uint64_t index, uint64_t n) const;
  uint64_t HashOf(const Bucket& b, int slot, uint64_t index, uint64_t n) const;
  uint64_t AlternateOffset(uint64_t fp) const;  // in [1, n): alternate = home + offset (mod n)
  // Finds the entry of `w`'s key: sets *bucket and *slot, returns false when absent.
  bool FindEntry(const Where& w, Bucket** bucket, int* slot, uint32_t* link_of_bucket, uint64_t* chain_home) const;
  void InsertNew(const Where& w, uint64_t address);
  int FreeSlots(const Bucket& b) const;
  uint32_t NewOverflowBucket();
  void Resize(uint64_t buckets);

  // The main bucket array, on huge pages where the kernel allows: each lookup
  // touches a random bucket, and 4 KiB pages would miss the TLB on most of them.
  class BucketArray {
   public:
    BucketArray() = default;
    explicit BucketArray(uint64_t n);
    ~BucketArray();
    BucketArray(const BucketArray&) = delete;
    BucketArray& operator=(const BucketArray&) = delete;
    void swap(BucketArray& other);
    Bucket& operator[](uint64_t i) { return data_[i]; }
    const Bucket& operator[](uint64_t i) const { return data_[i]; }
    uint64_t size() const { return size_; }
    uint64_t bytes() const { return bytes_; }

   private:
    Bucket* data_ = nullptr;
    uint64_t size_ = 0, bytes_ = 0;
  };

  Mixer mix_;
  uint64_t min_buckets_;  // fingerprints (h / buckets) then fit in their 51 bits
  uint64_t size_ = 0;
  uint64_t bucket_limit_ = 0;
  BucketArray buckets_;
  std::vector<Bucket> overflow_;  // overflow_[0] unused: link 0 means none
  std::vector<uint32_t> free_overflow_;
};

}  // namespace mlkv
