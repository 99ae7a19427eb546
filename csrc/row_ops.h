// Row-level operations shared by the embedding cache, the bindings and the
// CUDA kernels: the layout of a table row, initial values of rows never
// written, and the fused sparse optimizer rules.
//
// A row is a run of 32-bit words: the weights first (dim elements of the
// table's weight type; two 16-bit weights share a word), then the optimizer
// state as float32. One store read brings both.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define MLKV_HOST_DEVICE __host__ __device__
#else
#define MLKV_HOST_DEVICE
#endif

namespace mlkv {

enum class WeightType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };

// 32-bit words holding `dim` weights of type `t`.
inline int64_t WeightWords(WeightType t, int64_t dim) {
  switch (t) {
    case WeightType::kFloat32: return dim;
    case WeightType::kFloat64: return 2 * dim;
    default: return (dim + 1) / 2;
  }
}

enum class OptimizerKind : int { kSGD = 0, kAdagrad = 1, kRowWiseAdagrad = 2, kAdam = 3 };

struct OptimizerSpec {
  OptimizerKind kind = OptimizerKind::kSGD;
  float lr = 0.01f;
  float eps = 1e-8f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
};

// Optimizer state floats kept per row beside `dim` weights.
inline int64_t StateColumns(OptimizerKind kind, int64_t dim) {
  switch (kind) {
    case OptimizerKind::kSGD: return 0;
    case OptimizerKind::kAdagrad: return dim;
    case OptimizerKind::kRowWiseAdagrad: return 1;
    case OptimizerKind::kAdam: return 2 * dim;  // first moment, then second moment
  }
  return 0;
}

// -Adam's step size at `step` (from 1), computed in double as SparseAdam does.
inline float AdamStepScale(const OptimizerSpec& s, int64_t step) {
  const double b1 = s.beta1, b2 = s.beta2;
  return static_cast<float>(-(s.lr * std::sqrt(1.0 - std::pow(b2, static_cast<double>(step))) /
                              (1.0 - std::pow(b1, static_cast<double>(step)))));
}

// Element j of one step of rule K: `weights` [dim] (float, or a 16-bit type with float
// conversions), `state` the row's floats, `grad` the coalesced gradient row; `row_scale` is
// RowWiseAdagrad's step size for the row (RowWiseAdagradScale). The operations follow the reference
// of each rule in order, and fuse a multiply-add where its CPU kernel does (torch's add with alpha
// and addcmul run as FMAs), so float32 results are equal to the bit (see mlkv_torch/optim.py).
template <OptimizerKind K, typename W>
MLKV_HOST_DEVICE inline void UpdateElement(const OptimizerSpec& s, float adam_scale, float row_scale, W* weights,
                                           float* state, const float* grad, int64_t dim, int64_t j) {
  if constexpr (K == OptimizerKind::kSGD) {
    weights[j] = static_cast<W>(fmaf(-s.lr, grad[j], static_cast<float>(weights[j])));
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    state[j] = fmaf(grad[j], grad[j], state[j]);
    weights[j] = static_cast<W>(static_cast<float>(weights[j]) - s.lr * grad[j] / (sqrtf(state[j]) + s.eps));
  } else if constexpr (K == OptimizerKind::kRowWiseAdagrad) {
    weights[j] = static_cast<W>(static_cast<float>(weights[j]) - grad[j] * row_scale);
  } else {
    float* exp_avg = state;
    float* exp_avg_sq = state + dim;
    exp_avg[j] += (grad[j] - exp_avg[j]) * (1.f - s.beta1);
    exp_avg_sq[j] += (grad[j] * grad[j] - exp_avg_sq[j]) * (1.f - s.beta2);
    const float denom = sqrtf(exp_avg_sq[j]) + s.eps;
    weights[j] = static_cast<W>(static_cast<float>(weights[j]) + adam_scale * (exp_avg[j] / denom));
  }
}

// RowWiseAdagrad's row state after a gradient row whose squares sum to `sum_squares`, and the
// step size it gives.
MLKV_HOST_DEVICE inline float RowWiseAdagradState(float state, float sum_squares, int64_t dim) {
  return state + sum_squares / static_cast<float>(dim);
}
MLKV_HOST_DEVICE inline float RowWiseAdagradScale(const OptimizerSpec& s, float state) {
  return s.lr / (sqrtf(state) + s.eps);
}

template <OptimizerKind K, typename W>
MLKV_HOST_DEVICE inline void UpdateRowWith(const OptimizerSpec& s, float adam_scale, W* weights, float* state,
                                           const float* grad, int64_t dim) {
  float row_scale = 0.f;
  if constexpr (K == OptimizerKind::kRowWiseAdagrad) {
    float sum = 0.f;
    for (int64_t j = 0; j < dim; ++j) sum += grad[j] * grad[j];
    state[0] = RowWiseAdagradState(state[0], sum, dim);
    row_scale = RowWiseAdagradScale(s, state[0]);
  }
  for (int64_t j = 0; j < dim; ++j) UpdateElement<K, W>(s, adam_scale, row_scale, weights, state, grad, dim, j);
}

// One step of the rule on one row, element after element.
template <typename W>
MLKV_HOST_DEVICE inline void UpdateRow(const OptimizerSpec& s, float adam_scale, W* weights, float* state,
                                       const float* grad, int64_t dim) {
  switch (s.kind) {
    case OptimizerKind::kSGD: UpdateRowWith<OptimizerKind::kSGD>(s, adam_scale, weights, state, grad, dim); break;
    case OptimizerKind::kAdagrad:
      UpdateRowWith<OptimizerKind::kAdagrad>(s, adam_scale, weights, state, grad, dim);
      break;
    case OptimizerKind::kRowWiseAdagrad:
      UpdateRowWith<OptimizerKind::kRowWiseAdagrad>(s, adam_scale, weights, state, grad, dim);
      break;
    case OptimizerKind::kAdam: UpdateRowWith<OptimizerKind::kAdam>(s, adam_scale, weights, state, grad, dim); break;
  }
}

// Initial value of rows never written: element j of row `id` is uniform in
// [low, low + span) (or normal with mean `low` and deviation `span`), a
// function of (seed, id, j) alone.
MLKV_HOST_DEVICE inline uint64_t SplitMix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct RowInit {
  uint64_t seed = 0;
  float low = 0.f;
  float span = 0.f;
  // Column j of a row draws the value of column first_column + j of the full
  // row, so a column shard starts as its slice of the unsharded table.
  int64_t first_column = 0;
  bool normal = false;  // normal(low, span) instead of uniform [low, low + span)
  // Row `id` draws the values of row first_row + id of the full table, so a row shard (ids local
  // to its block) starts as its block of the unsharded table.
  int64_t first_row = 0;
};

inline void InitialRow(const RowInit& init, int64_t id, int64_t dim, float* out) {
  const uint64_t row_part = (init.seed * 0x9E3779B97F4A7C15ull) ^
                            SplitMix64(static_cast<uint64_t>(id + init.first_row) + 0xD1B54A32D192ED03ull);
  for (int64_t j = 0; j < dim; ++j) {
    const uint64_t z = SplitMix64(row_part + static_cast<uint64_t>(j + init.first_column) * 0x8CB92BA72F3D8DD7ull);
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);  // 24 random bits, in [0, 1)
    if (!init.normal) {
      out[j] = init.low + init.span * u;
      continue;
    }
    // Box-Muller over two 24-bit uniforms of the same draw; 1 - u is in (0, 1], so the log is finite.
    const float v = static_cast<float>((z >> 16) & 0xFFFFFFull) * (1.0f / 16777216.0f);
    const float radius = std::sqrt(-2.0f * std::log(1.0f - u));
    out[j] = init.low + init.span * radius * std::cos(6.2831853071795864f * v);
  }
}

}  // namespace mlkv
