// EmbeddingCache's life and what every part shares: the options checked, the members sized, the
// threads started and stopped, a batch's keys, and the counters (see embedding_cache.h).
#include "cache/embedding_cache.h"

#include "cache/cuda_slot_transfer.h"
#include "engine/thread_start.h"

#include <algorithm>
#include <cstdio>

namespace mlkv {

namespace {

// The options, checked before any member is sized by them.
CacheOptions CheckedOptions(CacheOptions o) {
  TORCH_CHECK_VALUE(o.capacity >= 0 && o.capacity < (int64_t{1} << 31), "cache_rows must be in [0, 2^31), got ",
                    o.capacity);
  TORCH_CHECK_VALUE(o.dim > 0, "dim must be positive");
  TORCH_CHECK_VALUE(o.staleness >= 0, "staleness must be >= 0, got ", o.staleness);
  TORCH_CHECK_VALUE(o.transfer_delay_us >= 0, "transfer_delay_us must be >= 0, got ", o.transfer_delay_us);
  TORCH_CHECK_VALUE(o.staging_rows > 0 && o.write_back_rows > 0,
                    "staging_rows and write_back_rows must be "
                    "positive, got ",
                    o.staging_rows, " and ", o.write_back_rows);
  return o;
}

}  // namespace

// ---- EmbeddingCache ------------------------------------------------------------------------------

void EmbeddingCache::CheckInt64Vector(const torch::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.device().is_cpu() && t.is_contiguous(), what,
                    " must be a contiguous 1-D int64 CPU tensor");
}

EmbeddingCache::EmbeddingCache(std::vector<CacheTable> tables, CacheOptions options, torch::Device device)
    : tables_(std::move(tables)),
      opt_(CheckedOptions(std::move(options))),
      device_(device),
      on_host_(device.is_cpu()),
      weight_words_(WeightWords(opt_.weight_type, opt_.dim)),
      row_words_(weight_words_ + StateColumns(opt_.optimizer.kind, opt_.dim)),
      slot_index_(opt_.capacity),
      policy_(opt_.capacity, opt_.policy),
      staging_(opt_.staging_rows, row_words_),
      write_back_(row_words_, static_cast<size_t>(std::max<int64_t>(1, opt_.write_back_rows))),
      cut_(row_words_, device.is_cpu() ? static_cast<size_t>(std::max<int64_t>(0, opt_.capacity)) : 0) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(opt_.initial_state.size()) == row_words_ - weight_words_,
                    "initial_state must have ", row_words_ - weight_words_, " values");
  TORCH_CHECK_VALUE(!tables_.empty() && tables_.size() < (size_t{1} << (63 - kTableShift)),
                    "a cache holds 1 to 2^23 tables, got ", tables_.size());
  for (const CacheTable& t : tables_) {
    TORCH_CHECK_VALUE(t.store != nullptr, "table '", t.name, "' has no store");
    TORCH_CHECK_VALUE(t.num_embeddings > 0 && t.num_embeddings <= kIdMask + 1, "table '", t.name,
                      "': num_embeddings must be in [1, 2^40], got ", t.num_embeddings);
    TORCH_CHECK_VALUE(static_cast<int64_t>(t.store->value_bytes()) == row_words_ * 4, "the store of table '", t.name,
                      "' holds rows of ", t.store->value_bytes(), " bytes, the table needs ", row_words_ * 4);
  }
  table_stats_.resize(tables_.size());
#ifndef MLKV_WITH_CUDA
  TORCH_CHECK_VALUE(device_.is_cpu(), "this build of mlkv_torch has no CUDA kernels; device must be the CPU");
#endif
  TORCH_CHECK_VALUE(device_.is_cpu() || device_.is_cuda(), "device must be the CPU or a CUDA device, got ", device_);
  slots_ = torch::zeros({opt_.capacity, row_words_}, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
  host_slots_ = on_host_ ? slots_.data_ptr<float>() : nullptr;
#ifdef MLKV_WITH_CUDA
  if (!on_host_) {
    slot_dirty_dev_ = torch::zeros({opt_.capacity}, torch::TensorOptions().dtype(torch::kUInt8).device(device_));
    std::vector<int64_t> table_rows;
    for (const CacheTable& t : tables_) table_rows.push_back(t.num_embeddings);
    device_index_ = std::make_unique<DeviceIndex>(slot_index_.map(), table_rows, kTableShift, device_);
    device_hits_ = device_index_->NewCounters();
  }
#endif
  if (opt_.read_ahead_into_slots) {
    if (on_host_) {
      transfer_ = std::make_unique<HostSlotTransfer>(host_slots_, row_words_, opt_.transfer_delay_us);
    } else {
#ifdef MLKV_WITH_CUDA
      transfer_ = std::make_unique<CudaSlotTransfer>(slots_, slot_dirty_dev_);
#endif
    }
  }
  writer_.limit = opt_.write_back_rows;  // rows waiting before a fetch waits for the writer
  StartThreads();
}

void EmbeddingCache::StartThreads() {
  try {
    if (device_.is_cpu()) applier_ = StartThread([this] { ApplierLoop(); });
    read_ahead_thread_ = StartThread([this] { ReadAheadLoop(); });
    writer_thread_ = StartThread([this] { WriterLoop(); });
  } catch (const std::exception& e) {
    StopThreads();  // a thread object destroyed while joinable would end the process
    TORCH_CHECK(false, "the cache of ", tables_[0].store->path(), " could not start its threads: ", e.what());
  }
}

void EmbeddingCache::StopThreads() {
  if (applier_.joinable()) {
    update_queue_.Stop();  // the updates still queued are applied first
    applier_.join();
  }
  if (writer_thread_.joinable()) {
    {
      MutexLock lock(&mu_);
      writer_.stopping = true;  // rows still waiting (after a failed write) stay unwritten: Close raised
      if (write_back_.size() + cut_.rows.size() > 0) {
        std::fprintf(stderr, "mlkv: %zu rows of %s (and the tables beside it) could not be written back: %s\n",
                     write_back_.size() + cut_.rows.size(), tables_[0].store->path().c_str(),
                     writer_.error.ToString().c_str());
      }
    }
    writer_cv_.notify_all();
    writer_thread_.join();
  }
  if (read_ahead_thread_.joinable()) {
    read_ahead_queue_.Stop();
    read_ahead_thread_.join();
  }
}

int64_t EmbeddingCache::HostBytesBesideRows(int64_t capacity) {
  if (capacity <= 0) return 0;  // a cache of no rows: a few KiB of fixed structures, not counted
  return static_cast<int64_t>(SlotIndex::HostBytes(capacity) + AdmissionPolicy::HostBytes(capacity) +
                              CutState::HostBytes(capacity));
}

int64_t EmbeddingCache::HostBytesOfBuffers(int64_t staging_rows, int64_t write_back_rows, int64_t row_words) {
  return StagingArea::HostBytes(staging_rows, row_words) + WriteBackBuffer::HostBytes(write_back_rows, row_words);
}

EmbeddingCache::~EmbeddingCache() {
  // Without Python: the binding decides what to do with the GIL while this waits (gil_for_teardown.h).
  try {
    Close();
  } catch (...) {
    // Close's error was already raised to Python by an earlier call, or the process is exiting.
  }
  StopThreads();
}

std::tuple<torch::Tensor, torch::Tensor> EmbeddingCache::UniqueKeys(const torch::Tensor& values,
                                                                    const std::vector<int64_t>& feature_counts,
                                                                    const std::vector<int64_t>& feature_tables) const {
  CheckInt64Vector(values, "values");
  const int64_t n = values.numel();
  CheckFeatures(n, feature_counts, feature_tables);
  const int64_t* id = values.data_ptr<int64_t>();
  torch::Tensor inverse = torch::empty({n}, torch::kInt64);
  int64_t* inv = inverse.data_ptr<int64_t>();
  std::vector<int64_t> distinct;
  IdMap index(static_cast<size_t>(n));
  int64_t i = 0;
  for (size_t f = 0; f < feature_counts.size(); ++f) {
    const CacheTable& table = tables_[static_cast<size_t>(feature_tables[f])];
    const int64_t table_bits = TableKey(feature_tables[f], 0);
    for (const int64_t end = i + feature_counts[f]; i < end; ++i) {
      TORCH_CHECK_VALUE(id[i] >= 0 && id[i] < table.num_embeddings, "id ", id[i], " is out of range [0, ",
                        table.num_embeddings, ") of table '", table.name, "'");
      const int64_t key = table_bits | id[i];
      const int32_t next = static_cast<int32_t>(distinct.size());
      const int32_t at = index.Insert(key, next);
      if (at == next) distinct.push_back(key);
      inv[i] = at;
    }
  }
  return {torch::tensor(distinct, torch::kInt64), inverse};
}

void EmbeddingCache::CheckFeatures(int64_t n, const std::vector<int64_t>& feature_counts,
                                   const std::vector<int64_t>& feature_tables) const {
  TORCH_CHECK_VALUE(feature_counts.size() == feature_tables.size(), "feature_counts has ", feature_counts.size(),
                    " features, feature_tables ", feature_tables.size());
  int64_t total = 0;
  for (size_t f = 0; f < feature_counts.size(); ++f) {
    TORCH_CHECK_VALUE(feature_counts[f] >= 0, "feature ", f, " has a negative count of ids");
    TORCH_CHECK_VALUE(feature_tables[f] >= 0 && feature_tables[f] < static_cast<int64_t>(tables_.size()), "feature ", f,
                      " names table ", feature_tables[f], " of ", tables_.size());
    total += feature_counts[f];
  }
  TORCH_CHECK_VALUE(total == n, "the features hold ", total, " ids, values has ", n);
}

std::vector<EmbeddingCache::TableBatch> EmbeddingCache::SplitByTable(const int64_t* keys, size_t n,
                                                                     int64_t* only) const {
  *only = n ? TableOf(keys[0]) : 0;
  size_t i = 0;
  while (i < n && TableOf(keys[i]) == *only) ++i;
  if (i == n) return {};
  std::vector<TableBatch> batches(tables_.size());
  for (i = 0; i < n; ++i) {
    TableBatch& b = batches[static_cast<size_t>(TableOf(keys[i]))];
    b.ids.push_back(keys[i] & kIdMask);
    b.positions.push_back(i);
  }
  return batches;
}

void EmbeddingCache::Close() {
  {
    MutexLock lock(&mu_);
    if (closed_) return;
  }
  WriteBack();
  MutexLock lock(&mu_);
  closed_ = true;
}

CacheStats EmbeddingCache::Stats() {
  CacheStats s;
  {
    MutexLock lock(&mu_);
    s = stats_;
    s.cached_rows = static_cast<int64_t>(slot_index_.size());
    s.pending_rows = static_cast<int64_t>(pending_.size());
    s.read_ahead_hits = 0;
    for (const TableCounters& t : table_stats_) s.read_ahead_hits += t.read_ahead_hits;
    s.write_back_rows = static_cast<int64_t>(write_back_.size() + cut_.rows.size() + cut_.slots_left());
  }
  s.read_ahead_latency_us = read_ahead_queue_.latency_us();
  s.read_ahead_wait_us = read_ahead_queue_.wait_us();
  s.queued_updates = update_queue_.queued();
  s.waits = update_queue_.waits();
  return s;
}

std::vector<TableCounters> EmbeddingCache::TableStats() {
  MutexLock lock(&mu_);
  FoldDeviceHits();
  return table_stats_;
}

}  // namespace mlkv
