// EmbeddingCache's updates: the queue of optimizer steps, the applier thread that applies them in
// order (CPU), and the update of rows the cache does not hold (see embedding_cache.h).
#include <cmath>

#include "cache/embedding_cache.h"
#include "engine/thread_name.h"

namespace mlkv {

void EmbeddingCache::ThrowIfFailed() {
  if (!failed_.ok()) throw StatusError(failed_);
}

void EmbeddingCache::UpdateHostRows(float* const* rows, const float* grads, int64_t n, const QueuedUpdate& u) const {
  const OptimizerSpec spec = SpecOf(u);
  const float adam_scale = spec.kind == OptimizerKind::kAdam ? AdamStepScale(spec, u.step) : 0.f;
  DispatchWeightType(opt_.weight_type, [&](auto zero) {
    using W = decltype(zero);
    for (int64_t i = 0; i < n; ++i) {
      UpdateRow<W>(spec, adam_scale, reinterpret_cast<W*>(rows[i]), rows[i] + weight_words_, grads + i * opt_.dim,
                   opt_.dim);
    }
  });
}

void EmbeddingCache::AddPending(const int64_t* keys, int64_t n, int delta) {
  for (int64_t i = 0; i < n; ++i) {
    if (delta > 0) {
      int32_t* count = pending_.FindMutable(keys[i]);
      if (count) {
        ++*count;
      } else {
        pending_.Insert(keys[i], 1);
      }
    } else {
      int32_t* count = pending_.FindMutable(keys[i]);
      if (count && --*count == 0) pending_.Erase(keys[i]);
    }
  }
}

void EmbeddingCache::Apply(const QueuedUpdate& u) {
  const int64_t n = u.keys.numel();
  const int64_t* key = u.keys.data_ptr<int64_t>();
  const CacheSplit split = SplitByCache(key, n, /*will_write=*/true);
  const auto& [cached_pos, cached_slots, missed_pos, missed_ids] = split;
  const int64_t m = static_cast<int64_t>(missed_ids.size());
  // Under the lock throughout: the slots split above stay the rows' slots. Rows outside the
  // cache are usually staged by the fetch before, so the stores are rarely read here.
  if (on_host_) {
    torch::Tensor missed_rows = torch::empty({m, row_words_}, torch::kFloat32);
    ReadOutsideCache(missed_ids.data(), static_cast<size_t>(m), missed_rows.data_ptr<float>(), nullptr);
    std::vector<float*> rows(static_cast<size_t>(n));
    for (size_t k = 0; k < cached_pos.size(); ++k) rows[cached_pos[k]] = host_slots_ + cached_slots[k] * row_words_;
    for (int64_t j = 0; j < m; ++j) rows[missed_pos[j]] = missed_rows.data_ptr<float>() + j * row_words_;
    UpdateHostRows(rows.data(), u.grads.data_ptr<float>(), n, u);
    // Rows outside the cache go back to the stores through the write-back buffer.
    WriteBehind(missed_ids.data(), static_cast<size_t>(m), missed_rows.data_ptr<float>());
  } else {
    if (!cached_pos.empty()) {
      const torch::Tensor pos = torch::tensor(cached_pos, torch::kInt64).to(device_);
      const torch::Tensor slot_index = torch::from_blob(const_cast<int32_t*>(cached_slots.data()),
                                                        {static_cast<int64_t>(cached_slots.size())}, torch::kInt32)
                                           .to(device_);
      UpdateSlotsOnDevice(slot_index, u.grads.index_select(0, pos), u);
    }
    if (m > 0) {
      const torch::Tensor grads =
          u.grads.index_select(0, torch::tensor(missed_pos, torch::kInt64).to(device_)).cpu().contiguous();
      ApplyOutsideCache(missed_ids.data(), m, grads.data_ptr<float>(), u);
    }
  }
  if (opt_.staleness > 0) AddPending(key, n, -1);
  ++stats_.updates_applied;
  stats_.rows_updated += n;
}

void EmbeddingCache::ApplyOutsideCache(const int64_t* keys, int64_t m, const float* grads, const QueuedUpdate& u) {
  torch::Tensor rows = torch::empty({m, row_words_}, torch::kFloat32);
  float* data = rows.data_ptr<float>();
  ReadOutsideCache(keys, static_cast<size_t>(m), data, nullptr);
  std::vector<float*> row(static_cast<size_t>(m));
  for (int64_t j = 0; j < m; ++j) row[j] = data + j * row_words_;
  UpdateHostRows(row.data(), grads, m, u);
  WriteBehind(keys, static_cast<size_t>(m), data);
}

void EmbeddingCache::QueueUpdate(const torch::Tensor& keys, const torch::Tensor& grads, int64_t step, double lr) {
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr > 0, "the learning rate must be a positive finite number, got ", lr);
  CheckInt64Vector(keys, "keys");
  TORCH_CHECK_VALUE(grads.scalar_type() == torch::kFloat32 && grads.is_contiguous() && grads.dim() == 2 &&
                        grads.size(0) == keys.numel() && grads.size(1) == opt_.dim && grads.device() == device_,
                    "grads must be a contiguous float32 [", keys.numel(), ", ", opt_.dim, "] tensor on ", device_);
  // Detached: tensors of their own over the caller's storage, holding no Python tensor (an alias
  // would, as its view base), so the applier drops them without the GIL even at interpreter exit.
  QueuedUpdate u{keys.detach(), grads.detach(), step, static_cast<float>(lr)};
  if (!device_.is_cpu()) {
    // CUDA: the kernels queue on the current stream, which is already asynchronous to the host.
    MutexLock lock(&mu_);
    ThrowIfFailed();
    Apply(u);
    return;
  }
  {
    MutexLock lock(&mu_);
    ThrowIfFailed();
    TORCH_CHECK(!closed_, "the table is closed");
    if (opt_.staleness > 0) AddPending(keys.data_ptr<int64_t>(), keys.numel(), +1);
  }
  update_queue_.Push(std::move(u));
}

void EmbeddingCache::ApplierLoop() {
  NameThisThread("mlkv-applier");
  while (std::optional<QueuedUpdate> u = update_queue_.Next()) {
    {
      MutexLock lock(&mu_);
      if (failed_.ok()) {
        try {
          Apply(*u);
        } catch (const StatusError& e) {
          failed_ = e.status;
        } catch (const std::exception& e) {
          failed_ = Status::IOError(std::string("applying an update failed: ") + e.what());
        }
      }
    }
    update_queue_.Applied();
  }
}

void EmbeddingCache::PauseApplier(bool paused) { update_queue_.Pause(paused); }

void EmbeddingCache::Drain() {
  update_queue_.WaitQueuedAtMost(0);
  MutexLock lock(&mu_);
  ThrowIfFailed();
}

}  // namespace mlkv
