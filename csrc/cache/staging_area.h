// StagingArea: a bounded area in host memory where rows read from the stores, and not cached,
// wait for the fetch or update that needs them: rows the admission policy kept out (their update
// takes them instead of reading the store again) and rows read ahead (EmbeddingCache::ReadAhead).
//
// Not thread-safe: the cache's lock guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "id_map.h"

namespace mlkv {

class StagingArea {
 public:
  StagingArea(int64_t rows, int64_t row_words);
  // Host bytes of an area of `rows` rows of `row_words` 32-bit words: rows, index, per-entry state.
  static int64_t HostBytes(int64_t rows, int64_t row_words);

  // Copies `row` in as `key`'s, staged during fetch `fetch_epoch` (AdmissionPolicy::fetch_epoch);
  // `read_ahead`: read ahead, not kept out by the policy. When full, rows no fetch took within the
  // last few fetches leave first; false when there is still no room.
  bool Stage(int64_t key, const float* row, bool read_ahead, uint32_t fetch_epoch);
  void Unstage(int64_t key);  // no-op when `key` is not staged
  // Copies the row of `key` into `row` and unstages it; false when not staged. *read_ahead says
  // it was read ahead.
  bool Take(int64_t key, float* row, bool* read_ahead);
  bool Contains(int64_t key) const { return staged_.Find(key) >= 0; }
  size_t size() const { return staged_.size(); }

 private:
  void Unstage(int64_t key, int32_t entry);
  const int64_t row_words_;
  IdMap staged_;                     // key -> entry
  std::unique_ptr<float[]> rows_;    // row_words_ floats per entry; untouched (no memory) until used
  std::vector<int32_t> free_;
  std::vector<int64_t> key_;         // per entry, -1 when free
  std::vector<uint32_t> epoch_;      // per entry, the fetch it was staged in
  std::vector<uint8_t> read_ahead_;  // per entry, staged by a read-ahead (its take is a read-ahead hit)
};

}  // namespace mlkv
