#include "id_activity.h"

#include <algorithm>
#include <numeric>

#include "cache/embedding_cache.h"

namespace mlkv {

IdActivity::IdActivity(std::vector<ActivityPolicy> tables) : tables_(std::move(tables)), live_(tables_.size(), 0) {
  for (const ActivityPolicy& p : tables_) {
    TORCH_CHECK_VALUE(p.admit_after >= 1, "admit_after must be >= 1, got ", p.admit_after);
    TORCH_CHECK_VALUE(p.decay_rate > 0 && p.decay_rate <= 1, "decay_rate must be in (0, 1], got ", p.decay_rate);
    TORCH_CHECK_VALUE(p.ttl >= 0 && p.trigger_ids >= 0 && p.keep_ids >= 0 && p.count_threshold >= 0,
                      "ttl, trigger_ids, keep_ids and count_threshold must be non-negative");
  }
}

int64_t IdActivity::BytesPerId() {
  // The vectors' entries, and the index's buckets at three quarters full at most (IdMap).
  return static_cast<int64_t>(sizeof(int64_t) + sizeof(float) + sizeof(int64_t) + 2 * sizeof(uint8_t) +
                              IdMap::kBucketBytes * 4 / 3);
}

namespace {

constexpr uint8_t kLookedUpSinceMark = 1, kHeldAtMark = 2;

void CheckKeys(const torch::Tensor& keys) {
  TORCH_CHECK_VALUE(
      keys.scalar_type() == torch::kInt64 && keys.dim() == 1 && keys.device().is_cpu() && keys.is_contiguous(),
      "keys must be a contiguous 1-D int64 CPU tensor");
}

// bool [n]: holds_row(key) of each key, in order.
template <typename HoldsRow>
torch::Tensor EachKey(const torch::Tensor& keys, HoldsRow holds_row) {
  CheckKeys(keys);
  const int64_t n = keys.numel();
  const int64_t* key = keys.data_ptr<int64_t>();
  torch::Tensor holds = torch::empty({n}, torch::kBool);
  bool* out = holds.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) out[i] = holds_row(key[i]);
  return holds;
}

}  // namespace

const ActivityPolicy& IdActivity::PolicyOf(int64_t key) const {
  const int64_t table = TableOf(key);
  TORCH_CHECK_VALUE(key >= 0 && table < static_cast<int64_t>(tables_.size()), "key ", key, " is of no table");
  return tables_[static_cast<size_t>(table)];
}

torch::Tensor IdActivity::Observe(const torch::Tensor& keys, int64_t now) {
  return EachKey(keys, [&](int64_t key) {
    const ActivityPolicy& p = PolicyOf(key);
    if (!p.tracked) return true;
    TORCH_CHECK(keys_.size() < static_cast<size_t>(INT32_MAX), "more than 2^31 ids tracked by one kernel");
    int32_t at = index_.Find(key);
    if (at < 0) {
      at = static_cast<int32_t>(keys_.size());
      index_.Insert(key, at);
      keys_.push_back(key);
      counts_.push_back(0);
      last_.push_back(now);
      holds_row_.push_back(0);
      since_mark_.push_back(0);
    }
    counts_[at] += 1;
    last_[at] = now;
    if (!holds_row_[at] && counts_[at] >= static_cast<float>(p.admit_after)) {
      holds_row_[at] = 1;
      ++live_[static_cast<size_t>(TableOf(key))];
    }
    if (holds_row_[at]) since_mark_[at] |= kLookedUpSinceMark;
    return holds_row_[at] != 0;
  });
}

torch::Tensor IdActivity::Holds(const torch::Tensor& keys) const {
  return EachKey(keys, [&](int64_t key) {
    if (!PolicyOf(key).tracked) return true;
    const int32_t at = index_.Find(key);
    return at >= 0 && holds_row_[static_cast<size_t>(at)] != 0;
  });
}

bool IdActivity::Due(int64_t table) const {
  const ActivityPolicy& p = tables_.at(static_cast<size_t>(table));
  return p.tracked && p.trigger_ids > 0 && live_[static_cast<size_t>(table)] > p.trigger_ids;
}

std::tuple<torch::Tensor, torch::Tensor> IdActivity::Pick(int64_t table, int64_t now) {
  const ActivityPolicy& p = tables_.at(static_cast<size_t>(table));
  std::vector<int64_t> with_rows, without_rows;
  std::vector<int32_t> kept;  // ids of the table holding rows that the rule keeps
  for (size_t i = 0; i < keys_.size(); ++i) {
    if (TableOf(keys_[i]) != table) continue;
    counts_[i] *= static_cast<float>(p.decay_rate);
    const bool rare = counts_[i] < static_cast<float>(p.count_threshold);
    const bool expired = now - last_[i] > p.ttl;
    bool evict = false;
    switch (p.rule) {
      case EvictionRule::kNone: break;
      case EvictionRule::kCount: evict = rare; break;
      case EvictionRule::kTimestamp: evict = expired; break;
      case EvictionRule::kCountAndTimestamp: evict = rare && expired; break;
    }
    // An id without a row is dropped when the rule picks it; it costs memory, not a row.
    if (evict) {
      (holds_row_[i] ? with_rows : without_rows).push_back(keys_[i]);
    } else if (holds_row_[i]) {
      kept.push_back(static_cast<int32_t>(i));
    }
  }
  if (p.keep_ids > 0 && static_cast<int64_t>(kept.size()) > p.keep_ids) {
    // The weakest first: the lowest count, then the least recently looked up, then the key (a
    // deterministic order, so two runs of the same batches evict the same ids).
    const size_t excess = kept.size() - static_cast<size_t>(p.keep_ids);
    auto weaker = [this](int32_t a, int32_t b) {
      if (counts_[a] != counts_[b]) return counts_[a] < counts_[b];
      if (last_[a] != last_[b]) return last_[a] < last_[b];
      return keys_[a] < keys_[b];
    };
    std::nth_element(kept.begin(), kept.begin() + static_cast<std::ptrdiff_t>(excess), kept.end(), weaker);
    for (size_t k = 0; k < excess; ++k) with_rows.push_back(keys_[kept[k]]);
  }
  std::sort(with_rows.begin(), with_rows.end());
  std::sort(without_rows.begin(), without_rows.end());
  return {torch::tensor(with_rows, torch::kInt64), torch::tensor(without_rows, torch::kInt64)};
}

void IdActivity::Erase(int64_t key) {
  const int32_t at = index_.Find(key);
  if (at < 0) return;
  if (holds_row_[at]) --live_[static_cast<size_t>(TableOf(key))];
  if (since_mark_[at] & kHeldAtMark) gone_.push_back(key);
  // The last entry moves into the hole.
  const size_t last = keys_.size() - 1;
  if (static_cast<size_t>(at) != last) {
    keys_[at] = keys_[last];
    counts_[at] = counts_[last];
    last_[at] = last_[last];
    holds_row_[at] = holds_row_[last];
    since_mark_[at] = since_mark_[last];
    *index_.FindMutable(keys_[at]) = at;
  }
  index_.Erase(key);
  keys_.pop_back();
  counts_.pop_back();
  last_.pop_back();
  holds_row_.pop_back();
  since_mark_.pop_back();
}

void IdActivity::Forget(const torch::Tensor& keys) {
  CheckKeys(keys);
  const int64_t* key = keys.data_ptr<int64_t>();
  for (int64_t i = 0; i < keys.numel(); ++i) Erase(key[i]);
}

void IdActivity::Mark() {
  for (size_t i = 0; i < keys_.size(); ++i) since_mark_[i] = holds_row_[i] ? kHeldAtMark : 0;
  gone_.clear();
  gone_.shrink_to_fit();
}

std::tuple<torch::Tensor, torch::Tensor> IdActivity::Changes() const {
  std::vector<int64_t> looked_up;
  for (size_t i = 0; i < keys_.size(); ++i) {
    if (holds_row_[i] && (since_mark_[i] & kLookedUpSinceMark)) looked_up.push_back(keys_[i]);
  }
  std::vector<int64_t> gone;  // an id gone and back since holds a row: a row, not a tombstone
  for (int64_t key : gone_) {
    const int32_t at = index_.Find(key);
    if (at < 0 || !holds_row_[static_cast<size_t>(at)]) gone.push_back(key);
  }
  std::sort(looked_up.begin(), looked_up.end());
  std::sort(gone.begin(), gone.end());
  gone.erase(std::unique(gone.begin(), gone.end()), gone.end());
  return {torch::tensor(looked_up, torch::kInt64), torch::tensor(gone, torch::kInt64)};
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor> IdActivity::State() const {
  const int64_t n = static_cast<int64_t>(keys_.size());
  torch::Tensor keys = torch::empty({n}, torch::kInt64), counts = torch::empty({n}, torch::kFloat32),
                last = torch::empty({n}, torch::kInt64), holds = torch::empty({n}, torch::kBool);
  std::copy(keys_.begin(), keys_.end(), keys.data_ptr<int64_t>());
  std::copy(counts_.begin(), counts_.end(), counts.data_ptr<float>());
  std::copy(last_.begin(), last_.end(), last.data_ptr<int64_t>());
  std::transform(holds_row_.begin(), holds_row_.end(), holds.data_ptr<bool>(), [](uint8_t h) { return h != 0; });
  return {keys, counts, last, holds};
}

void IdActivity::Restore(const torch::Tensor& keys, const torch::Tensor& counts, const torch::Tensor& last,
                         const torch::Tensor& holds_row) {
  const int64_t n = keys.numel();
  TORCH_CHECK_VALUE(keys.scalar_type() == torch::kInt64 && counts.scalar_type() == torch::kFloat32 &&
                        last.scalar_type() == torch::kInt64 && holds_row.scalar_type() == torch::kBool &&
                        counts.numel() == n && last.numel() == n && holds_row.numel() == n,
                    "activity state: keys int64, counts float32, last int64, holds_row bool, all [n]");
  index_ = IdMap(static_cast<size_t>(std::max<int64_t>(n, 16)));
  keys_.clear();
  counts_.clear();
  last_.clear();
  holds_row_.clear();
  since_mark_.clear();
  gone_.clear();
  std::fill(live_.begin(), live_.end(), 0);
  const torch::Tensor k = keys.contiguous().cpu(), c = counts.contiguous().cpu(), l = last.contiguous().cpu(),
                      h = holds_row.contiguous().cpu();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t key = k.data_ptr<int64_t>()[i];
    TORCH_CHECK_VALUE(PolicyOf(key).tracked, "activity state: key ", key, " is of a table without a policy");
    TORCH_CHECK_VALUE(index_.Find(key) < 0, "activity state: key ", key, " twice");
    index_.Insert(key, static_cast<int32_t>(keys_.size()));
    keys_.push_back(key);
    counts_.push_back(c.data_ptr<float>()[i]);
    last_.push_back(l.data_ptr<int64_t>()[i]);
    const bool holds = h.data_ptr<bool>()[i];
    holds_row_.push_back(holds ? 1 : 0);
    since_mark_.push_back(holds ? kHeldAtMark : 0);  // a restored state is the mark changes are followed from
    if (holds) ++live_[static_cast<size_t>(TableOf(key))];
  }
}

}  // namespace mlkv
