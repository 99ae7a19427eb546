// The byte layout of a KVStore's files, in one place: the records of the log
// (segment files and snapshots), CHECKPOINT and the index image. docs/format.md
// describes the same bytes for a reader of the files.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace mlkv {

constexpr uint16_t kRecordMagic = 0x4B56;  // "VK" little-endian
constexpr uint16_t kFlagTombstone = 1;
// 2: CHECKPOINT names a base run (96 bytes). A version-1 CHECKPOINT (88 bytes, no base run) is read
// as version 2 with none.
constexpr uint32_t kFormatVersion = 2;

// Every record starts with this header; the value bytes follow.
struct RecordHeader {
  int64_t key;
  uint32_t checksum;  // CRC-32C over key, magic, flags and the value
  uint16_t magic;
  uint16_t flags;
};
static_assert(sizeof(RecordHeader) == 16, "record header is 16 bytes");

// The CHECKPOINT file: the whole of it, little-endian.
struct CheckpointMeta {
  char magic[8];
  uint32_t format_version;
  uint32_t dim;
  uint32_t element_type;
  uint32_t record_bytes;
  uint64_t page_bytes;
  uint64_t pages_per_segment;
  uint64_t sequence;
  uint64_t begin;    // first slot in the log
  uint64_t flushed;  // slots below are in segment files
  uint64_t tail;     // slots below are the log at the checkpoint
  uint64_t rows;     // keys whose latest record in the log is live, a cross-check for recovery
  uint64_t base;     // the base run the rows outside the log are in: base-<base>.run (0: none)
  // The index image recovery loads: index-<sequence - image_age>.dat, this checkpoint's own or an
  // earlier one's (the log after it is replayed); kNoIndexImage: none, the whole log is scanned.
  // Files written before images aged hold 0 here: their own image, when there is one.
  uint32_t image_age;
  uint32_t crc;      // CRC-32C of every byte before this field
};
static_assert(sizeof(CheckpointMeta) == 96, "checkpoint file is 96 bytes");
// Version 1's CHECKPOINT: the same fields but `base`, 88 bytes.
constexpr size_t kCheckpointV1Bytes = 88;
constexpr size_t kCheckpointV1ImageAge = 80;
constexpr char kCheckpointMagic[8] = {'M', 'L', 'K', 'V', 'C', 'K', 'P', 'T'};
constexpr uint32_t kNoIndexImage = ~0u;

// The checkpoint whose index image `meta` names (0: none).
inline uint64_t IndexImageOf(const CheckpointMeta& meta) {
  return meta.image_age == kNoIndexImage || meta.image_age >= meta.sequence ? 0 : meta.sequence - meta.image_age;
}

inline uint64_t CheckpointSequenceOf(const std::string& record) {
  CheckpointMeta meta;
  std::memcpy(&meta, record.data(), sizeof(meta));
  return meta.sequence;
}

// The index-<seq>.dat file's header; the index's regions follow it.
struct IndexImageHeader {
  char magic[8];
  uint32_t format_version;
  uint32_t crc;       // CRC-32C of the words from `sequence` to `key_bits`, then of every region's bytes
  uint64_t sequence;  // the checkpoint it belongs to
  uint64_t size, buckets, overflow, free;  // HashIndex::ImageCounts
  // Log slots below were on disk when the image was taken, never to change; the records from here
  // on (in the mutable region then, or written since) are replayed over the image. 0 in images
  // written before images aged, which only their own checkpoint loads.
  uint64_t flushed;
  uint64_t key_bits;  // the index's hash width (HashIndex::key_bits): an index of other keys cannot load it
};
static_assert(sizeof(IndexImageHeader) == 72, "index image header is 72 bytes");
// The header's words its checksum covers: sequence, the counts, flushed (a later checkpoint's
// replay starts at flushed) and key_bits. An image whose checksum does not match is not trusted:
// the log is scanned instead.
constexpr size_t kIndexImageCheckedWords = 7;
static_assert(offsetof(IndexImageHeader, key_bits) - offsetof(IndexImageHeader, sequence) ==
                  (kIndexImageCheckedWords - 1) * sizeof(uint64_t),
              "the checked words lie side by side");
constexpr char kIndexImageMagic[8] = {'M', 'L', 'K', 'V', 'I', 'N', 'D', 'X'};
constexpr uint32_t kIndexImageVersion = 2;
// Version 1's header: the same fields but key_bits (its keys had 63), 64 bytes, one word less checked.
constexpr size_t kIndexImageV1Bytes = 64;

}  // namespace mlkv
