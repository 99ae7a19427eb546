// EmbeddingCache's reads: Fetch (a batch's weights, admitting misses), the rows outside the cache
// (staged, buffered, read from the stores without the lock), and the moves of rows between the
// host and the slots (see embedding_cache.h).
#include <algorithm>
#include <cstring>
#include <memory>

#include "cache/embedding_cache.h"
#include "engine/read_rounds.h"

namespace mlkv {

namespace {

void ThrowIfError(const Status& st) {
  if (!st.ok()) throw StatusError(st);
}

}  // namespace

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
    // Each table's rows into a buffer of its own, then back to the batch's order; every table's
    // disk reads go in the same rounds, so the batch waits for the disk once, not once a table.
    std::vector<std::vector<float>> rows(batches.size());
    std::vector<std::unique_ptr<bool[]>> table_found(batches.size());
    std::vector<std::unique_ptr<RoundedLookup>> lookups;
    std::vector<RoundedLookup*> rounds;
    for (size_t t = 0; t < batches.size(); ++t) {
      const TableBatch& b = batches[t];
      if (b.ids.empty()) continue;
      rows[t].resize(b.ids.size() * static_cast<size_t>(row_words_));
      table_found[t].reset(new bool[b.ids.size()]);
      lookups.push_back(
          tables_[t].store->StartLookup(b.ids.data(), b.ids.size(), rows[t].data(), table_found[t].get()));
      rounds.push_back(lookups.back().get());
    }
    ThrowIfError(RunReadRounds(rounds));
    for (size_t t = 0; t < batches.size(); ++t) {
      const TableBatch& b = batches[t];
      for (size_t k = 0; k < b.ids.size(); ++k) {
        std::memcpy(out + b.positions[k] * row_words_, &rows[t][k * row_words_], row_words_ * sizeof(float));
        found[b.positions[k]] = table_found[t][k];
      }
    }
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
  const int32_t s = policy_.Admit(frequency, slot_index_.dirty_bits(), cut_.phase == CutPhase::kWriting, &evicts);
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
  update_queue_.WaitQueuedAtMost(opt_.staleness);
  WaitForReadAheads(key, n);
  // One fetch at a time: between its unlocked store reads and its admissions no other fetch
  // changes which rows are cached.
  MutexLock fetch_lock(&fetch_mu_);
  MutexLock lock(&mu_);
  ThrowIfFailed();
  ThrowIfWriteFailed(lock);
  WaitForWriteBackRoom(lock);
  policy_.BeginFetch();
  FetchedBatch batch = FindCached(key, n);
  NoteStaleness(key, n);
  const int64_t m = static_cast<int64_t>(batch.missed_ids.size());
  stats_.hits += n - m;
  stats_.misses += m;
  batch.missed_rows = torch::empty({m, row_words_}, torch::kFloat32);
  ReadOutsideCache(batch.missed_ids.data(), static_cast<size_t>(m), batch.missed_rows.data_ptr<float>(), &lock);
  AdmitMisses(&batch);
  return on_host_ ? GatherOnHost(batch) : GatherOnDevice(batch);
}

EmbeddingCache::FetchedBatch EmbeddingCache::FindCached(const int64_t* key, int64_t n) {
  FetchedBatch batch;
  batch.source.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) slot_index_.Prefetch(key[i + kPrefetchAhead]);
    const int32_t s = slot_index_.Find(key[i]);
    TableCounters& counters = table_stats_[static_cast<size_t>(TableOf(key[i]))];
    if (s >= 0) {
      batch.source[i] = s;
      policy_.Touch(s);
      ++counters.hits;
    } else {
      batch.source[i] = -1;
      ++counters.misses;
      batch.missed_pos.push_back(i);
      batch.missed_ids.push_back(key[i]);
    }
  }
  return batch;
}

void EmbeddingCache::NoteStaleness(const int64_t* key, int64_t n) {
  if (opt_.staleness == 0 || pending_.size() == 0) return;
  int64_t worst = 0;
  for (int64_t i = 0; i < n; ++i) worst = std::max<int64_t>(worst, pending_.Find(key[i]));
  stats_.max_staleness = std::max(stats_.max_staleness, worst);
}

void EmbeddingCache::AdmitMisses(FetchedBatch* batch) {
  const int64_t m = static_cast<int64_t>(batch->missed_ids.size());
  if (m > 0) FoldDeviceDirty();  // admissions evict: they must see every dirty slot
  std::vector<Admission> admissions;
  std::vector<int32_t> admitted_slots;
  std::vector<int64_t> admitted_rows;  // rows of missed_rows
  for (int64_t j = 0; j < m; ++j) {
    const int64_t id = batch->missed_ids[j];
    const int32_t s = Admit(id, policy_.CountMiss(id), &admissions);
    if (s < 0) {
      ++stats_.rejected;
      continue;
    }
    // A row a batch read ahead may need stays until every batch read ahead so far took its rows.
    if (opt_.read_ahead_into_slots) policy_.Pin(s, read_aheads_.issued);
    admitted_slots.push_back(s);
    admitted_rows.push_back(j);
    batch->source[batch->missed_pos[j]] = s;
  }
  WriteEvictedBack(admissions);
  // Rows left out of the cache wait in the staging area for this batch's update, which would
  // otherwise read them from the store a second time.
  const float* missed = batch->missed_rows.data_ptr<float>();
  for (int64_t j = 0; j < m; ++j) {
    if (batch->source[batch->missed_pos[j]] < 0) {
      staging_.Stage(batch->missed_ids[j], missed + j * row_words_, /*read_ahead=*/false, policy_.fetch_epoch());
    }
  }
  if (admitted_slots.empty()) return;
  CopyRowsToSlots(admitted_slots,
                  admitted_rows.size() == static_cast<size_t>(m)
                      ? batch->missed_rows
                      : batch->missed_rows.index_select(0, torch::tensor(admitted_rows, torch::kInt64)));
}

void EmbeddingCache::WriteEvictedBack(const std::vector<Admission>& admissions) {
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
}

torch::Tensor EmbeddingCache::GatherOnHost(const FetchedBatch& batch) {
  const int64_t n = static_cast<int64_t>(batch.source.size());
  const int64_t m = static_cast<int64_t>(batch.missed_pos.size());
  const float* missed = batch.missed_rows.data_ptr<float>();
  torch::Tensor out = torch::empty({n, weight_words_}, torch::kFloat32);
  float* dst = out.data_ptr<float>();
  int64_t j = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* src;
    if (j < m && batch.missed_pos[j] == i) {
      src = missed + j * row_words_;  // its slot (if admitted) holds the same row
      ++j;
    } else {
      src = host_slots_ + batch.source[i] * row_words_;
    }
    std::memcpy(dst + i * weight_words_, src, weight_words_ * sizeof(float));
  }
  return out;
}

torch::Tensor EmbeddingCache::GatherOnDevice(FetchedBatch& batch) {
  // Every row from the slots, then the rows left out of the cache over them.
  const int64_t n = static_cast<int64_t>(batch.source.size());
  const torch::Tensor slot_index = torch::from_blob(batch.source.data(), {n}, torch::kInt64).to(device_).clamp_min_(0);
  torch::Tensor out = opt_.capacity > 0 ? slots_.narrow(1, 0, weight_words_).index_select(0, slot_index)
                                        : torch::empty({n, weight_words_}, slots_.options());
  std::vector<int64_t> outside_pos, outside_rows;
  for (size_t j = 0; j < batch.missed_pos.size(); ++j) {
    if (batch.source[batch.missed_pos[j]] < 0) {
      outside_pos.push_back(batch.missed_pos[j]);
      outside_rows.push_back(static_cast<int64_t>(j));
    }
  }
  if (!outside_pos.empty()) {
    torch::Tensor rows =
        batch.missed_rows.index_select(0, torch::tensor(outside_rows, torch::kInt64)).narrow(1, 0, weight_words_);
    out.index_copy_(0, torch::tensor(outside_pos, torch::kInt64).to(device_), rows.to(device_));
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

}  // namespace mlkv
