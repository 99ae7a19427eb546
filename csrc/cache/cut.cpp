// EmbeddingCache's cuts: a consistent state of every table of the cache, taken at a step boundary
// and written by the writer thread while training goes on (see embedding_cache.h).
//
// At the boundary the cut is every dirty cached row plus every row on its way to the stores.
// Those on their way move to cut_.rows as they are; dirty host slots are only marked
// (cut_.marked), and the writer copies them out a batch at a time. Training may change a marked
// slot before that: PreserveCutRow copies the cut value aside first. So the cut holds a second
// copy only of the rows training touches while it is written. Rows written after the boundary
// wait in write_back_ until every store has begun its checkpoint (the first half, which fixes
// its contents without waiting for the disk): a store checkpoint holds exactly the cut. Its
// second half, the syncs, runs in FinishCut, while the writer goes on with the later rows.
#include "cache/embedding_cache.h"

#include <algorithm>

namespace mlkv {

void EmbeddingCache::BeginCut() {
  Drain();  // updates queued before the boundary belong to the cut
  MutexLock fetch_lock(&fetch_mu_);
  MutexLock lock(&mu_);
  ThrowIfFailed();
  TORCH_CHECK(cut_.phase == CutPhase::kNone, "a cut of ", tables_[0].store->path(),
              " (and the tables beside it) is still being written: finish it before beginning another");
  // What waits for the stores is the cut's: it moves over whole (no batch of it in flight).
  while (writer_.busy) written_cv_.wait(lock.native());
  write_back_.Swap(cut_.rows);
  std::vector<int64_t> keys;
  std::vector<int32_t> slots = TakeDirtySlots(&keys);
  stats_.cut_rows = static_cast<int64_t>(cut_.rows.size() + keys.size());
  if (on_host_) {
    for (int32_t s : slots) cut_.marked[s] = 1;
    cut_.slots = std::move(slots);
    cut_.next = 0;
  } else if (!slots.empty()) {  // device slots: the cut's rows come to the host now
    const torch::Tensor rows = SlotRowsToHost(slots);
    const float* data = rows.data_ptr<float>();
    for (size_t i = 0; i < keys.size(); ++i) cut_.rows.Put(keys[i], data + i * row_words_);
  }
  CountWrittenBack(keys);
  cut_.sequences.clear();
  cut_.error = Status::OK();
  cut_.phase = CutPhase::kWriting;
  writer_cv_.notify_one();
}

void EmbeddingCache::WriteCut(MutexLock& lock) {
  if (cut_.next < cut_.slots.size()) {
    const size_t end = std::min(cut_.slots.size(), cut_.next + kWriteBatchRows);
    for (; cut_.next < end; ++cut_.next) PreserveCutRow(cut_.slots[cut_.next]);
    return;
  }
  std::vector<int32_t>().swap(cut_.slots);
  cut_.next = 0;
  // Every row of the cut is in its store, and no later row is: each store fixes its checkpoint
  // (a copy of its mutable pages, no disk wait), and rows after the boundary may follow at once.
  // The checkpoints become durable in FinishStoreCheckpoints.
  std::vector<uint8_t> begun(tables_.size(), 0);
  Status st;
  {
    MutexUnlock unlocked(&mu_, &lock);
    for (size_t t = 0; t < tables_.size() && st.ok(); ++t) {
      st = tables_[t].store->BeginCheckpoint();
      begun[t] = st.ok();
    }
  }
  cut_.begun = std::move(begun);
  cut_.error = st;
  cut_.phase = CutPhase::kSealed;
  writer_cv_.notify_one();  // rows after the boundary waited for this
  written_cv_.notify_all();
}

void EmbeddingCache::FinishStoreCheckpoints(MutexLock& lock) {
  cut_.phase = CutPhase::kSyncing;
  const std::vector<uint8_t> begun = std::move(cut_.begun);
  // Every begun checkpoint is finished, whatever fails: a store keeps one open until then.
  std::vector<int64_t> sequences(tables_.size(), 0);
  Status st;
  {
    MutexUnlock unlocked(&mu_, &lock);
    for (size_t t = 0; t < tables_.size(); ++t) {
      if (!begun[t]) continue;
      uint64_t sequence = 0;
      Status finished = tables_[t].store->FinishCheckpoint(&sequence);
      sequences[t] = static_cast<int64_t>(sequence);
      if (st.ok()) st = finished;
    }
  }
  cut_.sequences = std::move(sequences);
  if (cut_.error.ok()) cut_.error = st;
  cut_.phase = CutPhase::kDone;
  written_cv_.notify_all();
}

std::vector<int64_t> EmbeddingCache::FinishCut(bool superseded) {
  MutexLock lock(&mu_);
  TORCH_CHECK(cut_.phase != CutPhase::kNone, "no cut of ", tables_[0].store->path(), " was begun");
  WaitCutDurable(lock);
  TORCH_CHECK(cut_.phase == CutPhase::kDone, "the cut of ", tables_[0].store->path(),
              " (and the tables beside it) was finished by another call");
  cut_.phase = CutPhase::kNone;
  written_cv_.notify_all();
  if (!cut_.error.ok() && !superseded) throw StatusError(cut_.error);
  return cut_.sequences;
}

void EmbeddingCache::WaitCutDurable(MutexLock& lock) {
  for (;;) {
    if (cut_.phase == CutPhase::kWriting) CheckWriterNotPaused();
    // Only the cut's own rows failing concern it; after the seal, failed writes are later rows'.
    // kNone: another call finished it (a FinishCut, while this WriteBack waited).
    while (!(cut_.phase == CutPhase::kSealed || cut_.phase == CutPhase::kDone || cut_.phase == CutPhase::kNone ||
             (cut_.phase == CutPhase::kWriting && !writer_.error.ok()))) {
      written_cv_.wait(lock.native());
    }
    if (cut_.phase == CutPhase::kSealed) FinishStoreCheckpoints(lock);
    if (cut_.phase == CutPhase::kDone || cut_.phase == CutPhase::kNone) return;
    ThrowIfWriteFailed(lock);  // raises while the stores refuse the cut's rows; they stay in memory
  }
}

}  // namespace mlkv
