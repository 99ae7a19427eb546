// Entry points of the CUDA kernels in cuda/ (linked only with MLKV_WITH_CUDA).
// Plain pointers and a stream, so the kernels build without torch's CUDA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "row_ops.h"

namespace mlkv {

// One optimizer step, in place, on rows `slot_index[0..rows)` (distinct, on the device; rows
// with slot -1 are skipped) of the cache `slots` (row_words float32 words per row), with
// gradient rows `grads` [rows, dim] float32 on the device. Marks each updated slot in `dirty`.
struct SlotUpdate {
  OptimizerSpec spec;
  float adam_scale;
  WeightType weight_type;
  float* slots;
  const int32_t* slot_index;
  const float* grads;
  uint8_t* dirty;
  int64_t rows, dim, weight_words, row_words;
};

cudaError_t LaunchSlotUpdate(const SlotUpdate& update, cudaStream_t stream);

// The keys (table << table_shift | id) of `n` values of a batch of features: feature f holds
// values [feature_ends[f - 1], feature_ends[f]) of table feature_tables[f]. Ids outside
// [0, table_rows[table]) add to counters[0].
struct BatchKeysArgs {
  const int64_t* values;
  int64_t n;
  const int64_t* feature_ends;
  const int64_t* feature_tables;
  int64_t features;
  const int64_t* table_rows;
  int table_shift;
  int64_t* keys;
  int64_t* counters;
};

cudaError_t LaunchBatchKeys(const BatchKeysArgs& args, cudaStream_t stream);

// Slots of `n` keys in a copy of an IdMap (bucket_ids, bucket_slots; `buckets` of them), -1 for a
// key not in it. Misses add to counters[1], hits of table t to counters[2 + t].
struct FindSlotsArgs {
  const int64_t* bucket_ids;
  const int32_t* bucket_slots;
  uint64_t buckets;
  const int64_t* keys;
  int64_t n;
  int table_shift;
  int64_t tables;
  int32_t* slots;
  int64_t* counters;
};

cudaError_t LaunchFindSlots(const FindSlotsArgs& args, cudaStream_t stream);

}  // namespace mlkv
