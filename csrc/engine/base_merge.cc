#include "base_merge.h"

namespace mlkv {

Status VectorSource::Advance(bool* more) {
  *more = next_ < n_;
  if (*more) entry_ = entries_[next_++];
  return Status::OK();
}

Status RunsSource::Refill() {
  keys_.clear();
  values_.clear();
  row_ = 0;
  while (run_ < runs_.size() && next_block_ >= runs_[run_]->blocks()) {
    if (deletion_ < runs_[run_]->deletions().size()) return Status::OK();  // the run's last deletions first
    ++run_;
    next_block_ = deletion_ = 0;
  }
  if (run_ == runs_.size()) return Status::OK();
  return runs_[run_]->ReadBlocks(next_block_, &keys_, &values_, &next_block_);
}

Status RunsSource::Advance(bool* more) {
  for (;;) {
    if (run_ == runs_.size()) {
      *more = false;
      return Status::OK();
    }
    const BaseRun& run = *runs_[run_];
    const std::vector<int64_t>& deletions = run.deletions();
    const bool has_row = row_ < keys_.size(), has_deletion = deletion_ < deletions.size();
    // A deletion comes first when below the chunk's next row; past the chunk, only when the run has no more blocks.
    if (has_deletion && (has_row ? deletions[deletion_] < keys_[row_] : next_block_ >= run.blocks())) {
      entry_ = {deletions[deletion_++], nullptr};
      *more = true;
      return Status::OK();
    }
    if (has_row) {
      entry_ = {keys_[row_], values_.data() + row_ * run.value_bytes()};
      ++row_;
      *more = true;
      return Status::OK();
    }
    MLKV_RETURN_IF_ERROR(Refill());
  }
}

Status MergeEntries(const std::vector<EntrySource*>& newest_first, bool keep_deletions, BaseRunWriter* writer) {
  std::vector<EntrySource*> live;  // sources not at their end, newest first
  for (EntrySource* source : newest_first) {
    bool more;
    MLKV_RETURN_IF_ERROR(source->Advance(&more));
    if (more) live.push_back(source);
  }
  while (!live.empty()) {
    size_t winner = 0;  // the lowest key; the newest source among equals
    for (size_t s = 1; s < live.size(); ++s) {
      if (live[s]->entry().key < live[winner]->entry().key) winner = s;
    }
    const BaseEntry entry = live[winner]->entry();
    if (entry.value) {
      MLKV_RETURN_IF_ERROR(writer->Add(entry.key, entry.value));
    } else if (keep_deletions) {
      MLKV_RETURN_IF_ERROR(writer->AddDeletion(entry.key));
    }
    // Every source at this key moves on (the older ones' entries are superseded).
    for (size_t s = 0; s < live.size();) {
      bool more = true;
      if (live[s]->entry().key == entry.key) MLKV_RETURN_IF_ERROR(live[s]->Advance(&more));
      if (more) {
        ++s;
      } else {
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(s));
      }
    }
  }
  return Status::OK();
}

}  // namespace mlkv
