// CutState: the cut of an EmbeddingCache being written (cut.cpp tells the protocol). It changes
// together with the slots it marks, so it has no lock of its own: the cache holds it under its mu_.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache/write_back_buffer.h"
#include "engine/status.h"

namespace mlkv {

// kWriting: the cut's rows go to the stores; kSealed: every store began its checkpoint (`begun`
// says which did), and rows written later may follow; kSyncing: a call finishes those checkpoints;
// kDone: they are durable (or failed), until FinishCut takes the outcome.
enum class CutPhase { kNone, kWriting, kSealed, kSyncing, kDone };

struct CutState {
  CutState(int64_t row_words, size_t host_slots) : rows(row_words, 0), marked(host_slots, 0) {}

  // Host bytes of the marks of a cache of `capacity` slots in host memory.
  static size_t HostBytes(int64_t capacity) { return static_cast<size_t>(capacity) * sizeof(uint8_t); }
  // Marked slots not yet copied out.
  size_t slots_left() const { return slots.size() - std::min(next, slots.size()); }

  CutPhase phase = CutPhase::kNone;
  WriteBackBuffer rows;            // the cut's rows on their way to the stores, before any row written later
  std::vector<uint8_t> marked;     // per host slot: it still holds its cut value (copy on write)
  std::vector<int32_t> slots;      // the marked slots, copied out from `next` on
  size_t next = 0;
  std::vector<uint8_t> begun;      // per table: its store began the cut's checkpoint
  std::vector<int64_t> sequences;  // per table: the checkpoint its store made (0: none numbered)
  Status error;                    // what failed, kept until FinishCut takes it
};

}  // namespace mlkv
