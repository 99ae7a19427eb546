// AdmissionPolicy: which missed row the embedding cache admits, and which resident row leaves for
// it, over the cache's slots 0 .. capacity - 1 (the slots' keys are SlotIndex's).
//
// - "lfu": a miss is admitted only when its recent frequency (a count-min sketch, halved
//   periodically so it follows drift) beats that of the coldest of a few sampled residents.
// - "lru": every miss is admitted and the least recently used row leaves (the baseline).
// - Rows the fetch under way has read or admitted (its epoch) are never evicted by it.
// - Pins: a slot pinned for read-ahead request s (Pin) is not evicted until every request up to s
//   is released (ReleaseThrough): the rows of batches read ahead into slots stay until used.
//
// Not thread-safe: the cache's lock guards it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace mlkv {

enum class CachePolicy : int { kLfu = 0, kLru = 1 };

class AdmissionPolicy {
 public:
  AdmissionPolicy(int64_t capacity, CachePolicy policy);
  // Host bytes of the policy's state over `capacity` slots, with whichever policy needs more.
  static size_t HostBytes(int64_t capacity);

  // A fetch begins: the slots it touches or admits from now on are safe from its evictions.
  void BeginFetch();
  // The fetch under way, counting up (the staging area ages its rows by it).
  uint32_t fetch_epoch() const { return epoch_; }
  // A miss of `key`: the frequency it brings to Admit (lfu counts it in the sketch; lru: 1).
  uint8_t CountMiss(int64_t key);
  // A hit on the row of `slot`.
  void Touch(int32_t slot);
  // A slot for a miss seen `frequency` times: a free one, or a resident's (*evicts set), whose row
  // the caller evicts; -1 when the policy keeps the miss out. `dirty` holds each slot's dirty bit;
  // with `cut_writing` (a cut's rows are being written, and a dirty row evicted would wait behind
  // them) the coldest clean sampled row goes first and no miss is kept out.
  // `force`: no admission test (a row read ahead into a slot, which its batch needs there).
  int32_t Admit(uint8_t frequency, const std::vector<uint8_t>& dirty, bool cut_writing, bool* evicts,
                bool force = false);
  // Keeps `slot` until request `request` is released (a later pin of a later request extends it).
  void Pin(int32_t slot, int32_t request) { slot_pin_[slot] = std::max(slot_pin_[slot], request); }
  // Requests up to `request` are done with their rows: their pins no longer keep slots.
  void ReleaseThrough(int32_t request) { released_ = std::max(released_, request); }
  bool pinned(int32_t slot) const { return slot_pin_[slot] > released_; }
  int32_t released() const { return released_; }
  // The last read-ahead request `slot` is pinned for.
  int32_t pinned_for(int32_t slot) const { return slot_pin_[slot]; }
  // Keeps `slot` whatever is released, until Unreserve pins it for `request` (a row on its way in).
  void Reserve(int32_t slot) { slot_pin_[slot] = std::numeric_limits<int32_t>::max(); }
  void Unreserve(int32_t slot, int32_t request) { slot_pin_[slot] = request; }
  // A slot Admit gave out returns unused (its row never arrived).
  void Free(int32_t slot);

 private:
  static size_t SketchWidth(int64_t capacity);  // counters per row of the count-min sketch
  int32_t PickVictim(const std::vector<uint8_t>& dirty, bool clean_first);
  void LruUnlink(int32_t slot);
  void LruPushFront(int32_t slot);
  uint8_t SketchAdd(int64_t key);
  void Age();

  const int64_t capacity_;
  const CachePolicy policy_;
  std::vector<uint8_t> slot_freq_;
  std::vector<uint32_t> slot_epoch_;  // the fetch that last read the slot
  std::vector<int32_t> slot_pin_;     // the last read-ahead request that needs the slot
  int32_t released_ = 0;
  std::vector<int32_t> lru_prev_, lru_next_;
  int32_t lru_head_ = -1, lru_tail_ = -1;
  std::vector<int32_t> free_slots_;
  std::vector<uint8_t> sketch_;
  size_t sketch_mask_ = 0;
  int64_t sketch_adds_ = 0, age_period_ = 0;
  uint32_t epoch_ = 0;
  uint64_t rng_ = 0x9E3779B97F4A7C15ull;
};

}  // namespace mlkv
