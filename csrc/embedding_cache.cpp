#include "embedding_cache.h"

#include "cuda_slot_transfer.h"
#include "engine/task_pool.h"
#include "engine/thread_name.h"
#include "engine/thread_start.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>

namespace mlkv {

namespace {

// Rows of a store read from several tables above which the tables are read side by side.
constexpr size_t kParallelReadRows = 2048;

void ThrowIfError(const Status& st) {
  if (!st.ok()) throw StatusError(st);
}

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
      cut_write_back_(row_words_, 0) {
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
  const size_t cap = static_cast<size_t>(opt_.capacity);
  if (on_host_) cut_slot_.assign(cap, 0);
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
  write_back_limit_ = opt_.write_back_rows;  // rows waiting before a fetch waits for the writer
  StartThreads();
}

void EmbeddingCache::StartThreads() {
  try {
    if (device_.is_cpu()) applier_ = StartThread([this] { ApplierLoop(); });
    read_ahead_thread_ = StartThread([this] { ReadAheadLoop(); });
    writer_ = StartThread([this] { WriterLoop(); });
  } catch (const std::exception& e) {
    StopThreads();  // a thread object destroyed while joinable would end the process
    TORCH_CHECK(false, "the cache of ", tables_[0].store->path(), " could not start its threads: ", e.what());
  }
}

void EmbeddingCache::StopThreads() {
  if (applier_.joinable()) {
    {
      MutexLock lock(&queue_mu_);
      stopping_ = true;
      paused_ = false;
    }
    queue_cv_.notify_all();
    applier_.join();
  }
  if (writer_.joinable()) {
    {
      MutexLock lock(&mu_);
      writer_stopping_ = true;  // rows still waiting (after a failed write) stay unwritten: Close raised
      if (write_back_.size() + cut_write_back_.size() > 0) {
        std::fprintf(stderr, "mlkv: %zu rows of %s (and the tables beside it) could not be written back: %s\n",
                     write_back_.size() + cut_write_back_.size(), tables_[0].store->path().c_str(),
                     write_error_.ToString().c_str());
      }
    }
    writer_cv_.notify_all();
    writer_.join();
  }
  if (read_ahead_thread_.joinable()) {
    {
      MutexLock lock(&read_ahead_mu_);
      read_ahead_stopping_ = true;
    }
    read_ahead_cv_.notify_all();
    read_ahead_thread_.join();
  }
}

int64_t EmbeddingCache::HostBytesBesideRows(int64_t capacity) {
  if (capacity <= 0) return 0;  // a cache of no rows: a few KiB of fixed structures, not counted
  const size_t cut = static_cast<size_t>(capacity) * sizeof(decltype(cut_slot_)::value_type);
  return static_cast<int64_t>(SlotIndex::HostBytes(capacity) + AdmissionPolicy::HostBytes(capacity) + cut);
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

void EmbeddingCache::ReadFromStore(const int64_t* keys, size_t n, float* out, bool* fresh) const {
  if (n == 0) return;
  std::unique_ptr<bool[]> found(new bool[n]);
  int64_t only;
  const std::vector<TableBatch> batches = SplitByTable(keys, n, &only);
  if (batches.empty()) {
    std::vector<int64_t> ids(keys, keys + n);
    for (int64_t& id : ids) id &= kIdMask;
    ThrowIfError(tables_[static_cast<size_t>(only)].store->Lookup(ids.data(), n, out, found.get()));
  } else {
    // One batched read per table, into a buffer, then back to the batch's order (each table its
    // own rows of `out`). A large batch reads its tables side by side: one table's batched read
    // keeps only its own few reads in flight, and the disk (or the page cache) serves many more.
    std::vector<Status> status(batches.size());
    std::vector<std::function<void()>> reads;
    for (size_t t = 0; t < batches.size(); ++t) {
      if (batches[t].ids.empty()) continue;
      reads.push_back([this, t, &batches, &status, out, &found] {
        const TableBatch& b = batches[t];
        std::vector<float> rows(b.ids.size() * static_cast<size_t>(row_words_));
        std::unique_ptr<bool[]> table_found(new bool[b.ids.size()]);
        status[t] = tables_[t].store->Lookup(b.ids.data(), b.ids.size(), rows.data(), table_found.get());
        if (!status[t].ok()) return;
        for (size_t k = 0; k < b.ids.size(); ++k) {
          std::memcpy(out + b.positions[k] * row_words_, &rows[k * row_words_], row_words_ * sizeof(float));
          found[b.positions[k]] = table_found[k];
        }
      });
    }
    if (n >= kParallelReadRows) {
      TaskPool::Shared().RunAll(reads);
    } else {
      for (const auto& read : reads) read();
    }
    for (const Status& st : status) ThrowIfError(st);
  }
  std::vector<float> initial(static_cast<size_t>(opt_.dim));
  for (size_t i = 0; i < n; ++i) {
    fresh[i] = !found[i];
    if (found[i]) continue;
    float* row = out + i * row_words_;
    InitialRow(tables_[static_cast<size_t>(TableOf(keys[i]))].init, keys[i] & kIdMask, opt_.dim, initial.data());
    DispatchWeightType(opt_.weight_type, [&](auto zero) {
      using W = decltype(zero);
      W* w = reinterpret_cast<W*>(row);
      for (int64_t j = 0; j < opt_.dim; ++j) w[j] = static_cast<W>(initial[j]);
      if (weight_words_ * 4 > opt_.dim * static_cast<int64_t>(sizeof(W))) w[opt_.dim] = static_cast<W>(0.f);  // pad
    });
    std::copy(opt_.initial_state.begin(), opt_.initial_state.end(), row + weight_words_);
  }
}

// ---- admission ---------------------------------------------------------------------------------

int32_t EmbeddingCache::Admit(int64_t id, uint8_t frequency, std::vector<Admission>* admissions) {
  bool evicts = false;
  const int32_t s = policy_.Admit(frequency, slot_index_.dirty_bits(), cut_state_ == CutState::kWriting, &evicts);
  if (s < 0) return -1;
  if (evicts) {
    PreserveCutRow(s);
    const int64_t evicted = slot_index_.key(s);
    admissions->push_back({s, evicted, static_cast<uint8_t>(slot_index_.dirty(s))});
    --table_stats_[static_cast<size_t>(TableOf(evicted))].cached_rows;
  } else {
    admissions->push_back({s, -1, 0});
  }
  slot_index_.Assign(s, id);
  ++table_stats_[static_cast<size_t>(TableOf(id))].cached_rows;
  return s;
}

// ---- data movement between host buffers and slots ----------------------------------------------

void EmbeddingCache::CopyRowsToSlots(const std::vector<int32_t>& slots, const torch::Tensor& rows) {
  if (slots.empty()) return;
  if (on_host_) {
    const float* src = rows.data_ptr<float>();
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(host_slots_ + slots[i] * row_words_, src + i * row_words_, row_words_ * sizeof(float));
    }
    return;
  }
  torch::Tensor index = torch::tensor(std::vector<int64_t>(slots.begin(), slots.end()), torch::kInt64).to(device_);
  slots_.index_copy_(0, index, rows.to(device_, /*non_blocking=*/false));
}

torch::Tensor EmbeddingCache::SlotRowsToHost(const std::vector<int32_t>& slots) {
  if (on_host_) {
    torch::Tensor out = torch::empty({static_cast<int64_t>(slots.size()), row_words_}, torch::kFloat32);
    float* dst = out.data_ptr<float>();
    for (size_t i = 0; i < slots.size(); ++i) {
      std::memcpy(dst + i * row_words_, host_slots_ + slots[i] * row_words_, row_words_ * sizeof(float));
    }
    return out;
  }
  torch::Tensor index = torch::tensor(std::vector<int64_t>(slots.begin(), slots.end()), torch::kInt64).to(device_);
  return slots_.index_select(0, index).cpu();
}

EmbeddingCache::CacheSplit EmbeddingCache::SplitByCache(const int64_t* keys, int64_t n, bool will_write) {
  CacheSplit split;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = slot_index_.Find(keys[i]);
    if (s >= 0) {
      split.cached_pos.push_back(i);
      split.cached_slots.push_back(s);
      if (will_write) {
        PreserveCutRow(s);
        slot_index_.MarkDirty(s);
      }
    } else {
      split.missed_pos.push_back(i);
      split.missed_ids.push_back(keys[i]);
    }
  }
  return split;
}

// ---- the operations ------------------------------------------------------------------------------

torch::Tensor EmbeddingCache::FetchBatch(const torch::Tensor& keys) {
  {
    MutexLock lock(&mu_);
    TakeReadAhead(std::nullopt);  // on the host rows are found by key: only the pins matter
  }
  return Fetch(keys);
}

torch::Tensor EmbeddingCache::Fetch(const torch::Tensor& keys) {
  CheckInt64Vector(keys, "keys");
  const int64_t n = keys.numel();
  const int64_t* key = keys.data_ptr<int64_t>();
  torch::Tensor out;
  std::vector<int64_t> source(static_cast<size_t>(n));  // slot, or -1: row i of `missed`
  std::vector<int64_t> missed_pos, missed_ids;
  WaitQueuedAtMost(opt_.staleness);
  WaitForReadAheads(key, n);
  // One fetch at a time: between its unlocked store reads and its admissions no other fetch
  // changes which rows are cached.
  MutexLock fetch_lock(&fetch_mu_);
  MutexLock lock(&mu_);
  ThrowIfFailed();
  ThrowIfWriteFailed(lock);
  WaitForWriteBackRoom(lock);
  policy_.BeginFetch();
  for (int64_t i = 0; i < n; ++i) {
    const int32_t s = slot_index_.Find(key[i]);
    TableCounters& counters = table_stats_[static_cast<size_t>(TableOf(key[i]))];
    if (s >= 0) {
      source[i] = s;
      policy_.Touch(s);
      ++counters.hits;
    } else {
      source[i] = -1;
      ++counters.misses;
      missed_pos.push_back(i);
      missed_ids.push_back(key[i]);
    }
  }
  if (opt_.staleness > 0 && pending_.size() > 0) {
    int64_t worst = 0;
    for (int64_t i = 0; i < n; ++i) worst = std::max<int64_t>(worst, pending_.Find(key[i]));
    stats_.max_staleness = std::max(stats_.max_staleness, worst);
  }
  const int64_t m = static_cast<int64_t>(missed_ids.size());
  stats_.hits += n - m;
  stats_.misses += m;
  torch::Tensor missed_rows = torch::empty({m, row_words_}, torch::kFloat32);
  float* missed = missed_rows.data_ptr<float>();
  ReadOutsideCache(missed_ids.data(), static_cast<size_t>(m), missed, &lock);

  if (m > 0) FoldDeviceDirty();  // admissions evict: they must see every dirty slot
  std::vector<Admission> admissions;
  std::vector<int32_t> admitted_slots;
  std::vector<int64_t> admitted_rows;  // rows of missed_rows
  for (int64_t j = 0; j < m; ++j) {
    const int32_t s = Admit(missed_ids[j], policy_.CountMiss(missed_ids[j]), &admissions);
    if (s < 0) {
      ++stats_.rejected;
      continue;
    }
    // A row a batch read ahead may need stays until every batch read ahead so far took its rows.
    if (opt_.read_ahead_into_slots) policy_.Pin(s, read_ahead_issued_);
    admitted_slots.push_back(s);
    admitted_rows.push_back(j);
    source[missed_pos[j]] = s;
  }
  // Evicted dirty rows leave for the stores through the write-back buffer (the writer thread puts
  // them), before their slots take the newcomers.
  std::vector<int64_t> evicted_ids;
  std::vector<int32_t> evicted_slots;
  for (const Admission& a : admissions) {
    if (a.evicted_id >= 0 && a.evicted_dirty) {
      evicted_ids.push_back(a.evicted_id);
      evicted_slots.push_back(a.slot);
    }
  }
  if (!evicted_slots.empty()) {
    torch::Tensor rows = SlotRowsToHost(evicted_slots);
    WriteBehind(evicted_ids.data(), evicted_ids.size(), rows.data_ptr<float>());
    CountWrittenBack(evicted_ids);
  }
  for (const Admission& a : admissions) stats_.evictions += a.evicted_id >= 0;
  stats_.admitted += static_cast<int64_t>(admissions.size());
  // Rows left out of the cache wait in the staging area for this batch's update, which would
  // otherwise read them from the store a second time.
  for (int64_t j = 0; j < m; ++j) {
    if (source[missed_pos[j]] < 0) {
      staging_.Stage(missed_ids[j], missed + j * row_words_, /*read_ahead=*/false, policy_.fetch_epoch());
    }
  }
  if (!admitted_slots.empty()) {
    CopyRowsToSlots(admitted_slots, admitted_rows.size() == static_cast<size_t>(m)
                                        ? missed_rows
                                        : missed_rows.index_select(0, torch::tensor(admitted_rows, torch::kInt64)));
  }

  if (on_host_) {
    out = torch::empty({n, weight_words_}, torch::kFloat32);
    float* dst = out.data_ptr<float>();
    int64_t j = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* src;
      if (j < m && missed_pos[j] == i) {
        src = missed + j * row_words_;  // its slot (if admitted) holds the same row
        ++j;
      } else {
        src = host_slots_ + source[i] * row_words_;
      }
      std::memcpy(dst + i * weight_words_, src, weight_words_ * sizeof(float));
    }
  } else {
    // Device: gather every row from the slots, then overwrite the rows left out of the cache.
    const torch::Tensor slot_index = torch::from_blob(source.data(), {n}, torch::kInt64).to(device_).clamp_min_(0);
    out = opt_.capacity > 0 ? slots_.narrow(1, 0, weight_words_).index_select(0, slot_index)
                            : torch::empty({n, weight_words_}, slots_.options());
    std::vector<int64_t> outside_pos, outside_rows;
    for (int64_t j = 0; j < m; ++j) {
      if (source[missed_pos[j]] < 0) {
        outside_pos.push_back(missed_pos[j]);
        outside_rows.push_back(j);
      }
    }
    if (!outside_pos.empty()) {
      torch::Tensor rows =
          missed_rows.index_select(0, torch::tensor(outside_rows, torch::kInt64)).narrow(1, 0, weight_words_);
      out.index_copy_(0, torch::tensor(outside_pos, torch::kInt64).to(device_), rows.to(device_));
    }
  }
  return out;
}

void EmbeddingCache::ReadOutsideCache(const int64_t* keys, size_t n, float* out, MutexLock* lock) {
  // Staged copies and rows waiting in the write-back buffer are the newest; the rest come from
  // the stores, read without the lock (the applier, the writer and the read-ahead thread go on meanwhile).
  std::vector<int64_t> read_pos, read_keys;
  for (size_t i = 0; i < n; ++i) {
    float* row = out + i * row_words_;
    if (TakeStaged(keys[i], row)) continue;
    if (const float* waiting = BufferedRow(keys[i])) {
      std::memcpy(row, waiting, row_words_ * sizeof(float));
      continue;
    }
    read_pos.push_back(static_cast<int64_t>(i));
    read_keys.push_back(keys[i]);
  }
  if (read_keys.empty()) return;
  const size_t r = read_keys.size();
  std::vector<float> rows(r * static_cast<size_t>(row_words_));
  std::unique_ptr<bool[]> fresh(new bool[r]);
  if (lock == nullptr) {
    ReadFromStore(read_keys.data(), r, rows.data(), fresh.get());
    for (size_t k = 0; k < r; ++k) {
      std::memcpy(out + read_pos[k] * row_words_, &rows[k * row_words_], row_words_ * sizeof(float));
      TableCounters& counters = table_stats_[static_cast<size_t>(TableOf(read_keys[k]))];
      ++(fresh[k] ? counters.fresh_rows : counters.store_reads);
      ++(fresh[k] ? stats_.fresh_rows : stats_.store_reads);
    }
    return;
  }
  // Counted in flight while mu_ is released; ended however this returns, after `unlocked` below
  // has taken mu_ back.
  struct ReadInFlight {
    EmbeddingCache* cache;
    // The analysis cannot see that the scope below has taken mu_ back when this runs.
    ~ReadInFlight() NO_THREAD_SAFETY_ANALYSIS { cache->EndRead(); }
  };
  ++reads_in_flight_;
  const ReadInFlight in_flight{this};
  {
    MutexUnlock unlocked(&mu_, lock);
    ReadFromStore(read_keys.data(), r, rows.data(), fresh.get());
  }
  // Any row of the batch may have been written while the lock was released (an update applied,
  // including to a row taken from the staging area above): its newest value is in the write-back
  // buffer, or (if its write completed meanwhile) in the store again, read once more under the
  // lock (rare).
  for (size_t k = 0; k < r; ++k) {
    std::memcpy(out + read_pos[k] * row_words_, &rows[k * row_words_], row_words_ * sizeof(float));
    TableCounters& counters = table_stats_[static_cast<size_t>(TableOf(read_keys[k]))];
    ++(fresh[k] ? counters.fresh_rows : counters.store_reads);
    ++(fresh[k] ? stats_.fresh_rows : stats_.store_reads);
  }
  // A read-ahead may have staged rows of the batch meanwhile (one queued during this read): its copy
  // is no newer than what this read or the staging area gave, and the caller caches or stages the
  // row itself, so the copy goes.
  for (size_t i = 0; i < n; ++i) staging_.Unstage(keys[i]);
  std::vector<int64_t> again_pos, again_keys;
  for (size_t i = 0; i < n; ++i) {
    if (const float* waiting = BufferedRow(keys[i])) {
      std::memcpy(out + i * row_words_, waiting, row_words_ * sizeof(float));
    } else if (written_during_reads_.Find(keys[i]) >= 0) {
      again_pos.push_back(static_cast<int64_t>(i));
      again_keys.push_back(keys[i]);
    }
  }
  if (!again_keys.empty()) {
    std::vector<float> again(again_keys.size() * static_cast<size_t>(row_words_));
    std::unique_ptr<bool[]> again_fresh(new bool[again_keys.size()]);
    ReadFromStore(again_keys.data(), again_keys.size(), again.data(), again_fresh.get());
    for (size_t k = 0; k < again_keys.size(); ++k) {
      std::memcpy(out + again_pos[k] * row_words_, &again[k * row_words_], row_words_ * sizeof(float));
    }
  }
}

void EmbeddingCache::EndRead() {
  if (--reads_in_flight_ == 0) written_during_reads_.Clear();
}

torch::Tensor EmbeddingCache::ReadRows(const torch::Tensor& keys) {
  CheckInt64Vector(keys, "keys");
  Drain();
  const int64_t n = keys.numel();
  const int64_t* key = keys.data_ptr<int64_t>();
  torch::Tensor out = torch::empty({n, row_words_}, torch::kFloat32);
  MutexLock lock(&mu_);
  const CacheSplit split = SplitByCache(key, n, /*will_write=*/false);
  const auto& [cached_pos, cached_slots, missed_pos, missed_ids] = split;
  float* dst = out.data_ptr<float>();
  torch::Tensor cached = SlotRowsToHost(cached_slots);
  for (size_t k = 0; k < cached_pos.size(); ++k) {
    std::memcpy(dst + cached_pos[k] * row_words_, cached.data_ptr<float>() + k * row_words_,
                row_words_ * sizeof(float));
  }
  // Not from the staging area: reading rows out must not take staged copies away from a fetch.
  std::vector<int64_t> store_pos, store_ids;
  for (size_t k = 0; k < missed_pos.size(); ++k) {
    if (const float* waiting = BufferedRow(missed_ids[k])) {
      std::memcpy(dst + missed_pos[k] * row_words_, waiting, row_words_ * sizeof(float));
    } else {
      store_pos.push_back(missed_pos[k]);
      store_ids.push_back(missed_ids[k]);
    }
  }
  std::vector<float> rows(store_ids.size() * static_cast<size_t>(row_words_));
  std::unique_ptr<bool[]> fresh(new bool[store_ids.size()]);
  ReadFromStore(store_ids.data(), store_ids.size(), rows.data(), fresh.get());
  for (size_t k = 0; k < store_pos.size(); ++k) {
    std::memcpy(dst + store_pos[k] * row_words_, &rows[k * row_words_], row_words_ * sizeof(float));
  }
  return out;
}

bool EmbeddingCache::TakeStaged(int64_t key, float* row) {
  bool read_ahead = false;
  if (!staging_.Take(key, row, &read_ahead)) return false;
  if (read_ahead) ++table_stats_[static_cast<size_t>(TableOf(key))].read_ahead_hits;
  return true;
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
    s.write_back_rows = static_cast<int64_t>(write_back_.size() + cut_write_back_.size() +
                                             (cut_slots_.size() - std::min(cut_next_, cut_slots_.size())));
  }
  {
    MutexLock lock(&read_ahead_mu_);
    s.read_ahead_latency_us = read_ahead_latency_us_;
    s.read_ahead_wait_us = read_ahead_wait_us_;
  }
  MutexLock lock(&queue_mu_);
  s.queued_updates = queued_;
  s.waits = waits_;
  return s;
}

std::vector<TableCounters> EmbeddingCache::TableStats() {
  MutexLock lock(&mu_);
  FoldDeviceHits();
  return table_stats_;
}

}  // namespace mlkv
