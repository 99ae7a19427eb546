// EmbeddingCache's deletes: rows of ids a table no longer holds (evicted ids of a virtual table)
// leave the cache, its staging area, the read-aheads and their stores, so a later lookup of such
// an id finds it nowhere and starts it afresh from its initial row.
#include "cache/embedding_cache.h"

namespace mlkv {

torch::Tensor EmbeddingCache::DeleteRows(const torch::Tensor& keys) {
  CheckInt64Vector(keys, "keys");
  const int64_t n = keys.numel();
  const int64_t* key = keys.data_ptr<int64_t>();
  torch::Tensor deleted = torch::zeros({n}, torch::kBool);
  bool* gone = deleted.data_ptr<bool>();
  Drain();  // no queued update writes one of these rows after it is gone
  // No fetch admits or reads meanwhile: a row found missing stays missing.
  MutexLock fetch_lock(&fetch_mu_);
  MutexLock lock(&mu_);
  ThrowIfFailed();
  TORCH_CHECK(!closed_, "the table is closed");
  // A cut being written holds rows of these keys for its stores: the deletes follow its checkpoints,
  // so the cut keeps the rows it was taken with.
  if (cut_.phase != CutPhase::kNone) WaitCutDurable(lock);
  FoldDeviceDirty();  // the device's dirty marks of slots about to be freed are folded, then dropped
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(key[i] >= 0 && TableOf(key[i]) < num_tables(), "key ", key[i], " is of no table of the cache");
    const int32_t slot = slot_index_.Find(key[i]);
    if (slot >= 0) {
      // A row read ahead into a slot for a batch still to come stays: that batch holds its slot.
      if (policy_.pinned(slot)) continue;
      slot_index_.Unassign(slot);
      policy_.Free(slot);
      --table_stats_[static_cast<size_t>(TableOf(key[i]))].cached_rows;
    }
    gone[i] = true;
    staging_.Unstage(key[i]);
    read_aheads_.reading.Erase(key[i]);  // a read-ahead in flight neither stages nor places it
    if (reads_in_flight_ > 0) written_during_reads_.Insert(key[i], 1);  // reads in flight look again
  }
  // Rows of these keys on their way to the stores land first: the writer puts without the lock,
  // and a put after the delete would bring a row back.
  if (write_back_.size() > 0) {
    CheckWriterNotPaused();
    writer_cv_.notify_one();
    WaitWritten(lock);
    ThrowIfWriteFailed(lock);
  }
  std::vector<int64_t> gone_keys;
  for (int64_t i = 0; i < n; ++i) {
    if (gone[i]) gone_keys.push_back(key[i]);
  }
  int64_t only = 0;
  std::vector<TableBatch> batches = SplitByTable(gone_keys.data(), gone_keys.size(), &only);
  if (batches.empty() && !gone_keys.empty()) {  // one table's keys
    batches.resize(static_cast<size_t>(only) + 1);
    for (int64_t k : gone_keys) batches[static_cast<size_t>(only)].ids.push_back(k & kIdMask);
  }
  for (size_t t = 0; t < batches.size(); ++t) {
    if (batches[t].ids.empty()) continue;
    uint64_t removed = 0;
    const Status st = tables_[t].store->Delete(batches[t].ids.data(), batches[t].ids.size(), &removed);
    if (!st.ok()) throw StatusError(st);
  }
  return deleted;
}

}  // namespace mlkv
