// EmbeddingCache's read-ahead: ReadAhead (what Python's lookahead starts) queues the keys of
// future batches, the read-ahead thread reads them from the stores into the staging area, and a
// fetch waits for a read-ahead in flight rather than reading its rows twice (see
// embedding_cache.h).
#include <algorithm>
#include <chrono>
#include <cstring>

#include "cache/embedding_cache.h"
#include "engine/fault_points.h"
#include "engine/thread_name.h"

namespace mlkv {

namespace {

// Rows of a fetch a read-ahead request may read before the fetch waits for it rather than reading
// them itself.
constexpr int64_t kReadItselfRows = 64;
// Read-aheads no lookup took after this many more were asked for are dropped (their pins released):
// a caller that reads ahead batches it never looks up does not pin the cache full.
constexpr size_t kUntakenReadAheads = 64;

// The sum of a batch's keys (wrapping): a batch whose fingerprint is a read-ahead's is the batch read ahead.
uint64_t BatchFingerprint(const int64_t* values, const std::vector<int64_t>& feature_counts,
                          const std::vector<int64_t>& feature_tables) {
  uint64_t sum = 0;
  int64_t i = 0;
  for (size_t f = 0; f < feature_counts.size(); ++f) {
    const uint64_t table_bits = static_cast<uint64_t>(TableKey(feature_tables[f], 0));
    for (const int64_t end = i + feature_counts[f]; i < end; ++i) sum += table_bits | static_cast<uint64_t>(values[i]);
  }
  return sum;
}

}  // namespace

int64_t EmbeddingCache::ReadAheadBatch(const torch::Tensor& values, const std::vector<int64_t>& feature_counts,
                                       const std::vector<int64_t>& feature_tables) {
  auto [unique, inverse] = UniqueKeys(values, feature_counts, feature_tables);
  std::shared_ptr<BatchReadAhead> batch;
  if (opt_.read_ahead_into_slots) {  // kept for LookupReadAhead, in pinned memory for the copies up
    batch = std::make_shared<BatchReadAhead>();
    batch->feature_counts = feature_counts;
    batch->feature_tables = feature_tables;
    batch->unique = on_host_ ? unique : unique.pin_memory();
    batch->inverse = on_host_ ? inverse : inverse.pin_memory();
  }
  return QueueReadAhead(unique, BatchFingerprint(values.data_ptr<int64_t>(), feature_counts, feature_tables),
                        std::move(batch));
}

int32_t EmbeddingCache::QueueReadAhead(const torch::Tensor& keys, uint64_t fingerprint,
                                       std::shared_ptr<BatchReadAhead> batch) {
  CheckInt64Vector(keys, "keys");
  const int64_t n = keys.numel();
  const int64_t* key = keys.data_ptr<int64_t>();
  std::vector<int64_t> outside;
  bool into_slots = false, rows_of_earlier_requests = false;
  int32_t sequence;
  if (batch) {
    batch->slots.assign(static_cast<size_t>(n), -1);
    batch->table_keys.assign(tables_.size(), 0);
    for (int64_t i = 0; i < n; ++i) ++batch->table_keys[static_cast<size_t>(TableOf(key[i]))];
  }
  {
    MutexLock lock(&mu_);
    ThrowIfFailed();
    sequence = ++read_aheads_.issued;
    if (opt_.read_ahead_into_slots) {
      // Into slots only while the slots hold the rows of every batch read ahead and not yet looked
      // up: beyond that the pins would keep out the rows of the batches themselves.
      into_slots = n * static_cast<int64_t>(read_aheads_.untaken.size() + 1) <= opt_.capacity;
      read_aheads_.untaken.push_back(
          {sequence, into_slots ? std::optional<uint64_t>(fingerprint) : std::nullopt, batch});
      if (read_aheads_.untaken.size() > kUntakenReadAheads) {
        policy_.ReleaseThrough(read_aheads_.untaken.front().sequence);
        read_aheads_.untaken.pop_front();
      }
    }
    if (batch && !into_slots) batch->settled = true;  // its lookup fetches
    for (int64_t i = 0; i < n; ++i) {
      if (i + kPrefetchAhead < n) slot_index_.Prefetch(key[i + kPrefetchAhead]);
      const int32_t slot = slot_index_.Find(key[i]);
      if (slot >= 0) {
        if (into_slots) {
          policy_.Pin(slot, sequence);  // kept until this batch is done with it
          if (batch) batch->slots[static_cast<size_t>(i)] = slot;
        }
        continue;
      }
      // A row on its way in already is pinned for the newest read-ahead when it lands. Staged and
      // buffered rows are newer than the store: the staging path leaves them for the fetch, the
      // slot path places them (PlaceReadAhead takes their newest value).
      if (read_aheads_.reading.Find(key[i]) >= 0) {
        rows_of_earlier_requests = true;
        continue;
      }
      if (!into_slots && (staging_.Contains(key[i]) || BufferedRow(key[i]) != nullptr)) continue;
      read_aheads_.reading.Insert(key[i], sequence);
      outside.push_back(key[i]);
    }
    // A batch with rows on their way in for earlier requests settles after them, through a request
    // of its own (requests are done in order), even one that reads nothing.
    if (outside.empty() && !(batch && into_slots && rows_of_earlier_requests)) {
      if (batch && into_slots) SettleReadAhead(batch.get(), sequence);
      return sequence;
    }
    // Queued under mu_ too, so requests reach the read-ahead thread in sequence order.
    read_ahead_queue_.Push({sequence, std::move(outside), std::chrono::steady_clock::now(), into_slots,
                            into_slots ? std::move(batch) : nullptr});
  }
  return sequence;
}

void EmbeddingCache::SettleReadAhead(BatchReadAhead* batch, int32_t sequence) {
  const int64_t* key = batch->unique.data_ptr<int64_t>();
  bool complete = true;
  for (size_t i = 0; i < batch->slots.size() && complete; ++i) {
    if (batch->slots[i] >= 0) continue;  // found and pinned when it was read ahead
    // Placed by this request or one before it (each pinned for every read-ahead issued by then):
    // pinned for this one, else gone again (written meanwhile) or left in the staging area.
    const int32_t slot = slot_index_.Find(key[i]);
    complete = slot >= 0 && policy_.pinned_for(slot) >= sequence;
    batch->slots[i] = slot;
  }
  batch->settled = true;
  if (!complete) return;
  const int64_t n = static_cast<int64_t>(batch->slots.size());
  auto options = torch::TensorOptions().dtype(torch::kInt32);
  try {
    PassFaultPoint(FaultPoint::kReadAheadSlotList);
    batch->slot_index = torch::empty({n}, on_host_ ? options : options.pinned_memory(true));
  } catch (const std::exception&) {
    return;  // no (pinned) memory for the list: not complete, so its lookup fetches
  }
  std::copy(batch->slots.begin(), batch->slots.end(), batch->slot_index.data_ptr<int32_t>());
  batch->complete = true;  // only now: a lookup gathers from slot_index
}

int32_t EmbeddingCache::TakeReadAhead(std::optional<uint64_t> fingerprint) {
  policy_.ReleaseThrough(read_aheads_.in_use);  // the batch before this one is done with its rows
  if (read_aheads_.untaken.empty()) return 0;
  const UntakenReadAhead taken = std::move(read_aheads_.untaken.front());
  read_aheads_.untaken.pop_front();
  read_aheads_.in_use = taken.sequence;
  return fingerprint && taken.fingerprint && *fingerprint == *taken.fingerprint ? taken.sequence : 0;
}

EmbeddingCache::DeviceLookup EmbeddingCache::LookupReadAhead(int64_t ticket, const std::vector<int64_t>& feature_counts,
                                                             const std::vector<int64_t>& feature_tables) {
  int32_t sequence;
  bool settled;
  const std::shared_ptr<BatchReadAhead> batch =
      TakeNamedReadAhead(ticket, feature_counts, feature_tables, &sequence, &settled);
  // A request in flight settles its batch before it is done.
  if (!settled) read_ahead_queue_.WaitDone(sequence, /*counted=*/false);
  update_queue_.WaitQueuedAtMost(opt_.staleness);
  {
    MutexLock lock(&mu_);
    ThrowIfFailed();
    ThrowIfWriteFailed(lock);
    TORCH_CHECK(!closed_, "the table is closed");
    // Its pins hold unless something released them meanwhile (a read-ahead dropped untaken).
    if (batch->complete && policy_.released() < sequence) return GatherReadAhead(*batch, sequence);
  }
  // Rows left out of the slots: fetched (and admitted) by key.
  torch::Tensor weights = Fetch(batch->unique);
  if (on_host_) return {batch->unique.detach(), batch->inverse.detach(), weights, torch::Tensor(), 0, -1};
#ifdef MLKV_WITH_CUDA
  const torch::Tensor unique = batch->unique.to(device_, /*non_blocking=*/true);
  auto [slots, version, outside] = SlotsAfterFetch(unique);
  return {unique, batch->inverse.to(device_, /*non_blocking=*/true), weights, slots, version, outside};
#else
  TORCH_CHECK(false, "this build of mlkv_torch has no CUDA kernels");
#endif
}

bool EmbeddingCache::ReadAheadWaiting(int64_t ticket) {
  MutexLock lock(&mu_);
  return std::any_of(read_aheads_.untaken.begin(), read_aheads_.untaken.end(),
                     [&](const UntakenReadAhead& r) { return r.sequence == ticket && r.batch; });
}

std::shared_ptr<BatchReadAhead> EmbeddingCache::TakeNamedReadAhead(int64_t ticket,
                                                                   const std::vector<int64_t>& feature_counts,
                                                                   const std::vector<int64_t>& feature_tables,
                                                                   int32_t* sequence, bool* settled) {
  MutexLock lock(&mu_);
  ThrowIfFailed();
  TORCH_CHECK(!closed_, "the table is closed");
  TORCH_CHECK_VALUE(ticket > 0 && ticket <= read_aheads_.issued, "no read-ahead has ticket ", ticket,
                    " (the tickets lookahead returned run 1 to ", read_aheads_.issued, ")");
  auto waiting = std::find_if(read_aheads_.untaken.begin(), read_aheads_.untaken.end(),
                              [&](const UntakenReadAhead& r) { return r.sequence == ticket; });
  TORCH_CHECK_VALUE(waiting != read_aheads_.untaken.end() && waiting->batch, "the read-ahead with ticket ", ticket,
                    " is no longer waiting: looked up already, or dropped after ", kUntakenReadAheads,
                    " later read-aheads were not looked up; pool this batch without read_ahead");
  TORCH_CHECK_VALUE(
      waiting->batch->feature_counts == feature_counts && waiting->batch->feature_tables == feature_tables,
      "this batch's features are not those of the batch read ahead with ticket ", ticket);
  if (transfer_) transfer_->UseCurrentStreamForTraining();  // the copies in order after this batch's kernels
  std::shared_ptr<BatchReadAhead> batch = waiting->batch;
  *sequence = waiting->sequence;
  // Older read-aheads no lookup took are let go; this batch's pins stay until the next lookup.
  do {
    TakeReadAhead(std::nullopt);
  } while (read_aheads_.in_use != *sequence);
  *settled = batch->settled;
  return batch;
}

EmbeddingCache::DeviceLookup EmbeddingCache::GatherReadAhead(const BatchReadAhead& batch, int32_t sequence) {
  const int64_t n = batch.unique.numel();
  ++stats_.read_ahead_lookups;
  stats_.hits += n;
  for (size_t t = 0; t < table_stats_.size(); ++t) table_stats_[t].hits += batch.table_keys[t];
  if (on_host_) {
    torch::Tensor out = torch::empty({n, weight_words_}, torch::kFloat32);
    float* dst = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) {
      const int32_t s = batch.slots[static_cast<size_t>(i)];
      policy_.Touch(s);
      std::memcpy(dst + i * weight_words_, host_slots_ + static_cast<int64_t>(s) * row_words_,
                  weight_words_ * sizeof(float));
    }
    NoteStaleness(batch.unique.data_ptr<int64_t>(), n);
    // Detached: Python's tensors are its own, so the batch's last reference (the read-ahead thread
    // may drop it) never needs the GIL.
    const int64_t version = -static_cast<int64_t>(sequence);
    return {batch.unique.detach(), batch.inverse.detach(), out, batch.slot_index.detach(), version, 0};
  }
#ifdef MLKV_WITH_CUDA
  // The slots stay pinned for this batch until the next lookup: its update finds them unchanged.
  const torch::Tensor slots = batch.slot_index.to(device_, /*non_blocking=*/true);
  return {batch.unique.to(device_, /*non_blocking=*/true),
          batch.inverse.to(device_, /*non_blocking=*/true),
          slots_.narrow(1, 0, weight_words_).index_select(0, slots),
          slots,
          -static_cast<int64_t>(sequence),
          0};
#else
  TORCH_CHECK(false, "this build of mlkv_torch has no CUDA kernels");
#endif
}

void EmbeddingCache::PlaceReadAhead(const ReadAheadRequest& request, const std::vector<float>& rows) {
  Placement placement;
  placement.row.resize(static_cast<size_t>(row_words_));
  {
    MutexLock fetch_lock(&fetch_mu_);  // no lookup is between finding its slots and gathering them
    MutexLock lock(&mu_);
    WaitForPlacementRoom(lock);
    policy_.BeginFetch();  // slots reserved below are safe from this pass's own evictions
    for (size_t i = 0; i < request.keys.size(); ++i) {
      const int64_t key = request.keys[i];
      // A row a fetch took over (WaitForReadAheads) or a later request holds is not this one's to place.
      if (read_aheads_.reading.Find(key) != request.sequence) continue;
      read_aheads_.reading.Erase(key);
      if (slot_index_.Find(key) >= 0) continue;
      ReserveSlotFor(key, &rows[i * row_words_], &placement);
    }
    WriteVictimsBack(placement);
  }
  if (!placement.slots.empty()) transfer_->Wait(transfer_->CopyIn(placement.slots, placement.incoming.data()));
  PublishPlaced(placement);
}

void EmbeddingCache::WaitForPlacementRoom(MutexLock& lock) {
  // Evictions wait for room in the write-back buffer, as fetches do (not for a writer held back or failed:
  // the fetches meet that).
  while (static_cast<int64_t>(write_back_.size()) > writer_.limit && writer_.error.ok() && !writer_.paused &&
         !writer_.stopping) {
    writer_cv_.notify_one();
    written_cv_.wait(lock.native());
  }
}

void EmbeddingCache::ReserveSlotFor(int64_t key, const float* read, Placement* placement) {
  // The newest value: a buffered row (written since), a staged one, else the store's as read,
  // unless a write of it completed since the read began (then its fetch reads it again).
  std::vector<float>& row = placement->row;
  bool read_ahead = false;
  if (const float* waiting = BufferedRow(key)) {
    std::memcpy(row.data(), waiting, row.size() * sizeof(float));
  } else if (staging_.Take(key, row.data(), &read_ahead)) {
  } else if (written_during_reads_.Find(key) >= 0) {
    return;
  } else {
    std::memcpy(row.data(), read, row.size() * sizeof(float));
  }
  bool evicts = false;
  const int32_t s = policy_.Admit(policy_.CountMiss(key), slot_index_.dirty_bits(), cut_.phase == CutPhase::kWriting,
                                  &evicts, /*force=*/true);
  if (s < 0) {  // every slot is pinned: the row waits in the staging area for its fetch
    ++stats_.read_ahead_unplaced;
    if (staging_.Stage(key, row.data(), /*read_ahead=*/true, policy_.fetch_epoch())) ++stats_.read_ahead_rows;
    return;
  }
  policy_.Reserve(s);
  if (evicts) {
    PreserveCutRow(s);
    const int64_t evicted = slot_index_.key(s);
    placement->victim_slots.push_back(s);
    placement->victim_keys.push_back(evicted);
    placement->victim_dirty.push_back(static_cast<uint8_t>(slot_index_.dirty(s)));
    --table_stats_[static_cast<size_t>(TableOf(evicted))].cached_rows;
    ++stats_.evictions;
  }
  slot_index_.Unassign(s);
  placement->slots.push_back(s);
  placement->keys.push_back(key);
  placement->incoming.insert(placement->incoming.end(), row.begin(), row.end());
}

void EmbeddingCache::WriteVictimsBack(const Placement& placement) {
  if (placement.victim_slots.empty()) return;
  // Victims leave through the write-back buffer before their slots take the newcomers; the
  // device's dirty marks of them come along (the host's alone would miss device updates).
  const std::vector<int32_t>& victims = placement.victim_slots;
  std::vector<float> out(victims.size() * static_cast<size_t>(row_words_));
  std::vector<uint8_t> marks(victims.size());
  transfer_->CopyOut(victims, out.data(), marks.data());
  std::vector<int64_t> written;
  std::vector<float> written_rows;
  for (size_t v = 0; v < victims.size(); ++v) {
    if (!placement.victim_dirty[v] && !marks[v]) continue;
    written.push_back(placement.victim_keys[v]);
    written_rows.insert(written_rows.end(), &out[v * row_words_], &out[(v + 1) * row_words_]);
  }
  WriteBehind(written.data(), written.size(), written_rows.data());
  CountWrittenBack(written);
}

void EmbeddingCache::PublishPlaced(const Placement& placement) {
  // Published under fetch_mu_ too: a fetch between finding its misses and admitting them must not
  // see one of them cached meanwhile (it would admit it a second time).
  MutexLock fetch_lock(&fetch_mu_);
  MutexLock lock(&mu_);
  for (size_t j = 0; j < placement.slots.size(); ++j) {
    const int64_t key = placement.keys[j];
    const int32_t slot = placement.slots[j];
    // Cached by a fetch meanwhile, or written since (its newest value is elsewhere): the slot goes back.
    if (slot_index_.Find(key) >= 0 || BufferedRow(key) != nullptr || written_during_reads_.Find(key) >= 0) {
      policy_.Free(slot);
      continue;
    }
    staging_.Unstage(key);  // the slot holds its value now
    slot_index_.Assign(slot, key);
    policy_.Unreserve(slot, read_aheads_.issued);  // kept for every batch read ahead so far
    ++table_stats_[static_cast<size_t>(TableOf(key))].cached_rows;
    ++stats_.admitted;
    ++stats_.read_ahead_placed;
  }
  EndRead();
}

void EmbeddingCache::ReadAheadLoop() {
  NameThisThread("mlkv-read-ahead");
  while (std::optional<ReadAheadRequest> request = read_ahead_queue_.Next()) {
    RunReadAhead(*request);
    read_ahead_queue_.Done(request->sequence, request->queued);
  }
}

void EmbeddingCache::RunReadAhead(const ReadAheadRequest& request) {
  const std::vector<int64_t>& keys = request.keys;
  {
    MutexLock lock(&mu_);
    ++reads_in_flight_;
  }
  std::vector<float> rows;
  bool read_ok = true;
  try {
    rows.resize(keys.size() * static_cast<size_t>(row_words_));
    std::unique_ptr<bool[]> fresh(new bool[keys.size()]);
    ReadFromStore(keys.data(), keys.size(), rows.data(), fresh.get());
  } catch (const std::exception&) {
    read_ok = false;  // the fetch that needs these rows reads them itself and meets the error
  }
  if (request.into_slots && read_ok) {
    try {
      PlaceReadAhead(request, rows);  // ends the read once its rows are published
    } catch (const std::exception& e) {  // a failed copy (CUDA): every later call raises it
      MutexLock lock(&mu_);
      if (failed_.ok()) failed_ = Status::IOError(std::string("reading rows ahead into slots failed: ") + e.what());
      EndRead();
    }
  } else {
    MutexLock lock(&mu_);
    StageReadAhead(request, rows, read_ok);
    EndRead();
  }
  if (request.batch) {  // before it is done: its lookup waits for that
    MutexLock lock(&mu_);
    if (read_ok) SettleReadAhead(request.batch.get(), request.sequence);
    request.batch->settled = true;  // else its lookup fetches, and meets the read's error
  }
}

void EmbeddingCache::StageReadAhead(const ReadAheadRequest& request, const std::vector<float>& rows, bool read_ok) {
  const std::vector<int64_t>& keys = request.keys;
  for (size_t i = 0; i < keys.size(); ++i) {
    // A row a fetch took over (WaitForReadAheads) or a later request holds is not this one's to stage.
    if (read_aheads_.reading.Find(keys[i]) != request.sequence) continue;
    read_aheads_.reading.Erase(keys[i]);
    // A row written since the read began (now waiting to be written, or written) is newer than the read.
    if (!read_ok || written_during_reads_.Find(keys[i]) >= 0 || BufferedRow(keys[i]) != nullptr ||
        slot_index_.Find(keys[i]) >= 0 || staging_.Contains(keys[i])) {
      continue;
    }
    if (staging_.Stage(keys[i], &rows[i * row_words_], /*read_ahead=*/true, policy_.fetch_epoch())) {
      ++stats_.read_ahead_rows;
    } else {
      ++stats_.read_ahead_dropped;
    }
  }
}

void EmbeddingCache::WaitForReadAheads(const int64_t* keys, int64_t n) {
  int32_t needed = 0;
  {
    MutexLock lock(&mu_);
    if (read_aheads_.reading.size() == 0) return;
    // Requests complete in order: the fetch waits for the newest one that reads many of its rows.
    // A later one reading only a few (the next batch's look-ahead, queued just before this fetch,
    // holds the rows of this batch that were written back meanwhile) would hold it up for a whole
    // request: the fetch reads those rows itself, and takes them from read_aheads_.reading (ReadAheadLoop
    // stages only rows its request still holds, so never over what the fetch brought in).
    std::vector<std::pair<int32_t, int64_t>> rows_of;  // request -> rows of this fetch it reads
    for (int64_t i = 0; i < n; ++i) {
      const int32_t sequence = read_aheads_.reading.Find(keys[i]);
      if (sequence <= 0) continue;
      auto it = std::find_if(rows_of.begin(), rows_of.end(), [&](const auto& r) { return r.first == sequence; });
      if (it == rows_of.end()) {
        rows_of.emplace_back(sequence, 1);
      } else {
        ++it->second;
      }
    }
    for (const auto& [sequence, rows] : rows_of) {
      if (rows >= kReadItselfRows) needed = std::max(needed, sequence);
    }
    for (int64_t i = 0; i < n; ++i) {
      if (read_aheads_.reading.Find(keys[i]) > needed) read_aheads_.reading.Erase(keys[i]);
    }
  }
  if (needed > 0) read_ahead_queue_.WaitDone(needed, /*counted=*/true);
}

}  // namespace mlkv
