// Entry points of the CUDA kernels in cuda/ (linked only with MLKV_WITH_CUDA).
// Plain pointers and a stream, so the kernels build without torch's CUDA headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "row_ops.h"

namespace mlkv {

// One optimizer step, in place, on rows `slot_index[0..rows)` (distinct, on
// the device) of the cache `slots` (row_words float32 words per row), with
// gradient rows `grads` [rows, dim] float32 on the device.
struct SlotUpdate {
  OptimizerSpec spec;
  float adam_scale;
  WeightType weight_type;
  float* slots;
  const int64_t* slot_index;
  const float* grads;
  int64_t rows, dim, weight_words, row_words;
};

cudaError_t LaunchSlotUpdate(const SlotUpdate& update, cudaStream_t stream);

}  // namespace mlkv
