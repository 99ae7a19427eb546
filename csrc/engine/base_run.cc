#include "base_run.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "crc32c.h"

namespace mlkv {
namespace {

constexpr uint32_t kBaseRunVersion = 1;
constexpr uint64_t kWriteBufferBytes = 1ull << 20;  // blocks written at once
constexpr uint64_t kCursorReadBytes = 4ull << 20;   // one sequential read of a cursor
constexpr size_t kMaxBlocksPerRound = 4096;         // bounds a lookup's read buffer

uint32_t BlockCrc(const uint8_t* block, uint64_t block_bytes) {
  return Crc32c(0, block + sizeof(uint32_t), block_bytes - sizeof(uint32_t));
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

std::string BlockPlace(const std::string& path, uint64_t index, uint64_t block_bytes) {
  return path + ": block " + std::to_string(index) + " at byte offset " + std::to_string(index * block_bytes);
}

}  // namespace

uint64_t BaseBlockBytes(uint32_t value_bytes) {
  return RoundUp(sizeof(BaseBlockHeader) + sizeof(int64_t) + value_bytes, kBlockBytes);
}

// ---- writing ---------------------------------------------------------------------------------------

Status BaseRunWriter::Create(const std::string& path, uint32_t value_bytes, uint64_t generation,
                             std::unique_ptr<BaseRunWriter>* out) {
  if (value_bytes == 0) return Status::InvalidArgument("a base run's rows need at least one byte");
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("creating " + path + ": " + ErrnoText(errno));
  out->reset(new BaseRunWriter(path, fd, value_bytes, generation));
  return Status::OK();
}

BaseRunWriter::BaseRunWriter(std::string path, int fd, uint32_t value_bytes, uint64_t generation)
    : path_(std::move(path)),
      fd_(fd),
      value_bytes_(value_bytes),
      generation_(generation),
      block_bytes_(BaseBlockBytes(value_bytes)),
      rows_per_block_((block_bytes_ - sizeof(BaseBlockHeader)) / (sizeof(int64_t) + value_bytes)) {
  buffer_.assign(block_bytes_, 0);
}

BaseRunWriter::~BaseRunWriter() {
  if (fd_ >= 0) close(fd_);
}

Status BaseRunWriter::Add(int64_t key, const uint8_t* value) {
  if (finished_) return Status::InvalidArgument(path_ + " is finished");
  if (key <= last_key_) {
    return Status::InvalidArgument("base run " + path_ + ": key " + std::to_string(key) + " after key " +
                                   std::to_string(last_key_) + " (keys go in increasing order)");
  }
  if (rows_in_block_ == rows_per_block_) MLKV_RETURN_IF_ERROR(SealBlock());
  uint8_t* block = buffer_.data() + buffered_blocks_ * block_bytes_;
  if (rows_in_block_ == 0) {
    if (!fences_.empty()) MarkGapless(block_gapless_ && key == last_key_ + 1);
    fences_.push_back(key);
    block_gapless_ = true;
  } else {
    block_gapless_ = block_gapless_ && key == last_key_ + 1;
  }
  uint8_t* row = block + sizeof(BaseBlockHeader) + rows_in_block_ * (sizeof(int64_t) + value_bytes_);
  std::memcpy(row, &key, sizeof(key));
  std::memcpy(row + sizeof(key), value, value_bytes_);
  ++rows_in_block_;
  ++rows_;
  last_key_ = key;
  return Status::OK();
}

Status BaseRunWriter::SealBlock() {
  uint8_t* block = buffer_.data() + buffered_blocks_ * block_bytes_;
  BaseBlockHeader header{0, static_cast<uint32_t>(rows_in_block_), written_blocks_ + buffered_blocks_};
  std::memcpy(block, &header, sizeof(header));
  header.crc = BlockCrc(block, block_bytes_);
  std::memcpy(block, &header.crc, sizeof(header.crc));
  ++buffered_blocks_;
  rows_in_block_ = 0;
  if (buffered_blocks_ * block_bytes_ >= kWriteBufferBytes) MLKV_RETURN_IF_ERROR(WriteBuffer());
  buffer_.resize((buffered_blocks_ + 1) * block_bytes_);
  std::fill(buffer_.begin() + static_cast<ptrdiff_t>(buffered_blocks_ * block_bytes_), buffer_.end(), 0);
  return Status::OK();
}

void BaseRunWriter::MarkGapless(bool gapless) {
  const size_t block = fences_.size() - 1;
  if (gapless_.size() <= block / 64) gapless_.push_back(0);
  if (gapless) gapless_[block / 64] |= 1ull << (block % 64);
}

Status BaseRunWriter::WriteBuffer() {
  MLKV_RETURN_IF_ERROR(
      WriteFully(fd_, buffer_.data(), buffered_blocks_ * block_bytes_, written_blocks_ * block_bytes_, path_));
  written_blocks_ += buffered_blocks_;
  buffered_blocks_ = 0;
  return Status::OK();
}

Status BaseRunWriter::Finish() {
  if (finished_) return Status::InvalidArgument(path_ + " is finished");
  if (rows_in_block_ > 0) MLKV_RETURN_IF_ERROR(SealBlock());
  if (!fences_.empty()) MarkGapless(block_gapless_);
  MLKV_RETURN_IF_ERROR(WriteBuffer());
  const uint64_t fence_offset = written_blocks_ * block_bytes_;
  std::vector<uint8_t> section = FenceSection(fences_, gapless_, last_key_);
  const uint64_t fence_bytes = section.size();
  MLKV_RETURN_IF_ERROR(WriteFully(fd_, section.data(), fence_bytes, fence_offset, path_));
  BaseRunTrailer trailer{};
  std::memcpy(trailer.magic, kBaseRunMagic, sizeof(trailer.magic));
  trailer.format_version = kBaseRunVersion;
  trailer.value_bytes = value_bytes_;
  trailer.generation = generation_;
  trailer.block_bytes = block_bytes_;
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
    : path_(std::move(path)), fd_(fd), value_bytes_(value_bytes) {}

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
  if (trailer.format_version != kBaseRunVersion) {
    return Status::Corruption("base run " + path + " has format version " + std::to_string(trailer.format_version) +
                              ", this build reads " + std::to_string(kBaseRunVersion));
  }
  if (trailer.generation != generation) {
    return Status::Corruption("base run " + path + " is run " + std::to_string(trailer.generation) + ", not " +
                              std::to_string(generation));
  }
  if (trailer.value_bytes != value_bytes) {
    return Status::InvalidArgument("base run " + path + " holds rows of " + std::to_string(trailer.value_bytes) +
                                   " bytes, not " + std::to_string(value_bytes));
  }
  const uint64_t fence_bytes = FenceSectionBytes(trailer.blocks);
  if (trailer.block_bytes != BaseBlockBytes(value_bytes) ||
      trailer.fence_offset != trailer.blocks * trailer.block_bytes ||
      trailer.fence_offset + fence_bytes + sizeof(trailer) != run->file_bytes_) {
    return Status::Corruption("base run " + path + ": its trailer does not fit the file's " +
                              std::to_string(run->file_bytes_) + " bytes");
  }
  run->block_bytes_ = trailer.block_bytes;
  run->rows_ = trailer.rows;
  std::vector<uint8_t> section(fence_bytes);
  MLKV_RETURN_IF_ERROR(ReadExactly(fd, section.data(), fence_bytes, trailer.fence_offset, path));
  if (Crc32c(0, section.data(), fence_bytes) != trailer.fence_crc) {
    return Status::Corruption("base run " + path + ": its fences (byte offset " + std::to_string(trailer.fence_offset) +
                              ") fail their checksum");
  }
  run->fences_.resize(trailer.blocks);
  run->gapless_.resize(BitmapWords(trailer.blocks));
  const uint8_t* p = section.data();
  if (trailer.blocks) {
    std::memcpy(run->fences_.data(), p, trailer.blocks * sizeof(int64_t));
    std::memcpy(run->gapless_.data(), p + trailer.blocks * sizeof(int64_t), run->gapless_.size() * sizeof(uint64_t));
  }
  p += trailer.blocks * sizeof(int64_t) + run->gapless_.size() * sizeof(uint64_t);
  std::memcpy(&run->last_key_, p, sizeof(run->last_key_));
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

int64_t BaseRun::BlockOf(int64_t key) const {
  auto it = std::upper_bound(fences_.begin(), fences_.end(), key);
  return static_cast<int64_t>(it - fences_.begin()) - 1;
}

BaseRun::Presence BaseRun::PresenceOf(int64_t key) const {
  const int64_t block = BlockOf(key);
  if (block < 0 || key > last_key_) return Presence::kAbsent;
  if (key == fences_[block]) return Presence::kPresent;
  return (gapless_[block / 64] >> (block % 64)) & 1 ? Presence::kPresent : Presence::kMaybe;
}

Status BaseRun::CheckBlock(const uint8_t* data, uint64_t index, uint32_t* count) const {
  BaseBlockHeader header;
  std::memcpy(&header, data, sizeof(header));
  const uint64_t rows_per_block = (block_bytes_ - sizeof(BaseBlockHeader)) / (sizeof(int64_t) + value_bytes_);
  if (header.crc != BlockCrc(data, block_bytes_) || header.block_index != index || header.count == 0 ||
      header.count > rows_per_block) {
    return Status::Corruption(BlockPlace(path_, index, block_bytes_) + " fails its checksum");
  }
  *count = header.count;
  return Status::OK();
}

Status BaseRun::Lookup(const int64_t* keys, size_t n, uint8_t* out, bool* found, BlockReader* reader,
                       uint64_t* blocks_read) const {
  struct Want {
    int64_t block;
    size_t index;
  };
  std::vector<Want> wants;
  wants.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    found[i] = false;
    const int64_t block = BlockOf(keys[i]);
    if (block >= 0) wants.push_back({block, i});
  }
  std::sort(wants.begin(), wants.end(), [](const Want& a, const Want& b) { return a.block < b.block; });
  const size_t max_blocks = std::min(wants.size(), kMaxBlocksPerRound);
  AlignedBuffer buffer(max_blocks * block_bytes_);
  if (max_blocks && !buffer.data) return Status::IOError("cannot allocate a read buffer for " + path_);
  const size_t row_bytes = sizeof(int64_t) + value_bytes_;
  std::vector<ReadRequest> requests;
  std::vector<size_t> first_want;  // per request: its first want
  size_t pos = 0;
  while (pos < wants.size()) {
    requests.clear();
    first_want.clear();
    size_t end = pos;
    for (; end < wants.size(); ++end) {
      if (end > pos && wants[end].block == wants[end - 1].block) continue;
      if (requests.size() == max_blocks) break;
      ReadRequest req;
      req.fd = fd_;
      req.offset = static_cast<uint64_t>(wants[end].block) * block_bytes_;
      req.length = static_cast<uint32_t>(block_bytes_);
      req.buffer = buffer.data + requests.size() * block_bytes_;
      requests.push_back(req);
      first_want.push_back(end);
    }
    MLKV_RETURN_IF_ERROR(reader->ReadAll(requests.data(), requests.size()));
    first_want.push_back(end);
    for (size_t r = 0; r < requests.size(); ++r) {
      const ReadRequest& req = requests[r];
      const uint64_t index = req.offset / block_bytes_;
      if (req.result < 0) return Status::IOError("reading " + path_ + ": " + ErrnoText(static_cast<int>(-req.result)));
      if (static_cast<uint64_t>(req.result) < req.length) {
        return Status::Corruption(BlockPlace(path_, index, block_bytes_) + " is truncated");
      }
      uint32_t count;
      MLKV_RETURN_IF_ERROR(CheckBlock(req.buffer, index, &count));
      const uint8_t* rows = req.buffer + sizeof(BaseBlockHeader);
      auto key_at = [&](uint32_t j) {
        int64_t k;
        std::memcpy(&k, rows + j * row_bytes, sizeof(k));
        return k;
      };
      for (size_t w = first_want[r]; w < first_want[r + 1]; ++w) {
        const int64_t key = keys[wants[w].index];
        uint32_t lo = 0, hi = count;  // the first row whose key is not below `key`
        while (lo < hi) {
          const uint32_t mid = (lo + hi) / 2;
          if (key_at(mid) < key)
            lo = mid + 1;
          else
            hi = mid;
        }
        if (lo < count && key_at(lo) == key) {
          std::memcpy(out + wants[w].index * value_bytes_, rows + lo * row_bytes + sizeof(int64_t), value_bytes_);
          found[wants[w].index] = true;
        }
      }
    }
    if (blocks_read) *blocks_read += requests.size();
    pos = end;
  }
  return Status::OK();
}

Status BaseRun::ReadBlocks(uint64_t first, std::vector<int64_t>* keys, std::vector<uint8_t>* values,
                           uint64_t* next) const {
  const uint64_t total = fences_.size();
  const uint64_t blocks =
      std::min(std::max<uint64_t>(1, kCursorReadBytes / block_bytes_), total - std::min(first, total));
  *next = first + blocks;
  if (blocks == 0) return Status::OK();
  AlignedBuffer buffer(blocks * block_bytes_);
  if (!buffer.data) return Status::IOError("cannot allocate a read buffer for " + path_);
  MLKV_RETURN_IF_ERROR(ReadExactly(fd_, buffer.data, blocks * block_bytes_, first * block_bytes_, path_));
  const size_t row_bytes = sizeof(int64_t) + value_bytes_;
  for (uint64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = buffer.data + b * block_bytes_;
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

// ---- the base: runs in key order ---------------------------------------------------------------

BaseRuns::BaseRuns(std::vector<std::shared_ptr<const BaseRun>> runs, std::vector<uint64_t> ids)
    : runs_(std::move(runs)), ids_(std::move(ids)) {}

int64_t BaseRuns::RunOf(int64_t key) const {
  auto it = std::upper_bound(runs_.begin(), runs_.end(), key,
                             [](int64_t k, const std::shared_ptr<const BaseRun>& run) { return k < run->first_key(); });
  return static_cast<int64_t>(it - runs_.begin()) - 1;
}

BaseRun::Presence BaseRuns::PresenceOf(int64_t key) const {
  const int64_t run = RunOf(key);
  return run < 0 ? BaseRun::Presence::kAbsent : runs_[run]->PresenceOf(key);
}

Status BaseRuns::Lookup(const int64_t* keys, size_t n, uint8_t* out, bool* found, BlockReader* reader,
                        uint64_t* blocks_read) const {
  if (runs_.size() == 1) return runs_[0]->Lookup(keys, n, out, found, reader, blocks_read);
  std::vector<std::vector<size_t>> of_run(runs_.size());
  for (size_t i = 0; i < n; ++i) {
    found[i] = false;
    const int64_t run = RunOf(keys[i]);
    if (run >= 0) of_run[run].push_back(i);
  }
  for (size_t r = 0; r < runs_.size(); ++r) {
    if (of_run[r].empty()) continue;
    std::vector<int64_t> run_keys(of_run[r].size());
    for (size_t j = 0; j < of_run[r].size(); ++j) run_keys[j] = keys[of_run[r][j]];
    const uint32_t value_bytes = runs_[r]->value_bytes();
    std::vector<uint8_t> values(run_keys.size() * value_bytes);
    std::unique_ptr<bool[]> hit(new bool[run_keys.size()]);
    MLKV_RETURN_IF_ERROR(
        runs_[r]->Lookup(run_keys.data(), run_keys.size(), values.data(), hit.get(), reader, blocks_read));
    for (size_t j = 0; j < of_run[r].size(); ++j) {
      if (!hit[j]) continue;
      found[of_run[r][j]] = true;
      std::memcpy(out + of_run[r][j] * value_bytes, values.data() + j * value_bytes, value_bytes);
    }
  }
  return Status::OK();
}

Status BaseRuns::ReadBlocks(uint64_t first, std::vector<int64_t>* keys, std::vector<uint8_t>* values,
                            uint64_t* next) const {
  uint64_t before = 0;  // blocks of the runs before run r
  for (const auto& run : runs_) {
    if (first < before + run->blocks()) {
      uint64_t next_in_run;
      MLKV_RETURN_IF_ERROR(run->ReadBlocks(first - before, keys, values, &next_in_run));
      *next = before + next_in_run;
      return Status::OK();
    }
    before += run->blocks();
  }
  *next = before;
  return Status::OK();
}

uint64_t BaseRuns::rows() const {
  uint64_t total = 0;
  for (const auto& run : runs_) total += run->rows();
  return total;
}

uint64_t BaseRuns::blocks() const {
  uint64_t total = 0;
  for (const auto& run : runs_) total += run->blocks();
  return total;
}

uint64_t BaseRuns::memory_bytes() const {
  uint64_t total = runs_.capacity() * sizeof(runs_[0]) + ids_.capacity() * sizeof(uint64_t);
  for (const auto& run : runs_) total += run->memory_bytes() + sizeof(BaseRun);
  return total;
}

uint64_t BaseRuns::file_bytes() const {
  uint64_t total = 0;
  for (const auto& run : runs_) total += run->file_bytes();
  return total;
}

namespace {

struct ManifestHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t count;
  uint64_t generation;
  uint32_t crc;  // CRC-32C of the header before this field, then of the run numbers
  uint32_t reserved;
};
static_assert(sizeof(ManifestHeader) == 32, "a manifest header is 32 bytes");
constexpr char kManifestMagic[8] = {'M', 'L', 'K', 'V', 'R', 'U', 'N', 'S'};

uint32_t ManifestCrc(const ManifestHeader& header, const std::vector<uint64_t>& ids) {
  return Crc32c(Crc32c(0, &header, offsetof(ManifestHeader, crc)), ids.data(), ids.size() * sizeof(uint64_t));
}

}  // namespace

Status WriteBaseManifest(const std::string& path, uint64_t generation, const std::vector<uint64_t>& ids) {
  ManifestHeader header{};
  std::memcpy(header.magic, kManifestMagic, sizeof(header.magic));
  header.format_version = kBaseRunVersion;
  header.count = static_cast<uint32_t>(ids.size());
  header.generation = generation;
  header.crc = ManifestCrc(header, ids);
  std::vector<uint8_t> bytes(sizeof(header) + ids.size() * sizeof(uint64_t));
  std::memcpy(bytes.data(), &header, sizeof(header));
  if (!ids.empty()) std::memcpy(bytes.data() + sizeof(header), ids.data(), ids.size() * sizeof(uint64_t));
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("creating " + path + ": " + ErrnoText(errno));
  Status st = WriteFully(fd, bytes.data(), bytes.size(), 0, path);
  if (st.ok() && fdatasync(fd) != 0) st = Status::IOError("syncing " + path + ": " + ErrnoText(errno));
  close(fd);
  return st;
}

Status ReadBaseManifest(const std::string& path, uint64_t generation, std::vector<uint64_t>* ids) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return Status::Corruption("base manifest " + path + " is missing");
    return Status::IOError("opening " + path + ": " + ErrnoText(errno));
  }
  const uint64_t size = FileSize(fd);
  ManifestHeader header{};
  Status st = size >= sizeof(header) ? ReadExactly(fd, &header, sizeof(header), 0, path)
                                     : Status::Corruption("base manifest " + path + " is truncated");
  if (st.ok() && (std::memcmp(header.magic, kManifestMagic, sizeof(header.magic)) != 0 ||
                  size != sizeof(header) + uint64_t{header.count} * sizeof(uint64_t))) {
    st = Status::Corruption("base manifest " + path + " is damaged or truncated");
  }
  if (st.ok()) {
    ids->assign(header.count, 0);
    if (header.count) st = ReadExactly(fd, ids->data(), header.count * sizeof(uint64_t), sizeof(header), path);
  }
  close(fd);
  MLKV_RETURN_IF_ERROR(st);
  if (header.crc != ManifestCrc(header, *ids) || header.generation != generation) {
    return Status::Corruption("base manifest " + path + " fails its checksum or is another generation's");
  }
  return Status::OK();
}

}  // namespace mlkv
