// RocksRowStore: rows in RocksDB, the offloading baseline MLKV was measured
// against. The same cache and op run over it as over KVStore (RowStore), so a
// comparison isolates the store. Built when RocksDB's headers are found
// (MLKV_WITH_ROCKSDB); Debian's librocksdb-dev provides them.
//
// Settings chosen to be generous to RocksDB rather than to us: no write-ahead
// log (durability comes from the flush at Checkpoint/Close, as KVStore's comes
// from its checkpoint), no compression (float rows barely compress), 4 KiB
// blocks with a bloom filter, and the memory budget split between the block
// cache and the memtables. Reads bypass the page cache (direct I/O) where the
// file system allows, as KVStore's do, so neither store grows past its budget
// through the kernel's cache.
#pragma once

#ifdef MLKV_WITH_ROCKSDB

#include <atomic>
#include <cstdint>
#include <memory>
#include <shared_mutex>
#include <string>

#include "row_store.h"

namespace rocksdb {
class DB;
class Statistics;
}  // namespace rocksdb

namespace mlkv {

struct RocksStats {
  uint64_t rows_estimate = 0;  // RocksDB's own estimate (exact only after compaction)
  uint64_t disk_bytes = 0;     // live SST files
  uint64_t memtable_bytes = 0, block_cache_bytes = 0;
  uint64_t block_cache_hits = 0, block_cache_misses = 0;  // data blocks; a miss is a disk read
  uint64_t rows_read = 0, rows_found = 0, rows_written = 0;
  bool direct_io = false;
};

class RocksRowStore : public RowStore {
 public:
  // Opens or creates the database in directory `path`; a database written with another row width is refused.
  static Status Open(const std::string& path, uint32_t value_bytes, uint64_t memory_budget_bytes, bool direct_io,
                     std::unique_ptr<RocksRowStore>* out);
  ~RocksRowStore() override;
  RocksRowStore(const RocksRowStore&) = delete;
  RocksRowStore& operator=(const RocksRowStore&) = delete;

  Status Put(const int64_t* keys, size_t n, const void* values) override;
  Status Lookup(const int64_t* keys, size_t n, void* values, bool* found) override;
  Status Delete(const int64_t* keys, size_t n, uint64_t* deleted) override;
  uint32_t value_bytes() const override { return value_bytes_; }
  const std::string& path() const override { return path_; }
  // Writes the memtables to SST files: the rows written so far survive a reopen.
  Status Checkpoint();
  Status Checkpoint(uint64_t* sequence) override {
    if (sequence) *sequence = 0;
    return Checkpoint();
  }
  Status Close();
  RocksStats Stats() const;

 private:
  RocksRowStore(std::string path, uint32_t value_bytes);

  const std::string path_;
  const uint32_t value_bytes_;
  bool direct_io_ = false;
  std::shared_ptr<rocksdb::Statistics> statistics_;
  std::unique_ptr<rocksdb::DB> db_;
  mutable std::shared_mutex mu_;  // shared by reads and writes; exclusive to close
  std::atomic<uint64_t> rows_read_{0}, rows_found_{0}, rows_written_{0};
};

}  // namespace mlkv

#endif  // MLKV_WITH_ROCKSDB
