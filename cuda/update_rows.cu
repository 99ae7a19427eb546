// The fused optimizer over cache slots on the GPU: one warp per row, its lanes over the row's
// elements (coalesced), applying the rules of row_ops.h element by element, so both devices
// train alike. Only CUDA's runtime and c10's 16-bit float types are used here, so the file
// also compiles against a CPU build of torch (CI checks that with nvcc).
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include "cache/cuda_kernels.h"

namespace mlkv {

namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;

// A float64 weight as two 32-bit words: in rows of an odd number of words (row-wise Adagrad's
// one state word) a double lies 4-byte aligned only, and the GPU loads doubles 8-byte aligned.
struct Float64InWords {
  uint32_t lo, hi;
  __device__ explicit Float64InWords(float v) {
    const long long bits = __double_as_longlong(static_cast<double>(v));
    lo = static_cast<uint32_t>(bits);
    hi = static_cast<uint32_t>(static_cast<unsigned long long>(bits) >> 32);
  }
  __device__ explicit operator float() const {
    return static_cast<float>(
        __longlong_as_double(static_cast<long long>((static_cast<unsigned long long>(hi) << 32) | lo)));
  }
};

template <OptimizerKind K, typename W>
__global__ void UpdateSlotsKernel(OptimizerSpec spec, float adam_scale, float* slots, const int32_t* slot_index,
                                  const float* grads, uint8_t* dirty, int64_t n, int64_t dim, int64_t weight_words,
                                  int64_t row_words) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  if (i >= n) return;  // the whole warp
  const int32_t slot = slot_index[i];
  if (slot < 0) return;  // not cached: the host updates it
  if (lane == 0) dirty[slot] = 1;
  float* row = slots + static_cast<int64_t>(slot) * row_words;
  W* weights = reinterpret_cast<W*>(row);
  float* state = row + weight_words;
  const float* grad = grads + i * dim;
  float row_scale = 0.f;
  if constexpr (K == OptimizerKind::kRowWiseAdagrad) {
    float sum = 0.f;
    for (int64_t j = lane; j < dim; j += kWarp) sum += grad[j] * grad[j];
    for (int offset = kWarp / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    const float updated = RowWiseAdagradState(state[0], sum, dim);  // every lane reads the old state
    row_scale = RowWiseAdagradScale(spec, updated);
    __syncwarp();
    if (lane == 0) state[0] = updated;
  }
  for (int64_t j = lane; j < dim; j += kWarp) {
    UpdateElement<K, W>(spec, adam_scale, row_scale, weights, state, grad, dim, j);
  }
}

template <OptimizerKind K, typename W>
cudaError_t Launch(const SlotUpdate& u, cudaStream_t stream) {
  const int64_t blocks = (u.rows * kWarp + kThreads - 1) / kThreads;
  UpdateSlotsKernel<K, W><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      u.spec, u.adam_scale, u.slots, u.slot_index, u.grads, u.dirty, u.rows, u.dim, u.weight_words, u.row_words);
  return cudaGetLastError();
}

template <typename W>
cudaError_t LaunchFor(const SlotUpdate& u, cudaStream_t stream) {
  switch (u.spec.kind) {
    case OptimizerKind::kSGD: return Launch<OptimizerKind::kSGD, W>(u, stream);
    case OptimizerKind::kAdagrad: return Launch<OptimizerKind::kAdagrad, W>(u, stream);
    case OptimizerKind::kRowWiseAdagrad: return Launch<OptimizerKind::kRowWiseAdagrad, W>(u, stream);
    case OptimizerKind::kAdam: return Launch<OptimizerKind::kAdam, W>(u, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t LaunchSlotUpdate(const SlotUpdate& u, cudaStream_t stream) {
  if (u.rows == 0) return cudaSuccess;
  switch (u.weight_type) {
    case WeightType::kFloat32: return LaunchFor<float>(u, stream);
    case WeightType::kFloat16: return LaunchFor<c10::Half>(u, stream);
    case WeightType::kBFloat16: return LaunchFor<c10::BFloat16>(u, stream);
    case WeightType::kFloat64: return LaunchFor<Float64InWords>(u, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace mlkv
