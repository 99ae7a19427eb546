// Merging sorted entries (rows and deletions) of several sources into one base run: the merges of
// the log's rows into the base, of overlays into one, and of everything into a new bottom.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "base_run.h"
#include "status.h"

namespace mlkv {

// A row (value set) or a deletion (value null) of `key`.
struct BaseEntry {
  int64_t key;
  const uint8_t* value;
};

// Entries of one source, in strictly increasing key order.
class EntrySource {
 public:
  virtual ~EntrySource() = default;
  // Moves to the next entry (the first, on the first call); *more false at the end.
  virtual Status Advance(bool* more) = 0;
  const BaseEntry& entry() const { return entry_; }

 protected:
  BaseEntry entry_{-1, nullptr};
};

// Entries held in memory (the log's moved rows, sorted by key); the array must outlive it.
class VectorSource : public EntrySource {
 public:
  VectorSource(const BaseEntry* entries, size_t n) : entries_(entries), n_(n) {}
  explicit VectorSource(const std::vector<BaseEntry>& entries) : VectorSource(entries.data(), entries.size()) {}
  Status Advance(bool* more) override;

 private:
  const BaseEntry* entries_;
  size_t n_;
  size_t next_ = 0;
};

// The rows and deletions of runs whose keys follow one another (a bottom, or one overlay), read a
// few MiB at a time.
class RunsSource : public EntrySource {
 public:
  explicit RunsSource(std::vector<std::shared_ptr<const BaseRun>> runs) : runs_(std::move(runs)) {}
  Status Advance(bool* more) override;

 private:
  Status Refill();  // the next chunk of the current run's rows, or the next run's

  std::vector<std::shared_ptr<const BaseRun>> runs_;
  size_t run_ = 0;
  uint64_t next_block_ = 0;
  std::vector<int64_t> keys_;
  std::vector<uint8_t> values_;
  size_t row_ = 0, deletion_ = 0;  // the next row of the chunk, the next deletion of the run
};

// Writes each key's entry from the first source (the newest) that has one, into `writer`;
// deletions are written only when `keep_deletions` (a run under the written one may hold the key).
Status MergeEntries(const std::vector<EntrySource*>& newest_first, bool keep_deletions, BaseRunWriter* writer);

}  // namespace mlkv
