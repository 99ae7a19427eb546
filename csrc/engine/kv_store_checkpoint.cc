// KVStore's checkpoints. A checkpoint = the segment files synced + the mutable
// pages copied to a snapshot file + the index image (when it pays) + a new
// CHECKPOINT record renamed into place. Nothing becomes read-only, so in-place
// updates go on after it.
//
// It has two halves. The first fixes the contents: with the store's lock held
// shared (gets go on, puts wait) it copies the mutable pages to the snapshot
// file and the index to its image, both into the page cache, and composes the
// record. The second makes them durable without the lock (the flushes of the
// pages below the snapshot, the syncs, the record's rename), while puts land
// after the checkpoint: pages below the snapshot are read-only, and recovery
// takes the pages from the snapshot's first on from the snapshot, whatever
// later flushes wrote to their segments. The in-memory bookkeeping then moves
// to the new checkpoint under a short exclusive hold, and the files no kept
// checkpoint needs are removed after it. checkpoint_mu_ and begun_ keep
// checkpoints one at a time.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>

#include "crc32c.h"
#include "file_io.h"
#include "kv_store.h"
#include "log_format.h"

namespace mlkv {

std::string KVStore::NumberedPath(const char* stem, uint64_t number, const char* extension) const {
  char name[64];
  std::snprintf(name, sizeof(name), "/%s-%010" PRIu64 ".%s", stem, number, extension);
  return path_ + name;
}

std::string KVStore::IndexImagePath(uint64_t sequence) const { return NumberedPath("index", sequence, "dat"); }
std::string KVStore::SnapshotPath(uint64_t sequence) const { return NumberedPath("snapshot", sequence, "dat"); }

Status KVStore::WriteIndexImage(uint64_t sequence, uint64_t flushed, int* fd_out) {
  const HashIndex::ImageCounts counts = index_.Counts();
  const std::vector<HashIndex::Region> regions = index_.Regions();
  IndexImageHeader header;
  std::memset(&header, 0, sizeof(header));
  std::memcpy(header.magic, kIndexImageMagic, 8);
  header.format_version = kIndexImageVersion;
  header.sequence = sequence;
  header.size = counts.size;
  header.buckets = counts.buckets;
  header.overflow = counts.overflow;
  header.free = counts.free;
  header.flushed = flushed;
  header.key_bits = static_cast<uint64_t>(index_.key_bits());
  uint32_t crc = Crc32c(0, &header.sequence, kIndexImageCheckedWords * sizeof(uint64_t));
  for (const auto& r : regions) crc = Crc32c(crc, r.data, r.bytes);
  header.crc = crc;
  const std::string file = IndexImagePath(sequence);
  int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("creating " + file + ": " + ErrnoText(errno));
  Status st = WriteFully(fd, &header, sizeof(header), 0, file);
  uint64_t offset = sizeof(header);
  for (const auto& r : regions) {
    if (st.ok()) st = WriteFully(fd, r.data, r.bytes, offset, file);
    offset += r.bytes;
  }
  if (!st.ok()) {
    close(fd);
    unlink(file.c_str());
    return st;
  }
  *fd_out = fd;
  return Status::OK();
}

// tmp file, fsync, rename over `file`, fsync the directory: a crash leaves the old record or the new.
Status KVStore::WriteCheckpointRecord(const std::string& file, const std::string& record, bool* renamed) const {
  const std::string tmp = path_ + "/CHECKPOINT.tmp";
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::IOError("creating " + tmp + ": " + ErrnoText(errno));
  Status st = WriteFully(fd, record.data(), record.size(), 0, tmp);
  if (st.ok() && fsync(fd) != 0) st = Status::IOError("syncing " + tmp + ": " + ErrnoText(errno));
  close(fd);
  // New segment and snapshot entries are durable before a record names them.
  if (st.ok()) st = SyncDirectory(path_);
  if (st.ok() && rename(tmp.c_str(), file.c_str()) != 0) {
    st = Status::IOError("renaming " + tmp + " to " + file + ": " + ErrnoText(errno));
  }
  if (!st.ok()) {
    unlink(tmp.c_str());
    return st;
  }
  if (renamed) *renamed = true;
  return SyncDirectory(path_);
}

Status KVStore::Checkpoint(uint64_t* sequence) {
  MLKV_RETURN_IF_ERROR(RefuseWrite("checkpoint"));
  MLKV_RETURN_IF_ERROR(RefuseIfBegun("checkpoint"));
  // A failed lookahead or compaction is reported, but does not cost the checkpoint.
  Status background = Flush();
  MLKV_RETURN_IF_ERROR(CheckpointConcurrently(sequence));
  return background;
}

Status KVStore::RefuseIfBegun(const char* what) {
  MutexLock one_checkpoint(&checkpoint_mu_);
  if (!begun_.open || !begun_.by_owner) return Status::OK();  // a checkpoint of its own: wait for it
  uint64_t sequence = begun_.written.sequence;
  if (!begun_.written.wrote) {
    ReaderLock lock(&mu_);
    sequence = checkpoint_sequence_;
  }
  return Status::InvalidArgument("store at " + path_ + " cannot " + what + ": checkpoint " + std::to_string(sequence) +
                                 " is begun and not finished (finish it first)");
}

Status KVStore::CheckpointConcurrently(uint64_t* sequence, bool unless_owner_begun) {
  {
    MutexLock one_checkpoint(&checkpoint_mu_);
    // One begun by another thread finishes there. The owner's may wait for this very call (a
    // compaction its puts stall for, or its Close's Flush), so a compaction takes none then.
    while (begun_.open && !(begun_.by_owner && unless_owner_begun)) begun_cv_.wait(one_checkpoint.native());
    if (begun_.open) return Status::OK();  // its segments go at the next checkpoint
    MLKV_RETURN_IF_ERROR(BeginCheckpointLocked(/*by_owner=*/false));
  }
  uint64_t finished = 0;
  MLKV_RETURN_IF_ERROR(FinishBegunCheckpoint(/*by_owner=*/false, &finished));
  if (sequence) *sequence = finished;
  return Status::OK();
}

Status KVStore::BeginCheckpoint() {
  MLKV_RETURN_IF_ERROR(RefuseWrite("checkpoint"));
  MLKV_RETURN_IF_ERROR(RefuseIfBegun("begin a checkpoint"));
  MutexLock one_checkpoint(&checkpoint_mu_);
  WaitNoBegunCheckpoint(one_checkpoint);  // one a compaction began meanwhile
  return BeginCheckpointLocked(/*by_owner=*/true);
}

Status KVStore::BeginCheckpointLocked(bool by_owner) {
  ReaderLock lock(&mu_);
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  BegunCheckpoint begun;
  MLKV_RETURN_IF_ERROR(BeginCheckpointFiles(&begun));
  begun.open = true;
  begun.by_owner = by_owner;
  begun_ = begun;
  return Status::OK();
}

Status KVStore::FinishCheckpoint(uint64_t* sequence) { return FinishBegunCheckpoint(/*by_owner=*/true, sequence); }

Status KVStore::FinishBegunCheckpoint(bool by_owner, uint64_t* sequence) {
  BegunCheckpoint begun;
  {
    MutexLock one_checkpoint(&checkpoint_mu_);
    if (!begun_.open || begun_.finishing || begun_.by_owner != by_owner) {
      return Status::InvalidArgument("store at " + path_ + " has no checkpoint begun to finish");
    }
    begun_.finishing = true;
    begun = begun_;
  }
  // The files are this call's alone: another checkpoint waits for begun_ to close.
  Status st = begun.written.wrote ? FinishCheckpointFiles(&begun) : Status::OK();
  MutexLock one_checkpoint(&checkpoint_mu_);
  ObsoleteFiles obsolete;
  bool remove_obsolete;
  {
    WriterLock lock(&mu_);
    remove_obsolete = CommitBegunFiles(begun, st, &obsolete);
    *sequence = begun.written.wrote && st.ok() ? begun.written.sequence : checkpoint_sequence_;
  }
  if (remove_obsolete) RemoveObsoleteFiles(obsolete);
  begun_ = BegunCheckpoint();
  begun_cv_.notify_all();
  return st;
}

void KVStore::FinishOrWaitBegunCheckpoint(MutexLock& one_checkpoint) {
  while (begun_.open) {
    if (begun_.by_owner && !begun_.finishing) {
      // Through the mutex, not the lock: the analysis does not follow a lock passed by reference.
      checkpoint_mu_.Unlock();
      uint64_t unused = 0;
      (void)FinishCheckpoint(&unused);  // its failure leaves nothing to finish; Close checkpoints anew
      checkpoint_mu_.Lock();
    } else {
      begun_cv_.wait(one_checkpoint.native());
    }
  }
}

Status KVStore::CheckpointExclusively() {
  BegunCheckpoint begun;
  MLKV_RETURN_IF_ERROR(BeginCheckpointFiles(&begun));
  if (!begun.written.wrote) return Status::OK();
  const Status st = FinishCheckpointFiles(&begun);
  ObsoleteFiles obsolete;
  if (CommitBegunFiles(begun, st, &obsolete)) RemoveObsoleteFiles(obsolete);
  return st;
}

bool KVStore::CommitBegunFiles(const BegunCheckpoint& begun, const Status& finished, ObsoleteFiles* obsolete) {
  if (!begun.written.wrote || !(finished.ok() || begun.renamed)) return false;
  // Once CHECKPOINT names it the store is at it (its sequence is never written again), even when
  // the directory's sync after the rename failed; a crash may then recover either checkpoint, so
  // the files of both stay, and reopening removes what the recovered one does not name.
  CommitCheckpointLocked(begun.written, obsolete);
  return finished.ok();
}

void KVStore::DiscardBegunFiles(BegunCheckpoint* begun) {
  begun_base_ = 0;
  for (int* fd : {&begun->snapshot_fd, &begun->image_fd}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
  unlink(SnapshotPath(begun->written.sequence).c_str());
  if (begun->written.image == begun->written.sequence) unlink(IndexImagePath(begun->written.sequence).c_str());
}

Status KVStore::BeginCheckpointFiles(BegunCheckpoint* out) {
  WrittenCheckpoint& written = out->written;
  written.wrote = false;
  if (!ChangedSinceCheckpointLocked()) return Status::OK();  // the latest checkpoint still holds
  const uint64_t sequence = checkpoint_sequence_ + 1;
  written.sequence = sequence;
  const std::string snapshot = SnapshotPath(sequence);
  const uint64_t first_page = read_only_page_;
  const uint64_t end_page = (tail_ + records_per_page_ - 1) / records_per_page_;
  out->first_page = first_page;
  // The mutable pages go to the page cache now (a copy, as later puts change them in place); the
  // disk takes them in the second half.
  out->snapshot_fd = open(snapshot.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (out->snapshot_fd < 0) return Status::IOError("creating " + snapshot + ": " + ErrnoText(errno));
  Status st;
  for (uint64_t p = first_page; p < end_page && st.ok(); ++p) {
    st = WriteFully(out->snapshot_fd, FrameOf(p), page_bytes_, (p - first_page) * page_bytes_, snapshot);
  }
  // The index image: the latest one stands while the log recovery would replay after it is smaller
  // than an image; past that, a new one (none at all while the whole log is that small). An image
  // stands only while the log from its flushed slot on is all there: rows deleted in place after
  // it have their tombstones only there, and a compaction past it drops them.
  uint64_t image = image_sound_ && begin_ <= image_flushed_ ? image_sequence_ : 0, image_flushed = image_flushed_;
  const uint64_t replay_from = image ? image_flushed : begin_;
  const bool write_image = (ReadOnlySlot() - replay_from) * record_bytes_ > index_.MemoryBytes() ||
                           (image && sequence - image >= kNoIndexImage);
  if (st.ok() && write_image) {
    st = WriteIndexImage(sequence, ReadOnlySlot(), &out->image_fd);
    image = sequence;
    image_flushed = ReadOnlySlot();
  }
  written.image = write_image ? sequence : 0;  // the files DiscardBegunFiles removes
  if (!st.ok()) {
    DiscardBegunFiles(out);
    return st;
  }
  CheckpointMeta meta;
  std::memset(&meta, 0, sizeof(meta));
  std::memcpy(meta.magic, kCheckpointMagic, 8);
  meta.format_version = kFormatVersion;
  meta.dim = options_.dim;
  meta.element_type = static_cast<uint32_t>(options_.element_type);
  meta.record_bytes = record_bytes_;
  meta.page_bytes = page_bytes_;
  meta.pages_per_segment = pages_per_segment_;
  meta.sequence = sequence;
  meta.begin = begin_;
  meta.flushed = ReadOnlySlot();
  meta.tail = tail_;
  meta.rows = LiveLogKeysLocked();
  meta.base = base_generation_;
  meta.image_age = image ? static_cast<uint32_t>(sequence - image) : kNoIndexImage;
  meta.crc = Crc32c(0, &meta, offsetof(CheckpointMeta, crc));
  // With cuts the checkpoint kept beside the new one is the committed one: the latest, once its
  // owner committed it, becomes the previous first (a crash at any point leaves CHECKPOINT whole
  // and it recoverable); an uncommitted latest is replaced, and CHECKPOINT.previous, which
  // already holds the committed one, stays.
  written.kept_previous = options_.cut_checkpoints && checkpoint_sequence_ > 0;
  written.previous_moves = written.kept_previous && latest_committed_;
  if (written.previous_moves) written.previous_record = checkpoint_record_;
  written.wrote = true;
  written.begin = begin_;
  written.changes = changes_;
  written.image = image;
  written.image_flushed = image_flushed;
  written.base = base_generation_;
  begun_base_ = base_generation_;
  written.record.assign(reinterpret_cast<const char*>(&meta), sizeof(meta));
  return Status::OK();
}

Status KVStore::FinishCheckpointFiles(BegunCheckpoint* begun) {
  const WrittenCheckpoint& written = begun->written;
  Status st = flusher_.WaitFlushed(begun->first_page);
  // Every segment written so far (a superset of those below first_page: later flushes only add).
  std::vector<uint64_t> dirty;
  if (st.ok()) st = flusher_.TakeDirtySegments(&dirty);
  for (size_t i = 0; i < dirty.size() && st.ok(); ++i) {
    std::shared_ptr<SegmentFiles::File> file;
    st = segments_.Open(dirty[i], SegmentFiles::OpenMode::kMustExist, &file);
    if (st.ok() && fdatasync(file->fd) != 0) {  // kept: no later sync can be trusted with these pages
      const int err = errno;
      st = flusher_.FailSync(Status::IOError(
          "syncing " + file->path + ": " + ErrnoText(err) +
          " (a checkpoint's sync of the log failed: pages written since the last checkpoint may not be on disk, "
          "so no later checkpoint is taken; reopening the store goes back to the last one)"));
    } else if (!st.ok()) {  // the segment could not be opened: still dirty for the next try
      flusher_.ReturnDirtySegments(dirty.begin() + static_cast<long>(i), dirty.end());
    }
  }
  if (st.ok() && fdatasync(begun->snapshot_fd) != 0) {
    st = Status::IOError("syncing " + SnapshotPath(written.sequence) + ": " + ErrnoText(errno));
  }
  if (st.ok() && begun->image_fd >= 0 && fdatasync(begun->image_fd) != 0) {
    st = Status::IOError("syncing " + IndexImagePath(written.sequence) + ": " + ErrnoText(errno));
  }
  if (st.ok() && written.previous_moves) {
    st = WriteCheckpointRecord(path_ + "/CHECKPOINT.previous", written.previous_record);
  }
  if (st.ok()) st = WriteCheckpointRecord(path_ + "/CHECKPOINT", written.record, &begun->renamed);
  if (!st.ok() && !begun->renamed) {
    DiscardBegunFiles(begun);
    return st;
  }
  for (int* fd : {&begun->snapshot_fd, &begun->image_fd}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
  if (st.ok() && !written.kept_previous) unlink((path_ + "/CHECKPOINT.previous").c_str());
  return st;
}

void KVStore::CommitCheckpointLocked(const WrittenCheckpoint& written, ObsoleteFiles* obsolete) {
  // What neither kept checkpoint needs goes: the snapshot of the previous one when the committed
  // latest takes its place, else the latest's (replaced: uncommitted, or nothing kept beside it).
  const uint64_t dropped = written.previous_moves ? previous_sequence_ : checkpoint_sequence_;
  const uint64_t old_latest = image_sequence_, old_previous = previous_image_sequence_;
  unnamed_bases_.insert(unnamed_bases_.end(), {checkpointed_base_, previous_base_});  // may go now
  if (written.previous_moves) {
    previous_sequence_ = checkpoint_sequence_;
    previous_begin_ = checkpointed_begin_;
    previous_image_sequence_ = image_sequence_;
    previous_base_ = checkpointed_base_;
  } else if (!written.kept_previous) {
    previous_sequence_ = written.sequence;
    previous_begin_ = written.begin;
    previous_image_sequence_ = written.image;
    previous_base_ = written.base;
  }
  checkpointed_base_ = written.base;
  begun_base_ = 0;
  CollectObsoleteBases(obsolete);
  checkpoint_sequence_ = written.sequence;  // never reused, even if what follows fails
  checkpoint_record_ = written.record;
  checkpointed_changes_ = written.changes;
  checkpointed_begin_ = written.begin;
  latest_committed_ = !written.kept_previous;  // with nothing kept beside it, there is nothing to go back to
  if (dropped > 0 && dropped != previous_sequence_) obsolete->files.push_back(SnapshotPath(dropped));
  // Index images go once neither kept checkpoint names them.
  image_sequence_ = written.image;
  image_flushed_ = written.image_flushed;
  image_sound_ = written.image != 0;
  for (uint64_t old : {old_latest, old_previous != old_latest ? old_previous : 0}) {
    if (old && old != image_sequence_ && old != previous_image_sequence_)
      obsolete->files.push_back(IndexImagePath(old));
  }
  // Compacted segments go once neither kept checkpoint starts at or before them. A compaction
  // that finished while the files were written moved begin_ past written.begin: its segments
  // stay for the next checkpoint.
  const uint64_t keep_from = SegmentOfSlot(std::min(previous_begin_, written.begin));
  std::vector<uint64_t> kept;
  for (uint64_t s : compacted_segments_) {
    (s >= keep_from ? kept : obsolete->segments).push_back(s);
  }
  compacted_segments_.swap(kept);
  ++checkpoints_;
}

Status KVStore::CommitCheckpoint(uint64_t sequence) {
  MLKV_RETURN_IF_ERROR(RefuseWrite("commit_checkpoint"));
  MLKV_RETURN_IF_ERROR(RefuseIfBegun("commit a checkpoint"));
  MutexLock one_checkpoint(&checkpoint_mu_);
  WaitNoBegunCheckpoint(one_checkpoint);  // one a compaction began meanwhile
  WriterLock lock(&mu_);
  if (closed_) return Status::InvalidArgument("store at " + path_ + " is closed");
  if (sequence == checkpoint_sequence_) {
    latest_committed_ = true;
    return Status::OK();
  }
  if (sequence == previous_sequence_ && !latest_committed_) return Status::OK();  // committed already
  return Status::InvalidArgument("store at " + path_ + " cannot commit checkpoint " + std::to_string(sequence) +
                                 ": its latest is " + std::to_string(checkpoint_sequence_) + " and the one it keeps " +
                                 std::to_string(previous_sequence_));
}

void KVStore::RemoveObsoleteFiles(const ObsoleteFiles& obsolete) {
  for (const std::string& file : obsolete.files) unlink(file.c_str());
  for (uint64_t s : obsolete.segments) {
    unlink(segments_.PathOf(s).c_str());
    segments_.Forget(s);  // the checkpoint's own sync may have reopened it
  }
}

}  // namespace mlkv
