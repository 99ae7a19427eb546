// RowStore: what a table's cache needs from the store under it: batched reads
// that tolerate absent keys, and batched writes of fixed-width rows keyed by
// non-negative int64. KVStore (the hybrid log) and RocksRowStore (the RocksDB
// baseline) implement it, so one cache and one op run over either.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "status.h"

namespace mlkv {

class RowStore {
 public:
  virtual ~RowStore() = default;
  // Values are row-major, value_bytes() each, as raw bytes. Safe from several threads at once.
  virtual Status Put(const int64_t* keys, size_t n, const void* values) = 0;
  // Fills the rows of keys present; found[i] says which (absent keys are no error).
  virtual Status Lookup(const int64_t* keys, size_t n, void* values, bool* found) = 0;
  // Makes every row put so far durable; *sequence (when given) names the checkpoint, 0 when the
  // store keeps no numbered checkpoints (RocksDB keeps only its latest state).
  virtual Status Checkpoint(uint64_t* sequence) = 0;
  virtual uint32_t value_bytes() const = 0;
  virtual const std::string& path() const = 0;
};

}  // namespace mlkv
