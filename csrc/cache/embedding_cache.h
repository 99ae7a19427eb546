// EmbeddingCache: the table-batched hot cache of a group of disk tables that share a row
// layout (dim, weight type, optimizer), in device memory, in front of one RowStore per table
// (KVStore or RocksDB), with the group's fused optimizer and an applier thread that takes
// updates off the training step. A DiskEmbeddingBag is the one-table case.
//
// - Keys: a row of table t, id i is the key (t << kTableShift) | i (TableKey), so every
//   table's rows share one index, one slot tensor and one policy, and a whole batch of
//   every table's features is fetched, updated and read ahead in one call.
// - Rows: `capacity` rows of the layout (row_ops.h) in one tensor on the device. Index and
//   policy live on the host: SlotIndex (key -> slot, each slot's key and dirty bit) and
//   AdmissionPolicy ("lfu": a count-min sketch's admission test; "lru": the baseline).
// - Dirty rows are written back to the store on eviction and on WriteBack, through the
//   write-back buffer (WriteBackBuffer) and the writer thread (write_back.cpp).
// - Read-ahead (ReadAhead, what Python's `lookahead` starts; the thread is named mlkv-read-ahead):
//   rows of future batches are read from the stores into the staging area (StagingArea), which
//   also holds rows the policy kept out; a fetch takes staged rows instead of reading the store,
//   and waits for a read-ahead in flight rather than issuing it twice (read_ahead.cpp).
//   "Read-ahead" is the act and "staging area" where its rows wait; the stats say `read_ahead_*`.
//   Every store write of the cache drops staged copies of its rows (and
//   rows of the read in flight), so staged rows are never older than the store.
// - Read-ahead into slots (`read_ahead_into_slots`, the default on CUDA): the read-ahead thread
//   puts the rows it read straight into reserved slots through a SlotTransfer (slot_transfer.h:
//   pinned buffers and a side stream on CUDA), evicting only rows no batch read ahead still needs
//   (AdmissionPolicy's pins), and publishes each slot in the index once its row has landed. The
//   lookups take read-aheads in order (TakeReadAhead); a batch whose keys are those of the
//   read-ahead it takes (a fingerprint says so) keeps its slots until its update, so on CUDA it
//   runs the device path from lookup to update with no host round trip of its own.
//   A caller that names the batch it looks up as the one read ahead (LookupReadAhead) skips the
//   deduplication and the index lookup: the read-ahead did both on the host, and its batch's
//   keys, index and slots travel up from pinned memory without a synchronisation.
// - On CUDA, a copy of the key -> slot map lives in device memory (DeviceIndex): a batch whose
//   rows are all cached is keyed, deduplicated, looked up, gathered and updated on the device
//   (LookupOnDevice, UpdateOnDevice), with one host synchronisation (the deduplication's), which
//   also brings the count of misses.
//   Only batches with misses go through the host, which decides admissions. Such device-only
//   batches do not count towards the policy's frequencies (nothing of them reaches the host);
//   the update kernel marks the slots it writes dirty in device memory, and the host folds
//   those marks into its own before it evicts or writes back.
// - Methods run without the GIL (the binding releases it).
// - Updates (QueueUpdate) are applied in order by the applier thread (CPU) or
//   at once on the current stream (CUDA). A fetch first waits until at most
//   `staleness` updates are queued, so no row it reads misses more than that
//   many of its updates; with staleness 0 every read sees every update (applier.cpp).
// - Its parts, each in this folder: fetches (fetch.cpp), updates and the applier (applier.cpp, its
//   queue UpdateQueue), read-ahead (read_ahead.cpp; ReadAheadQueue, ReadAheadState), write-back and
//   the writer (write_back.cpp; WriterState), cuts (cut.cpp; CutState), deletes (delete.cpp), the
//   CUDA paths (device.cpp). The locks and their order: once, beside the mutexes below.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cache/admission_policy.h"
#include "cache/cut_state.h"
#include "cache/device_index.h"
#include "engine/row_store.h"
#include "engine/thread_annotations.h"
#include "id_map.h"
#include "row_ops.h"
#include "cache/slot_index.h"
#include "cache/read_ahead_queue.h"
#include "cache/read_ahead_state.h"
#include "cache/slot_transfer.h"
#include "cache/staging_area.h"
#include "cache/update_queue.h"
#include "cache/write_back_buffer.h"
#include "cache/writer_state.h"

namespace mlkv {

// Releases a held MutexLock for a scope (store I/O without the lock) and takes it back however
// the scope ends, so the analysis sees the guarded members as unprotected inside it.
class SCOPED_CAPABILITY MutexUnlock {
 public:
  MutexUnlock(Mutex* mu, MutexLock* lock) RELEASE(mu) : lock_(lock) { lock_->native().unlock(); }
  ~MutexUnlock() RELEASE() { lock_->native().lock(); }
  MutexUnlock(const MutexUnlock&) = delete;
  MutexUnlock& operator=(const MutexUnlock&) = delete;

 private:
  MutexLock* lock_;
};

// A non-OK Status from the store, raised through the cache; the binding maps
// it to the same Python exception as the store's own calls.
struct StatusError : std::runtime_error {
  explicit StatusError(Status s) : std::runtime_error(s.message()), status(std::move(s)) {}
  Status status;
};

// Bits of a key below the table index: ids up to 2^40 (a trillion rows), 2^23 tables.
constexpr int kTableShift = 40;
constexpr int64_t kIdMask = (int64_t{1} << kTableShift) - 1;
inline int64_t TableKey(int64_t table, int64_t id) { return (table << kTableShift) | id; }
inline int64_t TableOf(int64_t key) { return key >> kTableShift; }

// How many ids ahead a loop over a batch prefetches the cache's index buckets: enough to cover a
// miss to memory behind the probes between.
constexpr int64_t kPrefetchAhead = 8;

// One table of a cache: its store, the initial values of its rows never written, its size.
struct CacheTable {
  std::string name;  // named in errors
  std::shared_ptr<RowStore> store;
  RowInit init;
  int64_t num_embeddings = 0;
};

struct CacheOptions {
  int64_t capacity = 0;      // rows held at most, over all tables
  int64_t dim = 0;           // weights per row
  WeightType weight_type = WeightType::kFloat32;
  OptimizerSpec optimizer;
  std::vector<float> initial_state;  // state of rows never written
  CachePolicy policy = CachePolicy::kLfu;
  int64_t staleness = 0;
  // Rows of the read-ahead staging area, and of the write-back buffer before a fetch waits for the
  // writer (each at least 1); the memory budget counts both (HostBytesOfBuffers).
  int64_t staging_rows = 4096;
  int64_t write_back_rows = 4096;  // rows the buffer may hold before a fetch waits for the writer
  bool read_ahead_into_slots = false;  // rows read ahead go into slots, not the staging area
  int64_t transfer_delay_us = 0;       // on the host: each copy into slots lands this late (tests)
};

struct CacheStats {
  int64_t hits = 0, misses = 0, store_reads = 0, fresh_rows = 0, admitted = 0, rejected = 0, evictions = 0,
          written_back = 0, updates_applied = 0, rows_updated = 0, queued_updates = 0, pending_rows = 0,
          max_staleness = 0, cached_rows = 0, waits = 0, read_ahead_rows = 0, read_ahead_hits = 0,
          read_ahead_dropped = 0;
  // Read-ahead timing: the latency of a read-ahead (queued -> rows staged), a moving average over
  // recent requests, and the total time fetches waited for read-aheads still in flight.
  double read_ahead_latency_us = 0;
  int64_t read_ahead_wait_us = 0;
  int64_t write_back_rows = 0;  // rows waiting in the write-back buffer
  // Fetches that found the write-back buffer over its limit and waited for the writer, and how long.
  int64_t write_back_waits = 0, write_back_wait_us = 0;
  // Rows of the cut begun last: dirty cached rows and rows on their way to the stores at its boundary
  // (a row both evicted and cached again, dirty, counts twice).
  int64_t cut_rows = 0;
  // Rows read ahead into slots, and rows read ahead that found every slot pinned (staged instead).
  int64_t read_ahead_placed = 0, read_ahead_unplaced = 0;
  // Batches LookupReadAhead gathered from the slots their read-ahead pinned (no fetch).
  int64_t read_ahead_lookups = 0;
};

// The counters of CacheStats that belong to one table of the cache.
struct TableCounters {
  int64_t hits = 0, misses = 0, store_reads = 0, fresh_rows = 0, cached_rows = 0, read_ahead_hits = 0, written_back = 0;
};

// A batch read ahead (ReadAheadBatch) as LookupReadAhead takes it: its features, distinct keys
// and each value's index among them (pinned host memory on CUDA), each key's slot once known
// (-1 before), its distinct keys per table; `settled` once its request is done, `complete` when
// then every key's row is in a slot pinned for it (`slot_index`: the slots as int32, pinned on CUDA).
struct BatchReadAhead {
  std::vector<int64_t> feature_counts, feature_tables;
  torch::Tensor unique, inverse, slot_index;
  std::vector<int32_t> slots;
  std::vector<int64_t> table_keys;
  bool settled = false, complete = false;
};

class EmbeddingCache {
 public:
  EmbeddingCache(std::vector<CacheTable> tables, CacheOptions options, torch::Device device);
  ~EmbeddingCache();
  // Host bytes a cache of `capacity` rows keeps beside the rows themselves, with either policy: the
  // key -> slot index, per-slot state and the policy's (the memory budget's rule counts them); 0
  // for a cache of no rows.
  static int64_t HostBytesBesideRows(int64_t capacity);
  // Host bytes of the staging area and the write-back buffer at `staging_rows` and
  // `write_back_rows` rows of `row_words` 32-bit words: their rows, index and per-entry state.
  static int64_t HostBytesOfBuffers(int64_t staging_rows, int64_t write_back_rows, int64_t row_words);

  // Distinct keys of a batch of features, in order of first appearance: `values` holds feature_counts[f] ids of
  // feature f after those of f - 1, each a row of table feature_tables[f]. Returns the
  // distinct keys (TableKey) and, per value, its index among them; raises (ValueError)
  // naming the table on an id outside the table.
  std::tuple<torch::Tensor, torch::Tensor> UniqueKeys(const torch::Tensor& values,
                                                      const std::vector<int64_t>& feature_counts,
                                                      const std::vector<int64_t>& feature_tables) const;
  // Weights [n, weight_words] (float32 words) of distinct keys `keys`, on the device;
  // admits misses per policy. Every method below takes keys (TableKey), not ids.
  torch::Tensor Fetch(const torch::Tensor& keys) EXCLUDES(fetch_mu_, mu_);
  // Fetch of a batch's keys: the batch takes the oldest read-ahead not yet taken (see ReadAheadBatch).
  torch::Tensor FetchBatch(const torch::Tensor& keys) EXCLUDES(fetch_mu_, mu_);
  // What a device lookup returns: distinct keys, each value's index among them, their weights, their
  // slots, the index version the slots belong to, how many keys are not cached (see LookupOnDevice).
  using DeviceLookup = std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t>;
#ifdef MLKV_WITH_CUDA
  // The device-resident lookup of a batch of features (CUDA; `values` int64 on the device, as
  // UniqueKeys takes them): returns the distinct keys (sorted), each value's index among them,
  // their weights [n, weight_words], their slots (int32, -1: not cached), the version of the
  // index the slots belong to, and how many keys are not cached. A batch with misses is
  // fetched by Fetch (the host admits), then looked up again.
  DeviceLookup LookupOnDevice(const torch::Tensor& values, const std::vector<int64_t>& feature_counts,
                              const std::vector<int64_t>& feature_tables);
#endif
  // The lookup of the batch read ahead (ReadAheadBatch, read_ahead_into_slots) whose ticket the
  // caller names (its features must match; its ids are not compared). Read-aheads older than the
  // ticket and not yet looked up are let go (their pins released); a ticket no longer waiting
  // (looked up already, or dropped after kUntakenReadAheads later ones) or never issued raises
  // ValueError. The read-ahead's host deduplication and slots serve it: once every row of the batch
  // is pinned in a slot, its rows are gathered from the slots with no host synchronisation (on
  // CUDA keys, index and slots go up from pinned memory without blocking). Returns what
  // LookupOnDevice returns, on the device (keys in order of first appearance); a read-ahead that
  // left rows out of the slots (too little room, a failed read) is fetched as FetchBatch does.
  DeviceLookup LookupReadAhead(int64_t ticket, const std::vector<int64_t>& feature_counts,
                               const std::vector<int64_t>& feature_tables) EXCLUDES(fetch_mu_, mu_);
  // Whether the read-ahead with `ticket` still waits for its lookup (LookupReadAhead would take it):
  // a caller that may have let it go (a lookup without a ticket in between) then looks up by key.
  bool ReadAheadWaiting(int64_t ticket) EXCLUDES(mu_);
#ifdef MLKV_WITH_CUDA
  // One optimizer step for the keys of a LookupOnDevice (CUDA), with gradient rows `grads`
  // [n, dim] float32 on the device: the cached rows by one kernel over their slots, the
  // `outside` others on the host; by key, as QueueUpdate, when the index changed since.
  void UpdateOnDevice(const torch::Tensor& keys, const torch::Tensor& slots, int64_t version, int64_t outside,
                      const torch::Tensor& grads, int64_t step, double lr);
#endif
  // Queues one optimizer step for distinct `keys` with gradient rows `grads`
  // [n, dim] float32 (on the device), at learning rate `lr` (the rate when
  // the step was taken, so a schedule applies even to updates still queued).
  void QueueUpdate(const torch::Tensor& keys, const torch::Tensor& grads, int64_t step, double lr) EXCLUDES(mu_);
  // Waits until every queued update is applied.
  void Drain() EXCLUDES(mu_);
  // Holds queued updates back (tests and benchmarks of staleness); a call
  // that would wait for a held update raises instead.
  void PauseApplier(bool paused);
  // Holds the writer back (tests of cuts): a call that would wait for it raises instead.
  void PauseWriter(bool paused) EXCLUDES(mu_);
  // Current full rows [n, row_words] float32 on the CPU; no admission.
  torch::Tensor ReadRows(const torch::Tensor& keys) EXCLUDES(mu_);
  // Replaces full rows (CPU float32 [n, row_words]) in the cache or the store.
  void WriteRows(const torch::Tensor& keys, const torch::Tensor& rows) EXCLUDES(fetch_mu_, mu_);
  // Deletes the rows of `keys` from the cache and their stores (dirty values, staged and read-ahead
  // copies dropped), after queued updates and a cut being written: a later lookup starts each
  // afresh from its initial row. A row read ahead into a slot for a batch still to come stays.
  // Returns which keys went (bool [n]).
  torch::Tensor DeleteRows(const torch::Tensor& keys) EXCLUDES(fetch_mu_, mu_);
  // Queues a read-ahead of the rows of `keys` neither cached nor staged; returns at once. The
  // read-ahead thread puts them in the staging area, where the next fetch takes them instead of
  // reading the store, or (read_ahead_into_slots) into slots. `fingerprint`: of the batch's keys
  // (BatchFingerprint), which the batch's lookup compares.
  void ReadAhead(const torch::Tensor& keys, uint64_t fingerprint = 0) EXCLUDES(mu_) {
    QueueReadAhead(keys, fingerprint, nullptr);
  }
  // The read-ahead of a batch of features, as UniqueKeys takes them. Lookups (FetchBatch,
  // LookupOnDevice) take read-aheads in the order they were asked for, one each. Returns its
  // ticket (sequence number), by which LookupReadAhead names the batch.
  int64_t ReadAheadBatch(const torch::Tensor& values, const std::vector<int64_t>& feature_counts,
                         const std::vector<int64_t>& feature_tables) EXCLUDES(mu_);
  // Cuts (cut.cpp): one consistent state of every table, written while training goes on
  // (FASTER's CPR, at the level of the cache). BeginCut, at a step boundary, applies queued
  // updates and takes every dirty row and every row on its way to the stores as the cut's; it
  // returns at once. The writer thread then puts the cut's rows, before any row written after
  // the boundary, and begins every table's store checkpoint; FinishCut makes them durable. A host slot of the cut that
  // is about to change (an update, an eviction) first copies its cut value aside (copy on write), so the cut costs
  // memory only for the rows training changes while it is written; on CUDA the cut's rows are copied to the host at the
  // boundary. One cut at a time.
  void BeginCut() EXCLUDES(fetch_mu_, mu_);
  // Waits for the cut begun last and returns each table's store checkpoint (0: the store keeps
  // no numbered checkpoints); raises what failed (a full disk: the stores keep their previous
  // checkpoint, and the rows stay in memory until a write succeeds). `superseded`: a cut begun
  // next takes its place, and checkpoints every store again, so a failure of this one's store
  // checkpoints is not raised; rows it still cannot write are.
  std::vector<int64_t> FinishCut(bool superseded = false) EXCLUDES(mu_);
  // A cut was begun and not yet finished.
  bool CutPending() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return cut_.phase != CutPhase::kNone;
  }
  // The cut's rows are in the stores and every store has begun its checkpoint: rows written
  // after the boundary go to the stores again, while FinishCut has the checkpoints to finish.
  bool CutSealed() EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return cut_.phase == CutPhase::kSealed;
  }
  // Writes every dirty cached row to the store (after a cut being written, if any).
  void WriteBack() EXCLUDES(mu_);
  // Drains and writes back, then stops the applier.
  void Close() EXCLUDES(mu_);
  CacheStats Stats() EXCLUDES(mu_);
  std::vector<TableCounters> TableStats() EXCLUDES(mu_);
  int64_t num_tables() const { return static_cast<int64_t>(tables_.size()); }
  int64_t row_words() const { return row_words_; }
  int64_t weight_words() const { return weight_words_; }

 private:
  // Positions of `keys` held by the cache (with their slots) and the rest; marks the cached ones
  // dirty when the caller will write them.
  struct CacheSplit {
    std::vector<int64_t> cached_pos;
    std::vector<int32_t> cached_slots;
    std::vector<int64_t> missed_pos, missed_ids;
  };
  CacheSplit SplitByCache(const int64_t* keys, int64_t n, bool will_write) REQUIRES(mu_);
  // Raises (ValueError naming `what`) unless `t` is a contiguous 1-D int64 CPU tensor.
  static void CheckInt64Vector(const torch::Tensor& t, const char* what);
  // Calls f with a value of the C++ type of weight type t.
  template <typename F>
  static void DispatchWeightType(WeightType t, F&& f) {
    switch (t) {
      case WeightType::kFloat32: f(float{}); break;
      case WeightType::kFloat16: f(c10::Half{}); break;
      case WeightType::kBFloat16: f(c10::BFloat16{}); break;
      case WeightType::kFloat64: f(double{}); break;
    }
  }
  // Raises (ValueError) unless feature_counts (non-negative, `n` in all) and feature_tables
  // (tables of this cache) describe a batch of n values.
  void CheckFeatures(int64_t n, const std::vector<int64_t>& feature_counts,
                     const std::vector<int64_t>& feature_tables) const;
  // Reads full rows of keys not cached from their tables' stores (initial rows for ids
  // never written) into `out` [n, row_words] CPU; fresh[i] says row i was never written.
  void ReadFromStore(const int64_t* keys, size_t n, float* out, bool* fresh) const;
  // Rows of one table: its ids (keys without the table bits) and their positions in a batch.
  struct TableBatch {
    std::vector<int64_t> ids;
    std::vector<size_t> positions;
  };
  // `keys` split by table; empty when they all belong to table `*only` (set then).
  std::vector<TableBatch> SplitByTable(const int64_t* keys, size_t n, int64_t* only) const;
  // A slot given to a missed id, and what it held before (evicted_id -1: it was free).
  struct Admission {
    int32_t slot;
    int64_t evicted_id;
    uint8_t evicted_dirty;
  };
  // Slot for a missed id, or -1 when the policy keeps it out. May evict; the
  // caller writes evicted dirty rows back.
  int32_t Admit(int64_t id, uint8_t frequency, std::vector<Admission>* admissions) REQUIRES(mu_);
  // The steps of Fetch. A fetched batch: each key's slot (-1: not cached), the positions and keys of
  // its misses and, once read, their full rows.
  struct FetchedBatch {
    std::vector<int64_t> source;
    std::vector<int64_t> missed_pos, missed_ids;
    torch::Tensor missed_rows;  // [misses, row_words] float32 on the CPU
  };
  FetchedBatch FindCached(const int64_t* key, int64_t n) REQUIRES(mu_);
  void NoteStaleness(const int64_t* key, int64_t n) REQUIRES(mu_);  // the most updates a read row misses
  // Admits the misses the policy lets in (their slots into `source`), copies their rows in, and
  // stages those kept out for the batch's update.
  void AdmitMisses(FetchedBatch* batch) REQUIRES(mu_);
  void WriteEvictedBack(const std::vector<Admission>& admissions) REQUIRES(mu_);
  // The batch's weights [n, weight_words] on the device, from its slots and its rows kept out.
  torch::Tensor GatherOnHost(const FetchedBatch& batch) REQUIRES(mu_);
  torch::Tensor GatherOnDevice(FetchedBatch& batch) REQUIRES(mu_);
  void CopyRowsToSlots(const std::vector<int32_t>& slots, const torch::Tensor& rows) REQUIRES(mu_);
  torch::Tensor SlotRowsToHost(const std::vector<int32_t>& slots) REQUIRES(mu_);
  // Full rows of keys not cached: staged copies (taken), rows in the write-back buffer, and store
  // reads; with `lock` (holding mu_), the stores are read with it released.
  void ReadOutsideCache(const int64_t* keys, size_t n, float* out, MutexLock* lock) REQUIRES(mu_);
  void EndRead() REQUIRES(mu_);  // a store read without mu_ ended
  // Copies and unstages a staged row, counting a read-ahead hit when it was read ahead.
  bool TakeStaged(int64_t key, float* row) REQUIRES(mu_);

  // Starts the applier (CPU), the read-ahead thread and the writer; when one cannot start, stops
  // those started and raises.
  void StartThreads();
  // Stops and joins the threads that run (after Close, or when StartThreads failed).
  void StopThreads() EXCLUDES(mu_);

  // ---- updates and the applier (applier.cpp)
  void ApplierLoop() EXCLUDES(mu_);
  void Apply(const QueuedUpdate& u) REQUIRES(mu_);
  void ThrowIfFailed() REQUIRES(mu_);  // rethrows an error the applier met
  void UpdateHostRows(float* const* rows, const float* grads, int64_t n, const QueuedUpdate& u) const;
  // Rows not cached: read (staged, buffered or from the stores), updated with host gradient rows
  // `grads` [m, dim], and written back through the write-back buffer.
  void ApplyOutsideCache(const int64_t* keys, int64_t m, const float* grads, const QueuedUpdate& u) REQUIRES(mu_);
  // The table's optimizer at the update's learning rate.
  OptimizerSpec SpecOf(const QueuedUpdate& u) const {
    OptimizerSpec spec = opt_.optimizer;
    spec.lr = u.lr;
    return spec;
  }
  void AddPending(const int64_t* keys, int64_t n, int delta) REQUIRES(mu_);

  // ---- the device (device.cpp)
  // Device slots `slot_index` (int32 on the device; -1 skipped) updated with gradient rows
  // `grads` [n, dim] on the device by the update kernel.
  void UpdateSlotsOnDevice(const torch::Tensor& slot_index, const torch::Tensor& grads, const QueuedUpdate& u)
      REQUIRES(mu_);
  // Takes the device's dirty marks into slot_index_ (no-op on the CPU).
  void FoldDeviceDirty() REQUIRES(mu_);
  // Adds the hits the device counted (device_hits_) to table_stats_ (no-op on the CPU).
  void FoldDeviceHits() REQUIRES(mu_);

  // ---- write-back and the writer (write_back.cpp)
  // Every store write of the cache goes here: the rows wait in the write-back buffer, where reads
  // find them, until the writer thread has put them.
  void WriteBehind(const int64_t* keys, size_t n, const float* rows) REQUIRES(mu_);
  static constexpr size_t kWriteBatchRows = 4096;  // rows the writer puts per round
  void WriterLoop() EXCLUDES(mu_);
  // The writer's wait ends: it stops, or it has rows it may write (a cut's first).
  bool WriterWakes() const REQUIRES(mu_);
  // Waits until the write-back buffer is empty or a write failed.
  void WaitWritten(MutexLock& lock) REQUIRES(mu_);
  void ThrowIfWriteFailed(MutexLock& lock) REQUIRES(mu_);
  // Waits (releasing mu_) while the write-back buffer is over its limit.
  void WaitForWriteBackRoom(MutexLock& lock) REQUIRES(mu_);
  void CheckWriterNotPaused() const REQUIRES(mu_) {  // before waiting for the writer
    TORCH_CHECK(!writer_.paused, "the writer is paused with rows to write; this call would wait for it forever");
  }
  // Batched puts, one per table (no lock needed); landed[i] says row i reached its store. Every
  // table is written even when one fails; the first failure is returned.
  Status PutToStores(const int64_t* keys, size_t n, const float* rows, std::vector<uint8_t>* landed) const;
  void CountWrittenBack(const std::vector<int64_t>& keys) REQUIRES(mu_);
  // The dirty slots (device marks folded in) and their keys (appended to *keys), marked clean:
  // the caller takes their rows to the stores.
  std::vector<int32_t> TakeDirtySlots(std::vector<int64_t>* keys) REQUIRES(mu_);
  // The newest value of `key` on its way to the stores, or nullptr.
  const float* BufferedRow(int64_t key) const REQUIRES(mu_) {
    const float* row = write_back_.Find(key);
    return row ? row : cut_.rows.Find(key);
  }

  // ---- cuts (cut.cpp)
  // The writer's part of a cut: moves the next batch of cut slots into cut_.rows, or, once
  // every cut row is in its store, begins the stores' checkpoints (releasing mu_) and seals it.
  void WriteCut(MutexLock& lock) REQUIRES(mu_);
  // The sealed cut's store checkpoints made durable (mu_ released while the disk works).
  void FinishStoreCheckpoints(MutexLock& lock) REQUIRES(mu_);
  // Until the cut begun last is durable (finishing its stores' checkpoints if no other call is);
  // raises while the stores refuse its rows.
  void WaitCutDurable(MutexLock& lock) REQUIRES(mu_);
  // A cut slot about to change hands its cut value to cut_.rows.
  void PreserveCutRow(int32_t slot) REQUIRES(mu_) {
    if (cut_.marked.empty() || !cut_.marked[slot]) return;
    cut_.rows.Put(slot_index_.key(slot), host_slots_ + static_cast<int64_t>(slot) * row_words_);
    cut_.marked[slot] = 0;
  }

  // ---- read-ahead (read_ahead.cpp)
  void ReadAheadLoop() EXCLUDES(mu_);
  // One request: its rows read from the stores (without mu_), then placed into slots or staged, and
  // its batch settled.
  void RunReadAhead(const ReadAheadRequest& request) EXCLUDES(fetch_mu_, mu_);
  // Stages the rows a request read (`read_ok`: else it failed, and only lets its keys go) that it
  // still holds and that nothing newer has replaced.
  void StageReadAhead(const ReadAheadRequest& request, const std::vector<float>& rows, bool read_ok) REQUIRES(mu_);
  // ReadAhead, with the batch the keys are of (or none); returns the read-ahead's sequence number.
  int32_t QueueReadAhead(const torch::Tensor& keys, uint64_t fingerprint, std::shared_ptr<BatchReadAhead> batch)
      EXCLUDES(mu_);
  // Finds the slots of `batch`'s keys its request placed (or a request before it), each pinned for
  // read-ahead `sequence`, and marks it settled; complete once its slot list is made (no memory for
  // the list: not complete, and its lookup fetches). Raises nothing.
  void SettleReadAhead(BatchReadAhead* batch, int32_t sequence) REQUIRES(mu_);
#ifdef MLKV_WITH_CUDA
  // After a fetch of the distinct `unique` (on the device) of a device lookup: their slots, the
  // index version they belong to and how many are not cached (one synchronisation: the count).
  std::tuple<torch::Tensor, int64_t, int64_t> SlotsAfterFetch(const torch::Tensor& unique) EXCLUDES(mu_);
#endif
  // The rows a request read (`rows`, in its order) into reserved slots: victims out through the
  // write-back buffer, rows in through transfer_, each slot published once its row landed. Holds
  // fetch_mu_ while it evicts and publishes, so no lookup between finding its slots and gathering
  // them loses one, and no fetch between finding its misses and admitting them sees one cached.
  void PlaceReadAhead(const ReadAheadRequest& request, const std::vector<float>& rows) EXCLUDES(fetch_mu_, mu_);
  // Its steps. A placement: the slots reserved and the keys and rows (`incoming`) they take; the
  // rows evicted from them; `row`, room for one row.
  struct Placement {
    std::vector<int32_t> slots, victim_slots;
    std::vector<int64_t> keys, victim_keys;
    std::vector<uint8_t> victim_dirty;
    std::vector<float> incoming, row;
  };
  void WaitForPlacementRoom(MutexLock& lock) REQUIRES(mu_);
  // Reserves a slot for `key` (`read`: its row as the request read it), evicting an unpinned row.
  void ReserveSlotFor(int64_t key, const float* read, Placement* placement) REQUIRES(mu_);
  void WriteVictimsBack(const Placement& placement) REQUIRES(mu_);
  void PublishPlaced(const Placement& placement) EXCLUDES(fetch_mu_, mu_);  // and ends the read
  // The lookup of a batch takes the oldest read-ahead not taken, and the batch before it is done
  // with its rows (their pins released). Returns the read-ahead's sequence when its fingerprint is
  // `fingerprint` (its slots are pinned until this batch's update), else 0.
  int32_t TakeReadAhead(std::optional<uint64_t> fingerprint) REQUIRES(mu_);
  // The steps of LookupReadAhead: the read-ahead of `ticket` taken (checked against the batch's
  // features), its sequence and whether it was settled then; its rows gathered from its slots.
  std::shared_ptr<BatchReadAhead> TakeNamedReadAhead(int64_t ticket, const std::vector<int64_t>& feature_counts,
                                                     const std::vector<int64_t>& feature_tables, int32_t* sequence,
                                                     bool* settled) EXCLUDES(mu_);
  DeviceLookup GatherReadAhead(const BatchReadAhead& batch, int32_t sequence) REQUIRES(mu_);
  // Waits (without mu_) until no read-ahead in flight covers one of `keys`.
  void WaitForReadAheads(const int64_t* keys, int64_t n) EXCLUDES(mu_);

  const std::vector<CacheTable> tables_;
  const CacheOptions opt_;
  const torch::Device device_;
  const bool on_host_;  // the slots are in host memory
  const int64_t weight_words_, row_words_;

  // The locks, in the order a thread takes them (one that holds a lock takes only those after it):
  //   fetch_mu_            one fetch (or a call that must see no admission meanwhile) at a time;
  //   mu_                  the slots and everything below that says GUARDED_BY(mu_): the index, the
  //                        policy, the staging area, the write-back buffer and the state of the writer
  //                        (WriterState), the cut (CutState) and the read-aheads (ReadAheadState), which
  //                        change together with the slots; the applier holds it while it applies, the
  //                        writer and the read-ahead thread between their store I/O, done without it;
  //   read_ahead_queue_'s  the read-ahead requests (queued under mu_, so they arrive in order);
  // and leaves held with no other: update_queue_'s (the updates the applier applies) and transfer_'s
  // (copies into slots).
  // Condition variables wait in a loop on the guarded condition: while (!cond) cv.wait(lock.native()).
  Mutex fetch_mu_ ACQUIRED_BEFORE(mu_);
  Mutex mu_;

  torch::Tensor slots_ GUARDED_BY(mu_);             // [capacity, row_words] float32 on device_
  float* host_slots_ PT_GUARDED_BY(mu_) = nullptr;  // slots_ data when on the CPU
  SlotIndex slot_index_ GUARDED_BY(mu_);
  AdmissionPolicy policy_ GUARDED_BY(mu_);
#ifdef MLKV_WITH_CUDA
  // slot_index_'s map in device memory (CUDA): its copy changes under mu_ (Sync); keying a batch
  // and making counters need no lock.
  std::unique_ptr<DeviceIndex> device_index_;
#endif
  torch::Tensor slot_dirty_dev_ GUARDED_BY(mu_);  // uint8 [capacity] on the device: slots the update kernel wrote
  torch::Tensor device_hits_ GUARDED_BY(mu_);  // DeviceIndex counters: [2 + t] hits of table t by device-only lookups
  IdMap pending_ GUARDED_BY(mu_);  // id -> updates queued and not applied (staleness > 0 only)
  CacheStats stats_ GUARDED_BY(mu_);
  std::vector<TableCounters> table_stats_ GUARDED_BY(mu_);  // cached_rows kept current; the rest count up
  Status failed_ GUARDED_BY(mu_);  // the first error the applier met; every later call raises it
  bool closed_ GUARDED_BY(mu_) = false;
  // Store reads running without mu_ (fetches' and the read-ahead thread's), and the keys whose
  // writes completed meanwhile: those reads may hold older values.
  int64_t reads_in_flight_ GUARDED_BY(mu_) = 0;
  IdMap written_during_reads_ GUARDED_BY(mu_);

  // Read-ahead: rows read from the stores and not cached wait in the staging area until a fetch or
  // an update takes them; the thread takes requests from its queue.
  StagingArea staging_ GUARDED_BY(mu_);
  ReadAheadState read_aheads_ GUARDED_BY(mu_);
  ReadAheadQueue read_ahead_queue_;
  std::unique_ptr<SlotTransfer> transfer_;  // moves rows into slots for PlaceReadAhead (read_ahead_into_slots)
  std::thread read_ahead_thread_;

  // Write-back: every store write waits in the buffer until the writer has put it.
  WriteBackBuffer write_back_ GUARDED_BY(mu_);
  WriterState writer_ GUARDED_BY(mu_);
  CutState cut_ GUARDED_BY(mu_);
  std::condition_variable writer_cv_, written_cv_;  // with mu_
  std::thread writer_thread_;

  // Updates (CPU): applied in order by the applier.
  UpdateQueue update_queue_;
  std::thread applier_;
};

}  // namespace mlkv
