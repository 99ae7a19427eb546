// SlotIndex: the embedding cache's host bookkeeping of its slots: the key -> slot map, the key
// each slot holds (-1: free), and the slots that are dirty (hold a row newer than its store's).
//
// Not thread-safe: the cache's lock guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "id_map.h"

namespace mlkv {

class SlotIndex {
 public:
  explicit SlotIndex(int64_t capacity);
  // Host bytes of an index over `capacity` slots: the map and the per-slot state.
  static size_t HostBytes(int64_t capacity);

  int32_t Find(int64_t key) const { return slot_of_.Find(key); }  // -1: not cached
  void Prefetch(int64_t key) const { slot_of_.Prefetch(key); }
  int64_t key(int32_t slot) const { return slot_key_[slot]; }
  bool dirty(int32_t slot) const { return slot_dirty_[slot] != 0; }
  const std::vector<uint8_t>& dirty_bits() const { return slot_dirty_; }
  size_t size() const { return slot_of_.size(); }  // keys cached
  int64_t capacity() const { return static_cast<int64_t>(slot_key_.size()); }

  void MarkDirty(int32_t slot) { slot_dirty_[slot] = 1; }
  // Marks dirty every slot whose mark (one per slot, as the device's update kernel keeps them) is set.
  void MarkDirty(const uint8_t* marks);
  // `slot` holds `key` from now on, clean; the key it held before leaves the map.
  void Assign(int32_t slot, int64_t key);
  // `slot` holds no key from now on (its row leaves; the slot is reserved for a row on its way).
  void Unassign(int32_t slot);
  // The dirty slots, marked clean, with their keys appended to *keys: the caller takes their rows
  // to the stores.
  std::vector<int32_t> TakeDirty(std::vector<int64_t>* keys);

  // The key -> slot map, for the copy in device memory (DeviceIndex) to follow.
  IdMap* map() { return &slot_of_; }

 private:
  IdMap slot_of_;
  std::vector<int64_t> slot_key_;
  std::vector<uint8_t> slot_dirty_;
};

}  // namespace mlkv
