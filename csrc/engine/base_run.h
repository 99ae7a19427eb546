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
// Layout (little-endian; docs/format.md):
//   block i, at i * block_bytes: BaseBlockHeader, then `count` rows of (int64 key, value bytes) in
//     increasing key order, zeros after them;
//   the fence section, at fence_offset: one int64 per block, the first key of each; then a bitmap
//     (uint64 words) of the blocks whose keys run without a gap to the next block's first key (to
//     the run's last key for the last block); then the last key (int64);
//   BaseRunTrailer, the file's last 64 bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "file_io.h"
#include "io_reader.h"
#include "status.h"

namespace mlkv {

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

// The block size rows of `value_bytes` take: 4 KiB, or the multiple of it that holds one row.
uint64_t BaseBlockBytes(uint32_t value_bytes);

// Writes a run front to back. Rows go in strictly increasing key order; nothing is a run until
// Finish has written the fences and trailer and synced the file.
class BaseRunWriter {
 public:
  // Creates (truncates) `path` for run number `generation`.
  static Status Create(const std::string& path, uint32_t value_bytes, uint64_t generation,
                       std::unique_ptr<BaseRunWriter>* out);
  ~BaseRunWriter();
  BaseRunWriter(const BaseRunWriter&) = delete;
  BaseRunWriter& operator=(const BaseRunWriter&) = delete;

  // InvalidArgument when `key` is not above the last row's.
  Status Add(int64_t key, const uint8_t* value);
  // The fences and trailer written, the file synced and closed.
  Status Finish();
  uint64_t rows() const { return rows_; }

 private:
  BaseRunWriter(std::string path, int fd, uint32_t value_bytes, uint64_t generation);
  Status SealBlock();   // the block being filled: its header, into the write buffer
  void MarkGapless(bool gapless);  // the bit of the block before the last fence
  Status WriteBuffer();  // the buffer's whole blocks, to the file

  const std::string path_;
  int fd_;
  const uint32_t value_bytes_;
  const uint64_t generation_, block_bytes_, rows_per_block_;
  std::vector<uint8_t> buffer_;  // whole blocks not yet written, then the one being filled
  uint64_t buffered_blocks_ = 0, written_blocks_ = 0, rows_in_block_ = 0, rows_ = 0;
  std::vector<int64_t> fences_;
  std::vector<uint64_t> gapless_;  // the bitmap of blocks whose keys run without a gap
  bool block_gapless_ = true;      // the block being filled, so far
  int64_t last_key_ = -1;
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

  // Whether the run holds `key`, where the fences alone tell: kAbsent outside its keys' range,
  // kPresent in a block whose keys run without a gap (a table's rows written in full), else kMaybe.
  enum class Presence { kAbsent, kPresent, kMaybe };
  Presence PresenceOf(int64_t key) const;

  uint64_t rows() const { return rows_; }
  uint64_t blocks() const { return fences_.size(); }
  int64_t first_key() const { return fences_.empty() ? -1 : fences_[0]; }
  int64_t last_key() const { return last_key_; }
  uint64_t file_bytes() const { return file_bytes_; }
  uint32_t value_bytes() const { return value_bytes_; }
  // What a reader holds in memory: the fences and the bitmap.
  uint64_t memory_bytes() const {
    return fences_.capacity() * sizeof(int64_t) + gapless_.capacity() * sizeof(uint64_t);
  }
  const std::string& path() const { return path_; }

 private:
  BaseRun(std::string path, int fd, uint32_t value_bytes);
  // Checks block `index`'s checksum and place, in `data`; sets *count.
  Status CheckBlock(const uint8_t* data, uint64_t index, uint32_t* count) const;
  // The block that would hold `key`, or -1 when the key is below the first row.
  int64_t BlockOf(int64_t key) const;

  const std::string path_;
  int fd_;
  const uint32_t value_bytes_;
  uint64_t block_bytes_ = 0, rows_ = 0, file_bytes_ = 0;
  std::vector<int64_t> fences_;
  std::vector<uint64_t> gapless_;
  int64_t last_key_ = -1;
};

// The base of a store: runs with disjoint key ranges, in key order, named by a manifest
// (base-<generation>.runs: the run numbers). A merge whose rows all lie past the last run's keys (a
// table written in key order) adds a run and rewrites none.
class BaseRuns {
 public:
  BaseRuns(std::vector<std::shared_ptr<const BaseRun>> runs, std::vector<uint64_t> ids);

  BaseRun::Presence PresenceOf(int64_t key) const;
  // As BaseRun::Lookup, over the runs.
  Status Lookup(const int64_t* keys, size_t n, uint8_t* out, bool* found, BlockReader* reader,
                uint64_t* blocks_read) const;
  // As BaseRun::ReadBlocks, over the runs' blocks numbered one after another.
  Status ReadBlocks(uint64_t first, std::vector<int64_t>* keys, std::vector<uint8_t>* values, uint64_t* next) const;

  const std::vector<std::shared_ptr<const BaseRun>>& runs() const { return runs_; }
  const std::vector<uint64_t>& ids() const { return ids_; }
  uint64_t rows() const;
  uint64_t blocks() const;
  uint64_t memory_bytes() const;
  uint64_t file_bytes() const;
  int64_t last_key() const { return runs_.empty() ? -1 : runs_.back()->last_key(); }

 private:
  // The run that would hold `key` (-1: below the first run's keys).
  int64_t RunOf(int64_t key) const;

  std::vector<std::shared_ptr<const BaseRun>> runs_;
  std::vector<uint64_t> ids_;
};

// base-<generation>.runs: the run numbers of a base, checked by a checksum.
Status WriteBaseManifest(const std::string& path, uint64_t generation, const std::vector<uint64_t>& ids);
Status ReadBaseManifest(const std::string& path, uint64_t generation, std::vector<uint64_t>* ids);

}  // namespace mlkv
