#include "cache/slot_index.h"

#include <algorithm>

namespace mlkv {

SlotIndex::SlotIndex(int64_t capacity)
    : slot_of_(static_cast<size_t>(std::max<int64_t>(capacity, 1))),
      slot_key_(static_cast<size_t>(capacity), -1),
      slot_dirty_(static_cast<size_t>(capacity), 0) {}

size_t SlotIndex::HostBytes(int64_t capacity) {
  const size_t cap = static_cast<size_t>(capacity);
  return cap * (sizeof(decltype(slot_key_)::value_type) + sizeof(decltype(slot_dirty_)::value_type)) +
         IdMap::BytesFor(cap);
}

void SlotIndex::MarkDirty(const uint8_t* marks) {
  for (size_t s = 0; s < slot_dirty_.size(); ++s) slot_dirty_[s] |= marks[s];
}

void SlotIndex::Assign(int32_t slot, int64_t key) {
  if (slot_key_[slot] >= 0) slot_of_.Erase(slot_key_[slot]);
  slot_key_[slot] = key;
  slot_of_.Insert(key, slot);
  slot_dirty_[slot] = 0;
}

void SlotIndex::Unassign(int32_t slot) {
  if (slot_key_[slot] >= 0) slot_of_.Erase(slot_key_[slot]);
  slot_key_[slot] = -1;
  slot_dirty_[slot] = 0;
}

std::vector<int32_t> SlotIndex::TakeDirty(std::vector<int64_t>* keys) {
  std::vector<int32_t> slots;
  for (int32_t s = 0; s < static_cast<int32_t>(slot_key_.size()); ++s) {
    if (slot_key_[s] >= 0 && slot_dirty_[s]) {
      keys->push_back(slot_key_[s]);
      slots.push_back(s);
      slot_dirty_[s] = 0;
    }
  }
  return slots;
}

}  // namespace mlkv
