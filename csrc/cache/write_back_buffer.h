// WriteBackBuffer: rows on their way to the stores (the embedding cache's asynchronous Puts).
//
// A dirty row evicted from the cache, or an updated row the cache does not hold, is copied
// here; the cache's writer thread takes a batch, writes it to the stores without the cache's
// lock, then completes it. Until then the buffer holds the newest value of the row: every read
// of the cache looks here before the store, so a row being written back is never read stale and
// never read from the disk. A row written again while its older value is being written keeps
// the newer value (its version moves on) and goes out in a later batch.
//
// Not thread-safe: the owner's lock guards it.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "id_map.h"

namespace mlkv {

class WriteBackBuffer {
 public:
  // Emptied, it keeps memory for `keep_rows` rows and frees the rest.
  WriteBackBuffer(int64_t row_words, size_t keep_rows) : row_words_(row_words), keep_rows_(keep_rows) {}

  // Host bytes of a buffer holding `rows` rows of `row_words` words: rows, index, per-entry state.
  static int64_t HostBytes(int64_t rows, int64_t row_words);

  // Copies `row` in as the newest value of `key` (replacing an older one).
  void Put(int64_t key, const float* row);
  // The newest value of `key` waiting here, or nullptr.
  const float* Find(int64_t key) const;
  // Up to `max_rows` rows not yet taken, oldest first: keys, their versions, and rows (row_words each).
  struct Batch {
    std::vector<int64_t> keys;
    std::vector<uint32_t> versions;
    std::vector<float> rows;
    // The keys and versions (not the rows) of entries i with mask[i] == value: the part of a
    // batch to Complete or Return.
    Batch Only(const std::vector<uint8_t>& mask, uint8_t value) const;
  };
  Batch Take(size_t max_rows);
  // The rows of a taken batch reached the stores: each leaves unless written again since.
  void Complete(const Batch& batch);
  // A taken batch failed: its rows stay, to be taken again.
  void Return(const Batch& batch);

  // Exchanges contents with `other` (rows of the same width); neither may have a batch taken and
  // not yet completed or returned.
  void Swap(WriteBackBuffer& other);

  size_t size() const { return index_.size(); }   // rows waiting, taken or not
  size_t waiting() const { return order_.size(); }  // rows not taken

 private:
  int32_t Entry(int64_t key);  // the entry of `key`, made when absent
  const int64_t row_words_;
  const size_t keep_rows_;
  IdMap index_;                  // key -> entry
  std::vector<float> rows_;      // row_words_ per entry
  std::vector<int64_t> keys_;    // per entry, -1 when free
  std::vector<uint32_t> versions_;
  std::vector<uint8_t> queued_;  // the entry is in order_ (not taken since its last Put)
  std::vector<int32_t> free_;
  std::deque<int32_t> order_;    // entries to take, oldest first
};

}  // namespace mlkv
