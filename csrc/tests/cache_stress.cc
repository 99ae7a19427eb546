// Torch-free stress test of the embedding cache's host parts (AdmissionPolicy, SlotIndex,
// StagingArea, WriteBackBuffer), built and run under AddressSanitizer/UndefinedBehaviorSanitizer
// and ThreadSanitizer by scripts/sanitize.sh. A small cache put together from them as
// EmbeddingCache does (admit or stage on a miss, write evicted dirty rows behind, a writer that
// puts rows to a "store" without the lock) is driven by random fetches, updates, read-aheads and
// write-backs from several threads under one mlkv::Mutex, against a reference model: the newest
// version of every key (std::unordered_map) and the keys the staging area must hold.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tests/expect.h"
#include "cache/admission_policy.h"
#include "cache/read_ahead_queue.h"
#include "engine/thread_annotations.h"
#include "cache/slot_index.h"
#include "cache/slot_transfer.h"
#include "cache/staging_area.h"
#include "cache/write_back_buffer.h"
#include "id_map.h"

namespace {

constexpr int64_t kRowWords = 6;
constexpr uint32_t kStagedFetches = 8;  // as staging_area.cpp: fetches a staged row may wait

// Row contents that say which key and version they are.
void Fill(float* row, int64_t key, int64_t version) {
  for (int64_t w = 0; w < kRowWords; ++w) row[w] = static_cast<float>(key * 4096 + version) + 0.125f * w;
}
bool Holds(const float* row, int64_t key, int64_t version) {
  std::vector<float> want(kRowWords);
  Fill(want.data(), key, version);
  return std::memcmp(row, want.data(), sizeof(float) * kRowWords) == 0;
}

struct Staged {
  uint32_t epoch;
  bool read_ahead;
};

// The cache's host side as EmbeddingCache composes it, with a reference model beside it.
class ModelCache {
 public:
  ModelCache(int64_t capacity, mlkv::CachePolicy policy, int64_t staging_rows)
      : capacity_(capacity),
        staging_rows_(staging_rows),
        index_(capacity),
        policy_(capacity, policy),
        staging_(staging_rows, kRowWords),
        write_back_(kRowWords, 16),
        rows_(static_cast<size_t>(capacity * kRowWords)) {}

  // A fetch of `keys` (distinct): every row read must be the key's newest version.
  void Fetch(const std::vector<int64_t>& keys, bool cut_writing) EXCLUDES(mu_) {
    mlkv::MutexLock lock(&mu_);
    policy_.BeginFetch();
    std::vector<float> row(kRowWords);
    for (int64_t key : keys) {
      const int32_t s = index_.Find(key);
      if (s >= 0) {
        policy_.Touch(s);
        EXPECT(Holds(&rows_[s * kRowWords], key, Version(key)), "cached row of key %lld is stale", (long long)key);
        continue;
      }
      ReadOutside(key, row.data());
      bool evicts = false;
      const int32_t slot = policy_.Admit(policy_.CountMiss(key), index_.dirty_bits(), cut_writing, &evicts);
      if (slot < 0) {
        StageModel(key, row.data(), /*read_ahead=*/false);
        continue;
      }
      EXPECT(slot < capacity_, "slot %d outside a cache of %lld", slot, (long long)capacity_);
      const int64_t evicted = index_.key(slot);
      EXPECT(evicts == (evicted >= 0), "slot %d: evicts %d but held key %lld", slot, evicts, (long long)evicted);
      if (evicted >= 0) {
        EXPECT(cached_.erase(evicted) == 1, "evicted key %lld was not cached", (long long)evicted);
        if (index_.dirty(slot)) WriteBehind(evicted, &rows_[slot * kRowWords]);
      }
      index_.Assign(slot, key);
      EXPECT(cached_.insert(key).second, "key %lld admitted twice", (long long)key);
      std::memcpy(&rows_[slot * kRowWords], row.data(), sizeof(float) * kRowWords);
    }
  }

  // An optimizer step for `keys`: cached rows change in place, the rest go through the buffer.
  void Update(const std::vector<int64_t>& keys) EXCLUDES(mu_) {
    mlkv::MutexLock lock(&mu_);
    std::vector<float> row(kRowWords);
    for (int64_t key : keys) {
      const int32_t s = index_.Find(key);
      if (s >= 0) {
        Fill(&rows_[s * kRowWords], key, ++versions_[key]);
        index_.MarkDirty(s);
        continue;
      }
      ReadOutside(key, row.data());  // the newest version, which this step replaces
      Fill(row.data(), key, ++versions_[key]);
      WriteBehind(key, row.data());
    }
  }

  // Reads ahead the keys neither cached, staged nor on their way to the store.
  void ReadAhead(const std::vector<int64_t>& keys) EXCLUDES(mu_) {
    mlkv::MutexLock lock(&mu_);
    std::vector<float> row(kRowWords);
    for (int64_t key : keys) {
      if (index_.Find(key) >= 0 || staging_.Contains(key) || write_back_.Find(key) != nullptr) continue;
      ReadStore(key, row.data());
      StageModel(key, row.data(), /*read_ahead=*/true);
    }
  }

  // Every dirty cached row to the write-back buffer.
  void WriteBack() EXCLUDES(mu_) {
    mlkv::MutexLock lock(&mu_);
    std::vector<int64_t> keys;
    const std::vector<int32_t> dirty = index_.TakeDirty(&keys);
    EXPECT(dirty.size() == keys.size(), "%zu dirty slots, %zu keys", dirty.size(), keys.size());
    for (size_t i = 0; i < dirty.size() && i < keys.size(); ++i) {
      EXPECT(index_.key(dirty[i]) == keys[i] && !index_.dirty(dirty[i]), "slot %d taken dirty", dirty[i]);
      WriteBehind(keys[i], &rows_[dirty[i] * kRowWords]);
    }
  }

  // One round of the writer: a batch put to the store without the lock, then completed. False
  // when there was nothing to write. One round at a time, as the cache has one writer thread: an
  // older batch put after a newer one would leave the store stale.
  bool WriteOnce() EXCLUDES(writer_mu_, mu_) {
    mlkv::MutexLock writer_lock(&writer_mu_);
    mlkv::MutexLock lock(&mu_);
    const mlkv::WriteBackBuffer::Batch batch = write_back_.Take(7);
    if (batch.keys.empty()) return false;
    lock.Unlock();
    {
      mlkv::MutexLock store_lock(&store_mu_);
      for (size_t i = 0; i < batch.keys.size(); ++i) {
        store_[batch.keys[i]].assign(&batch.rows[i * kRowWords], &batch.rows[(i + 1) * kRowWords]);
      }
    }
    lock.Lock();
    write_back_.Complete(batch);
    return true;
  }

  // The invariants, and the model against the structures.
  void Check() EXCLUDES(mu_) {
    mlkv::MutexLock lock(&mu_);
    std::unordered_set<int64_t> seen;
    for (int32_t s = 0; s < capacity_; ++s) {
      const int64_t key = index_.key(s);
      if (key < 0) continue;
      EXPECT(index_.Find(key) == s, "slot %d holds key %lld, which maps to %d", s, (long long)key, index_.Find(key));
      EXPECT(seen.insert(key).second, "key %lld in two slots", (long long)key);
      EXPECT(cached_.count(key) == 1, "key %lld cached, not in the model", (long long)key);
      EXPECT(!staging_.Contains(key), "key %lld both cached and staged", (long long)key);
      EXPECT(Holds(&rows_[s * kRowWords], key, Version(key)), "slot %d: key %lld is stale", s, (long long)key);
    }
    EXPECT(seen.size() == cached_.size() && index_.size() == cached_.size(),
           "%zu keys in slots, %zu in the map, %zu in the model", seen.size(), index_.size(), cached_.size());
    EXPECT(static_cast<int64_t>(index_.size()) <= capacity_, "%zu keys in %lld slots", index_.size(),
           (long long)capacity_);
    EXPECT(staging_.size() == staged_.size(), "%zu rows staged, the model has %zu", staging_.size(), staged_.size());
    EXPECT(static_cast<int64_t>(staging_.size()) <= staging_rows_, "%zu rows staged in an area of %lld",
           staging_.size(), (long long)staging_rows_);
    for (const auto& [key, staged] : staged_) EXPECT(staging_.Contains(key), "key %lld not staged", (long long)key);
  }

  // Writes every row back and checks that the store holds the newest version of every key.
  void Finish() EXCLUDES(writer_mu_, mu_) {
    WriteBack();
    while (WriteOnce()) {
    }
    mlkv::MutexLock lock(&mu_);
    mlkv::MutexLock store_lock(&store_mu_);
    EXPECT(write_back_.size() == 0, "%zu rows left in the write-back buffer", write_back_.size());
    for (const auto& [key, version] : versions_) {
      auto it = store_.find(key);
      EXPECT(it != store_.end() && Holds(it->second.data(), key, version), "the store lost key %lld version %lld",
             (long long)key, (long long)version);
    }
  }

 private:
  int64_t Version(int64_t key) const REQUIRES(mu_) {
    auto it = versions_.find(key);
    return it == versions_.end() ? 0 : it->second;
  }

  void ReadStore(int64_t key, float* row) REQUIRES(mu_) {
    mlkv::MutexLock store_lock(&store_mu_);
    auto it = store_.find(key);
    if (it == store_.end()) {
      Fill(row, key, 0);
    } else {
      std::memcpy(row, it->second.data(), sizeof(float) * kRowWords);
    }
  }

  // A row not cached, as EmbeddingCache::ReadOutsideCache finds it: staged (taken), on its way to
  // the store, or in the store; it must be the newest version.
  void ReadOutside(int64_t key, float* row) REQUIRES(mu_) {
    bool read_ahead = false;
    auto staged = staged_.find(key);
    if (staging_.Take(key, row, &read_ahead)) {
      EXPECT(staged != staged_.end() && staged->second.read_ahead == read_ahead, "key %lld taken, not staged so",
             (long long)key);
      if (staged != staged_.end()) staged_.erase(staged);
    } else if (const float* waiting = write_back_.Find(key)) {
      EXPECT(staged == staged_.end(), "key %lld staged, not taken", (long long)key);
      std::memcpy(row, waiting, sizeof(float) * kRowWords);
    } else {
      EXPECT(staged == staged_.end(), "key %lld staged, not taken", (long long)key);
      ReadStore(key, row);
    }
    EXPECT(Holds(row, key, Version(key)), "key %lld read stale", (long long)key);
  }

  void WriteBehind(int64_t key, const float* row) REQUIRES(mu_) {
    staging_.Unstage(key);  // the staged copy is older
    staged_.erase(key);
    write_back_.Put(key, row);
    EXPECT(write_back_.Find(key) != nullptr && std::memcmp(write_back_.Find(key), row, sizeof(float) * kRowWords) == 0,
           "key %lld not found as put", (long long)key);
  }

  // Stages a row, predicting from the model whether there is room: rows staged more than
  // kStagedFetches fetches ago leave a full area first.
  void StageModel(int64_t key, const float* row, bool read_ahead) REQUIRES(mu_) {
    const uint32_t epoch = policy_.fetch_epoch();
    if (static_cast<int64_t>(staged_.size()) >= staging_rows_) {
      for (auto it = staged_.begin(); it != staged_.end();) {
        it = epoch - it->second.epoch > kStagedFetches ? staged_.erase(it) : std::next(it);
      }
    }
    const bool room = static_cast<int64_t>(staged_.size()) < staging_rows_;
    const bool staged = staging_.Stage(key, row, read_ahead, epoch);
    EXPECT(staged == room, "staging key %lld: %d, the model expects %d", (long long)key, staged, room);
    if (staged) staged_[key] = Staged{epoch, read_ahead};
  }

  const int64_t capacity_, staging_rows_;
  mlkv::Mutex writer_mu_ ACQUIRED_BEFORE(mu_);
  mlkv::Mutex mu_;
  mlkv::Mutex store_mu_ ACQUIRED_AFTER(mu_);
  mlkv::SlotIndex index_ GUARDED_BY(mu_);
  mlkv::AdmissionPolicy policy_ GUARDED_BY(mu_);
  mlkv::StagingArea staging_ GUARDED_BY(mu_);
  mlkv::WriteBackBuffer write_back_ GUARDED_BY(mu_);
  std::vector<float> rows_ GUARDED_BY(mu_);  // the slots' rows
  // The model: each key's newest version (absent: 0, its initial row), the cached keys, the staged ones.
  std::unordered_map<int64_t, int64_t> versions_ GUARDED_BY(mu_);
  std::unordered_set<int64_t> cached_ GUARDED_BY(mu_);
  std::unordered_map<int64_t, Staged> staged_ GUARDED_BY(mu_);
  std::unordered_map<int64_t, std::vector<float>> store_ GUARDED_BY(store_mu_);
};

std::vector<int64_t> DistinctKeys(std::mt19937_64& rng, int64_t key_space) {
  std::unordered_set<int64_t> set;
  const size_t n = 1 + rng() % 24;
  // A skewed draw, so the frequent keys win the lfu admission test.
  while (set.size() < n) set.insert(static_cast<int64_t>((rng() % key_space) * (rng() % key_space) / key_space));
  return std::vector<int64_t>(set.begin(), set.end());
}

void RandomOps(ModelCache* cache, uint64_t seed, int steps, int64_t key_space) {
  std::mt19937_64 rng(seed);
  for (int step = 0; step < steps; ++step) {
    const int op = static_cast<int>(rng() % 100);
    if (op < 45) {
      cache->Fetch(DistinctKeys(rng, key_space), rng() % 10 == 0);
    } else if (op < 75) {
      cache->Update(DistinctKeys(rng, key_space));
    } else if (op < 90) {
      cache->ReadAhead(DistinctKeys(rng, key_space));
    } else if (op < 93) {
      cache->WriteBack();
    } else if (op < 97) {
      cache->WriteOnce();
    } else {
      cache->Check();
    }
  }
}

// One thread: random operations against the model, checked as they go.
void ModelTest(mlkv::CachePolicy policy, uint64_t seed) {
  ModelCache cache(48, policy, 16);
  RandomOps(&cache, seed, 6000, 400);
  cache.Check();
  cache.Finish();
}

// Four threads under the cache's lock and a writer putting rows without it.
void ConcurrencyTest(mlkv::CachePolicy policy) {
  ModelCache cache(64, policy, 24);
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop) {
      if (!cache.WriteOnce()) std::this_thread::yield();
    }
  });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { RandomOps(&cache, 100 + t, 2500, 300); });
  for (std::thread& t : threads) t.join();
  stop = true;
  writer.join();
  cache.Check();
  cache.Finish();
}

// The staging area alone: capacity, round trips, and the ageing of rows no fetch took.
void StagingTest() {
  constexpr int64_t kRows = 8;
  mlkv::StagingArea area(kRows, kRowWords);
  std::vector<float> row(kRowWords), out(kRowWords);
  for (int round = 0; round < 3; ++round) {
    for (int64_t key = 0; key < kRows; ++key) {
      Fill(row.data(), key, round);
      EXPECT(area.Stage(key, row.data(), key % 2 == 0, 1), "round %d: key %lld found no room", round, (long long)key);
    }
    Fill(row.data(), 99, round);
    EXPECT(!area.Stage(99, row.data(), false, 1), "round %d: a full area took a row", round);
    EXPECT(area.size() == static_cast<size_t>(kRows), "round %d: %zu rows staged", round, area.size());
    for (int64_t key = 0; key < kRows; key += 2) area.Unstage(key);
    for (int64_t key = 0; key < kRows; ++key) {
      bool read_ahead = true;
      const bool taken = area.Take(key, out.data(), &read_ahead);
      EXPECT(taken == (key % 2 == 1), "round %d: key %lld taken %d", round, (long long)key, taken);
      if (taken)
        EXPECT(Holds(out.data(), key, round) && !read_ahead, "round %d: key %lld changed", round, (long long)key);
      EXPECT(!area.Contains(key), "round %d: key %lld still staged", round, (long long)key);
    }
    EXPECT(area.size() == 0, "round %d: %zu rows left", round, area.size());
  }
  for (int64_t key = 0; key < kRows; ++key) EXPECT(area.Stage(key, row.data(), false, 1), "key %lld", (long long)key);
  EXPECT(!area.Stage(100, row.data(), false, 1 + kStagedFetches), "rows of the last fetches were dropped");
  EXPECT(area.Stage(100, row.data(), false, 2 + kStagedFetches), "rows no fetch took were kept");
  EXPECT(area.size() == 1 && area.Contains(100), "%zu rows staged after the ageing", area.size());
}

// The admission policy alone: a fetch never evicts what it read, and lru evicts the oldest.
void PolicyTest() {
  for (mlkv::CachePolicy policy : {mlkv::CachePolicy::kLru, mlkv::CachePolicy::kLfu}) {
    constexpr int64_t kSlots = 16;
    mlkv::AdmissionPolicy p(kSlots, policy);
    std::vector<uint8_t> dirty(kSlots, 0);
    std::unordered_set<int32_t> slots;
    int32_t first = -1;
    p.BeginFetch();
    bool evicts = false;
    for (int64_t key = 0; key < kSlots; ++key) {
      const int32_t s = p.Admit(p.CountMiss(key), dirty, false, &evicts);
      EXPECT(s >= 0 && s < kSlots && !evicts && slots.insert(s).second, "free slot %d for key %lld", s, (long long)key);
      if (key == 0) first = s;
    }
    const int32_t none = p.Admit(255, dirty, false, &evicts);
    EXPECT(none < 0, "the fetch evicted slot %d it had just filled", none);
    p.BeginFetch();
    const int32_t victim = p.Admit(255, dirty, false, &evicts);
    EXPECT(victim >= 0 && evicts, "a new fetch found no victim");
    if (policy == mlkv::CachePolicy::kLru) EXPECT(victim == first, "lru evicted slot %d, not %d", victim, first);
  }
}

// Pins: a slot pinned for read-ahead request r is no victim until r is released, a reserved one
// never until unreserved, with either policy, under random pins and releases.
void PinTest() {
  for (mlkv::CachePolicy policy : {mlkv::CachePolicy::kLru, mlkv::CachePolicy::kLfu}) {
    constexpr int64_t kSlots = 64;
    mlkv::AdmissionPolicy p(kSlots, policy);
    std::vector<uint8_t> dirty(kSlots, 0);
    std::vector<int32_t> pin(kSlots, 0);  // the model: the request each slot is pinned for (max: reserved)
    std::mt19937_64 rng(policy == mlkv::CachePolicy::kLru ? 5 : 6);
    int32_t request = 0, released = 0;
    bool evicts = false;
    for (int64_t key = 0; key < kSlots; ++key) p.Admit(1, dirty, false, &evicts);  // every slot taken
    for (int round = 0; round < 4000; ++round) {
      p.BeginFetch();
      const int op = static_cast<int>(rng() % 4);
      const int32_t s = static_cast<int32_t>(rng() % kSlots);
      if (op == 0) {
        ++request;
        p.Pin(s, request);
        pin[s] = std::max(pin[s], request);
      } else if (op == 1 && request > released) {
        released += 1 + static_cast<int32_t>(rng() % (request - released));
        p.ReleaseThrough(released);
      } else {
        const int32_t victim = p.Admit(255, dirty, false, &evicts, /*force=*/true);
        if (victim < 0) continue;  // every sampled slot pinned
        EXPECT(pin[victim] <= released, "slot %d pinned for %d evicted with %d released", victim, pin[victim],
               released);
        if (rng() % 2) {
          p.Reserve(victim);
          pin[victim] = std::numeric_limits<int32_t>::max();
        } else {
          pin[victim] = 0;
        }
      }
      if (round % 500 == 499) {  // reservations end: the rows landed
        for (int32_t slot = 0; slot < kSlots; ++slot) {
          if (pin[slot] == std::numeric_limits<int32_t>::max()) {
            p.Unreserve(slot, request);
            pin[slot] = request;
          }
        }
      }
    }
  }
}

// HostSlotTransfer: copies land in order, each row in its slot, whoever waits; a copy out waits
// for the copies in before it; from several threads, with copies held in flight.
void TransferTest() {
  constexpr int64_t kSlots = 256, kWords = kRowWords;
  std::vector<float> slots(kSlots * kWords, -1.f);
  mlkv::HostSlotTransfer transfer(slots.data(), kWords, /*delay_us=*/200);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int round = 0; round < 50; ++round) {
        // Each thread owns the slots t, t + 4, ...: nothing else writes them.
        std::vector<int32_t> mine;
        for (int32_t s = t; s < kSlots; s += 4) {
          if (rng() % 3 == 0) mine.push_back(s);
        }
        std::vector<float> rows(mine.size() * kWords);
        for (size_t i = 0; i < mine.size(); ++i) Fill(&rows[i * kWords], mine[i], round);
        const uint64_t ticket = transfer.CopyIn(mine, rows.data());
        if (rng() % 2) {
          transfer.Wait(ticket);
        }
        std::vector<float> out(mine.size() * kWords);
        std::vector<uint8_t> marks(mine.size(), 1);
        transfer.CopyOut(mine, out.data(), marks.data());  // after every copy in started before it
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT(Holds(&out[i * kWords], mine[i], round) && marks[i] == 0, "slot %d round %d", mine[i], round);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
}

// IdMap against std::unordered_map: inserts, finds and erases at sizes whose bucket counts are no
// power of two (probes that wrap past the last bucket, backward shifts across it), growth, and a
// map sized for its ids (the cache's) never growing.
void IdMapTest() {
  std::mt19937_64 rng(21);
  for (size_t expected : {size_t{1}, size_t{17}, size_t{100}, size_t{1000}, size_t{4097}}) {
    mlkv::IdMap map(expected);
    const size_t buckets = map.buckets();
    std::unordered_map<int64_t, int32_t> model;
    size_t wrong = 0;
    for (int op = 0; op < 20000; ++op) {
      const int64_t id = static_cast<int64_t>(rng() % (3 * expected + 5));
      if (rng() % 3 == 0) {
        map.Erase(id);
        model.erase(id);
      } else if (model.size() < expected || model.count(id)) {
        const int32_t value = static_cast<int32_t>(rng() % 1000000);
        const int32_t stored = map.Insert(id, value);
        wrong += stored != model.emplace(id, value).first->second;
      }
      if (op % 97 == 0) {
        for (int64_t k = 0; k < static_cast<int64_t>(3 * expected + 5); ++k) {
          auto it = model.find(k);
          wrong += map.Find(k) != (it == model.end() ? -1 : it->second);
        }
      }
    }
    EXPECT(wrong == 0 && map.size() == model.size() && map.buckets() == buckets,
           "IdMap for %zu ids: %zu answers wrong, %zu ids for %zu, %zu buckets (made with %zu)", expected, wrong,
           map.size(), model.size(), map.buckets(), buckets);
    for (int64_t k = 0; k < static_cast<int64_t>(buckets); ++k) map.Insert(k + 1000000, 1);  // grows
    EXPECT(map.buckets() > buckets && map.Find(1000000) == 1, "IdMap for %zu ids did not grow", expected);
  }
}

// The read-ahead queue between producers that queue in sequence order (as the cache does, under a
// lock of theirs), its thread and waiters: every request arrives once and in order, a wait for a
// sequence ends only once it is done, and Stop ends the thread and every wait.
void ReadAheadQueueTest() {
  mlkv::ReadAheadQueue queue;
  constexpr int32_t kRequests = 3000;
  std::atomic<int32_t> done{0};
  std::thread worker([&] {
    int32_t expected = 1;
    while (std::optional<mlkv::ReadAheadRequest> request = queue.Next()) {
      EXPECT(request->sequence == expected, "request %d arrived, %d expected", request->sequence, expected);
      EXPECT(request->keys.size() == 1 && request->keys[0] == request->sequence, "request %d carries the wrong keys",
             request->sequence);
      expected = request->sequence + 1;
      done = request->sequence;
      queue.Done(request->sequence, request->queued);
    }
  });
  std::mutex order;  // the producers' own lock, as the cache's mu_: sequences queued in order
  int32_t next = 0;
  std::vector<std::thread> producers;
  for (int p = 0; p < 3; ++p) {
    producers.emplace_back([&] {
      for (;;) {
        int32_t sequence;
        {
          std::lock_guard<std::mutex> lock(order);
          if (next == kRequests) return;
          sequence = ++next;
          mlkv::ReadAheadRequest request;
          request.sequence = sequence;
          request.keys = {sequence};
          request.queued = std::chrono::steady_clock::now();
          queue.Push(std::move(request));
        }
        if (sequence % 7 == 0) {
          queue.WaitDone(sequence, /*counted=*/true);
          EXPECT(done.load() >= sequence, "a wait for %d ended at %d", sequence, done.load());
        }
      }
    });
  }
  for (std::thread& t : producers) t.join();
  queue.WaitDone(kRequests, /*counted=*/false);
  EXPECT(done.load() == kRequests, "%d of %d requests done", done.load(), kRequests);
  EXPECT(queue.latency_us() > 0 && queue.wait_us() >= 0, "no latency measured");
  std::thread waiter([&] { queue.WaitDone(kRequests + 1, /*counted=*/false); });  // never done: Stop ends it
  queue.Stop();
  waiter.join();
  worker.join();
}

}  // namespace

int main() {
  int passed = 0, failed = 0;
  auto run = [&](auto&& test) {
    const int before = mlkv_test::Failures();
    test();
    (mlkv_test::Failures() == before ? passed : failed) += 1;
  };
  run(StagingTest);
  run(PolicyTest);
  for (uint64_t seed = 1; seed <= 2; ++seed) {
    run([seed] { ModelTest(mlkv::CachePolicy::kLfu, seed); });
    run([seed] { ModelTest(mlkv::CachePolicy::kLru, seed); });
  }
  run([] { ConcurrencyTest(mlkv::CachePolicy::kLfu); });
  run([] { ConcurrencyTest(mlkv::CachePolicy::kLru); });
  run(PinTest);
  run(TransferTest);
  run(ReadAheadQueueTest);
  run(IdMapTest);
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
