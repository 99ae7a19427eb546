// EmbeddingCache on a CUDA device: the update kernel over slots, the device's dirty marks and hit
// counters, and the device-resident lookup and update of batches whose rows are all cached.
#include <cmath>

#include "cache/embedding_cache.h"

#ifdef MLKV_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "cache/cuda_kernels.h"
#endif

namespace mlkv {

void EmbeddingCache::UpdateSlotsOnDevice(const torch::Tensor& slot_index, const torch::Tensor& grads,
                                         const QueuedUpdate& u) {
#ifdef MLKV_WITH_CUDA
  // Temporaries may die before the kernel runs: the caching allocator orders their reuse on this stream.
  const torch::Tensor g = grads.contiguous();
  const OptimizerSpec spec = SpecOf(u);
  const SlotUpdate update{spec,
                          spec.kind == OptimizerKind::kAdam ? AdamStepScale(spec, u.step) : 0.f,
                          opt_.weight_type,
                          slots_.data_ptr<float>(),
                          slot_index.data_ptr<int32_t>(),
                          g.data_ptr<float>(),
                          slot_dirty_dev_.data_ptr<uint8_t>(),
                          slot_index.numel(),
                          opt_.dim,
                          weight_words_,
                          row_words_};
  const cudaError_t err = LaunchSlotUpdate(update, c10::cuda::getCurrentCUDAStream(device_.index()).stream());
  TORCH_CHECK(err == cudaSuccess, "the CUDA update kernel failed: ", cudaGetErrorString(err));
#else
  TORCH_CHECK(false, "this build of mlkv_torch has no CUDA kernels");
#endif
}

void EmbeddingCache::FoldDeviceDirty() {
  if (on_host_ || opt_.capacity == 0) return;
  const torch::Tensor marks = slot_dirty_dev_.cpu();  // after every update kernel queued before
  slot_dirty_dev_.zero_();
  slot_index_.MarkDirty(marks.data_ptr<uint8_t>());
}

#ifdef MLKV_WITH_CUDA
EmbeddingCache::DeviceLookup EmbeddingCache::LookupOnDevice(const torch::Tensor& values,
                                                            const std::vector<int64_t>& feature_counts,
                                                            const std::vector<int64_t>& feature_tables) {
  TORCH_CHECK_VALUE(!on_host_, "the device lookup needs a cache on a CUDA device");
  TORCH_CHECK_VALUE(values.scalar_type() == torch::kInt64 && values.dim() == 1 && values.device() == device_ &&
                        values.is_contiguous(),
                    "values must be a contiguous 1-D int64 tensor on ", device_);
  CheckFeatures(values.numel(), feature_counts, feature_tables);
  // No fetch admits or evicts until the slots are found: every row found cached stays cached.
  MutexLock fetch_lock(&fetch_mu_);
  const torch::Tensor counters = device_index_->NewCounters();
  const torch::Tensor keys = device_index_->BatchKeys(values, feature_counts, feature_tables, counters);
  {
    MutexLock lock(&mu_);
    ThrowIfFailed();
    TORCH_CHECK(!closed_, "the table is closed");
    if (transfer_) transfer_->UseCurrentStreamForTraining();
    device_index_->Sync();
    device_index_->FindSlots(keys, counters);  // every value: are any missing?
  }
  // The counts (and the keys' fingerprint, which says whether this is the batch read ahead) travel
  // to the host while the keys are deduplicated; the deduplication synchronises the stream (it
  // needs its output's size), so they have arrived when it returns: one synchronisation for a
  // batch whose rows are all cached.
  const int64_t n_counters = counters.numel();
  torch::Tensor found = torch::empty({n_counters + 1}, torch::TensorOptions().dtype(torch::kInt64).pinned_memory(true));
  found.narrow(0, 0, n_counters).copy_(counters, /*non_blocking=*/true);
  found.narrow(0, n_counters, 1).copy_(keys.sum().reshape({1}), /*non_blocking=*/true);
  auto [unique, inverse, unused_counts] = at::_unique2(keys, /*sorted=*/true, /*return_inverse=*/true);
  c10::cuda::getCurrentCUDAStream(device_.index()).synchronize();  // already done by _unique2; made explicit
  const int64_t* count = found.data_ptr<int64_t>();
  if (count[0] > 0) {  // ids outside their tables: the host's check names the first
    fetch_lock.Unlock();
    UniqueKeys(values.cpu(), feature_counts, feature_tables);
    TORCH_CHECK_VALUE(false, count[0], " ids lie outside their tables");
  }
  torch::Tensor slots;
  int64_t version;
  if (count[1] == 0) {
    MutexLock lock(&mu_);
    // The batch read ahead keeps its slots until its update: it says so with the read-ahead's
    // sequence, negated, where the index's version would go.
    const int32_t read_ahead = TakeReadAhead(static_cast<uint64_t>(count[n_counters]));
    slots = device_index_->FindSlots(unique, device_hits_);  // hits per table, counted on the device
    version = read_ahead > 0 ? -static_cast<int64_t>(read_ahead) : device_index_->version();
    stats_.hits += unique.numel();
    return {unique, inverse, slots_.narrow(1, 0, weight_words_).index_select(0, slots), slots, version, 0};
  }
  {
    MutexLock lock(&mu_);
    TakeReadAhead(std::nullopt);
  }
  // Misses: the host admits (and reads the rows outside the cache), then the slots are looked up again.
  fetch_lock.Unlock();
  torch::Tensor weights = Fetch(unique.cpu());
  int64_t outside;
  std::tie(slots, version, outside) = SlotsAfterFetch(unique);
  return {unique, inverse, weights, slots, version, outside};
}

std::tuple<torch::Tensor, int64_t, int64_t> EmbeddingCache::SlotsAfterFetch(const torch::Tensor& unique) {
  torch::Tensor again = device_index_->NewCounters();
  torch::Tensor slots;
  int64_t version;
  {
    MutexLock lock(&mu_);
    device_index_->Sync();
    slots = device_index_->FindSlots(unique, again);
    version = device_index_->version();
  }
  return {slots, version, again[1].item<int64_t>()};
}

void EmbeddingCache::FoldDeviceHits() {
  if (!device_hits_.defined()) return;
  const torch::Tensor hits = device_hits_.cpu();
  device_hits_.zero_();
  for (size_t t = 0; t < table_stats_.size(); ++t) table_stats_[t].hits += hits.data_ptr<int64_t>()[2 + t];
}

void EmbeddingCache::UpdateOnDevice(const torch::Tensor& keys, const torch::Tensor& slots, int64_t version,
                                    int64_t outside, const torch::Tensor& grads, int64_t step, double lr) {
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr > 0, "the learning rate must be a positive finite number, got ", lr);
  TORCH_CHECK_VALUE(!on_host_, "the device update needs a cache on a CUDA device");
  const int64_t n = keys.numel();
  TORCH_CHECK_VALUE(keys.scalar_type() == torch::kInt64 && keys.dim() == 1 && keys.device() == device_ &&
                        slots.scalar_type() == torch::kInt32 && slots.dim() == 1 && slots.numel() == n &&
                        slots.device() == device_,
                    "keys (int64) and slots (int32) must be 1-D tensors of one length on ", device_);
  TORCH_CHECK_VALUE(grads.scalar_type() == torch::kFloat32 && grads.dim() == 2 && grads.size(0) == n &&
                        grads.size(1) == opt_.dim && grads.device() == device_,
                    "grads must be a float32 [", n, ", ", opt_.dim, "] tensor on ", device_);
  MutexLock lock(&mu_);
  ThrowIfFailed();
  TORCH_CHECK(!closed_, "the table is closed");
  // A batch read ahead kept its slots unless a later lookup released its pins first; any other
  // batch kept them if the index did not change since its lookup.
  const bool slots_kept = version < 0 ? policy_.released() < -version : device_index_->Unchanged(version);
  if (version < 0) policy_.ReleaseThrough(static_cast<int32_t>(-version));
  if (!slots_kept) {  // rows moved since the lookup: by key, on the host
    Apply(QueuedUpdate{keys.cpu(), grads.contiguous(), step, static_cast<float>(lr)});
    return;
  }
  const QueuedUpdate u{keys, grads, step, static_cast<float>(lr)};
  UpdateSlotsOnDevice(slots, grads, u);
  if (outside != 0) {  // rows the cache does not hold, by the host
    const torch::Tensor positions = slots.lt(0).nonzero().squeeze(1);
    const torch::Tensor missed = keys.index_select(0, positions).cpu();
    const torch::Tensor missed_grads = grads.index_select(0, positions).cpu().contiguous();
    ApplyOutsideCache(missed.data_ptr<int64_t>(), missed.numel(), missed_grads.data_ptr<float>(), u);
  }
  ++stats_.updates_applied;
  stats_.rows_updated += n;
}
#else
void EmbeddingCache::FoldDeviceHits() {}
#endif

}  // namespace mlkv
