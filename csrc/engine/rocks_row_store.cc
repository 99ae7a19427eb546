#include "rocks_row_store.h"

#ifdef MLKV_WITH_ROCKSDB

#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/options.h>
#include <rocksdb/statistics.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <vector>

namespace mlkv {
namespace {

// The row width, under a key no row has (row keys are 8 bytes).
const char kWidthKey[] = "mlkv.value_bytes";

// Big-endian, so RocksDB's byte order is the ids' order and neighbouring ids share blocks.
void EncodeKey(int64_t key, char* out) {
  const uint64_t k = static_cast<uint64_t>(key);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(k >> (56 - 8 * i));
}

Status FromRocks(const rocksdb::Status& s, const std::string& path) {
  if (s.ok()) return Status::OK();
  const std::string msg = "rocksdb at " + path + ": " + s.ToString();
  if (s.IsCorruption()) return Status::Corruption(msg);
  if (s.IsInvalidArgument() || s.IsNotSupported()) return Status::InvalidArgument(msg);
  if (s.IsBusy()) return Status::Busy(msg);
  return Status::IOError(msg);
}

rocksdb::Options MakeOptions(uint64_t memory_budget_bytes, bool direct_io,
                             const std::shared_ptr<rocksdb::Statistics>& statistics) {
  rocksdb::Options o;
  o.create_if_missing = true;
  o.IncreaseParallelism(2);
  // Half the budget to two memtables, half to the block cache.
  const uint64_t memtable = std::max<uint64_t>(64 << 10, memory_budget_bytes / 4);
  o.write_buffer_size = memtable;
  o.max_write_buffer_number = 2;
  o.target_file_size_base = std::max<uint64_t>(memtable, 8 << 20);
  o.max_bytes_for_level_base = 4 * o.target_file_size_base;
  o.compression = rocksdb::kNoCompression;
  o.use_direct_reads = direct_io;
  o.use_direct_io_for_flush_and_compaction = direct_io;
  o.statistics = statistics;
  rocksdb::BlockBasedTableOptions t;
  t.block_cache = rocksdb::NewLRUCache(std::max<uint64_t>(64 << 10, memory_budget_bytes / 2));
  t.block_size = 4096;
  t.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
  t.cache_index_and_filter_blocks = true;  // index and filters count against the budget
  t.pin_l0_filter_and_index_blocks_in_cache = true;
  o.table_factory.reset(rocksdb::NewBlockBasedTableFactory(t));
  return o;
}

}  // namespace

Status RocksRowStore::Open(const std::string& path, uint32_t value_bytes, uint64_t memory_budget_bytes, bool direct_io,
                           std::unique_ptr<RocksRowStore>* out) {
  if (value_bytes == 0) return Status::InvalidArgument("rows must have at least one byte");
  std::error_code error;
  std::filesystem::create_directories(path, error);
  if (error) return Status::IOError("cannot create the store directory " + path + ": " + error.message());
  std::unique_ptr<RocksRowStore> store(new RocksRowStore(path, value_bytes));
  store->statistics_ = rocksdb::CreateDBStatistics();
  store->statistics_->set_stats_level(rocksdb::StatsLevel::kExceptTimers);
  rocksdb::DB* db = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(MakeOptions(memory_budget_bytes, direct_io, store->statistics_), path, &db);
  store->direct_io_ = direct_io;
  if (!s.ok() && direct_io && (s.IsInvalidArgument() || s.IsNotSupported() || s.IsIOError())) {
    // A file system without O_DIRECT (tmpfs): read through the page cache instead.
    rocksdb::Status buffered =
        rocksdb::DB::Open(MakeOptions(memory_budget_bytes, false, store->statistics_), path, &db);
    if (buffered.ok()) store->direct_io_ = false;
    s = buffered.ok() ? buffered : s;
  }
  MLKV_RETURN_IF_ERROR(FromRocks(s, path));
  store->db_.reset(db);
  std::string width;
  s = db->Get(rocksdb::ReadOptions(), kWidthKey, &width);
  if (s.IsNotFound()) {
    const uint32_t w = value_bytes;
    MLKV_RETURN_IF_ERROR(FromRocks(
        db->Put(rocksdb::WriteOptions(), kWidthKey, rocksdb::Slice(reinterpret_cast<const char*>(&w), sizeof(w))),
        path));
  } else {
    MLKV_RETURN_IF_ERROR(FromRocks(s, path));
    uint32_t stored = 0;
    if (width.size() != sizeof(stored))
      return Status::Corruption("rocksdb at " + path + ": its row width record is damaged");
    std::memcpy(&stored, width.data(), sizeof(stored));
    if (stored != value_bytes) {
      return Status::InvalidArgument("rocksdb at " + path + " holds rows of " + std::to_string(stored) +
                                     " bytes; this table needs " + std::to_string(value_bytes));
    }
  }
  *out = std::move(store);
  return Status::OK();
}

RocksRowStore::RocksRowStore(std::string path, uint32_t value_bytes)
    : path_(std::move(path)), value_bytes_(value_bytes) {}

RocksRowStore::~RocksRowStore() { Close(); }

Status RocksRowStore::Put(const int64_t* keys, size_t n, const void* values) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (!db_) return Status::InvalidArgument("store at " + path_ + " is closed");
  rocksdb::WriteBatch batch;
  char key[8];
  const char* rows = static_cast<const char*>(values);
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0) return Status::InvalidArgument("keys must be non-negative, got " + std::to_string(keys[i]));
    EncodeKey(keys[i], key);
    MLKV_RETURN_IF_ERROR(
        FromRocks(batch.Put(rocksdb::Slice(key, 8), rocksdb::Slice(rows + i * value_bytes_, value_bytes_)), path_));
  }
  rocksdb::WriteOptions write;
  write.disableWAL = true;
  MLKV_RETURN_IF_ERROR(FromRocks(db_->Write(write, &batch), path_));
  rows_written_ += n;
  return Status::OK();
}

Status RocksRowStore::Lookup(const int64_t* keys, size_t n, void* values, bool* found) {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (!db_) return Status::InvalidArgument("store at " + path_ + " is closed");
  if (n == 0) return Status::OK();
  std::vector<char> encoded(8 * n);
  std::vector<rocksdb::Slice> slices(n);
  for (size_t i = 0; i < n; ++i) {
    if (keys[i] < 0) return Status::InvalidArgument("keys must be non-negative, got " + std::to_string(keys[i]));
    EncodeKey(keys[i], &encoded[8 * i]);
    slices[i] = rocksdb::Slice(&encoded[8 * i], 8);
  }
  std::vector<rocksdb::PinnableSlice> rows(n);
  std::vector<rocksdb::Status> statuses(n);
  db_->MultiGet(rocksdb::ReadOptions(), db_->DefaultColumnFamily(), n, slices.data(), rows.data(), statuses.data());
  char* out = static_cast<char*>(values);
  uint64_t hits = 0;
  for (size_t i = 0; i < n; ++i) {
    found[i] = statuses[i].ok();
    if (statuses[i].IsNotFound()) continue;
    MLKV_RETURN_IF_ERROR(FromRocks(statuses[i], path_));
    if (rows[i].size() != value_bytes_) {
      return Status::Corruption("rocksdb at " + path_ + ": row " + std::to_string(keys[i]) + " has " +
                                std::to_string(rows[i].size()) + " bytes, not " + std::to_string(value_bytes_));
    }
    std::memcpy(out + i * value_bytes_, rows[i].data(), value_bytes_);
    ++hits;
  }
  rows_read_ += n;
  rows_found_ += hits;
  return Status::OK();
}

Status RocksRowStore::Delete(const int64_t* keys, size_t n, uint64_t* deleted) {
  *deleted = 0;
  if (n == 0) return Status::OK();
  // RocksDB deletes blindly; the count comes from a read of the same keys first.
  std::vector<char> rows(n * value_bytes_);
  std::unique_ptr<bool[]> found(new bool[n]);
  MLKV_RETURN_IF_ERROR(Lookup(keys, n, rows.data(), found.get()));
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (!db_) return Status::InvalidArgument("store at " + path_ + " is closed");
  rocksdb::WriteBatch batch;
  char key[8];
  for (size_t i = 0; i < n; ++i) {
    if (!found[i]) continue;
    EncodeKey(keys[i], key);
    MLKV_RETURN_IF_ERROR(FromRocks(batch.Delete(rocksdb::Slice(key, 8)), path_));
    ++*deleted;
  }
  rocksdb::WriteOptions write;
  write.disableWAL = true;
  return FromRocks(db_->Write(write, &batch), path_);
}

Status RocksRowStore::Checkpoint() {
  std::shared_lock<std::shared_mutex> lock(mu_);
  if (!db_) return Status::InvalidArgument("store at " + path_ + " is closed");
  return FromRocks(db_->Flush(rocksdb::FlushOptions()), path_);
}

Status RocksRowStore::Close() {
  std::unique_lock<std::shared_mutex> lock(mu_);
  if (!db_) return Status::OK();
  Status flushed = FromRocks(db_->Flush(rocksdb::FlushOptions()), path_);
  Status closed = FromRocks(db_->Close(), path_);
  db_.reset();
  return flushed.ok() ? closed : flushed;
}

RocksStats RocksRowStore::Stats() const {
  std::shared_lock<std::shared_mutex> lock(mu_);
  RocksStats s;
  s.direct_io = direct_io_;
  s.rows_read = rows_read_;
  s.rows_found = rows_found_;
  s.rows_written = rows_written_;
  if (!db_) return s;
  db_->GetIntProperty(rocksdb::DB::Properties::kEstimateNumKeys, &s.rows_estimate);
  db_->GetIntProperty(rocksdb::DB::Properties::kLiveSstFilesSize, &s.disk_bytes);
  db_->GetIntProperty(rocksdb::DB::Properties::kCurSizeAllMemTables, &s.memtable_bytes);
  db_->GetIntProperty(rocksdb::DB::Properties::kBlockCacheUsage, &s.block_cache_bytes);
  s.block_cache_hits = statistics_->getTickerCount(rocksdb::BLOCK_CACHE_DATA_HIT);
  s.block_cache_misses = statistics_->getTickerCount(rocksdb::BLOCK_CACHE_DATA_MISS);
  return s;
}

}  // namespace mlkv

#endif  // MLKV_WITH_ROCKSDB
