// KVStore: a larger-than-memory store of fixed-width rows keyed by
// non-negative int64, on a hybrid log in the spirit of FASTER:
//
//   slots [begin, head)      on disk only, in append-only segment files
//   slots [head, read_only)  in memory and on disk; updates copy to the tail
//   slots [read_only, tail)  in memory, updated in place
//
// A HashIndex maps each key to the slot of its latest record. With an index budget, the index
// holds only the keys the log holds: once it outgrows the budget, the live rows of the log's
// written pages move into a base run (base_run.h: rows sorted by key, found by one block read with
// no memory per row), which holds every other row; a key's record in the log supersedes its base
// row, and a deletion of a base row stays in the index (as a tombstone's slot) until the next
// move. docs/format.md
// gives the on-disk format byte by byte. Every public method is safe to call
// from several threads at once: readers share a lock and do their disk reads
// outside it; writers hold it exclusively.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <unordered_map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "base_merge.h"
#include "base_run.h"
#include "hash_index.h"
#include "io_reader.h"
#include "log_flusher.h"
#include "row_store.h"
#include "segment_files.h"
#include "status.h"
#include "thread_annotations.h"

namespace mlkv {

struct CheckpointMeta;  // log_format.h

// Division by a divisor fixed at open, as a multiply: exact for numerators
// below 2^44 (every log slot) when the divisor is below 2^20; larger divisors
// fall back to the division instruction.
class FastDivisor {
 public:
  FastDivisor() = default;
  explicit FastDivisor(uint64_t d) : d_(d), m_(d < (1u << 20) && d > 1 ? ~uint64_t{0} / d + 1 : 0) {}
  uint64_t Div(uint64_t x) const {
    return m_ ? static_cast<uint64_t>((static_cast<unsigned __int128>(x) * m_) >> 64) : x / d_;
  }
  uint64_t Mod(uint64_t x) const { return x - Div(x) * d_; }
  uint64_t value() const { return d_; }

 private:
  uint64_t d_ = 1, m_ = 0;
};

enum class ElementType : uint32_t { kFloat32 = 1, kFloat16 = 2, kBFloat16 = 3 };
uint32_t ElementSize(ElementType t);

struct StoreOptions {
  uint32_t dim = 0;                              // elements per row (required, >= 1)
  ElementType element_type = ElementType::kFloat32;
  uint64_t memory_budget_bytes = 256ull << 20;   // bytes of log pages held in memory
  uint64_t expected_keys = 1ull << 20;           // sizes the index; it grows past this
  uint64_t segment_bytes = 64ull << 20;          // bytes per segment file (rounded to pages)
  uint64_t page_bytes = 0;                       // log page size; 0 = budget / 16, at most 1 MiB
  double mutable_fraction = 0.9;                 // share of memory pages updated in place
  uint32_t io_depth = 64;                        // disk reads in flight per batch
  IoEngine io_engine = IoEngine::kAuto;          // see BlockReader::Create
  uint32_t io_threads = 16;                      // pread workers, for IoEngine::kThreads
  bool direct_io = true;                         // O_DIRECT on segment files where supported
  double compaction_ratio = 2.0;                 // compact when on-disk log > ratio x live rows; 0 = never
  bool promote_hot_reads = true;                 // copy rows a get reads from disk twice within a window to memory
  // Checkpoints are cuts an owner commits across several stores (an embedding table's, at a
  // training checkpoint): automatic compaction takes none (its segments go at the next one), and
  // besides the latest the store keeps the one its owner last committed (CommitCheckpoint), so a
  // cut that crashed half-way across the stores, or failed, can be undone. Off: compaction
  // checkpoints, only the latest stays.
  bool cut_checkpoints = false;
  // Recover this checkpoint (the latest or the committed one kept beside it); 0 = the latest.
  uint64_t checkpoint_sequence = 0;
  // Bytes the index may take: past them, the live rows of the log's written pages move into the
  // base run (a compaction does the same), so memory stays bounded whatever the rows. 0: no
  // bound; the index keeps every key (as FASTER's), and a store without a base run makes none.
  uint64_t index_budget_bytes = 0;
  // Keys are below this (an embedding table's rows; 0: any non-negative int64). The index then
  // hashes only the bits such keys have, so a table of few rows takes as little index as its keys.
  uint64_t key_limit = 0;
  // Opens the store's checkpoint (the latest, or checkpoint_sequence) without writing a byte: no
  // file is created, changed or removed, writes are refused, and any number of read-only opens
  // share the path while no writer holds it. For reading a checkpoint another job will resume.
  bool read_only = false;
};

struct StoreStats {
  uint64_t rows = 0;
  uint64_t memory_bytes = 0;     // log pages + index + the base run's fences
  uint64_t index_bytes = 0;
  uint64_t log_memory_bytes = 0;
  uint64_t base_memory_bytes = 0;  // the base run's fences
  uint64_t disk_bytes = 0;       // segment files + snapshot + base runs
  uint64_t base_rows = 0;        // rows in the base run (the log may hold newer ones of some)
  uint64_t base_runs = 0;        // the run files it is made of
  uint64_t base_overlays = 0;    // of them, overlays (young runs over the bottom)
  uint64_t base_disk_bytes = 0;  // the base run's file
  uint64_t base_reads = 0;       // blocks of the base run that gets read
  uint64_t base_merges = 0;      // times the log's rows moved into a new base run
  uint64_t base_rows_written = 0;  // rows merges wrote into runs (their I/O: moved rows and rows rewritten)
  uint64_t memory_hits = 0;      // rows a get found in memory
  uint64_t disk_reads = 0;       // blocks read from disk
  uint64_t disk_rows = 0;        // rows a get read from disk
  uint64_t lookahead_rows = 0;   // rows lookahead brought into memory
  uint64_t promoted_rows = 0;    // hot rows a get read from disk and the store copied to memory
  uint64_t lookahead_dropped_rows = 0;  // queued lookahead rows dropped under a backlog
  uint64_t write_stalls = 0;            // times a write waited for compaction to catch up
  uint64_t frame_waits = 0;             // times a write waited, holding the lock, for a page to be written
  double frame_wait_seconds = 0;        // ... and for how long, in all
  uint64_t in_place_updates = 0;
  uint64_t appends = 0;
  uint64_t compactions = 0;
  uint64_t compacted_rows = 0;   // live rows copied by compaction
  uint64_t checkpoints = 0;
  bool recovered_from_index_image = false;  // the last open loaded an index checkpoint, not the log
  uint64_t begin_address = 0, head_address = 0, read_only_address = 0, tail_address = 0;
  uint64_t page_bytes = 0, record_bytes = 0;
  bool direct_io = false;
  std::string io_engine;
};

class KVStore : public RowStore {
 public:
  // Creates a store at `path` (a directory) or recovers the latest checkpoint there.
  static Status Open(const std::string& path, const StoreOptions& options, std::unique_ptr<KVStore>* out);
  // The least memory_budget_bytes the store at `path` opens with: kMinLogPages of the log pages
  // it was created with (its layout is fixed then). 0 when no store is there yet.
  static Status MinimumMemoryBytes(const std::string& path, uint64_t* bytes);
  static constexpr uint64_t kMinLogPages = 4;
  // Deletes the files of a closed store at `path` (as LevelDB's DestroyDB); other files stay.
  // Busy if the store is open.
  static Status Destroy(const std::string& path);
  ~KVStore() override;
  KVStore(const KVStore&) = delete;
  KVStore& operator=(const KVStore&) = delete;

  // Values are row-major [n, dim] of the store's element type, as raw bytes. Many rows go in
  // chunks of what the written memory pages can take: a get or checkpoint meanwhile may see part.
  Status Put(const int64_t* keys, size_t n, const void* values) override;
  // Fills `values`; when keys are absent returns NotFound and lists them in `missing`.
  Status Get(const int64_t* keys, size_t n, void* values, std::vector<int64_t>* missing);
  // Like Get, but absent keys are no error: found[i] says which rows were filled.
  Status Lookup(const int64_t* keys, size_t n, void* values, bool* found) override;
  std::unique_ptr<RoundedLookup> StartLookup(const int64_t* keys, size_t n, void* values, bool* found) override;
  Status Contains(const int64_t* keys, size_t n, bool* found);
  Status Delete(const int64_t* keys, size_t n, uint64_t* deleted) override;
  // Queues the rows for a background copy from disk to memory; returns at once.
  Status Lookahead(const int64_t* keys, size_t n);
  // Waits for queued lookaheads; reports an error one of them met.
  Status Flush();
  // Makes the contents durable as checkpoint `*sequence` (when given); with nothing changed
  // since the last one, that one stands and no file is written. With cut_checkpoints the
  // committed checkpoint stays recoverable beside it (Open with options.checkpoint_sequence).
  Status Checkpoint(uint64_t* sequence = nullptr) override;
  // Checkpoint in two halves (RowStore). Begin holds the lock shared only while it copies the
  // mutable pages to the snapshot file (and, when one is due, the index to its image), unsynced;
  // Finish waits for the flushes, syncs the files and commits, without the lock: puts and gets
  // between the two go on, and land after the checkpoint. Until Finish, Begin, Checkpoint,
  // Compact and CommitCheckpoint are refused (InvalidArgument); Close finishes it first.
  Status BeginCheckpoint() override;
  Status FinishCheckpoint(uint64_t* sequence) override;
  // With cut_checkpoints: the owner recorded the latest checkpoint, `sequence`, as its cut, so the
  // next checkpoint keeps it beside itself, and the one kept until now may go. Until then a new
  // checkpoint replaces the latest and keeps the committed one: the owner's record, which still
  // names that, stays recoverable however many uncommitted checkpoints follow. In memory only:
  // after a crash the owner opens the store at the checkpoint its record names.
  Status CommitCheckpoint(uint64_t sequence);
  // One step of a scan of every live row in log address order: the log read sequentially, a few
  // MiB per read, where Get reads a 4 KiB block per row. Appends the rows of whole pages from slot
  // *cursor on, stopping once `max_rows` or more are in, to `keys` and `values`, and advances
  // *cursor (kScanDone at the end; a step ends at the log's end, then the base's rows follow in key
  // order). A row written while a scan runs may be visited twice (the newer last: it moved to the
  // tail) and one deleted may be missed; at rest, each once.
  static constexpr uint64_t kScanDone = ~0ull;
  // Scan cursors past the log: the base run's blocks, from this bit on (below kScanDone as an int64).
  // A scan from kScanBase reads only the base's rows (in key order); one that stops there, the log's.
  static constexpr uint64_t kScanBase = 1ull << 62;
  Status ScanRows(uint64_t* cursor, size_t max_rows, std::vector<int64_t>* keys, std::vector<uint8_t>* values);
  Status Compact();
  // A load (kv_store_load.cc): fills a store that holds no row from rows in strictly increasing key
  // order, written once, front to back, into a base run, where Put writes a row to the log and
  // again when it moves into the base (a table filled from another's sorted rows: no log record and
  // no index entry a row). Begin sets *begun false for a store that holds a row; InvalidArgument
  // when a load is begun already. Until End every write (put, delete, lookahead, compact,
  // checkpoint) is refused and gets do not see the rows loaded; End makes them the store's base,
  // which the next checkpoint records (a crash before leaves the store as it was), and Close before
  // End drops them. `expected_rows` (at least the rows to come) sizes the run's Bloom filter, which
  // keys with gaps need. LoadRows: InvalidArgument for a key out of order or out of range (the rows
  // before it are loaded).
  Status BeginLoad(uint64_t expected_rows, bool* begun) EXCLUDES(load_mu_, mu_);
  Status LoadRows(const int64_t* keys, size_t n, const void* values) EXCLUDES(load_mu_);
  Status EndLoad(uint64_t* rows) EXCLUDES(load_mu_, mu_);
  // Closes the store: checkpoints, then releases the path. A failed checkpoint leaves it open, but
  // for one that can never succeed (a failed sync of the log): then it closes and returns the error.
  Status Close();
  bool Closed() const {
    ReaderLock lock(&mu_);
    return closed_;
  }
  // Both count the live rows: with a base run that may read it (CountRows).
  Status Stats(StoreStats* stats) const;
  Status Size(uint64_t* rows) const;
  uint32_t value_bytes() const override { return value_bytes_; }
  const std::string& path() const override { return path_; }

 private:
  static constexpr uint64_t kNone = HashIndex::kNoAddress;
  static constexpr size_t kDoorkeeperWords = 1 << 14;  // 1M bits
  // An index entry of a deleted base row: its tombstone's slot with this bit (slots stay below it).
  static constexpr uint64_t kDeletionBit = 1ull << 42;
  static bool IsDeletion(uint64_t address) { return address != kNone && (address & kDeletionBit) != 0; }
  static uint64_t SlotOf(uint64_t address) { return address == kNone ? kNone : address & ~kDeletionBit; }
  // Index bytes a key is charged against index_budget_bytes: a 64-byte bucket's four keys. The
  // bucket array grows no further than the budget (HashIndex::set_bucket_limit), so at this charge
  // it is full when a merge is due.
  static constexpr uint64_t kIndexBytesPerKey = 16;
  struct DiskRecord {  // a record to read from disk
    size_t index;      // position in the caller's batch
    uint64_t slot;
  };

  KVStore(const std::string& path, const StoreOptions& options);
  Status Init() EXCLUDES(close_mu_);
  Status LockPath(bool read_only) REQUIRES(close_mu_);
  Status CloseReadOnly() REQUIRES(close_mu_) EXCLUDES(mu_, lookahead_mu_, compaction_state_mu_);
  void ReleasePath() REQUIRES(close_mu_, mu_);  // closed: the segment files and the LOCK let go
  Status ComputeLayout(uint64_t page_bytes, uint64_t pages_per_segment);
  Status CreateFresh() EXCLUDES(checkpoint_mu_, mu_);
  Status CheckKeys(const int64_t* keys, size_t n) const;
  // InvalidArgument naming the write, when read-only or loading (BeginLoad).
  Status RefuseWrite(const char* what) const;
  // A load's steps: the loaded run made the base of a store that still holds no row; the run
  // dropped (Close before EndLoad).
  Status InstallLoadedRun(std::unique_ptr<BaseRun> run, uint64_t id, uint64_t rows) EXCLUDES(mu_);
  void DropLoad() EXCLUDES(load_mu_);
  bool HoldsNoRowLocked() const REQUIRES_SHARED(mu_) { return !base_ && LiveLogKeysLocked() == 0; }
  std::string KeyRangeText() const;  // the keys the store takes, for its errors
  // found[i]: the store holds keys[i] (log_too false: the base run holds it and the log has no
  // record of it); the base run read without the lock; *generation the base run's it answered for.
  Status ContainsOnce(const int64_t* keys, size_t n, bool* found, bool log_too, uint64_t* generation) EXCLUDES(mu_);
  void StopThreads() EXCLUDES(lookahead_mu_, compaction_state_mu_);

  // Recovery, in kv_store_recovery.cc.
  Status Recover() EXCLUDES(mu_);
  // Its steps: the checkpoint to recover (*meta; *older the one kept beside it; *latest the record
  // CHECKPOINT holds once recovery goes back to an older one), its rows' layout checked against the
  // options, the log replayed from the segments and from the snapshot of its last pages, the
  // recovered index checked against the checkpoint.
  Status ChooseCheckpoint(CheckpointMeta* meta, CheckpointMeta* older, std::string* latest) EXCLUDES(mu_);
  Status CheckRowLayout(const CheckpointMeta& meta, const std::string& meta_path);
  Status ReplaySegmentPages(uint64_t replay_from, uint64_t flushed_page) REQUIRES(mu_);
  Status ReplaySnapshotPages(const CheckpointMeta& meta, uint64_t flushed_page, uint64_t end_page) REQUIRES(mu_);
  Status CheckRecoveredIndex(const CheckpointMeta& meta) REQUIRES(mu_);
  void RemoveLeftovers(uint64_t first_segment, uint64_t sequence, uint64_t previous_sequence) REQUIRES_SHARED(mu_);
  Status ScanSlots(const uint8_t* page, uint64_t first_slot, uint64_t end_slot, const std::string& file_name,
                   uint64_t file_base_offset) REQUIRES(mu_);

  // Reads, in kv_store_read.cc. With `missing`, absent keys are listed there and fail the call
  // (Get); without, they are only marked false in `found` (Lookup; null when n == 0).
  Status ReadRows(const int64_t* keys, size_t n, uint8_t* out, std::vector<int64_t>* missing, bool* found)
      EXCLUDES(mu_);
  // A get in read rounds (kv_store_read.cc): the index under the shared lock, then the log's records
  // on disk and the base's blocks in the same rounds, outside it.
  class RowLookup;
  // The log's records on disk of a get, read in rounds: fills the value bytes of each DiskRecord at
  // out + index * value_bytes, verifying keys and checksums.
  class LogReads;
  // Disk reads outside the lock, on their own: LogReads' rounds.
  Status ReadFromDisk(const int64_t* keys, std::vector<DiskRecord>& reads, uint8_t* out) EXCLUDES(mu_);
  // The keys at `wanted` (positions in `keys`) that the log does not hold, from the base run, outside
  // the lock: sets found[i] and fills out + i * value_bytes for each one it holds.
  Status ReadFromBase(const BaseRuns& base, const int64_t* keys, const std::vector<size_t>& wanted, uint8_t* out,
                      bool* found) const EXCLUDES(mu_);
  // ScanRows past the log: the rows of the base run's blocks from *cursor - kScanBase on that the log
  // holds no record of.
  Status ScanBaseRows(uint64_t* cursor, size_t max_rows, size_t first_row, std::vector<int64_t>* keys,
                      std::vector<uint8_t>* values) EXCLUDES(mu_);
  // Whether the base run may hold `key` (the log holding none of it): false when it surely does not.
  bool BaseMayHold(int64_t key) const REQUIRES_SHARED(mu_) {
    return base_ && base_->PresenceOf(key) != BaseRun::Presence::kAbsent;
  }
  // The index's keys whose record in the log is live (not a deletion of a base row): what a
  // checkpoint records and recovery checks. A deletion stays in the index only where the base run may
  // hold the key, which recovery judges by the run it opens: their number may differ, these may not.
  uint64_t LiveLogKeysLocked() const REQUIRES_SHARED(mu_);
  // Whether a deletion of `key` must stay in the index: the base run may hold the key, or the run a
  // merge is writing may (it may be moving the very row deleted).
  bool KeepsDeletion(int64_t key) const REQUIRES_SHARED(mu_) { return merging_ || BaseMayHold(key); }
  // Live rows: the base's, less those deleted since, plus the log's keys it does not hold. The keys
  // whose presence the base's fences and filters cannot tell are looked up (outside the lock), and
  // the count kept until the store changes; without `read_unknown` (stats(), which monitoring calls
  // often) they count as held by the base, as most are (rows read, then written back), with no read.
  Status CountRows(uint64_t* rows, bool read_unknown = true) const EXCLUDES(mu_, rows_mu_);

  // Log geometry.
  uint64_t PageOf(uint64_t slot) const { return div_records_per_page_.Div(slot); }
  uint64_t SegmentOfPage(uint64_t page) const { return page / pages_per_segment_; }
  uint64_t SegmentOfSlot(uint64_t slot) const { return SegmentOfPage(PageOf(slot)); }
  uint64_t OffsetInPage(uint64_t slot) const;
  // The key of the record at `slot` of a page read into `page`.
  int64_t KeyInPage(const uint8_t* page, uint64_t slot) const {
    int64_t key;
    std::memcpy(&key, page + OffsetInPage(slot), sizeof(key));  // a record begins with its key
    return key;
  }
  uint8_t* FrameOf(uint64_t page) const { return frames_ + div_num_frames_.Mod(page) * page_bytes_; }
  uint8_t* RecordInMemory(uint64_t slot) const { return FrameOf(PageOf(slot)) + OffsetInPage(slot); }
  uint64_t HeadSlot() const REQUIRES_SHARED(mu_) { return head_page_ * records_per_page_; }
  // The first page still in memory once `page` is: `page`'s frame, and those before it in the
  // ring, held the pages below, which must be written first.
  uint64_t HeadPageWith(uint64_t page) const { return page >= num_frames_ ? page - num_frames_ + 1 : 0; }
  uint64_t ReadOnlySlot() const REQUIRES_SHARED(mu_) { return read_only_page_ * records_per_page_; }

  // Record encoding.
  void WriteRecord(uint8_t* rec, int64_t key, uint16_t flags, const uint8_t* value) const;
  uint32_t RecordChecksum(const uint8_t* rec) const;
  Status VerifyRecord(const uint8_t* rec, const std::string& file, uint64_t offset) const;

  // Log mutation, in kv_store_log.cc.
  Status ReserveSlot(uint64_t* slot, uint8_t** record)
      REQUIRES(mu_);  // the next slot at the tail, starting a page if needed
  Status Append(int64_t key, uint16_t flags, const uint8_t* value, uint64_t* slot) REQUIRES(mu_);
  Status AppendRecord(const uint8_t* record, uint64_t* slot) REQUIRES(mu_);  // a verified record, copied verbatim
  Status StartPage(uint64_t page) REQUIRES(mu_);
  // How many of `wanted` records (at least one) can be appended now without StartPage waiting for
  // a page to be written; first waits for the pages whose frames they reuse.
  size_t MakeAppendRoom(size_t wanted) EXCLUDES(mu_);
  void MoveLive(uint64_t old_slot, uint64_t new_slot) REQUIRES(mu_);

  // Checkpoints, in kv_store_checkpoint.cc. Concurrently: both halves on the calling thread (the
  // first with mu_ held shared, the second without it, its commit exclusively). unless_owner_begun:
  // none while the owner's checkpoint is begun (a compaction's, which the owner's puts or Close may
  // be waiting for). Exclusively: the caller holds both locks throughout (open, close).
  Status CheckpointConcurrently(uint64_t* sequence = nullptr, bool unless_owner_begun = false)
      EXCLUDES(checkpoint_mu_, mu_);
  Status CheckpointExclusively() REQUIRES(checkpoint_mu_, mu_);
  // Close: returns once no checkpoint is begun, having finished the owner's (or waited for the call
  // finishing one).
  void FinishOrWaitBegunCheckpoint(MutexLock& one_checkpoint) REQUIRES(checkpoint_mu_) EXCLUDES(mu_);
  struct WrittenCheckpoint {  // files on disk, not yet the store's checkpoint in memory
    bool wrote = false;       // false: nothing changed since the latest, which still holds
    bool kept_previous = false;   // a checkpoint is kept beside it (cut_checkpoints)
    bool previous_moves = false;  // that is the latest until now (committed), not the one kept before
    uint64_t sequence = 0, begin = 0, changes = 0;
    uint64_t image = 0, image_flushed = 0;  // the index image it names (0: none)
    uint64_t base = 0;                      // the base run it names (0: none)
    std::string record;
    std::string previous_record;  // with previous_moves: the latest's record, for CHECKPOINT.previous
  };
  struct ObsoleteFiles {  // removed after the commit, outside mu_
    std::vector<std::string> files;
    std::vector<uint64_t> segments;
  };
  // A checkpoint between its halves: its contents fixed in files not yet synced, and the record
  // that will name them.
  struct BegunCheckpoint {
    bool open = false;         // begun, not yet finished
    bool finishing = false;    // a FinishCheckpoint has it
    bool by_owner = false;     // BeginCheckpoint's (not Checkpoint's or a compaction's, on their way)
    uint64_t first_page = 0;   // pages below are in segment files: flushed and synced by Finish
    int snapshot_fd = -1, image_fd = -1;
    WrittenCheckpoint written;
    // CHECKPOINT names it: its files stay even when a sync after the rename failed (Finish's error).
    bool renamed = false;
  };
  // The first half. Writes the snapshot (and the index image when due) unsynced and composes the
  // record; out->written.wrote false when nothing changed since the latest checkpoint.
  Status BeginCheckpointFiles(BegunCheckpoint* out) REQUIRES(checkpoint_mu_) REQUIRES_SHARED(mu_);
  // The second half, with or without mu_: the flushes below first_page, every sync, the record
  // renamed into place. On failure before the rename the files go and the store stays at its
  // latest checkpoint; after it (the directory's sync failed) begun->renamed is set: the record on
  // disk may name either, so both checkpoints' files stay (CommitBegunFiles).
  Status FinishCheckpointFiles(BegunCheckpoint* begun);
  // After FinishCheckpointFiles: the store moves to the begun checkpoint once CHECKPOINT names it.
  // Returns whether the files in *obsolete, which neither kept checkpoint needs, may go (`finished` OK).
  bool CommitBegunFiles(const BegunCheckpoint& begun, const Status& finished, ObsoleteFiles* obsolete)
      REQUIRES(checkpoint_mu_, mu_);
  void DiscardBegunFiles(BegunCheckpoint* begun);
  Status BeginCheckpointLocked(bool by_owner) REQUIRES(checkpoint_mu_) EXCLUDES(mu_);  // no checkpoint begun
  // The second half of the checkpoint begun by the owner (BeginCheckpoint), or by the calling
  // Checkpoint or compaction (by_owner false), which no other call may take.
  Status FinishBegunCheckpoint(bool by_owner, uint64_t* sequence) EXCLUDES(checkpoint_mu_, mu_);
  // InvalidArgument while the owner's checkpoint is begun (a call that would wait for it could
  // wait for itself); the store's own checkpoints are waited for instead.
  Status RefuseIfBegun(const char* what) EXCLUDES(checkpoint_mu_, mu_);
  // Waits until no checkpoint is between its halves (one begun by a background compaction, or by
  // another thread).
  void WaitNoBegunCheckpoint(MutexLock& one_checkpoint) REQUIRES(checkpoint_mu_) {
    while (begun_.open) begun_cv_.wait(one_checkpoint.native());
  }
  void CommitCheckpointLocked(const WrittenCheckpoint& written, ObsoleteFiles* obsolete) REQUIRES(checkpoint_mu_, mu_);
  void RemoveObsoleteFiles(const ObsoleteFiles& obsolete);
  // CHECKPOINT and CHECKPOINT.previous: the 88-byte record, read and checked / written atomically.
  static Status ReadCheckpointRecord(const std::string& file, std::string* record);
  // *renamed (when given) is set once `file` holds the record, even if the directory's sync after fails.
  Status WriteCheckpointRecord(const std::string& file, const std::string& record, bool* renamed = nullptr) const;
  // A compaction or merge alone changes no row: with cut_checkpoints it waits for the owner's next
  // checkpoint that has rows to take (a cut the owner just took stands).
  bool ChangedSinceCheckpointLocked() const REQUIRES_SHARED(mu_) {
    return changes_ != checkpointed_changes_ || checkpoint_sequence_ == 0 ||
           (begin_ != checkpointed_begin_ && !options_.cut_checkpoints);
  }
  // <path>/<stem>-<number, 10 digits>.<extension>: the store's numbered files.
  std::string NumberedPath(const char* stem, uint64_t number, const char* extension) const;
  std::string SnapshotPath(uint64_t sequence) const;
  std::string IndexImagePath(uint64_t sequence) const;
  // The index checkpoint (index-<seq>.dat): recovery loads it and replays the log written after it
  // (from its `flushed` slot) instead of scanning the whole log. A checkpoint names the latest
  // image and writes a new one only when the log to replay after that one has outgrown the image,
  // so recovery reads at most about twice the index's bytes, and a checkpoint between rewrites
  // none. The file is left open and unsynced in *fd_out (the checkpoint's second half syncs it).
  Status WriteIndexImage(uint64_t sequence, uint64_t flushed, int* fd_out) REQUIRES_SHARED(mu_);
  // Loads the image the checkpoint `meta` names into the index and sets *flushed, the slot
  // recovery replays the log from. Any failure (no such file, damage, an image that does not fit
  // the checkpoint) leaves the index empty.
  Status LoadIndexImage(const CheckpointMeta& meta, uint64_t* flushed) REQUIRES(mu_);

  // Compaction, in kv_store_compaction.cc. It runs outside mu_: it reads old segments unlocked and
  // copies live rows in chunks, each under a short exclusive lock. `all`: every segment below the
  // mutable region; otherwise the oldest ones that hold half of the garbage on disk. Sets *compacted.
  Status CompactSegments(bool all, bool* compacted) REQUIRES(compaction_mu_) EXCLUDES(checkpoint_mu_, mu_);
  // Its steps: the segments [*first, *end) it compacts; the live records of a segment, read
  // unlocked and copied to the log a chunk at a time (CopyLiveRecords, under a short exclusive lock).
  struct LiveRecords {
    std::vector<int64_t> keys;
    std::vector<uint64_t> slots;
    std::vector<uint8_t> values;  // whole records
  };
  Status SegmentsToCompact(bool all, uint64_t* first, uint64_t* end) EXCLUDES(mu_);
  // Pages below the flushed one, `count` of one segment from `first_page`, read in one read and
  // every record verified, unlocked (such pages never change): a damaged key must not make a live
  // row look dead.
  Status ReadWrittenPages(uint64_t first_page, uint64_t count, uint8_t* buffer) EXCLUDES(mu_);
  // Calls each(page, its bytes) for the written pages [first_page, end_page) in order, read a
  // segment's run of pages at a time: a merge's pages would otherwise be as many small reads,
  // queued behind the read-ahead's on the same disk.
  Status ForEachWrittenPage(uint64_t first_page, uint64_t end_page,
                            const std::function<Status(uint64_t page, const uint8_t* data)>& each) EXCLUDES(mu_);
  Status CopyLiveRecordsOfSegment(uint64_t segment, LiveRecords* live) EXCLUDES(mu_);
  // The records of a page read into `page` that the index names (deletions too: `with_deletions`).
  void CollectLiveRecords(const uint8_t* page, uint64_t first_slot, bool with_deletions, LiveRecords* live)
      EXCLUDES(mu_);
  Status CopyLiveRecords(LiveRecords* live) EXCLUDES(mu_);
  // On-disk log > ratio x live rows, or the index over its budget (`stalling`: twice over).
  bool CompactionDueLocked(double ratio, bool stalling = false) const REQUIRES_SHARED(mu_);
  void StallForCompaction() EXCLUDES(mu_, compaction_state_mu_);
  // After writes: queues a compaction (executor "mlkv-compact") when due.
  Status MaybeAutoCompactLocked() REQUIRES(mu_) EXCLUDES(compaction_state_mu_);
  void RunCompactions() EXCLUDES(compaction_mu_, mu_, compaction_state_mu_);  // the compaction task

  // Base runs, in kv_store_base.cc. A merge moves the live rows (and deletions) of the log's
  // pages below `end_slot` into base run generation + 1: the old run and the moved rows, streamed
  // in key order into a new file; then, under a short exclusive lock, the moved keys leave the
  // index and begin_ moves to end_slot. Sets *merged.
  Status MergeIntoBase(uint64_t end_slot, bool* merged) REQUIRES(compaction_mu_) EXCLUDES(checkpoint_mu_, mu_);
  // The merge's end, under the exclusive lock: with `written` OK, the moved keys leave the index,
  // base becomes the store's and begin_ moves to end_page; else the files written go.
  Status CommitMerge(const Status& written, uint64_t generation, uint64_t run_id, uint64_t end_page,
                     const LiveRecords& moved, std::shared_ptr<const BaseRuns> base, ObsoleteFiles* obsolete,
                     bool* merged) EXCLUDES(mu_);
  // The live records of the log's pages [first_page, end_page), read unlocked: *live gets them.
  Status CollectLogRows(uint64_t first_page, uint64_t end_page, LiveRecords* live) EXCLUDES(mu_);
  // The next base (base_run.h, BaseRuns): the old bottom and a run of the moved rows when they all
  // lie past its keys; else the old base and an overlay of the moved rows and deletions, while the
  // overlays stay within OverlayCapacity; else one bottom run of every row. Writes the runs
  // (numbers from `run_id` on) and the manifest of `generation`, and opens them into *out.
  Status WriteBase(uint64_t generation, uint64_t run_id, const std::shared_ptr<const BaseRuns>& old_base,
                   const LiveRecords& moved, std::vector<size_t>& order, std::shared_ptr<const BaseRuns>* out)
      EXCLUDES(mu_);
  struct BaseRunsParts {
    std::vector<std::shared_ptr<const BaseRun>> runs, overlays;
    BaseManifest manifest;
  };
  // The old base and an overlay of `moved` (in key order; a deletion only of a key the old base
  // holds), the overlays joined as JoinOverlays does; the rows counted, reading the keys whose
  // presence the fences and filters cannot tell.
  Status AddOverlay(const BaseRuns& old_base, const std::vector<BaseEntry>& moved, uint64_t run_id, uint64_t end_id,
                    BaseRunsParts* next) EXCLUDES(mu_);
  // The filter of a bottom run of `run_rows` in a bottom of `bottom_rows`: 10 bits a key, fewer
  // where the bottom's filters would take more than the index's budget.
  FilterSize BottomFilter(uint64_t run_rows, uint64_t bottom_rows) const;
  // The entries the overlays may hold over a bottom of `bottom_rows`.
  uint64_t OverlayCapacity(uint64_t bottom_rows) const;
  // Writes run `id` from the sources' newest entries (deletions kept when `keep_deletions`) and
  // opens it into *out (null when it holds nothing: no file stays).
  Status WriteRun(uint64_t id, const FilterSize& filter, const std::vector<EntrySource*>& newest_first,
                  bool keep_deletions, std::shared_ptr<const BaseRun>* out) EXCLUDES(mu_);
  // While the newest overlay holds half as many entries as the one before it or more, the two are
  // joined into one (run numbers from *next_id, below end_id).
  Status JoinOverlays(std::vector<std::shared_ptr<const BaseRun>>* overlays, std::vector<uint64_t>* ids,
                      uint64_t* next_id, uint64_t end_id) EXCLUDES(mu_);
  // Past `times` its budget: its keys at kIndexBytesPerKey, or (twice over, where writers wait) its
  // memory, which keys past the full bucket array take in overflow buckets at a higher rate.
  bool IndexOverBudgetLocked(uint64_t times = 1) const REQUIRES_SHARED(mu_) {
    const uint64_t budget = times * options_.index_budget_bytes;
    return budget > 0 && (index_.size() * kIndexBytesPerKey > budget || (times > 1 && index_.MemoryBytes() > budget));
  }
  // Rows added in key order add a run each merge: when kTailRunsPerLevel runs of one size (a level:
  // 4096 rows, 4x that, ...) end the base, they are joined into one, as a binary counter carries, so a
  // table written front to back keeps a few runs per level and copies each row once a level. Takes
  // the numbers of the runs it writes from *next_id, below end_id.
  Status JoinTailRuns(std::vector<std::shared_ptr<const BaseRun>>* runs, std::vector<uint64_t>* ids, uint64_t* next_id,
                      uint64_t end_id) EXCLUDES(mu_);
  std::string BasePath(uint64_t generation) const;  // the manifest base-<generation>.runs
  std::string RunPath(uint64_t id) const;            // run-<id>.run
  // Opens base `generation` (0: none) as base_, and records its runs.
  Status OpenBase(uint64_t generation) REQUIRES(mu_);
  // The runs of the bases a checkpoint may name, and the files of the others that may go.
  // The base runs neither kept checkpoint nor the store names go (with a checkpoint's obsolete files).
  void CollectObsoleteBases(ObsoleteFiles* obsolete) REQUIRES(mu_);

  // Background copies, in kv_store_copies.cc: a lookahead (keys to read) or a promotion (rows a
  // get already read, with their slots). Both end in ApplyCopies.
  struct CopyJob {
    std::vector<int64_t> keys;
    std::vector<uint64_t> slots;   // empty for a lookahead
    std::vector<uint8_t> values;   // value bytes per key, for a promotion
  };
  void ScheduleCopiesLocked() REQUIRES(lookahead_mu_);  // executor "mlkv-copy"
  void RunCopies() EXCLUDES(lookahead_mu_, mu_);        // the copy task: runs the queued jobs
  Status LookaheadBatch(const std::vector<int64_t>& keys) EXCLUDES(mu_);
  enum class CopyKind { kLookahead, kPromotion, kCompaction };
  // `rows` holds n records (header + value, checksum included) or, with
  // values_only, n values; each is appended unless superseded since it was read.
  Status ApplyCopies(const int64_t* keys, const uint64_t* slots, const uint8_t* rows, size_t n, CopyKind kind,
                     bool values_only = true) REQUIRES(mu_);
  // The doorkeeper: true when `key` was read from disk recently (then clears it), else marks it.
  bool SeenRecently(int64_t key);
  void QueuePromotions(const int64_t* keys, const std::vector<DiskRecord>& reads, const uint8_t* values)
      EXCLUDES(lookahead_mu_);

  const std::string path_;
  StoreOptions options_;
  SegmentFiles segments_;
  LogFlusher flusher_;  // writes the pages below read_only_page_ to segments_
  uint32_t value_bytes_ = 0, record_bytes_ = 0;
  uint64_t unit_bytes_ = 0, records_per_unit_ = 0, records_per_page_ = 0, page_bytes_ = 0;
  uint64_t pages_per_segment_ = 0, num_frames_ = 0, mutable_pages_ = 0;
  bool direct_io_ = false;
  FastDivisor div_records_per_page_, div_records_per_unit_, div_num_frames_;

  // The locks, in the order a thread takes them (holding one, it takes only those below it):
  //   close_mu_             one open or Close at a time; lock_fd_
  //   compaction_mu_        one compaction at a time
  //   checkpoint_mu_        one checkpoint at a time; begun_
  //   mu_                   the log's boundaries, the index, the checkpoint bookkeeping and the
  //                         counters: readers share it, writers hold it alone
  //   lookahead_mu_         the queue of copies (lookahead, promotion) and its task's state
  //   compaction_state_mu_  the background compaction's requests and state
  //   flusher_'s and segments_'s own (LogFlusher, SegmentFiles)
  // The last four are leaves: holding one, a thread takes no other store lock (only an executor's, to submit).
  Mutex close_mu_ ACQUIRED_BEFORE(compaction_mu_);
  Mutex compaction_mu_ ACQUIRED_BEFORE(checkpoint_mu_);
  Mutex checkpoint_mu_ ACQUIRED_BEFORE(mu_);
  mutable SharedMutex mu_ ACQUIRED_BEFORE(lookahead_mu_, compaction_state_mu_);
  Mutex lookahead_mu_;
  Mutex compaction_state_mu_;

  int lock_fd_ GUARDED_BY(close_mu_) = -1;

  // Set at open, read by the flush task without a lock: a frame's bytes are guarded by mu_ while
  // its page is mutable, and read-only after.
  uint8_t* frames_ = nullptr;  // num_frames_ pages, mapped anonymously
  uint64_t frames_mapped_bytes_ = 0;
  void* frames_mapping_ = nullptr;
  std::shared_ptr<BlockReader> reader_;  // set at open
  HashIndex index_ GUARDED_BY(mu_);
  uint64_t begin_ GUARDED_BY(mu_) = 0;      // first slot still in the log
  uint64_t head_page_ GUARDED_BY(mu_) = 0;  // first page in memory
  // First mutable page; pages below it go to segment files (those below flusher_.flushed_page() are there).
  uint64_t read_only_page_ GUARDED_BY(mu_) = 0;
  uint64_t tail_ GUARDED_BY(mu_) = 0;  // next slot to append
  uint64_t checkpoint_sequence_ GUARDED_BY(mu_) = 0;
  std::string checkpoint_record_ GUARDED_BY(mu_);  // the bytes of CHECKPOINT, to become CHECKPOINT.previous
  bool latest_committed_ GUARDED_BY(mu_) = true;   // the owner committed the latest (CommitCheckpoint)
  // The checkpoint kept beside it, still recoverable: the committed one (with cuts), CHECKPOINT.previous on disk.
  uint64_t previous_sequence_ GUARDED_BY(mu_) = 0;
  // The index images the latest and the previous checkpoint name (0: none); the latest's, when
  // sound, covers the log below image_flushed_, and the next checkpoint may name it too.
  uint64_t image_sequence_ GUARDED_BY(mu_) = 0, previous_image_sequence_ GUARDED_BY(mu_) = 0;
  uint64_t image_flushed_ GUARDED_BY(mu_) = 0;
  bool image_sound_ GUARDED_BY(mu_) = false;
  uint64_t previous_begin_ GUARDED_BY(mu_) = 0;  // its first slot: segments from here on stay
  uint64_t changes_ GUARDED_BY(mu_) = 0;         // appends and in-place writes, ever
  // At the latest checkpoint.
  uint64_t checkpointed_changes_ GUARDED_BY(mu_) = 0, checkpointed_begin_ GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> compacted_segments_ GUARDED_BY(mu_);  // deleted once a checkpoint no longer needs them
  std::vector<int64_t> live_per_segment_ GUARDED_BY(mu_);     // records the index points at, per segment
  bool closed_ GUARDED_BY(mu_) = true;                        // until Open succeeds

  mutable std::atomic<uint64_t> memory_hits_{0}, disk_reads_{0}, disk_rows_{0};
  std::atomic<uint64_t> lookahead_rows_{0}, promoted_rows_{0}, lookahead_dropped_rows_{0}, write_stalls_{0};
  std::atomic<uint64_t> frame_waits_{0}, frame_wait_ns_{0};
  std::vector<std::atomic<uint64_t>> doorkeeper_;
  std::atomic<uint64_t> doorkeeper_marks_{0};
  uint64_t in_place_updates_ GUARDED_BY(mu_) = 0, appends_ GUARDED_BY(mu_) = 0;
  uint64_t compactions_ GUARDED_BY(mu_) = 0, compacted_rows_ GUARDED_BY(mu_) = 0, checkpoints_ GUARDED_BY(mu_) = 0;
  bool recovered_from_index_image_ GUARDED_BY(mu_) = false;

  // The base run (null: none yet) and its generation; the ones the latest and the previous
  // checkpoint name stay on disk while those are kept.
  std::shared_ptr<const BaseRuns> base_ GUARDED_BY(mu_);
  uint64_t base_generation_ GUARDED_BY(mu_) = 0;
  uint64_t checkpointed_base_ GUARDED_BY(mu_) = 0, previous_base_ GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> unnamed_bases_ GUARDED_BY(mu_);  // replaced bases a kept checkpoint may still name
  std::map<uint64_t, std::vector<uint64_t>> base_runs_of_ GUARDED_BY(mu_);  // generation -> its run numbers
  uint64_t next_run_id_ GUARDED_BY(mu_) = 1;
  // The base a begun checkpoint names (0: none begun): a merge meanwhile must not remove it. Set
  // under mu_ shared by the checkpoint's first half, read under mu_ exclusive by a merge's commit.
  std::atomic<uint64_t> begun_base_{0};
  Mutex load_mu_ ACQUIRED_BEFORE(mu_);                      // a load's run, written outside mu_
  std::unique_ptr<BaseRunWriter> load_writer_ GUARDED_BY(load_mu_);
  uint64_t load_run_id_ GUARDED_BY(load_mu_) = 0;
  std::atomic<bool> loading_{false};                        // set while load_writer_ is open
  uint64_t base_merges_ GUARDED_BY(mu_) = 0;
  bool merging_ GUARDED_BY(mu_) = false;  // a merge is writing the next run
  // The index has held a deletion (even with no base yet: one made while the first merge ran).
  bool deletions_indexed_ GUARDED_BY(mu_) = false;
  mutable std::atomic<uint64_t> base_reads_{0};
  std::atomic<uint64_t> base_rows_written_{0};
  // CountRows' last count, and the store's changes and base run it was taken at.
  mutable Mutex rows_mu_;
  mutable uint64_t counted_rows_ GUARDED_BY(rows_mu_) = 0;
  mutable uint64_t counted_changes_ GUARDED_BY(rows_mu_) = ~0ull, counted_base_ GUARDED_BY(rows_mu_) = 0;

  std::condition_variable begun_cv_;  // with checkpoint_mu_: begun_ was finished
  BegunCheckpoint begun_ GUARDED_BY(checkpoint_mu_);  // its files belong to whoever finishes it

  std::condition_variable lookahead_idle_;  // with lookahead_mu_
  std::deque<CopyJob> lookahead_queue_ GUARDED_BY(lookahead_mu_);
  bool lookahead_busy_ GUARDED_BY(lookahead_mu_) = false, lookahead_stop_ GUARDED_BY(lookahead_mu_) = false;
  // A RunCopies task is queued or running on the copy executor.
  bool lookahead_scheduled_ GUARDED_BY(lookahead_mu_) = false;
  Status lookahead_error_ GUARDED_BY(lookahead_mu_);

  std::condition_variable compaction_idle_;  // with compaction_state_mu_
  bool compaction_requested_ GUARDED_BY(compaction_state_mu_) = false;
  bool compaction_running_ GUARDED_BY(compaction_state_mu_) = false;
  bool compaction_stop_ GUARDED_BY(compaction_state_mu_) = false;
  bool compaction_scheduled_ GUARDED_BY(compaction_state_mu_) = false;  // a RunCompactions task is queued or running
  Status compaction_error_ GUARDED_BY(compaction_state_mu_);
};

}  // namespace mlkv
