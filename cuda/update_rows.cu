// The fused optimizer over cache slots on the GPU: one thread per row applies
// the same rule as the CPU path (row_ops.h), so both devices train alike.
// Only CUDA's runtime and c10's 16-bit float types are used here, so the file
// also compiles against a CPU build of torch (CI checks that with nvcc).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include "cuda_kernels.h"

namespace mlkv {

namespace {

template <typename W>
__global__ void UpdateSlotsKernel(OptimizerSpec spec, float adam_scale, float* slots, const int64_t* slot_index,
                                  const float* grads, int64_t n, int64_t dim, int64_t weight_words, int64_t row_words) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float* row = slots + slot_index[i] * row_words;
  UpdateRow<W>(spec, adam_scale, reinterpret_cast<W*>(row), row + weight_words, grads + i * dim, dim);
}

template <typename W>
cudaError_t Launch(const SlotUpdate& u, cudaStream_t stream) {
  constexpr int kThreads = 128;
  const int64_t blocks = (u.rows + kThreads - 1) / kThreads;
  UpdateSlotsKernel<W><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      u.spec, u.adam_scale, u.slots, u.slot_index, u.grads, u.rows, u.dim, u.weight_words, u.row_words);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchSlotUpdate(const SlotUpdate& u, cudaStream_t stream) {
  if (u.rows == 0) return cudaSuccess;
  switch (u.weight_type) {
    case WeightType::kFloat32: return Launch<float>(u, stream);
    case WeightType::kFloat16: return Launch<c10::Half>(u, stream);
    case WeightType::kBFloat16: return Launch<c10::BFloat16>(u, stream);
    case WeightType::kFloat64: return Launch<double>(u, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace mlkv
