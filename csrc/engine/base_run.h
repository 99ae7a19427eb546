// BaseRun: rows sorted by key in an immutable file, found by one block read and no per-row memory.
//
// The store's cold tier (docs/design.md, "Memory the budget bounds"): the hybrid log keeps an
// in-memory index of only the keys it holds, and every other row lives here, in blocks of 4 KiB (or
// the multiple of 4 KiB one row needs). The file keeps the first key of each block (its fence), and
// a reader holds those in memory: 8 bytes a block, a few hundredths of a byte a row. A key's block is
// the last whose fence is not above it, so a row not in the log costs exactly one disk read. A run is
// written once, front to back, by BaseRunWriter (a merge streams the old run and the log's rows into
// a new one) and never changes after: a checkpoint names the run it needs, and a crash leaves only
// files that are whole or unnamed.
//
// A young run (an overlay, BaseRuns) also holds the keys deleted since the runs under it were
// written, and a Bloom filter of its rows' keys, both kept in memory: a key it does not hold costs
// no read but one in a hundred.
//
// Layout (little-endian; docs/format.md):
//   block i, at i * block_bytes: BaseBlockHeader, then `count` rows of (int64 key, value bytes) in
//     increasing key order, zeros after them; (format 3) the block's last 4 * rows_per_block bytes
//     a CRC-32C per row;
//   the fence section, at fence_offset: one int64 per block, the first key of each; then a bitmap
//     (uint64 words) of the blocks whose keys run without a gap to the next block's first key (to
//     the run's last key for the last block); then the last key (int64); then (format 2) the
//     deleted keys (uint64 count, int64 keys in increasing order) and the filter (uint64 hashes, 0
//     for none; uint64 words; the words);
//   BaseRunTrailer, the file's last 64 bytes.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "file_io.h"
#include "io_reader.h"
#include "read_rounds.h"
#include "status.h"

namespace mlkv {

class BaseLookup;

struct BaseBlockHeader {
  uint32_t crc;          // CRC-32C of the block's bytes after this field
  uint32_t count;        // rows in the block
  uint64_t block_index;  // where the block belongs: a block read from the wrong place fails
};
static_assert(sizeof(BaseBlockHeader) == 16, "a base block header is 16 bytes");

struct BaseRunTrailer {
  char magic[8];
  uint32_t format_version;
  uint32_t value_bytes;
  uint64_t generation;  // the run's number (the store's base-<generation>.run): a file put in another's place fails
  uint64_t block_bytes;
  uint64_t rows;
  uint64_t blocks;
  uint64_t fence_offset;
  uint32_t fence_crc;  // CRC-32C of the fence section
  uint32_t crc;        // CRC-32C of every byte before this field
};
static_assert(sizeof(BaseRunTrailer) == 64, "a base run trailer is 64 bytes");
constexpr char kBaseRunMagic[8] = {'M', 'L', 'K', 'V', 'B', 'A', 'S', 'E'};

// How a run's Bloom filter is sized: `keys` keys at `bits_per_key` (none when either is 0).
struct FilterSize {
  uint64_t keys = 0;
  uint64_t bits_per_key = 10;
};

// A Bloom filter of keys: at 10 bits and 7 probes a key, about one false yes in 120; at fewer
// bits, fewer probes (bits x ln 2) and more false yeses (5 bits: one in 10).
class BloomFilter {
 public:
  static constexpr uint64_t kBitsPerKey = 10;  // the most a filter takes

  BloomFilter() = default;
  explicit BloomFilter(const FilterSize& size);
  // From a file's words; an empty filter (no words) answers yes to every key.
  BloomFilter(uint64_t hashes, std::vector<uint64_t> words) : hashes_(hashes), words_(std::move(words)) {}

  void Add(int64_t key);
  bool MayHold(int64_t key) const;
  bool empty() const { return words_.empty(); }
  uint64_t hashes() const { return hashes_; }
  const std::vector<uint64_t>& words() const { return words_; }

 private:
  uint64_t hashes_ = 0;
  std::vector<uint64_t> words_;
};

// The run format BaseRunWriter writes; BaseRun reads 1 to this.
constexpr uint32_t kBaseRunFormat = 3;

// Where a block's parts lie, by the run's format. From format 3 a block ends with a CRC-32C of each
// row (its block index, key and value), so a lookup checks the row it takes instead of the whole
// block: the block comes from the disk by DMA, and checking all of it reads 4 KiB from memory for
// one row.
struct BaseBlockLayout {
  // Rows of `value_bytes`: blocks of 4 KiB, or the multiple of it that holds one row.
  BaseBlockLayout(uint32_t value_bytes, uint32_t format_version);
  uint64_t block_bytes, rows_per_block;
  bool row_checksums;
  uint64_t row_bytes() const { return sizeof(int64_t) + value_bytes; }
  uint64_t row_crc_offset() const { return block_bytes - rows_per_block * sizeof(uint32_t); }

 private:
  uint32_t value_bytes;
};

// Writes a run front to back. Rows and deletions go in strictly increasing key order; nothing is a
// run until Finish has written the fences and trailer and synced the file.
class BaseRunWriter {
 public:
  // Creates (truncates) `path` for run number `generation`. `filter`: its Bloom filter's size (for
  // the most rows it will hold); a run whose blocks all run without a gap keeps none (its fences
  // tell every key).
  // `format_version`: kBaseRunFormat, or 2 (what builds before per-row checksums wrote).
  static Status Create(const std::string& path, uint32_t value_bytes, uint64_t generation, const FilterSize& filter,
                       std::unique_ptr<BaseRunWriter>* out, uint32_t format_version = kBaseRunFormat);
  ~BaseRunWriter();
  BaseRunWriter(const BaseRunWriter&) = delete;
  BaseRunWriter& operator=(const BaseRunWriter&) = delete;

  // InvalidArgument when `key` is not above the last row's or deletion's.
  Status Add(int64_t key, const uint8_t* value);
  // The key is deleted: a run under this one may hold it, and no longer does.
  Status AddDeletion(int64_t key);
  // The fences and trailer written, the file synced and closed.
  Status Finish();
  uint64_t rows() const { return rows_; }
  // Rows and deletions.
  uint64_t entries() const { return rows_ + deletions_.size(); }

 private:
  BaseRunWriter(std::string path, int fd, uint32_t value_bytes, uint64_t generation, const FilterSize& filter,
                uint32_t format_version);
  bool AllGapless() const;  // every block sealed so far runs without a gap
  Status CheckOrder(int64_t key) const;
  Status SealBlock();   // the block being filled: its header, into the write buffer
  void MarkGapless(bool gapless);  // the bit of the block before the last fence
  Status WriteBuffer();  // the buffer's whole blocks, to the file

  const std::string path_;
  int fd_;
  const uint32_t value_bytes_, format_version_;
  const uint64_t generation_;
  const BaseBlockLayout layout_;
  std::vector<uint8_t> buffer_;  // whole blocks not yet written, then the one being filled
  uint64_t buffered_blocks_ = 0, written_blocks_ = 0, rows_in_block_ = 0, rows_ = 0;
  std::vector<int64_t> fences_;
  std::vector<uint64_t> gapless_;  // the bitmap of blocks whose keys run without a gap
  bool block_gapless_ = true;      // the block being filled, so far
  int64_t last_key_ = -1;          // the last row's
  int64_t last_entry_ = -1;        // the last row's or deletion's
  std::vector<int64_t> deletions_;
  BloomFilter filter_;
  bool finished_ = false;
};

class BaseRun {
 public:
  // Opens run number `generation` at `path`, reading its trailer and fences (the file is checked
  // against them); Corruption naming the file when they are damaged or it is another run,
  // InvalidArgument when its rows are not `value_bytes` wide. `direct_io`: lookups read with
  // O_DIRECT where the file system allows it.
  static Status Open(const std::string& path, uint32_t value_bytes, uint64_t generation, bool direct_io,
                     std::unique_ptr<BaseRun>* out);
  ~BaseRun();
  BaseRun(const BaseRun&) = delete;
  BaseRun& operator=(const BaseRun&) = delete;

  // Fills the value of each key the run holds at out + i * value_bytes and sets found[i]; a block
  // holding several of the keys is read once. Adds the blocks read to *blocks_read (when given).
  // Corruption naming the file and block for a block that fails its checksum or is misplaced.
  Status Lookup(const int64_t* keys, size_t n, uint8_t* out, bool* found, BlockReader* reader,
                uint64_t* blocks_read = nullptr) const;

  // Appends the rows of the blocks from `first` on, as many as one sequential read of a few MiB
  // takes, to `keys` and `values` (in key order); *next is the block after them (blocks() at the end).
  Status ReadBlocks(uint64_t first, std::vector<int64_t>* keys, std::vector<uint8_t>* values, uint64_t* next) const;

  // Reads the run front to back, ReadBlocks after ReadBlocks.
  class Cursor {
   public:
    explicit Cursor(const BaseRun& run) : run_(run) {}
    // Status and, in *more, whether rows were appended.
    Status Next(std::vector<int64_t>* keys, std::vector<uint8_t>* values, bool* more) {
      *more = next_block_ < run_.blocks();
      return *more ? run_.ReadBlocks(next_block_, keys, values, &next_block_) : Status::OK();
    }

   private:
    const BaseRun& run_;
    uint64_t next_block_ = 0;
  };

  // Whether the run holds a row of `key`, where memory alone tells: kAbsent outside its keys'
  // range or where the filter says no, kPresent in a block whose keys run without a gap (a table's
  // rows written in full), else kMaybe.
  enum class Presence { kAbsent, kPresent, kMaybe };
  Presence PresenceOf(int64_t key) const;
  // Whether the run deletes `key` (an overlay's deletion of a row under it).
  bool Deletes(int64_t key) const { return std::binary_search(deletions_.begin(), deletions_.end(), key); }
  // Appends the rows with keys in [lo, hi) to `keys` and `values`, in key order.
  Status ReadKeyRange(int64_t lo, int64_t hi, std::vector<int64_t>* keys, std::vector<uint8_t>* values) const;
  const std::vector<int64_t>& deletions() const { return deletions_; }

  uint64_t rows() const { return rows_; }
  uint64_t entries() const { return rows_ + deletions_.size(); }  // rows and deletions
  uint64_t blocks() const { return fences_.size(); }
  int64_t first_key() const { return fences_.empty() ? -1 : fences_[0]; }
  int64_t fence(uint64_t block) const { return fences_[block]; }
  int64_t last_key() const { return last_key_; }
  uint64_t file_bytes() const { return file_bytes_; }
  uint32_t value_bytes() const { return value_bytes_; }
  // What a reader holds in memory: the fences, the bitmap, the deletions and the filter.
  uint64_t memory_bytes() const {
    return fences_.capacity() * sizeof(int64_t) + gapless_.capacity() * sizeof(uint64_t) +
           deletions_.capacity() * sizeof(int64_t) + filter_.words().capacity() * sizeof(uint64_t);
  }
  const std::string& path() const { return path_; }

 private:
  BaseRun(std::string path, int fd, uint32_t value_bytes);
  // Checks block `index`'s checksum and place, in `data`; sets *count.
  Status CheckBlock(const uint8_t* data, uint64_t index, uint32_t* count) const;
  // Block `index`'s row count where its header tells it in range and the block is in its place;
  // 0 where not (its checksum then says whether the block is damaged).
  uint32_t UncheckedCount(const uint8_t* data, uint64_t index) const;
  // Whether row `row` of block `index` (format 3) matches its checksum.
  bool RowIntact(const uint8_t* block, uint64_t index, uint32_t row) const;
  // Sets found[i] and out + i * value_bytes for each keys[i] (i of `indexes`) that the block `req`
  // read holds.
  Status FindInBlock(const ReadRequest& req, const int64_t* keys, const size_t* indexes, size_t count, uint8_t* out,
                     bool* found) const;
  friend class BaseLookup;
  // Reads the fence section's bytes (after the trailer's checks) into the reader's memory.
  Status ParseFenceSection(const std::vector<uint8_t>& section, uint64_t blocks, uint32_t format_version);
  // Appends the rows of blocks [first, first + blocks) to `keys` and `values`.
  Status AppendBlocks(uint64_t first, uint64_t blocks, std::vector<int64_t>* keys, std::vector<uint8_t>* values) const;
  // The block that would hold `key`, or -1 when the key is below the first row.
  int64_t BlockOf(int64_t key) const;

  const std::string path_;
  int fd_;
  const uint32_t value_bytes_;
  BaseBlockLayout layout_;  // by the file's format
  uint64_t rows_ = 0, file_bytes_ = 0;
  std::vector<int64_t> fences_;
  std::vector<uint64_t> gapless_;
  int64_t last_key_ = -1;
  std::vector<int64_t> deletions_;
  BloomFilter filter_;
};

// What a base manifest (base-<generation>.runs) names: its runs and its count of rows.
struct BaseManifest {
  std::vector<uint64_t> runs;      // the bottom: runs with disjoint key ranges, in key order
  std::vector<uint64_t> overlays;  // young runs over it, oldest first
  uint64_t rows = 0;               // the live rows of the whole base

  // The run numbers of the bottom, then the overlays'.
  std::vector<uint64_t> all_ids() const {
    std::vector<uint64_t> ids = runs;
    ids.insert(ids.end(), overlays.begin(), overlays.end());
    return ids;
  }
};

// The base of a store: a bottom of runs with disjoint key ranges, in key order, and overlays on it,
// young runs of the rows (and deletions) merges moved since the bottom was written, each newer
// than the ones before it. A merge whose rows all lie past the bottom's keys (a table written in
// key order) adds a run to the bottom and rewrites none; another adds an overlay, whose Bloom
// filter spares reads, until the overlays hold a share of the rows and a merge rewrites them all
// into one bottom run.
class BaseRuns {
 public:
  BaseRuns(std::vector<std::shared_ptr<const BaseRun>> runs, std::vector<std::shared_ptr<const BaseRun>> overlays,
           BaseManifest manifest);

  BaseRun::Presence PresenceOf(int64_t key) const;
  // As BaseRun::Lookup, over the runs: an overlay's row or deletion hides the ones under it.
  Status Lookup(const int64_t* keys, size_t n, uint8_t* out, bool* found, BlockReader* reader,
                uint64_t* blocks_read) const;
  // The same lookup, its reads in rounds it may share with others (RunReadRounds).
  std::unique_ptr<BaseLookup> StartLookup(const int64_t* keys, size_t n, uint8_t* out, bool* found,
                                          BlockReader* reader) const;
  // The live rows of the bottom's blocks from `first` on, as many as one sequential read of a few
  // MiB takes, with the overlays' rows and deletions of the keys between those blocks' fences (the
  // first block's from the lowest key, the last's to the highest); *next is the block after them.
  Status ReadBlocks(uint64_t first, std::vector<int64_t>* keys, std::vector<uint8_t>* values, uint64_t* next) const;

  const std::vector<std::shared_ptr<const BaseRun>>& runs() const { return runs_; }
  const std::vector<std::shared_ptr<const BaseRun>>& overlays() const { return overlays_; }
  const BaseManifest& manifest() const { return manifest_; }
  std::vector<uint64_t> all_ids() const { return manifest_.all_ids(); }
  uint64_t rows() const { return manifest_.rows; }
  uint64_t bottom_rows() const;
  uint64_t overlay_entries() const;  // rows and deletions
  uint64_t blocks() const;           // the bottom's
  uint64_t memory_bytes() const;
  uint64_t file_bytes() const;
  int64_t last_key() const { return runs_.empty() ? -1 : runs_.back()->last_key(); }

 private:
  BaseRun::Presence BottomPresenceOf(int64_t key) const;
  // The first key of the bottom's block `block` (counted across its runs).
  int64_t FenceOf(uint64_t block) const;

  std::vector<std::shared_ptr<const BaseRun>> runs_, overlays_;
  BaseManifest manifest_;
};

// A lookup in a base's runs (the bottom's, in key order, and overlays, oldest first), in read rounds:
// each key asks one run a round, the newest overlay (below those it asked) that may hold it, unless
// a newer one deletes it, else the bottom's run of its range; a key an overlay's filter let through
// that the overlay does not hold (one in a hundred) asks again the next round. Fills out +
// i * value_bytes and sets found[i] for each key the base holds. The runs outlive the lookup.
class BaseLookup : public RoundedLookup {
 public:
  BaseLookup(std::vector<const BaseRun*> bottom, std::vector<const BaseRun*> overlays, const int64_t* keys, size_t n,
             uint8_t* out, bool* found, BlockReader* reader);
  Status Next(const ReadRequest* results, size_t n, size_t room, std::vector<ReadRequest>* wants, bool* done) override;
  BlockReader* reader() const override { return reader_; }
  uint64_t blocks_read() const { return blocks_read_; }

 private:
  struct Want {
    size_t run;  // in runs_: overlays first, newest first, then the bottom's
    int64_t block;
    size_t index;  // of the key
  };
  // The keys in left_ to the run each asks next (wants_, in run and block order); clears left_.
  void Route();
  // Takes the results of the blocks asked last round: rows found, keys to ask again (left_).
  Status TakeResults(const ReadRequest* results, size_t n);

  const std::vector<const BaseRun*> bottom_;
  std::vector<const BaseRun*> runs_;  // the overlays, newest first, then the bottom's
  const size_t overlays_;
  const int64_t* keys_;
  uint8_t* out_;
  bool* found_;
  BlockReader* reader_;
  std::vector<size_t> left_;    // keys to route
  std::vector<size_t> from_;    // per key: the first overlay (in runs_) it has yet to ask
  std::vector<Want> wants_;     // this route's reads
  size_t next_want_ = 0;        // the first not yet asked
  std::vector<size_t> first_want_;  // per block asked last round: its first want; then the end
  std::unique_ptr<AlignedBuffer> buffer_;
  uint64_t blocks_read_ = 0;
};

// base-<generation>.runs: what a base is made of, checked by a checksum. A manifest of format 1
// (no overlays, no count) reads with rows = kRowsUncounted.
constexpr uint64_t kRowsUncounted = ~0ull;
Status WriteBaseManifest(const std::string& path, uint64_t generation, const BaseManifest& manifest);
Status ReadBaseManifest(const std::string& path, uint64_t generation, BaseManifest* manifest);

}  // namespace mlkv
