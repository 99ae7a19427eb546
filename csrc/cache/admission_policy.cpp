#include "cache/admission_policy.h"

#include <algorithm>

#include "id_map.h"

namespace mlkv {

namespace {

constexpr int kVictimSamples = 8;
constexpr int kVictimRounds = 4;

}  // namespace

AdmissionPolicy::AdmissionPolicy(int64_t capacity, CachePolicy policy) : capacity_(capacity), policy_(policy) {
  const size_t cap = static_cast<size_t>(capacity);
  slot_freq_.assign(cap, 0);
  slot_epoch_.assign(cap, 0);
  slot_pin_.assign(cap, 0);
  free_slots_.resize(cap);
  for (size_t i = 0; i < cap; ++i) free_slots_[i] = static_cast<int32_t>(cap - 1 - i);
  if (policy_ == CachePolicy::kLru) {
    lru_prev_.assign(cap, -1);
    lru_next_.assign(cap, -1);
  } else {
    const size_t width = SketchWidth(capacity);
    sketch_.assign(width * 2, 0);  // two rows of a count-min sketch
    sketch_mask_ = width - 1;
  }
  age_period_ = std::max<int64_t>(1024, capacity * 10);
}

size_t AdmissionPolicy::SketchWidth(int64_t capacity) {
  return PowerOfTwoAtLeast(std::max<size_t>(1024, static_cast<size_t>(capacity) * 4));
}

size_t AdmissionPolicy::HostBytes(int64_t capacity) {
  const size_t cap = static_cast<size_t>(capacity);
  const size_t per_slot = sizeof(decltype(slot_freq_)::value_type) + sizeof(decltype(slot_epoch_)::value_type) +
                          sizeof(decltype(slot_pin_)::value_type) + sizeof(decltype(free_slots_)::value_type);
  const size_t policy =
      std::max(2 * SketchWidth(capacity) * sizeof(decltype(sketch_)::value_type),  // lfu's sketch
               cap * (sizeof(decltype(lru_prev_)::value_type) + sizeof(decltype(lru_next_)::value_type)));
  return cap * per_slot + policy;
}

void AdmissionPolicy::BeginFetch() {
  if (++epoch_ == 0) {  // wrapped: no slot may look read by this fetch
    std::fill(slot_epoch_.begin(), slot_epoch_.end(), 0);
    epoch_ = 1;
  }
}

uint8_t AdmissionPolicy::CountMiss(int64_t key) { return policy_ == CachePolicy::kLfu ? SketchAdd(key) : 1; }

uint8_t AdmissionPolicy::SketchAdd(int64_t key) {
  const uint64_t h = SplitMix64(static_cast<uint64_t>(key) ^ 0x5851F42D4C957F2Dull);
  uint8_t& a = sketch_[h & sketch_mask_];
  uint8_t& b = sketch_[(sketch_mask_ + 1) + ((h >> 32) & sketch_mask_)];
  if (a < 255) ++a;
  if (b < 255) ++b;
  const uint8_t estimate = std::min(a, b);
  if (++sketch_adds_ >= age_period_) Age();
  return estimate;
}

void AdmissionPolicy::Age() {
  // Halving every count keeps the frequencies recent, so the cache follows a drifting hot set.
  for (auto& c : sketch_) c >>= 1;
  for (auto& c : slot_freq_) c >>= 1;
  sketch_adds_ = 0;
}

void AdmissionPolicy::LruUnlink(int32_t s) {
  const int32_t p = lru_prev_[s], n = lru_next_[s];
  (p >= 0 ? lru_next_[p] : lru_head_) = n;
  (n >= 0 ? lru_prev_[n] : lru_tail_) = p;
  lru_prev_[s] = lru_next_[s] = -1;
}

void AdmissionPolicy::LruPushFront(int32_t s) {
  lru_prev_[s] = -1;
  lru_next_[s] = lru_head_;
  if (lru_head_ >= 0) lru_prev_[lru_head_] = s;
  lru_head_ = s;
  if (lru_tail_ < 0) lru_tail_ = s;
}

void AdmissionPolicy::Touch(int32_t s) {
  slot_epoch_[s] = epoch_;
  if (policy_ == CachePolicy::kLru) {
    LruUnlink(s);
    LruPushFront(s);
  } else {
    if (slot_freq_[s] < 255) ++slot_freq_[s];
    if (++sketch_adds_ >= age_period_) Age();
  }
}

int32_t AdmissionPolicy::PickVictim(const std::vector<uint8_t>& dirty, bool clean_first) {
  if (policy_ == CachePolicy::kLru) {
    // Rows this fetch read sit at the front; a read row means every row before it was read. Pinned
    // rows are stepped over, a bounded number of them.
    int32_t s = lru_tail_;
    for (int k = 0; s >= 0 && k < kVictimSamples * kVictimRounds * 8; ++k, s = lru_prev_[s]) {
      if (slot_epoch_[s] == epoch_) return -1;
      if (!pinned(s)) return s;
    }
    return -1;
  }
  int32_t best = -1, best_clean = -1;
  for (int round = 0; round < kVictimRounds && best < 0; ++round) {
    for (int k = 0; k < kVictimSamples; ++k) {
      rng_ ^= rng_ << 13;
      rng_ ^= rng_ >> 7;
      rng_ ^= rng_ << 17;
      const int32_t s = static_cast<int32_t>(rng_ % static_cast<uint64_t>(capacity_));
      if (slot_epoch_[s] == epoch_ || pinned(s)) continue;
      if (best < 0 || slot_freq_[s] < slot_freq_[best]) best = s;
      if (clean_first && !dirty[s] && (best_clean < 0 || slot_freq_[s] < slot_freq_[best_clean])) {
        best_clean = s;
      }
    }
  }
  return best_clean >= 0 ? best_clean : best;
}

int32_t AdmissionPolicy::Admit(uint8_t frequency, const std::vector<uint8_t>& dirty, bool cut_writing, bool* evicts,
                               bool force) {
  *evicts = false;
  if (capacity_ == 0) return -1;
  int32_t s;
  if (!free_slots_.empty()) {
    s = free_slots_.back();
    free_slots_.pop_back();
  } else {
    s = PickVictim(dirty, cut_writing);
    if (s < 0) return -1;
    // TinyLFU's admission test: a newcomer must be seen more often than the row it displaces
    // (not while a cut is written: a row kept out is written back at its update, behind the cut).
    if (policy_ == CachePolicy::kLfu && frequency <= slot_freq_[s] && !cut_writing && !force) return -1;
    *evicts = true;
    if (policy_ == CachePolicy::kLru) LruUnlink(s);
  }
  slot_freq_[s] = frequency;
  slot_epoch_[s] = epoch_;
  if (policy_ == CachePolicy::kLru) LruPushFront(s);
  return s;
}

void AdmissionPolicy::Free(int32_t slot) {
  if (policy_ == CachePolicy::kLru) LruUnlink(slot);
  slot_freq_[slot] = 0;
  slot_pin_[slot] = 0;
  free_slots_.push_back(slot);
}

}  // namespace mlkv
