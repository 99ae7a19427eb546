#include "cache/staging_area.h"

#include <algorithm>
#include <cstring>

namespace mlkv {

namespace {

constexpr uint32_t kStagedFetches = 8;  // fetches a staged row may wait before it can be dropped

}  // namespace

StagingArea::StagingArea(int64_t rows, int64_t row_words)
    : row_words_(row_words),
      rows_(new float[static_cast<size_t>(rows * row_words)]),
      free_(static_cast<size_t>(rows)),
      key_(static_cast<size_t>(rows), -1),
      epoch_(static_cast<size_t>(rows), 0),
      read_ahead_(static_cast<size_t>(rows), 0) {
  for (int64_t i = 0; i < rows; ++i) free_[i] = static_cast<int32_t>(rows - 1 - i);
}

int64_t StagingArea::HostBytes(int64_t rows, int64_t row_words) {
  const size_t n = static_cast<size_t>(std::max<int64_t>(rows, 0));
  const size_t per_entry = static_cast<size_t>(row_words) * sizeof(float) + sizeof(decltype(free_)::value_type) +
                           sizeof(decltype(key_)::value_type) + sizeof(decltype(epoch_)::value_type) +
                           sizeof(decltype(read_ahead_)::value_type);
  return static_cast<int64_t>(n ? n * per_entry + IdMap::BytesFor(n) : 0);
}

bool StagingArea::Stage(int64_t key, const float* row, bool read_ahead, uint32_t fetch_epoch) {
  if (free_.empty()) {
    // Full: entries no fetch took within the last kStagedFetches fetches are not coming back.
    for (size_t e = 0; e < key_.size(); ++e) {
      if (key_[e] >= 0 && fetch_epoch - epoch_[e] > kStagedFetches) Unstage(key_[e], static_cast<int32_t>(e));
    }
    if (free_.empty()) return false;
  }
  const int32_t entry = free_.back();
  free_.pop_back();
  std::memcpy(&rows_[entry * row_words_], row, row_words_ * sizeof(float));
  key_[entry] = key;
  epoch_[entry] = fetch_epoch;
  read_ahead_[entry] = read_ahead;
  staged_.Insert(key, entry);
  return true;
}

void StagingArea::Unstage(int64_t key, int32_t entry) {
  staged_.Erase(key);
  key_[entry] = -1;
  free_.push_back(entry);
}

void StagingArea::Unstage(int64_t key) {
  const int32_t entry = staged_.Find(key);
  if (entry >= 0) Unstage(key, entry);
}

bool StagingArea::Take(int64_t key, float* row, bool* read_ahead) {
  const int32_t entry = staged_.Find(key);
  if (entry < 0) return false;
  std::memcpy(row, &rows_[entry * row_words_], row_words_ * sizeof(float));
  *read_ahead = read_ahead_[entry] != 0;
  Unstage(key, entry);
  return true;
}

}  // namespace mlkv
