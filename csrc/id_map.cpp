#include "id_map.h"

#include <algorithm>

namespace mlkv {

IdMap::IdMap(size_t expected) {
  const size_t cap = BucketsFor(expected);
  ids_.assign(cap, -1);
  values_.assign(cap, 0);
}

int32_t IdMap::Find(int64_t id) const {
  for (size_t i = Home(id);; i = After(i)) {
    if (ids_[i] == id) return values_[i];
    if (ids_[i] < 0) return -1;
  }
}

int32_t* IdMap::FindMutable(int64_t id) {
  for (size_t i = Home(id);; i = After(i)) {
    if (ids_[i] == id) return &values_[i];
    if (ids_[i] < 0) return nullptr;
  }
}

int32_t IdMap::Insert(int64_t id, int32_t value) {
  for (size_t i = Home(id);; i = After(i)) {
    if (ids_[i] == id) return values_[i];
    if (ids_[i] < 0) {
      if (Overfull(size_ + 1, ids_.size())) {  // only a new id grows the map: one sized for its ids never grows
        Grow();
        return Insert(id, value);
      }
      Set(i, id, value);
      ++size_;
      return value;
    }
  }
}

void IdMap::Erase(int64_t id) {
  size_t i = Home(id);
  while (ids_[i] != id) {
    if (ids_[i] < 0) return;
    i = After(i);
  }
  // Backward shift: move later entries of the probe run into the hole when their home allows it.
  for (size_t j = After(i);; j = After(j)) {
    if (ids_[j] < 0) break;
    const size_t home = Home(ids_[j]);
    const bool movable = (j > i) ? (home <= i || home > j) : (home <= i && home > j);
    if (movable) {
      Set(i, ids_[j], values_[j]);
      i = j;
    }
  }
  Set(i, -1, 0);
  --size_;
}

void IdMap::Clear() {
  std::fill(ids_.begin(), ids_.end(), -1);
  size_ = 0;
  if (regrown_ != nullptr) *regrown_ = true;
}

void IdMap::Grow() {
  std::vector<int64_t> old_ids = std::move(ids_);
  std::vector<int32_t> old_values = std::move(values_);
  ids_.assign(old_ids.size() * 2, -1);
  values_.assign(old_ids.size() * 2, 0);
  size_ = 0;
  if (regrown_ != nullptr) *regrown_ = true;
  for (size_t i = 0; i < old_ids.size(); ++i) {
    if (old_ids[i] >= 0) Insert(old_ids[i], old_values[i]);
  }
}

}  // namespace mlkv
