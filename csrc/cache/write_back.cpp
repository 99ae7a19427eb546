// EmbeddingCache's write-back: every store write of the cache goes through the write-back buffer,
// and the writer thread puts its rows to the stores without the cache's lock (see embedding_cache.h).
#include <algorithm>
#include <cstring>

#include "cache/embedding_cache.h"
#include "engine/thread_name.h"

namespace mlkv {

void EmbeddingCache::WaitForWriteBackRoom(MutexLock& lock) {
  if (static_cast<int64_t>(write_back_.size()) <= writer_.limit) return;
  CheckWriterNotPaused();
  const auto began = std::chrono::steady_clock::now();
  writer_cv_.notify_one();
  while (static_cast<int64_t>(write_back_.size()) > writer_.limit && writer_.error.ok()) {
    written_cv_.wait(lock.native());
  }
  ++stats_.write_back_waits;
  stats_.write_back_wait_us +=
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - began).count();
  ThrowIfWriteFailed(lock);
}

void EmbeddingCache::ThrowIfWriteFailed(MutexLock& lock) {
  if (writer_.error.ok()) return;
  // The rows stay in the buffer. Each call tries the write again first (a disk that was full may
  // have room now) and raises while it still fails.
  const int64_t attempt = writer_.attempts;
  writer_.retry = true;
  writer_cv_.notify_one();
  while (writer_.attempts <= attempt && !writer_.stopping) written_cv_.wait(lock.native());
  if (!writer_.error.ok()) throw StatusError(writer_.error);
}

void EmbeddingCache::WriteBehind(const int64_t* keys, size_t n, const float* rows) {
  for (size_t i = 0; i < n; ++i) {
    staging_.Unstage(keys[i]);  // the staged copy is older
    write_back_.Put(keys[i], rows + i * row_words_);
  }
  if (n) writer_cv_.notify_one();
}

bool EmbeddingCache::WriterWakes() const {
  if (writer_.stopping) return true;
  if (writer_.paused) return false;
  const bool can_write = writer_.error.ok() || writer_.retry;
  return cut_.phase == CutPhase::kWriting ? can_write : write_back_.waiting() > 0 && can_write;
}

void EmbeddingCache::WaitWritten(MutexLock& lock) {
  while (write_back_.size() != 0 && writer_.error.ok()) written_cv_.wait(lock.native());
}

void EmbeddingCache::WriterLoop() {
  NameThisThread("mlkv-writer");
  MutexLock lock(&mu_);
  for (;;) {
    // During a cut only its rows are written: a row written after the boundary must not reach a
    // store before the cut's value of it, nor before the stores' checkpoints.
    while (!WriterWakes()) writer_cv_.wait(lock.native());
    if (!(writer_.error.ok() || writer_.retry)) return;  // stopping, with rows a failed write left
    WriteBackBuffer* source = &write_back_;
    if (cut_.phase == CutPhase::kWriting) {
      if (cut_.rows.waiting() == 0) {
        WriteCut(lock);  // more cut rows to take, or the stores' checkpoints
        continue;
      }
      source = &cut_.rows;
    } else if (write_back_.waiting() == 0) {
      return;  // stopping
    }
    writer_.retry = false;
    const WriteBackBuffer::Batch batch = source->Take(kWriteBatchRows);
    writer_.busy = true;
    std::vector<uint8_t> landed;
    Status st;
    {
      MutexUnlock unlocked(&mu_, &lock);
      st = PutToStores(batch.keys.data(), batch.keys.size(), batch.rows.data(), &landed);
    }
    writer_.busy = false;
    ++writer_.attempts;
    // Rows of the tables whose stores took them leave the buffer; a failing table's stay in
    // memory until a write succeeds, and hold back no other table's.
    const WriteBackBuffer::Batch written = st.ok() ? batch : batch.Only(landed, 1);
    source->Complete(written);
    // Reads in flight may have read the older value: they look again (see ReadOutsideCache).
    if (reads_in_flight_ > 0) {
      for (int64_t key : written.keys) written_during_reads_.Insert(key, 1);
    }
    if (st.ok()) {
      writer_.error = Status::OK();
    } else {
      source->Return(batch.Only(landed, 0));
      writer_.error = st;
    }
    written_cv_.notify_all();
  }
}

void EmbeddingCache::PauseWriter(bool paused) {
  {
    MutexLock lock(&mu_);
    writer_.paused = paused;
  }
  writer_cv_.notify_all();
}

Status EmbeddingCache::PutToStores(const int64_t* keys, size_t n, const float* rows,
                                   std::vector<uint8_t>* landed) const {
  landed->assign(n, 0);
  int64_t only;
  const std::vector<TableBatch> batches = SplitByTable(keys, n, &only);
  if (batches.empty()) {
    std::vector<int64_t> ids(keys, keys + n);
    for (int64_t& id : ids) id &= kIdMask;
    const Status st = tables_[static_cast<size_t>(only)].store->Put(ids.data(), n, rows);
    if (st.ok()) landed->assign(n, 1);
    return st;
  }
  Status first_error;
  for (size_t t = 0; t < batches.size(); ++t) {
    const TableBatch& b = batches[t];
    if (b.ids.empty()) continue;
    std::vector<float> table_rows(b.ids.size() * static_cast<size_t>(row_words_));
    for (size_t k = 0; k < b.ids.size(); ++k) {
      std::memcpy(&table_rows[k * row_words_], rows + b.positions[k] * row_words_, row_words_ * sizeof(float));
    }
    const Status st = tables_[t].store->Put(b.ids.data(), b.ids.size(), table_rows.data());
    if (st.ok()) {
      for (size_t position : b.positions) (*landed)[position] = 1;
    } else if (first_error.ok()) {
      first_error = st;  // the other tables are still written
    }
  }
  return first_error;
}

std::vector<int32_t> EmbeddingCache::TakeDirtySlots(std::vector<int64_t>* keys) {
  FoldDeviceDirty();
  return slot_index_.TakeDirty(keys);
}

void EmbeddingCache::CountWrittenBack(const std::vector<int64_t>& keys) {
  stats_.written_back += static_cast<int64_t>(keys.size());
  for (int64_t key : keys) ++table_stats_[static_cast<size_t>(TableOf(key))].written_back;
}

void EmbeddingCache::WriteBack() {
  try {
    Drain();
  } catch (...) {
    // The applier failed: its update is lost and raised, but rows already on their way to the
    // stores (evictions) still get there before the caller closes the stores.
    MutexLock lock(&mu_);
    writer_cv_.notify_one();
    WaitWritten(lock);
    throw;
  }
  MutexLock lock(&mu_);
  // A cut being written goes first (rows written back now are past its boundary), and its
  // stores' checkpoints are finished: the stores may be closed next.
  if (write_back_.size() > 0) CheckWriterNotPaused();
  if (cut_.phase != CutPhase::kNone) WaitCutDurable(lock);
  std::vector<int64_t> keys;
  const std::vector<int32_t> slots = TakeDirtySlots(&keys);
  if (!keys.empty()) {
    torch::Tensor rows = SlotRowsToHost(slots);
    WriteBehind(keys.data(), keys.size(), rows.data_ptr<float>());
    CountWrittenBack(keys);
  }
  // Every row reaches its store before this returns.
  if (write_back_.size() > 0) CheckWriterNotPaused();
  writer_cv_.notify_one();
  WaitWritten(lock);
  ThrowIfWriteFailed(lock);
  if (write_back_.size() > 0) {  // the retry succeeded: the rest follows
    WaitWritten(lock);
    if (!writer_.error.ok()) throw StatusError(writer_.error);
  }
}

void EmbeddingCache::WriteRows(const torch::Tensor& keys, const torch::Tensor& rows) {
  CheckInt64Vector(keys, "keys");
  TORCH_CHECK_VALUE(rows.scalar_type() == torch::kFloat32 && rows.device().is_cpu() && rows.is_contiguous() &&
                        rows.dim() == 2 && rows.size(0) == keys.numel() && rows.size(1) == row_words_,
                    "rows must be a contiguous float32 CPU tensor [", keys.numel(), ", ", row_words_, "]");
  Drain();
  const int64_t n = keys.numel();
  const int64_t* key = keys.data_ptr<int64_t>();
  // No fetch admits or evicts meanwhile: rows found missing stay missing while they are written.
  MutexLock fetch_lock(&fetch_mu_);
  MutexLock lock(&mu_);
  const CacheSplit split = SplitByCache(key, n, /*will_write=*/true);
  const auto& [cached_pos, cached_slots, missed_pos, missed_ids] = split;
  // Keys repeat at most harmlessly: the last row written for a key wins in both places.
  if (!cached_pos.empty())
    CopyRowsToSlots(cached_slots, rows.index_select(0, torch::tensor(cached_pos, torch::kInt64)));
  // The rest through the write-back buffer, a buffer's worth at a time, so an import of many rows
  // holds no more of them in memory than training does.
  const float* data = rows.data_ptr<float>();
  std::vector<float> piece;
  for (size_t start = 0; start < missed_pos.size(); start += static_cast<size_t>(writer_.limit)) {
    WaitForWriteBackRoom(lock);
    const size_t end = std::min(missed_pos.size(), start + static_cast<size_t>(writer_.limit));
    piece.resize((end - start) * static_cast<size_t>(row_words_));
    for (size_t k = start; k < end; ++k) {
      std::memcpy(&piece[(k - start) * row_words_], data + missed_pos[k] * row_words_, row_words_ * sizeof(float));
    }
    WriteBehind(missed_ids.data() + start, end - start, piece.data());
  }
}

}  // namespace mlkv
