// RowStore: what a table's cache needs from the store under it: batched reads
// that tolerate absent keys, and batched writes of fixed-width rows keyed by
// non-negative int64. KVStore (the hybrid log) and RocksRowStore (the RocksDB
// baseline) implement it, so one cache and one op run over either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "read_rounds.h"
#include "status.h"

namespace mlkv {

class RowStore {
 public:
  virtual ~RowStore() = default;
  // Values are row-major, value_bytes() each, as raw bytes. Safe from several threads at once.
  virtual Status Put(const int64_t* keys, size_t n, const void* values) = 0;
  // Fills the rows of keys present; found[i] says which (absent keys are no error).
  virtual Status Lookup(const int64_t* keys, size_t n, void* values, bool* found) = 0;
  // Lookup, its disk reads in rounds shared with other lookups (RunReadRounds: a batch of many
  // tables waits for the disk once); the arrays outlive it. By default Lookup, whole, at its first
  // round.
  virtual std::unique_ptr<RoundedLookup> StartLookup(const int64_t* keys, size_t n, void* values, bool* found) {
    auto lookup = [this, keys, n, values, found] { return Lookup(keys, n, values, found); };
    return std::make_unique<ImmediateLookup<decltype(lookup)>>(lookup);
  }
  // Removes the rows of `keys` (absent keys are no error); *deleted counts the rows removed.
  virtual Status Delete(const int64_t* keys, size_t n, uint64_t* deleted) = 0;
  // Makes every row put so far durable; *sequence (when given) names the checkpoint, 0 when the
  // store keeps no numbered checkpoints (RocksDB keeps only its latest state).
  virtual Status Checkpoint(uint64_t* sequence) = 0;
  // A checkpoint in two halves, for a caller that must not wait for the disk between them:
  // BeginCheckpoint fixes its contents (every row put before it, none put after) and returns once
  // puts may go on; FinishCheckpoint makes those durable and names them, as Checkpoint does. Each
  // begun checkpoint is finished once, possibly by another thread. Here both happen in Begin.
  virtual Status BeginCheckpoint() {
    begun_status_ = Checkpoint(&begun_sequence_);
    return Status::OK();
  }
  virtual Status FinishCheckpoint(uint64_t* sequence) {
    *sequence = begun_sequence_;
    return begun_status_;
  }
  virtual uint32_t value_bytes() const = 0;
  virtual const std::string& path() const = 0;

 private:
  Status begun_status_;  // the default halves: the checkpoint Begin took
  uint64_t begun_sequence_ = 0;
};

}  // namespace mlkv
