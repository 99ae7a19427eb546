// KVStore's recovery: reopening a store at one of its two kept checkpoints.
// The CHECKPOINT record names the log's extent; the index comes from the
// checkpoint's index image when there is a sound one, else from a scan of the
// log; the mutable pages come back from the checkpoint's snapshot.
#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "crc32c.h"
#include "file_io.h"
#include "kv_store.h"
#include "log_format.h"

namespace mlkv {

namespace {

// An image's header, version 1's (64 bytes, its keys of 63 bits) read into version 2's; *bytes: its size.
Status ReadIndexImageHeader(int fd, const std::string& file, IndexImageHeader* header, uint64_t* bytes) {
  std::memset(header, 0, sizeof(*header));
  *bytes = kIndexImageV1Bytes;
  MLKV_RETURN_IF_ERROR(ReadExactly(fd, header, kIndexImageV1Bytes, 0, file));
  if (header->format_version == 1) {
    header->key_bits = HashIndex::kMaxKeyBits;
    return Status::OK();
  }
  *bytes = sizeof(*header);
  return ReadExactly(fd, header, sizeof(*header), 0, file);
}

}  // namespace

// Any failure leaves the index empty, for the caller to rebuild from the log.
Status KVStore::LoadIndexImage(const CheckpointMeta& meta, uint64_t* flushed) {
  const uint64_t sequence = IndexImageOf(meta);
  const std::string file = IndexImagePath(sequence);
  int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::NotFound(file);
  const HashIndex::ImageCounts empty{0, index_.Counts().buckets, 1, 0};
  IndexImageHeader header;
  uint64_t header_bytes = 0;
  Status st = ReadIndexImageHeader(fd, file, &header, &header_bytes);
  const bool v1 = header_bytes == kIndexImageV1Bytes;
  std::vector<HashIndex::Region> regions;
  // The counts size the index before the checksum can be checked: the file must hold exactly the
  // regions they name, so a damaged count is refused here, not allocated.
  const bool sized = st.ok() && header.buckets <= HashIndex::kMaxBuckets &&
                     header.overflow <= HashIndex::kMaxOverflowBuckets &&
                     header.free <= HashIndex::kMaxOverflowBuckets &&
                     FileSize(fd) == header_bytes + (header.buckets + header.overflow) * HashIndex::kBucketBytes +
                                         header.free * sizeof(uint32_t);
  // An index of another key width (the store opened with another key_limit) places keys elsewhere.
  const bool same_keys = header.key_bits == static_cast<uint64_t>(index_.key_bits());
  bool reset = false;
  if (st.ok() && sized && same_keys) {
    try {
      reset = index_.Reset({header.size, header.buckets, header.overflow, header.free}, &regions);
    } catch (const std::bad_alloc&) {
      reset = false;  // the log scan rebuilds it
    }
  }
  if (st.ok() &&
      (std::memcmp(header.magic, kIndexImageMagic, 8) != 0 || (!v1 && header.format_version != kIndexImageVersion) ||
       header.sequence != sequence || (meta.image_age == 0 && header.size != meta.rows) || !reset)) {
    st = Status::Corruption(file + " is not the index of checkpoint " + std::to_string(sequence) +
                            (same_keys ? "" : " for keys below 2^" + std::to_string(index_.key_bits())));
  }
  const size_t checked_words = v1 ? kIndexImageCheckedWords - 1 : kIndexImageCheckedWords;
  uint32_t crc = st.ok() ? Crc32c(0, &header.sequence, checked_words * sizeof(uint64_t)) : 0;
  uint64_t offset = header_bytes;
  for (const auto& r : regions) {
    if (!st.ok()) break;
    st = ReadExactly(fd, r.data, r.bytes, offset, file);
    crc = Crc32c(crc, r.data, r.bytes);
    offset += r.bytes;
  }
  close(fd);
  if (st.ok() && crc != header.crc) st = Status::Corruption(file + " fails its checksum");
  // The checkpoint's own image covers the log up to its `flushed` (older files left 0 in the
  // header); an earlier one's replay starts at its header's, which must still be in the log.
  *flushed = meta.image_age == 0 ? meta.flushed : header.flushed;
  if (st.ok() && !(meta.begin <= *flushed && *flushed <= meta.flushed)) {
    st = Status::Corruption(file + " covers the log to slot " + std::to_string(*flushed) + ", outside [" +
                            std::to_string(meta.begin) + ", " + std::to_string(meta.flushed) + "]");
  }
  if (!st.ok()) {
    std::vector<HashIndex::Region> unused;
    index_.Reset(empty, &unused);
    return st;
  }
  // Unchecked: ForEachAddress calls it while mu_ is held here, which the analysis cannot see through the template.
  index_.ForEachAddress([&](uint64_t slot) NO_THREAD_SAFETY_ANALYSIS {
    MoveLive(HashIndex::kNoAddress, slot);
    deletions_indexed_ = deletions_indexed_ || IsDeletion(slot);
  });
  return Status::OK();
}

Status KVStore::ReadCheckpointRecord(const std::string& file, std::string* record) {
  CheckpointMeta meta;
  std::memset(&meta, 0, sizeof(meta));
  int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IOError("opening " + file + ": " + ErrnoText(errno));
  const uint64_t size = FileSize(fd);
  const bool v1 = size == kCheckpointV1Bytes;
  Status st = size == sizeof(meta) || v1 ? ReadExactly(fd, &meta, size, 0, file)
                                         : Status::Corruption(file + " has " + std::to_string(size) +
                                                              " bytes, expected " + std::to_string(sizeof(meta)));
  close(fd);
  MLKV_RETURN_IF_ERROR(st);
  const size_t crc_at = v1 ? kCheckpointV1Bytes - sizeof(uint32_t) : offsetof(CheckpointMeta, crc);
  uint32_t crc;
  std::memcpy(&crc, reinterpret_cast<const uint8_t*>(&meta) + crc_at, sizeof(crc));
  if (std::memcmp(meta.magic, kCheckpointMagic, 8) != 0 || crc != Crc32c(0, &meta, crc_at)) {
    return Status::Corruption(file + " fails its checksum");
  }
  if (meta.format_version != (v1 ? 1u : kFormatVersion)) {
    return Status::Corruption(file + " has format version " + std::to_string(meta.format_version) +
                              ", this build reads versions 1 and " + std::to_string(kFormatVersion));
  }
  if (v1) {  // version 2 with no base run: `base` sits where image_age was
    std::memcpy(&meta.image_age, reinterpret_cast<const uint8_t*>(&meta) + kCheckpointV1ImageAge,
                sizeof(meta.image_age));
    meta.base = 0;
    meta.format_version = kFormatVersion;
    meta.crc = Crc32c(0, &meta, offsetof(CheckpointMeta, crc));
  }
  record->assign(reinterpret_cast<const char*>(&meta), sizeof(meta));
  return Status::OK();
}

Status KVStore::MinimumMemoryBytes(const std::string& path, uint64_t* bytes) {
  *bytes = 0;
  const std::string file = path + "/CHECKPOINT";
  if (!FileExists(file)) return Status::OK();
  std::string record;
  MLKV_RETURN_IF_ERROR(ReadCheckpointRecord(file, &record));
  CheckpointMeta meta;
  std::memcpy(&meta, record.data(), sizeof(meta));
  *bytes = kMinLogPages * meta.page_bytes;
  return Status::OK();
}

Status KVStore::ScanSlots(const uint8_t* page, uint64_t first_slot, uint64_t end_slot, const std::string& file_name,
                          uint64_t file_base_offset) {
  for (uint64_t slot = first_slot; slot < end_slot; ++slot) {
    const uint8_t* rec = page + OffsetInPage(slot);
    MLKV_RETURN_IF_ERROR(VerifyRecord(rec, file_name, file_base_offset + OffsetInPage(slot)));
    RecordHeader h;
    std::memcpy(&h, rec, sizeof(h));
    if (options_.key_limit && static_cast<uint64_t>(h.key) >= options_.key_limit) {  // its index cannot hold it
      return Status::InvalidArgument(path_ + " holds key " + std::to_string(h.key) + ", but " + KeyRangeText() +
                                     ": open it with the key_limit it was written with");
    }
    if (h.flags & kFlagTombstone) {
      // A deletion of a base row stays in the index until a merge drops the row.
      if (BaseMayHold(h.key)) {
        deletions_indexed_ = true;
        MoveLive(index_.Upsert(h.key, slot | kDeletionBit), slot);
      } else {
        MoveLive(index_.Erase(h.key), HashIndex::kNoAddress);
      }
    } else {
      MoveLive(index_.Upsert(h.key, slot), slot);
    }
  }
  return Status::OK();
}

Status KVStore::ChooseCheckpoint(CheckpointMeta* meta, CheckpointMeta* older, std::string* latest) {
  const std::string latest_path = path_ + "/CHECKPOINT", previous_path = path_ + "/CHECKPOINT.previous";
  std::string previous;
  MLKV_RETURN_IF_ERROR(ReadCheckpointRecord(latest_path, latest));
  // A store written before CHECKPOINT.previous existed, or one checkpoint old, has none.
  if (!FileExists(previous_path) || !ReadCheckpointRecord(previous_path, &previous).ok()) previous = *latest;
  const bool drop_previous = !options_.cut_checkpoints && options_.checkpoint_sequence == 0 && previous != *latest;
  if (drop_previous) previous = *latest;  // a store opened without cuts keeps only its latest
  std::memcpy(meta, latest->data(), sizeof(*meta));
  std::memcpy(older, previous.data(), sizeof(*older));
  const uint64_t wanted = options_.checkpoint_sequence;
  if (wanted != 0 && wanted != meta->sequence) {
    if (wanted != older->sequence) {
      return Status::InvalidArgument("store at " + path_ + " has checkpoints " + std::to_string(older->sequence) +
                                     " and " + std::to_string(meta->sequence) + ", not checkpoint " +
                                     std::to_string(wanted) +
                                     " that was asked for: it has moved past that cut, or never reached it");
    }
    *meta = *older;
  }
  MLKV_RETURN_IF_ERROR(CheckRowLayout(*meta, latest_path));
  if (options_.read_only) return Status::OK();  // the checkpoint as it is: nothing rewritten or dropped
  if (drop_previous && unlink(previous_path.c_str()) != 0 && errno != ENOENT) {
    return Status::IOError("removing " + previous_path + ": " + ErrnoText(errno));
  }
  if (meta->sequence != CheckpointSequenceOf(*latest)) {
    // Back to the previous checkpoint: it becomes the latest before anything is written, so a
    // crash from here on recovers it, never the newer one being discarded.
    MLKV_RETURN_IF_ERROR(WriteCheckpointRecord(latest_path, previous));
    *latest = previous;
  }
  return Status::OK();
}

Status KVStore::CheckRowLayout(const CheckpointMeta& meta, const std::string& meta_path) {
  if (meta.dim != options_.dim) {
    return Status::InvalidArgument("store at " + path_ + " holds rows of dim " + std::to_string(meta.dim) +
                                   ", opened with dim " + std::to_string(options_.dim));
  }
  if (meta.element_type != static_cast<uint32_t>(options_.element_type)) {
    static const char* names[] = {"?", "float32", "float16", "bfloat16"};
    return Status::InvalidArgument("store at " + path_ + " holds " + names[meta.element_type & 3] +
                                   " rows, opened with " + names[static_cast<uint32_t>(options_.element_type) & 3]);
  }
  MLKV_RETURN_IF_ERROR(ComputeLayout(meta.page_bytes, meta.pages_per_segment));
  if (meta.record_bytes != record_bytes_) return Status::Corruption(meta_path + " has an inconsistent record size");
  return Status::OK();
}

Status KVStore::ReplaySegmentPages(uint64_t replay_from, uint64_t flushed_page) {
  AlignedBuffer page_buffer(page_bytes_);
  for (uint64_t page = replay_from / records_per_page_; page < flushed_page; ++page) {
    std::shared_ptr<SegmentFiles::File> file;
    MLKV_RETURN_IF_ERROR(segments_.Open(SegmentOfPage(page), SegmentFiles::OpenMode::kMustExist, &file));
    const uint64_t offset = (page % pages_per_segment_) * page_bytes_;
    MLKV_RETURN_IF_ERROR(ReadExactly(file->fd, page_buffer.data, page_bytes_, offset, file->path));
    const uint64_t first_slot = std::max(page * records_per_page_, replay_from);
    MLKV_RETURN_IF_ERROR(ScanSlots(page_buffer.data, first_slot, (page + 1) * records_per_page_, file->path, offset));
  }
  return Status::OK();
}

Status KVStore::ReplaySnapshotPages(const CheckpointMeta& meta, uint64_t flushed_page, uint64_t end_page) {
  const std::string snapshot = SnapshotPath(meta.sequence);
  int fd = open(snapshot.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::Corruption("snapshot file " + snapshot + " is missing: " + ErrnoText(errno));
  Status st;
  // Replays the pages as if appended, so a smaller budget spills the oldest to disk.
  for (uint64_t page = flushed_page; page < end_page && st.ok(); ++page) {
    st = StartPage(page);
    const uint64_t offset = (page - flushed_page) * page_bytes_;
    if (st.ok()) st = ReadExactly(fd, FrameOf(page), page_bytes_, offset, snapshot);
    const uint64_t first_slot = page * records_per_page_,
                   end_slot = std::min(meta.tail, (page + 1) * records_per_page_);
    // The pages that were mutable at the checkpoint are replayed whatever the image.
    if (st.ok()) st = ScanSlots(FrameOf(page), first_slot, end_slot, snapshot, offset);
  }
  close(fd);
  return st;
}

Status KVStore::CheckRecoveredIndex(const CheckpointMeta& meta) {
  if (LiveLogKeysLocked() != meta.rows) {
    return Status::Corruption(
        "recovered " + std::to_string(LiveLogKeysLocked()) + " rows from " + path_ +
        (recovered_from_index_image_ ? " (through " + IndexImagePath(image_sequence_) + ")" : "") +
        ", its CHECKPOINT says " + std::to_string(meta.rows));
  }
  if (!recovered_from_index_image_) return Status::OK();
  // Every row the image names in segments compacted since was copied to the log replayed over
  // it: a slot below begin means the image is not this log's.
  bool stale = false;
  const uint64_t begin = begin_;
  index_.ForEachAddress([&](uint64_t address) { stale = stale || SlotOf(address) < begin; });
  if (stale) {
    return Status::Corruption(IndexImagePath(image_sequence_) + " names rows below the log's first slot " +
                              std::to_string(begin_) + "; remove it to recover by a scan of the log");
  }
  return Status::OK();
}

Status KVStore::Recover() {
  CheckpointMeta meta, older;
  std::string latest;
  MLKV_RETURN_IF_ERROR(ChooseCheckpoint(&meta, &older, &latest));
  WriterLock lock(&mu_);
  begin_ = meta.begin;
  MLKV_RETURN_IF_ERROR(OpenBase(meta.base));  // before the log's deletions are replayed over it
  checkpointed_base_ = meta.base;
  previous_base_ = older.sequence < meta.sequence ? older.base : meta.base;
  if (previous_base_ != meta.base && previous_base_ != 0) {  // its runs stay while it is kept
    BaseManifest manifest;
    MLKV_RETURN_IF_ERROR(ReadBaseManifest(BasePath(previous_base_), previous_base_, &manifest));
    std::vector<uint64_t> ids = manifest.all_ids();
    for (uint64_t id : ids) next_run_id_ = std::max(next_run_id_, id + 1);
    base_runs_of_[previous_base_] = std::move(ids);
    unnamed_bases_.push_back(previous_base_);
  }
  checkpoint_sequence_ = meta.sequence;
  checkpoint_record_ = latest;
  if (older.sequence < meta.sequence) {
    previous_sequence_ = older.sequence;
    previous_begin_ = std::min(older.begin, meta.begin);
  } else {
    previous_sequence_ = meta.sequence;
    previous_begin_ = meta.begin;
  }
  const uint64_t flushed_page = meta.flushed / records_per_page_;
  const uint64_t end_page = (meta.tail + records_per_page_ - 1) / records_per_page_;

  // The index: the image the checkpoint names, when it is sound, and the log written after it
  // replayed over it; otherwise the whole log is scanned.
  image_sequence_ = IndexImageOf(meta);
  previous_image_sequence_ = older.sequence < meta.sequence ? IndexImageOf(older) : image_sequence_;
  uint64_t replay_from = begin_;
  if (image_sequence_ && LoadIndexImage(meta, &image_flushed_).ok()) {
    recovered_from_index_image_ = image_sound_ = true;
    replay_from = image_flushed_;
  }
  MLKV_RETURN_IF_ERROR(ReplaySegmentPages(replay_from, flushed_page));
  head_page_ = read_only_page_ = flushed_page;
  flusher_.Reset(flushed_page);
  tail_ = flushed_page * records_per_page_;
  if (end_page > flushed_page) MLKV_RETURN_IF_ERROR(ReplaySnapshotPages(meta, flushed_page, end_page));
  tail_ = meta.tail;
  MLKV_RETURN_IF_ERROR(CheckRecoveredIndex(meta));
  // Segments below begin that the previous checkpoint still needs go at the next checkpoint.
  const uint64_t slots_per_segment = pages_per_segment_ * records_per_page_;
  for (uint64_t seg = previous_begin_ / slots_per_segment; seg < begin_ / slots_per_segment; ++seg) {
    compacted_segments_.push_back(seg);
  }
  checkpointed_changes_ = changes_;
  checkpointed_begin_ = begin_;
  if (!options_.read_only) RemoveLeftovers(previous_begin_ / slots_per_segment, meta.sequence, previous_sequence_);
  return Status::OK();
}

// Files the recovered checkpoint does not name, left by a crash between a
// write and the next checkpoint: compacted segments below `first_segment`,
// segments past the one the log writes next (the flusher may be writing pages
// replayed from the snapshot up to there), other snapshots, CHECKPOINT.tmp.
void KVStore::RemoveLeftovers(uint64_t first_segment, uint64_t sequence, uint64_t previous_sequence) {
  DIR* dir = opendir(path_.c_str());
  if (!dir) return;
  const uint64_t last_segment = SegmentOfPage(read_only_page_);
  std::vector<std::string> doomed;
  while (dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    unsigned long long number = 0;
    char tail[8] = {0};
    if (std::sscanf(name.c_str(), "segment-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "log") == 0) {
      if (number < first_segment || number > last_segment) doomed.push_back(name);
    } else if (std::sscanf(name.c_str(), "snapshot-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "dat") == 0) {
      if (number != sequence && number != previous_sequence) doomed.push_back(name);
    } else if (std::sscanf(name.c_str(), "index-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "dat") == 0) {
      if (number != image_sequence_ && number != previous_image_sequence_) doomed.push_back(name);
    } else if (std::sscanf(name.c_str(), "base-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "runs") == 0) {
      if (!base_runs_of_.count(number)) doomed.push_back(name);  // a merge a crash cut short
    } else if (std::sscanf(name.c_str(), "run-%llu.%7s", &number, tail) == 2 && std::strcmp(tail, "run") == 0) {
      bool named = false;
      for (const auto& [g, ids] : base_runs_of_)
        named = named || std::find(ids.begin(), ids.end(), number) != ids.end();
      if (!named) doomed.push_back(name);
    } else if (name == "CHECKPOINT.tmp") {
      doomed.push_back(name);
    }
  }
  closedir(dir);
  for (const std::string& name : doomed) unlink((path_ + "/" + name).c_str());
}

}  // namespace mlkv
