// KVStore's load: a store that holds no row filled from rows in key order straight into its base,
// each row written once (a table filled from another's sorted rows, as a reshard does).
#include <unistd.h>

#include "kv_store.h"

namespace mlkv {

Status KVStore::BeginLoad(uint64_t expected_rows, bool* begun) {
  *begun = false;
  MLKV_RETURN_IF_ERROR(RefuseWrite("load"));  // a read-only store, or a load begun
  MutexLock load(&load_mu_);
  uint64_t id;
  {
    WriterLock lock(&mu_);
    if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
    if (!HoldsNoRowLocked()) return Status::OK();
    id = next_run_id_++;
    // Set under the lock that a put takes: no put lands between the check and the flag.
    loading_ = true;
  }
  const uint64_t bottom_rows = expected_rows ? expected_rows : options_.key_limit;
  Status st =
      BaseRunWriter::Create(RunPath(id), value_bytes_, id, BottomFilter(bottom_rows, bottom_rows), &load_writer_);
  if (!st.ok()) {
    loading_ = false;
    return st;
  }
  load_run_id_ = id;
  *begun = true;
  return Status::OK();
}

Status KVStore::LoadRows(const int64_t* keys, size_t n, const void* values) {
  MLKV_RETURN_IF_ERROR(CheckKeys(keys, n));
  MutexLock load(&load_mu_);
  if (!load_writer_) return Status::InvalidArgument("store at " + path_ + " has no load begun");
  const auto* rows = static_cast<const uint8_t*>(values);
  for (size_t i = 0; i < n; ++i) {
    Status st = load_writer_->Add(keys[i], rows + i * value_bytes_);
    if (!st.ok()) {
      return Status::InvalidArgument("store at " + path_ + ": a load takes keys in increasing order; keys[" +
                                     std::to_string(i) + "] = " + std::to_string(keys[i]) + " (" + st.message() + ")");
    }
  }
  return Status::OK();
}

Status KVStore::EndLoad(uint64_t* rows) {
  *rows = 0;
  MutexLock load(&load_mu_);
  if (!load_writer_) return Status::InvalidArgument("store at " + path_ + " has no load begun");
  const std::string path = RunPath(load_run_id_);
  Status st = load_writer_->Finish();  // synced: the base that names it may be checkpointed at once
  const uint64_t loaded = load_writer_->rows();
  load_writer_.reset();
  std::unique_ptr<BaseRun> run;
  if (st.ok() && loaded) st = BaseRun::Open(path, value_bytes_, load_run_id_, direct_io_, &run);
  if (st.ok() && loaded) st = InstallLoadedRun(std::move(run), load_run_id_, loaded);
  loading_ = false;
  if (!st.ok() || !loaded) unlink(path.c_str());
  if (st.ok()) *rows = loaded;
  return st;
}

Status KVStore::InstallLoadedRun(std::unique_ptr<BaseRun> run, uint64_t id, uint64_t rows) {
  WriterLock lock(&mu_);
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  if (!HoldsNoRowLocked()) return Status::InvalidArgument("store at " + path_ + " took rows during its load");
  const uint64_t generation = base_generation_ + 1;
  BaseManifest manifest;
  manifest.runs = {id};
  manifest.rows = rows;
  MLKV_RETURN_IF_ERROR(WriteBaseManifest(BasePath(generation), generation, manifest));
  base_ = std::make_shared<const BaseRuns>(std::vector<std::shared_ptr<const BaseRun>>{std::move(run)},
                                           std::vector<std::shared_ptr<const BaseRun>>{}, std::move(manifest));
  base_runs_of_[generation] = {id};
  base_generation_ = generation;
  base_rows_written_ += rows;
  ++changes_;  // the next checkpoint records the new base
  return Status::OK();
}

void KVStore::DropLoad() {
  MutexLock load(&load_mu_);
  if (!load_writer_) return;
  load_writer_.reset();
  unlink(RunPath(load_run_id_).c_str());
  loading_ = false;
}

}  // namespace mlkv
