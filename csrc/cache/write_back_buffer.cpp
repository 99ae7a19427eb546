#include "cache/write_back_buffer.h"

#include <cstring>
#include <utility>

namespace mlkv {

int64_t WriteBackBuffer::HostBytes(int64_t rows, int64_t row_words) {
  if (rows <= 0) return 0;
  const size_t n = static_cast<size_t>(rows);
  const size_t per_entry = static_cast<size_t>(row_words) * sizeof(float) + sizeof(decltype(keys_)::value_type) +
                           sizeof(decltype(versions_)::value_type) + sizeof(decltype(queued_)::value_type) +
                           sizeof(decltype(free_)::value_type) + sizeof(decltype(order_)::value_type);
  return static_cast<int64_t>(n * per_entry + IdMap::BytesFor(n));
}

int32_t WriteBackBuffer::Entry(int64_t key) {
  const int32_t found = index_.Find(key);
  if (found >= 0) return found;
  int32_t entry;
  if (!free_.empty()) {
    entry = free_.back();
    free_.pop_back();
  } else {
    entry = static_cast<int32_t>(keys_.size());
    keys_.push_back(-1);
    versions_.push_back(0);
    queued_.push_back(0);
    rows_.resize(rows_.size() + static_cast<size_t>(row_words_));
  }
  keys_[entry] = key;
  index_.Insert(key, entry);
  return entry;
}

void WriteBackBuffer::Put(int64_t key, const float* row) {
  const int32_t entry = Entry(key);
  std::memcpy(&rows_[static_cast<size_t>(entry) * row_words_], row, row_words_ * sizeof(float));
  ++versions_[entry];
  if (!queued_[entry]) {
    queued_[entry] = 1;
    order_.push_back(entry);
  }
}

const float* WriteBackBuffer::Find(int64_t key) const {
  const int32_t entry = index_.Find(key);
  return entry < 0 ? nullptr : &rows_[static_cast<size_t>(entry) * row_words_];
}

WriteBackBuffer::Batch WriteBackBuffer::Take(size_t max_rows) {
  Batch batch;
  while (!order_.empty() && batch.keys.size() < max_rows) {
    const int32_t entry = order_.front();
    order_.pop_front();
    queued_[entry] = 0;
    batch.keys.push_back(keys_[entry]);
    batch.versions.push_back(versions_[entry]);
    const float* row = &rows_[static_cast<size_t>(entry) * row_words_];
    batch.rows.insert(batch.rows.end(), row, row + row_words_);
  }
  return batch;
}

void WriteBackBuffer::Complete(const Batch& batch) {
  for (size_t i = 0; i < batch.keys.size(); ++i) {
    const int32_t entry = index_.Find(batch.keys[i]);
    if (entry < 0 || versions_[entry] != batch.versions[i]) continue;  // written again: a later batch takes it
    index_.Erase(batch.keys[i]);
    keys_[entry] = -1;
    free_.push_back(entry);
  }
  if (index_.size() == 0 && keys_.size() > keep_rows_) {  // a burst (an import) is over: give its memory back
    std::vector<float>().swap(rows_);
    std::vector<int64_t>().swap(keys_);
    std::vector<uint32_t>().swap(versions_);
    std::vector<uint8_t>().swap(queued_);
    std::vector<int32_t>().swap(free_);
    index_ = IdMap();
  }
}

WriteBackBuffer::Batch WriteBackBuffer::Batch::Only(const std::vector<uint8_t>& mask, uint8_t value) const {
  Batch part;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (mask[i] != value) continue;
    part.keys.push_back(keys[i]);
    part.versions.push_back(versions[i]);
  }
  return part;
}

void WriteBackBuffer::Return(const Batch& batch) {
  for (size_t i = batch.keys.size(); i-- > 0;) {
    const int32_t entry = index_.Find(batch.keys[i]);
    if (entry < 0 || queued_[entry]) continue;  // written again: already queued with its newer value
    queued_[entry] = 1;
    order_.push_front(entry);
  }
}

void WriteBackBuffer::Swap(WriteBackBuffer& other) {
  std::swap(index_, other.index_);
  rows_.swap(other.rows_);
  keys_.swap(other.keys_);
  versions_.swap(other.versions_);
  queued_.swap(other.queued_);
  free_.swap(other.free_);
  order_.swap(other.order_);
}

}  // namespace mlkv
