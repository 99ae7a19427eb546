#include "base_run.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "crc32c.h"

namespace mlkv {
namespace {

// Format 1: no deletions or filter (read as none); 2: no per-row checksums.
constexpr uint32_t kManifestVersion = 2;  // 1: runs alone, no overlays or count
constexpr uint64_t kFilterHashes = 7;  // the best for 10 bits a key: ln 2 * 10
constexpr uint64_t kWriteBufferBytes = 1ull << 20;  // blocks written at once
constexpr uint64_t kCursorReadBytes = 4ull << 20;   // one sequential read of a cursor
constexpr size_t kMaxBlocksPerRound = 4096;         // bounds a lookup's read buffer

uint32_t BlockCrc(const uint8_t* block, uint64_t block_bytes) {
  return Crc32c(0, block + sizeof(uint32_t), block_bytes - sizeof(uint32_t));
}

// A row's checksum binds it to its block: a row read from the wrong place fails.
uint32_t RowCrc(uint64_t block_index, const uint8_t* row, uint64_t row_bytes) {
  return Crc32c(Crc32c(0, &block_index, sizeof(block_index)), row, row_bytes);
}

uint64_t BitmapWords(uint64_t blocks) { return (blocks + 63) / 64; }

uint64_t FenceSectionBytes(uint64_t blocks) {
  return blocks * sizeof(int64_t) + BitmapWords(blocks) * sizeof(uint64_t) + sizeof(int64_t);
}

// The fences, the gapless bitmap and the last key, as the file holds them.
std::vector<uint8_t> FenceSection(const std::vector<int64_t>& fences, const std::vector<uint64_t>& gapless,
                                  int64_t last_key) {
  std::vector<uint8_t> bytes(FenceSectionBytes(fences.size()));
  uint8_t* p = bytes.data();
  if (!fences.empty()) {  // (memcpy of an empty vector's null data is undefined)
    std::memcpy(p, fences.data(), fences.size() * sizeof(int64_t));
    std::memcpy(p + fences.size() * sizeof(int64_t), gapless.data(), gapless.size() * sizeof(uint64_t));
  }
  p += fences.size() * sizeof(int64_t) + BitmapWords(fences.size()) * sizeof(uint64_t);
  std::memcpy(p, &last_key, sizeof(last_key));
  return bytes;
}

// splitmix64's finalizer: keys that differ in one bit land on unrelated filter bits.
uint64_t MixKey(int64_t key) {
  uint64_t z = static_cast<uint64_t>(key) + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

template <typename Bytes>
void AppendBytes(Bytes* bytes, const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  bytes->insert(bytes->end(), p, p + n);
}

// The run of `runs` (in key order) whose keys' range would hold `key`: -1 below the first run's.
template <typename Runs>
int64_t RunHolding(const Runs& runs, int64_t key) {
  auto it =
      std::upper_bound(runs.begin(), runs.end(), key, [](int64_t k, const auto& run) { return k < run->first_key(); });
  return static_cast<int64_t>(it - runs.begin()) - 1;
}

std::string BlockPlace(const std::string& path, uint64_t index, uint64_t block_bytes) {
  return path + ": block " + std::to_string(index) + " at byte offset " + std::to_string(index * block_bytes);
}

}  // namespace

BloomFilter::BloomFilter(const FilterSize& size)
    : hashes_(std::clamp<uint64_t>((size.bits_per_key * 69 + 50) / 100, 1, kFilterHashes)),
      words_(std::max<uint64_t>(1, (size.keys * std::min(size.bits_per_key, kBitsPerKey) + 63) / 64), 0) {}

// Double hashing: probe i is h + i * step, about as few false yeses as independent hashes (Kirsch and
// Mitzenmacher).
void BloomFilter::Add(int64_t key) {
  const uint64_t h = MixKey(key), bits = words_.size() * 64, step = 1 + (h >> 32) % (bits - 1);
  for (uint64_t i = 0, bit = h % bits; i < hashes_; ++i, bit = (bit + step) % bits)
    words_[bit / 64] |= 1ull << (bit % 64);
}

bool BloomFilter::MayHold(int64_t key) const {
  if (words_.empty()) return true;
  const uint64_t h = MixKey(key), bits = words_.size() * 64, step = 1 + (h >> 32) % (bits - 1);
  for (uint64_t i = 0, bit = h % bits; i < hashes_; ++i, bit = (bit + step) % bits) {
    if (!((words_[bit / 64] >> (bit % 64)) & 1)) return false;
  }
  return true;
}

BaseBlockLayout::BaseBlockLayout(uint32_t value_bytes, uint32_t format_version)
    : row_checksums(format_version >= 3), value_bytes(value_bytes) {
  const uint64_t row_cost = row_bytes() + (row_checksums ? sizeof(uint32_t) : 0);
  block_bytes = RoundUp(sizeof(BaseBlockHeader) + row_cost, kBlockBytes);
  rows_per_block = (block_bytes - sizeof(BaseBlockHeader)) / row_cost;
}

// ---- writing ---------------------------------------------------------------------------------------

Status BaseRunWriter::Create(const std::string& path, uint32_t value_bytes, uint64_t generation,
                             const FilterSize& filter, std::unique_ptr<BaseRunWriter>* out, uint32_t format_version) {
  if (value_bytes == 0) return Status::InvalidArgument("a base run's rows need at least one byte");
  if (format_version != 2 && format_version != kBaseRunFormat) {
    return Status::InvalidArgument("base run " + path + ": this build writes formats 2 and " +
                                   std::to_string(kBaseRunFormat) + ", not " + std::to_string(format_version));
  }
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("creating " + path + ": " + ErrnoText(errno));
  out->reset(new BaseRunWriter(path, fd, value_bytes, generation, filter, format_version));
  return Status::OK();
}

BaseRunWriter::BaseRunWriter(std::string path, int fd, uint32_t value_bytes, uint64_t generation,
                             const FilterSize& filter, uint32_t format_version)
    : path_(std::move(path)),
      fd_(fd),
      value_bytes_(value_bytes),
      format_version_(format_version),
      generation_(generation),
      layout_(value_bytes, format_version),
      filter_(filter.keys && filter.bits_per_key ? BloomFilter(filter) : BloomFilter()) {
  buffer_.assign(layout_.block_bytes, 0);
}

BaseRunWriter::~BaseRunWriter() {
  if (fd_ >= 0) close(fd_);
}

Status BaseRunWriter::CheckOrder(int64_t key) const {
  if (finished_) return Status::InvalidArgument(path_ + " is finished");
  if (key <= last_entry_) {
    return Status::InvalidArgument("base run " + path_ + ": key " + std::to_string(key) + " after key " +
                                   std::to_string(last_entry_) + " (keys go in increasing order)");
  }
  return Status::OK();
}

Status BaseRunWriter::AddDeletion(int64_t key) {
  MLKV_RETURN_IF_ERROR(CheckOrder(key));
  deletions_.push_back(key);
  last_entry_ = key;
  return Status::OK();
}

Status BaseRunWriter::Add(int64_t key, const uint8_t* value) {
  MLKV_RETURN_IF_ERROR(CheckOrder(key));
  if (!filter_.empty()) filter_.Add(key);
  if (rows_in_block_ == layout_.rows_per_block) MLKV_RETURN_IF_ERROR(SealBlock());
  uint8_t* block = buffer_.data() + buffered_blocks_ * layout_.block_bytes;
  if (rows_in_block_ == 0) {
    if (!fences_.empty()) MarkGapless(block_gapless_ && key == last_key_ + 1);
    fences_.push_back(key);
    block_gapless_ = true;
  } else {
    block_gapless_ = block_gapless_ && key == last_key_ + 1;
  }
  uint8_t* row = block + sizeof(BaseBlockHeader) + rows_in_block_ * layout_.row_bytes();
  std::memcpy(row, &key, sizeof(key));
  std::memcpy(row + sizeof(key), value, value_bytes_);
  if (layout_.row_checksums) {
    const uint32_t crc = RowCrc(written_blocks_ + buffered_blocks_, row, layout_.row_bytes());
    std::memcpy(block + layout_.row_crc_offset() + rows_in_block_ * sizeof(crc), &crc, sizeof(crc));
  }
  ++rows_in_block_;
  ++rows_;
  last_key_ = last_entry_ = key;
  return Status::OK();
}

Status BaseRunWriter::SealBlock() {
  const uint64_t block_bytes = layout_.block_bytes;
  uint8_t* block = buffer_.data() + buffered_blocks_ * block_bytes;
  BaseBlockHeader header{0, static_cast<uint32_t>(rows_in_block_), written_blocks_ + buffered_blocks_};
  std::memcpy(block, &header, sizeof(header));
  header.crc = BlockCrc(block, block_bytes);
  std::memcpy(block, &header.crc, sizeof(header.crc));
  ++buffered_blocks_;
  rows_in_block_ = 0;
  if (buffered_blocks_ * block_bytes >= kWriteBufferBytes) MLKV_RETURN_IF_ERROR(WriteBuffer());
  buffer_.resize((buffered_blocks_ + 1) * block_bytes);
  std::fill(buffer_.begin() + static_cast<ptrdiff_t>(buffered_blocks_ * block_bytes), buffer_.end(), 0);
  return Status::OK();
}

void BaseRunWriter::MarkGapless(bool gapless) {
  const size_t block = fences_.size() - 1;
  if (gapless_.size() <= block / 64) gapless_.push_back(0);
  if (gapless) gapless_[block / 64] |= 1ull << (block % 64);
}

Status BaseRunWriter::WriteBuffer() {
  const uint64_t block_bytes = layout_.block_bytes;
  MLKV_RETURN_IF_ERROR(
      WriteFully(fd_, buffer_.data(), buffered_blocks_ * block_bytes, written_blocks_ * block_bytes, path_));
  written_blocks_ += buffered_blocks_;
  buffered_blocks_ = 0;
  return Status::OK();
}

bool BaseRunWriter::AllGapless() const {
  for (size_t block = 0; block < fences_.size(); ++block) {
    if (!((gapless_[block / 64] >> (block % 64)) & 1)) return false;
  }
  return true;
}

Status BaseRunWriter::Finish() {
  if (finished_) return Status::InvalidArgument(path_ + " is finished");
  if (rows_in_block_ > 0) MLKV_RETURN_IF_ERROR(SealBlock());
  if (!fences_.empty()) MarkGapless(block_gapless_);
  if (AllGapless()) filter_ = BloomFilter();  // the fences tell every key: a filter would only take memory
  MLKV_RETURN_IF_ERROR(WriteBuffer());
  const uint64_t fence_offset = written_blocks_ * layout_.block_bytes;
  std::vector<uint8_t> section = FenceSection(fences_, gapless_, last_key_);
  const uint64_t deletions = deletions_.size(), hashes = filter_.hashes(), words = filter_.words().size();
  AppendBytes(&section, &deletions, sizeof(deletions));
  AppendBytes(&section, deletions_.data(), deletions * sizeof(int64_t));
  AppendBytes(&section, &hashes, sizeof(hashes));
  AppendBytes(&section, &words, sizeof(words));
  AppendBytes(&section, filter_.words().data(), words * sizeof(uint64_t));
  const uint64_t fence_bytes = section.size();
  MLKV_RETURN_IF_ERROR(WriteFully(fd_, section.data(), fence_bytes, fence_offset, path_));
  BaseRunTrailer trailer{};
  std::memcpy(trailer.magic, kBaseRunMagic, sizeof(trailer.magic));
  trailer.format_version = format_version_;
  trailer.value_bytes = value_bytes_;
  trailer.generation = generation_;
  trailer.block_bytes = layout_.block_bytes;
  trailer.rows = rows_;
  trailer.blocks = written_blocks_;
  trailer.fence_offset = fence_offset;
  trailer.fence_crc = Crc32c(0, section.data(), fence_bytes);
  trailer.crc = Crc32c(0, &trailer, offsetof(BaseRunTrailer, crc));
  MLKV_RETURN_IF_ERROR(WriteFully(fd_, &trailer, sizeof(trailer), fence_offset + fence_bytes, path_));
  if (fdatasync(fd_) != 0) return Status::IOError("syncing " + path_ + ": " + ErrnoText(errno));
  const int fd = fd_;
  fd_ = -1;
  finished_ = true;
  if (close(fd) != 0) return Status::IOError("closing " + path_ + ": " + ErrnoText(errno));
  return Status::OK();
}

// ---- reading ---------------------------------------------------------------------------------------

BaseRun::BaseRun(std::string path, int fd, uint32_t value_bytes)
    : path_(std::move(path)), fd_(fd), value_bytes_(value_bytes), layout_(value_bytes, kBaseRunFormat) {}

BaseRun::~BaseRun() {
  if (fd_ >= 0) close(fd_);
}

Status BaseRun::Open(const std::string& path, uint32_t value_bytes, uint64_t generation, bool direct_io,
                     std::unique_ptr<BaseRun>* out) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::Corruption("base run " + path + " is missing");
    return Status::IOError("opening " + path + ": " + ErrnoText(errno));
  }
  std::unique_ptr<BaseRun> run(new BaseRun(path, fd, value_bytes));
  run->file_bytes_ = FileSize(fd);
  if (run->file_bytes_ < sizeof(BaseRunTrailer)) {
    return Status::Corruption("base run " + path + " is truncated: " + std::to_string(run->file_bytes_) + " bytes");
  }
  BaseRunTrailer trailer;
  MLKV_RETURN_IF_ERROR(ReadExactly(fd, &trailer, sizeof(trailer), run->file_bytes_ - sizeof(trailer), path));
  if (std::memcmp(trailer.magic, kBaseRunMagic, sizeof(trailer.magic)) != 0 ||
      trailer.crc != Crc32c(0, &trailer, offsetof(BaseRunTrailer, crc))) {
    return Status::Corruption("base run " + path +
                              ": its trailer (the last 64 bytes) is damaged or the file truncated");
  }
  if (trailer.format_version < 1 || trailer.format_version > kBaseRunFormat) {
    return Status::Corruption("base run " + path + " has format version " + std::to_string(trailer.format_version) +
                              ", this build reads 1 to " + std::to_string(kBaseRunFormat));
  }
  if (trailer.generation != generation) {
    return Status::Corruption("base run " + path + " is run " + std::to_string(trailer.generation) + ", not " +
                              std::to_string(generation));
  }
  if (trailer.value_bytes != value_bytes) {
    return Status::InvalidArgument("base run " + path + " holds rows of " + std::to_string(trailer.value_bytes) +
                                   " bytes, not " + std::to_string(value_bytes));
  }
  const uint64_t fence_bytes =
      run->file_bytes_ - sizeof(trailer) - std::min(trailer.fence_offset, run->file_bytes_ - sizeof(trailer));
  run->layout_ = BaseBlockLayout(value_bytes, trailer.format_version);
  if (trailer.block_bytes != run->layout_.block_bytes || trailer.fence_offset != trailer.blocks * trailer.block_bytes ||
      trailer.fence_offset + FenceSectionBytes(trailer.blocks) + sizeof(trailer) > run->file_bytes_) {
    return Status::Corruption("base run " + path + ": its trailer does not fit the file's " +
                              std::to_string(run->file_bytes_) + " bytes");
  }
  run->rows_ = trailer.rows;
  std::vector<uint8_t> section(fence_bytes);
  MLKV_RETURN_IF_ERROR(ReadExactly(fd, section.data(), fence_bytes, trailer.fence_offset, path));
  if (Crc32c(0, section.data(), fence_bytes) != trailer.fence_crc) {
    return Status::Corruption("base run " + path + ": its fences (byte offset " + std::to_string(trailer.fence_offset) +
                              ") fail their checksum");
  }
  MLKV_RETURN_IF_ERROR(run->ParseFenceSection(section, trailer.blocks, trailer.format_version));
  if (direct_io) {  // blocks bypass the page cache, as the log's segments do: the budget is the bound
    const int direct = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
    if (direct >= 0) {
      close(run->fd_);
      run->fd_ = direct;
    }
  }
  *out = std::move(run);
  return Status::OK();
}

Status BaseRun::ParseFenceSection(const std::vector<uint8_t>& section, uint64_t blocks, uint32_t format_version) {
  const uint8_t* p = section.data();
  const uint8_t* const end = p + section.size();
  auto take = [&](void* to, uint64_t n) {
    if (static_cast<uint64_t>(end - p) < n) return false;
    if (n) std::memcpy(to, p, n);
    p += n;
    return true;
  };
  fences_.resize(blocks);
  gapless_.resize(BitmapWords(blocks));
  bool whole = take(fences_.data(), blocks * sizeof(int64_t)) &&
               take(gapless_.data(), gapless_.size() * sizeof(uint64_t)) && take(&last_key_, sizeof(last_key_));
  if (whole && format_version >= 2) {
    uint64_t deletions = 0, hashes = 0, words = 0;
    whole = take(&deletions, sizeof(deletions)) && deletions <= section.size() / sizeof(int64_t);
    if (whole) deletions_.resize(deletions);
    whole = whole && take(deletions_.data(), deletions * sizeof(int64_t)) && take(&hashes, sizeof(hashes)) &&
            take(&words, sizeof(words)) && words <= section.size() / sizeof(uint64_t);
    std::vector<uint64_t> filter(whole ? words : 0);
    whole = whole && take(filter.data(), words * sizeof(uint64_t)) && (words == 0) == (hashes == 0);
    if (whole) filter_ = BloomFilter(hashes, std::move(filter));
  }
  if (!whole || p != end) {
    return Status::Corruption("base run " + path_ + ": its fence section's parts do not fit its " +
                              std::to_string(section.size()) + " bytes");
  }
  return Status::OK();
}

int64_t BaseRun::BlockOf(int64_t key) const {
  auto it = std::upper_bound(fences_.begin(), fences_.end(), key);
  return static_cast<int64_t>(it - fences_.begin()) - 1;
}

BaseRun::Presence BaseRun::PresenceOf(int64_t key) const {
  const int64_t block = BlockOf(key);
  if (block < 0 || key > last_key_ || !filter_.MayHold(key)) return Presence::kAbsent;
  if (key == fences_[block]) return Presence::kPresent;
  return (gapless_[block / 64] >> (block % 64)) & 1 ? Presence::kPresent : Presence::kMaybe;
}

Status BaseRun::CheckBlock(const uint8_t* data, uint64_t index, uint32_t* count) const {
  BaseBlockHeader header;
  std::memcpy(&header, data, sizeof(header));
  if (header.crc != BlockCrc(data, layout_.block_bytes) || header.block_index != index || header.count == 0 ||
      header.count > layout_.rows_per_block) {
    return Status::Corruption(BlockPlace(path_, index, layout_.block_bytes) + " fails its checksum");
  }
  *count = header.count;
  return Status::OK();
}

Status BaseRun::Lookup(const int64_t* keys, size_t n, uint8_t* out, bool* found, BlockReader* reader,
                       uint64_t* blocks_read) const {
  BaseLookup lookup({this}, {}, keys, n, out, found, reader);
  MLKV_RETURN_IF_ERROR(RunReadRounds({&lookup}));
  if (blocks_read) *blocks_read += lookup.blocks_read();
  return Status::OK();
}

uint32_t BaseRun::UncheckedCount(const uint8_t* data, uint64_t index) const {
  BaseBlockHeader header;
  std::memcpy(&header, data, sizeof(header));
  const bool plausible = header.block_index == index && header.count > 0 && header.count <= layout_.rows_per_block;
  return plausible ? header.count : 0;
}

Status BaseRun::FindInBlock(const ReadRequest& req, const int64_t* keys, const size_t* indexes, size_t count,
                            uint8_t* out, bool* found) const {
  const uint64_t index = req.offset / layout_.block_bytes;
  if (req.result < 0) return Status::IOError("reading " + path_ + ": " + ErrnoText(static_cast<int>(-req.result)));
  if (static_cast<uint64_t>(req.result) < req.length) {
    return Status::Corruption(BlockPlace(path_, index, layout_.block_bytes) + " is truncated");
  }
  // With per-row checksums a row taken is checked alone; the whole block only where a key is not
  // found or a row fails (then the block's checksum tells damage from a row the run does not hold).
  uint32_t rows_in_block = layout_.row_checksums ? UncheckedCount(req.buffer, index) : 0;
  bool block_checked = false;
  auto check_block = [&]() {
    if (block_checked) return Status::OK();
    block_checked = true;
    return CheckBlock(req.buffer, index, &rows_in_block);
  };
  if (rows_in_block == 0) MLKV_RETURN_IF_ERROR(check_block());
  const size_t row_bytes = layout_.row_bytes();
  const uint8_t* rows = req.buffer + sizeof(BaseBlockHeader);
  auto key_at = [&](uint32_t j) {
    int64_t k;
    std::memcpy(&k, rows + j * row_bytes, sizeof(k));
    return k;
  };
  for (size_t c = 0; c < count; ++c) {
    const size_t i = indexes[c];
    const int64_t key = keys[i];
    uint32_t lo = 0, hi = rows_in_block;  // the first row whose key is not below `key`
    while (lo < hi) {
      const uint32_t mid = (lo + hi) / 2;
      if (key_at(mid) < key)
        lo = mid + 1;
      else
        hi = mid;
    }
    if (lo < rows_in_block && key_at(lo) == key) {
      if (!block_checked && !RowIntact(req.buffer, index, lo)) {
        MLKV_RETURN_IF_ERROR(check_block());
        return Status::Corruption(BlockPlace(path_, index, layout_.block_bytes) + ": row " + std::to_string(lo) +
                                  " fails its checksum");
      }
      std::memcpy(out + i * value_bytes_, rows + lo * row_bytes + sizeof(int64_t), value_bytes_);
      found[i] = true;
    } else {
      MLKV_RETURN_IF_ERROR(check_block());  // the keys searched were the block's own
    }
  }
  return Status::OK();
}

bool BaseRun::RowIntact(const uint8_t* block, uint64_t index, uint32_t row) const {
  uint32_t crc;
  std::memcpy(&crc, block + layout_.row_crc_offset() + row * sizeof(crc), sizeof(crc));
  return crc == RowCrc(index, block + sizeof(BaseBlockHeader) + row * layout_.row_bytes(), layout_.row_bytes());
}

Status BaseRun::AppendBlocks(uint64_t first, uint64_t blocks, std::vector<int64_t>* keys,
                             std::vector<uint8_t>* values) const {
  if (blocks == 0) return Status::OK();
  AlignedBuffer buffer(blocks * layout_.block_bytes);
  if (!buffer.data) return Status::IOError("cannot allocate a read buffer for " + path_);
  MLKV_RETURN_IF_ERROR(ReadExactly(fd_, buffer.data, blocks * layout_.block_bytes, first * layout_.block_bytes, path_));
  const size_t row_bytes = sizeof(int64_t) + value_bytes_;
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = buffer.data + b * layout_.block_bytes;
    uint32_t count;
    MLKV_RETURN_IF_ERROR(CheckBlock(block, first + b, &count));
    for (uint32_t j = 0; j < count; ++j) {
      const uint8_t* row = block + sizeof(BaseBlockHeader) + j * row_bytes;
      int64_t key;
      std::memcpy(&key, row, sizeof(key));
      keys->push_back(key);
      values->insert(values->end(), row + sizeof(int64_t), row + row_bytes);
    }
  }
  return Status::OK();
}

Status BaseRun::ReadBlocks(uint64_t first, std::vector<int64_t>* keys, std::vector<uint8_t>* values,
                           uint64_t* next) const {
  const uint64_t total = fences_.size();
  const uint64_t blocks =
      std::min(std::max<uint64_t>(1, kCursorReadBytes / layout_.block_bytes), total - std::min(first, total));
  *next = first + blocks;
  return AppendBlocks(first, blocks, keys, values);
}

Status BaseRun::ReadKeyRange(int64_t lo, int64_t hi, std::vector<int64_t>* keys, std::vector<uint8_t>* values) const {
  if (fences_.empty() || lo > last_key_ || hi < fences_[0] || lo > hi) return Status::OK();
  const uint64_t first = static_cast<uint64_t>(std::max<int64_t>(0, BlockOf(lo)));
  const uint64_t end = static_cast<uint64_t>(BlockOf(hi)) + 1;
  const uint64_t chunk = std::max<uint64_t>(1, kCursorReadBytes / layout_.block_bytes);
  std::vector<int64_t> block_keys;
  std::vector<uint8_t> block_values;
  for (uint64_t b = first; b < end; b += chunk) {
    block_keys.clear();
    block_values.clear();
    MLKV_RETURN_IF_ERROR(AppendBlocks(b, std::min(chunk, end - b), &block_keys, &block_values));
    for (size_t j = 0; j < block_keys.size(); ++j) {
      if (block_keys[j] < lo || block_keys[j] > hi) continue;
      keys->push_back(block_keys[j]);
      values->insert(values->end(), block_values.begin() + static_cast<std::ptrdiff_t>(j * value_bytes_),
                     block_values.begin() + static_cast<std::ptrdiff_t>((j + 1) * value_bytes_));
    }
  }
  return Status::OK();
}

// ---- the base: a bottom of runs in key order, and overlays -----------------------------------------

BaseRuns::BaseRuns(std::vector<std::shared_ptr<const BaseRun>> runs,
                   std::vector<std::shared_ptr<const BaseRun>> overlays, BaseManifest manifest)
    : runs_(std::move(runs)), overlays_(std::move(overlays)), manifest_(std::move(manifest)) {
  if (manifest_.rows == kRowsUncounted) manifest_.rows = bottom_rows();  // format 1: the bottom alone
}

BaseRun::Presence BaseRuns::BottomPresenceOf(int64_t key) const {
  const int64_t run = RunHolding(runs_, key);
  return run < 0 ? BaseRun::Presence::kAbsent : runs_[run]->PresenceOf(key);
}

BaseRun::Presence BaseRuns::PresenceOf(int64_t key) const {
  using Presence = BaseRun::Presence;
  bool maybe = false;  // a newer overlay may hold a row of it
  for (auto it = overlays_.rbegin(); it != overlays_.rend(); ++it) {
    if ((*it)->Deletes(key)) return maybe ? Presence::kMaybe : Presence::kAbsent;
    const Presence presence = (*it)->PresenceOf(key);
    if (presence == Presence::kPresent) return presence;
    maybe = maybe || presence == Presence::kMaybe;
  }
  const Presence bottom = BottomPresenceOf(key);
  return bottom == Presence::kAbsent && maybe ? Presence::kMaybe : bottom;
}

Status BaseRuns::Lookup(const int64_t* keys, size_t n, uint8_t* out, bool* found, BlockReader* reader,
                        uint64_t* blocks_read) const {
  std::unique_ptr<BaseLookup> lookup = StartLookup(keys, n, out, found, reader);
  MLKV_RETURN_IF_ERROR(RunReadRounds({lookup.get()}));
  if (blocks_read) *blocks_read += lookup->blocks_read();
  return Status::OK();
}

std::unique_ptr<BaseLookup> BaseRuns::StartLookup(const int64_t* keys, size_t n, uint8_t* out, bool* found,
                                                  BlockReader* reader) const {
  std::vector<const BaseRun*> bottom, overlays;
  for (const auto& run : runs_) bottom.push_back(run.get());
  for (const auto& run : overlays_) overlays.push_back(run.get());
  return std::make_unique<BaseLookup>(std::move(bottom), std::move(overlays), keys, n, out, found, reader);
}

// ---- a lookup in the runs, in read rounds ------------------------------------------------------------

BaseLookup::BaseLookup(std::vector<const BaseRun*> bottom, std::vector<const BaseRun*> overlays, const int64_t* keys,
                       size_t n, uint8_t* out, bool* found, BlockReader* reader)
    : bottom_(std::move(bottom)),
      runs_(overlays.rbegin(), overlays.rend()),
      overlays_(overlays.size()),
      keys_(keys),
      out_(out),
      found_(found),
      reader_(reader),
      left_(n),
      from_(n, 0) {
  runs_.insert(runs_.end(), bottom_.begin(), bottom_.end());
  for (size_t i = 0; i < n; ++i) {
    found_[i] = false;
    left_[i] = i;
  }
}

void BaseLookup::Route() {
  wants_.clear();
  next_want_ = 0;
  for (size_t i : left_) {
    const int64_t key = keys_[i];
    size_t o = from_[i];
    bool deleted = false;
    for (; o < overlays_; ++o) {
      if ((deleted = runs_[o]->Deletes(key))) break;
      if (runs_[o]->PresenceOf(key) != BaseRun::Presence::kAbsent) break;
    }
    if (deleted) continue;
    size_t run = o;
    if (o == overlays_) {  // the bottom's run of its range, unless its fences and filter rule the key out
      const int64_t r = RunHolding(bottom_, key);
      if (r < 0 || bottom_[r]->PresenceOf(key) == BaseRun::Presence::kAbsent) continue;
      run = overlays_ + static_cast<size_t>(r);
    }
    from_[i] = o + 1;
    const int64_t block = runs_[run]->BlockOf(key);
    if (block >= 0) wants_.push_back({run, block, i});
  }
  left_.clear();
  std::sort(wants_.begin(), wants_.end(),
            [](const Want& a, const Want& b) { return a.run != b.run ? a.run < b.run : a.block < b.block; });
}

Status BaseLookup::TakeResults(const ReadRequest* results, size_t n) {
  std::vector<size_t> indexes;
  for (size_t r = 0; r < n; ++r) {
    const BaseRun& run = *runs_[wants_[first_want_[r]].run];
    indexes.clear();
    for (size_t w = first_want_[r]; w < first_want_[r + 1]; ++w) indexes.push_back(wants_[w].index);
    MLKV_RETURN_IF_ERROR(run.FindInBlock(results[r], keys_, indexes.data(), indexes.size(), out_, found_));
    for (size_t w = first_want_[r]; w < first_want_[r + 1]; ++w) {
      // The filter let it through: the runs under this overlay.
      if (!found_[wants_[w].index] && wants_[w].run < overlays_) left_.push_back(wants_[w].index);
    }
  }
  blocks_read_ += n;
  return Status::OK();
}

Status BaseLookup::Next(const ReadRequest* results, size_t n, size_t room, std::vector<ReadRequest>* wants,
                        bool* done) {
  MLKV_RETURN_IF_ERROR(TakeResults(results, n));
  first_want_.clear();
  if (next_want_ == wants_.size()) Route();  // this route's reads all taken: the keys asking again
  // The blocks of the next wants, a block wanted by several keys once.
  const size_t most = std::min(room, kMaxBlocksPerRound);
  uint64_t block_bytes = 0;
  for (const BaseRun* run : runs_) block_bytes = std::max(block_bytes, run->layout_.block_bytes);
  size_t blocks = 0;
  for (size_t w = next_want_; w < wants_.size() && blocks <= most; ++w) {
    blocks += w == next_want_ || wants_[w].run != wants_[w - 1].run || wants_[w].block != wants_[w - 1].block;
  }
  blocks = std::min(blocks, most);
  buffer_.reset(blocks ? new AlignedBuffer(blocks * block_bytes) : nullptr);
  if (blocks && !buffer_->data) return Status::IOError("cannot allocate a read buffer for a base lookup");
  size_t w = next_want_;
  for (; w < wants_.size(); ++w) {
    if (w > next_want_ && wants_[w].run == wants_[w - 1].run && wants_[w].block == wants_[w - 1].block) continue;
    if (first_want_.size() == blocks) break;
    const BaseRun& run = *runs_[wants_[w].run];
    ReadRequest req;
    req.fd = run.fd_;
    req.offset = static_cast<uint64_t>(wants_[w].block) * run.layout_.block_bytes;
    req.length = static_cast<uint32_t>(run.layout_.block_bytes);
    req.buffer = buffer_->data + first_want_.size() * block_bytes;
    wants->push_back(req);
    first_want_.push_back(w);
  }
  *done = first_want_.empty() && next_want_ == wants_.size() && left_.empty();
  first_want_.push_back(w);
  next_want_ = w;
  return Status::OK();
}

int64_t BaseRuns::FenceOf(uint64_t block) const {
  for (const auto& run : runs_) {
    if (block < run->blocks()) return run->fence(block);
    block -= run->blocks();
  }
  return -1;
}

Status BaseRuns::ReadBlocks(uint64_t first, std::vector<int64_t>* keys, std::vector<uint8_t>* values,
                            uint64_t* next) const {
  uint64_t before = 0;  // blocks of the runs before run r
  *next = blocks();
  std::vector<int64_t> bottom_keys;
  std::vector<uint8_t> bottom_values;
  for (const auto& run : runs_) {
    if (first < before + run->blocks()) {
      uint64_t next_in_run;
      MLKV_RETURN_IF_ERROR(run->ReadBlocks(first - before, &bottom_keys, &bottom_values, &next_in_run));
      *next = before + next_in_run;
      break;
    }
    before += run->blocks();
  }
  if (overlays_.empty() || first >= *next) {
    keys->insert(keys->end(), bottom_keys.begin(), bottom_keys.end());
    values->insert(values->end(), bottom_values.begin(), bottom_values.end());
    return Status::OK();
  }
  const int64_t lo = first == 0 ? 0 : FenceOf(first);
  const int64_t hi = *next >= blocks() ? INT64_MAX : FenceOf(*next) - 1;
  // Each key's newest entry: overlay i's (newest last) hides the bottom's (source 0) and older ones.
  struct Entry {
    int64_t key;
    size_t source;
    const uint8_t* value;  // null: a deletion
  };
  std::vector<Entry> entries;
  const uint32_t value_bytes = overlays_.back()->value_bytes();
  for (size_t j = 0; j < bottom_keys.size(); ++j)
    entries.push_back({bottom_keys[j], 0, &bottom_values[j * value_bytes]});
  std::vector<std::vector<int64_t>> overlay_keys(overlays_.size());
  std::vector<std::vector<uint8_t>> overlay_values(overlays_.size());
  for (size_t o = 0; o < overlays_.size(); ++o) {
    MLKV_RETURN_IF_ERROR(overlays_[o]->ReadKeyRange(lo, hi, &overlay_keys[o], &overlay_values[o]));
    for (size_t j = 0; j < overlay_keys[o].size(); ++j)
      entries.push_back({overlay_keys[o][j], o + 1, &overlay_values[o][j * value_bytes]});
    const auto& deleted = overlays_[o]->deletions();
    for (auto it = std::lower_bound(deleted.begin(), deleted.end(), lo); it != deleted.end() && *it <= hi; ++it)
      entries.push_back({*it, o + 1, nullptr});
  }
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.key != b.key ? a.key < b.key : a.source > b.source; });
  for (size_t j = 0; j < entries.size(); ++j) {
    if ((j > 0 && entries[j].key == entries[j - 1].key) || !entries[j].value) continue;
    keys->push_back(entries[j].key);
    values->insert(values->end(), entries[j].value, entries[j].value + value_bytes);
  }
  return Status::OK();
}

uint64_t BaseRuns::bottom_rows() const {
  uint64_t total = 0;
  for (const auto& run : runs_) total += run->rows();
  return total;
}

uint64_t BaseRuns::overlay_entries() const {
  uint64_t total = 0;
  for (const auto& run : overlays_) total += run->entries();
  return total;
}

uint64_t BaseRuns::blocks() const {
  uint64_t total = 0;
  for (const auto& run : runs_) total += run->blocks();
  return total;
}

uint64_t BaseRuns::memory_bytes() const {
  uint64_t total = (runs_.capacity() + overlays_.capacity()) * sizeof(runs_[0]) +
                   (manifest_.runs.capacity() + manifest_.overlays.capacity()) * sizeof(uint64_t);
  for (const auto& run : runs_) total += run->memory_bytes() + sizeof(BaseRun);
  for (const auto& run : overlays_) total += run->memory_bytes() + sizeof(BaseRun);
  return total;
}

uint64_t BaseRuns::file_bytes() const {
  uint64_t total = 0;
  for (const auto& run : runs_) total += run->file_bytes();
  for (const auto& run : overlays_) total += run->file_bytes();
  return total;
}

namespace {

// Format 1's header (32 bytes, the run numbers after it) begins as format 2's does.
struct ManifestHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t count;  // runs of the bottom (format 1: all its runs)
  uint64_t generation;
  uint32_t crc;  // CRC-32C of the header before this field (format 1: of its first 24 bytes), then of the run numbers
  uint32_t overlays;  // format 2
  uint64_t rows;  // format 2
  uint64_t reserved;
};
static_assert(sizeof(ManifestHeader) == 48, "a manifest header is 48 bytes");
constexpr size_t kManifestV1HeaderBytes = 32;
constexpr char kManifestMagic[8] = {'M', 'L', 'K', 'V', 'R', 'U', 'N', 'S'};

size_t ManifestHeaderBytes(uint32_t format_version) {
  return format_version == 1 ? kManifestV1HeaderBytes : sizeof(ManifestHeader);
}

uint32_t ManifestCrc(const ManifestHeader& header, const std::vector<uint64_t>& ids) {
  uint32_t crc = Crc32c(0, &header, offsetof(ManifestHeader, crc));
  if (header.format_version >= 2) {
    crc = Crc32c(crc, &header.overlays, sizeof(ManifestHeader) - offsetof(ManifestHeader, overlays));
  }
  return Crc32c(crc, ids.data(), ids.size() * sizeof(uint64_t));
}

}  // namespace

Status WriteBaseManifest(const std::string& path, uint64_t generation, const BaseManifest& manifest) {
  ManifestHeader header{};
  std::memcpy(header.magic, kManifestMagic, sizeof(header.magic));
  header.format_version = kManifestVersion;
  header.count = static_cast<uint32_t>(manifest.runs.size());
  header.generation = generation;
  header.overlays = static_cast<uint32_t>(manifest.overlays.size());
  header.rows = manifest.rows;
  const std::vector<uint64_t> ids = manifest.all_ids();
  header.crc = ManifestCrc(header, ids);
  std::vector<uint8_t> bytes(sizeof(header));
  std::memcpy(bytes.data(), &header, sizeof(header));
  AppendBytes(&bytes, ids.data(), ids.size() * sizeof(uint64_t));
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("creating " + path + ": " + ErrnoText(errno));
  Status st = WriteFully(fd, bytes.data(), bytes.size(), 0, path);
  if (st.ok() && fdatasync(fd) != 0) st = Status::IOError("syncing " + path + ": " + ErrnoText(errno));
  close(fd);
  return st;
}

Status ReadBaseManifest(const std::string& path, uint64_t generation, BaseManifest* manifest) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::Corruption("base manifest " + path + " is missing");
    return Status::IOError("opening " + path + ": " + ErrnoText(errno));
  }
  const uint64_t size = FileSize(fd);
  ManifestHeader header{};
  const Status damaged = Status::Corruption("base manifest " + path + " is damaged or truncated");
  Status st = size >= kManifestV1HeaderBytes ? ReadExactly(fd, &header, kManifestV1HeaderBytes, 0, path) : damaged;
  const bool known = header.format_version == 1 || header.format_version == kManifestVersion;
  if (st.ok() && (std::memcmp(header.magic, kManifestMagic, sizeof(header.magic)) != 0 || !known)) st = damaged;
  const size_t header_bytes = ManifestHeaderBytes(header.format_version);
  if (st.ok() && header.format_version >= 2) {
    st = size >= header_bytes ? ReadExactly(fd, &header, header_bytes, 0, path) : damaged;
  }
  const uint64_t count = uint64_t{header.count} + (header.format_version >= 2 ? header.overlays : 0);
  if (st.ok() && size != header_bytes + count * sizeof(uint64_t)) st = damaged;
  std::vector<uint64_t> ids(st.ok() ? count : 0);
  if (st.ok() && count) st = ReadExactly(fd, ids.data(), count * sizeof(uint64_t), header_bytes, path);
  close(fd);
  MLKV_RETURN_IF_ERROR(st);
  if (header.crc != ManifestCrc(header, ids) || header.generation != generation) {
    return Status::Corruption("base manifest " + path + " fails its checksum or is another generation's");
  }
  manifest->runs.assign(ids.begin(), ids.begin() + header.count);
  manifest->overlays.assign(ids.begin() + header.count, ids.end());
  manifest->rows = header.format_version >= 2 ? header.rows : kRowsUncounted;
  return Status::OK();
}

}  // namespace mlkv
