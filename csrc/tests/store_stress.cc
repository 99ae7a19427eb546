// Torch-free stress test of the storage engine, built and run under
// AddressSanitizer/UndefinedBehaviorSanitizer and ThreadSanitizer by
// scripts/sanitize.sh. Part 1 checks random operation sequences against
// std::unordered_map; part 2 runs readers, writers and lookahead on shared keys.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tests/expect.h"
#include "engine/kv_store.h"

using mlkv::KVStore;
using mlkv::Status;

namespace {

constexpr uint32_t kDim = 8;

mlkv::StoreOptions SmallOptions() {
  mlkv::StoreOptions o;
  o.dim = kDim;
  o.memory_budget_bytes = 32 << 10;
  o.segment_bytes = 16 << 10;
  o.expected_keys = 256;
  return o;
}

void Fill(float* row, int64_t key, int64_t version) {
  for (uint32_t d = 0; d < kDim; ++d) row[d] = static_cast<float>(key * 1000 + version) + 0.25f * d;
}

std::unique_ptr<KVStore> MustOpen(const std::string& path, const mlkv::StoreOptions& o) {
  std::unique_ptr<KVStore> store;
  Status st = KVStore::Open(path, o, &store);
  if (!st.ok()) {
    std::fprintf(stderr, "open %s: %s\n", path.c_str(), st.ToString().c_str());
    std::exit(2);
  }
  return store;
}

// index_budget_bytes: with one, the log's keys move into base runs as the test goes. key_limit: the
// index hashes 12-bit keys (the test's keys lie below 3000).
void ModelTest(const std::string& path, uint32_t seed, uint64_t index_budget_bytes = 0, uint64_t key_limit = 0) {
  std::mt19937_64 rng(seed);
  auto o = SmallOptions();
  o.index_budget_bytes = index_budget_bytes;
  o.key_limit = key_limit;
  auto store = MustOpen(path, o);
  std::unordered_map<int64_t, std::vector<float>> model;
  int64_t version = 0;
  for (int step = 0; step < 3000; ++step) {
    int op = static_cast<int>(rng() % 100);
    size_t n = 1 + rng() % 64;
    std::vector<int64_t> keys(n);
    for (auto& k : keys) k = static_cast<int64_t>(rng() % 3000);
    if (op < 40) {
      std::vector<float> values(n * kDim);
      for (size_t i = 0; i < n; ++i) {
        Fill(&values[i * kDim], keys[i], ++version);
        model[keys[i]].assign(&values[i * kDim], &values[i * kDim] + kDim);
      }
      Status st = store->Put(keys.data(), n, values.data());
      EXPECT(st.ok(), "put: %s", st.ToString().c_str());
    } else if (op < 70) {
      std::vector<int64_t> present;
      for (int64_t k : keys)
        if (model.count(k)) present.push_back(k);
      std::vector<float> out(present.size() * kDim);
      std::vector<int64_t> missing;
      Status st = store->Get(present.data(), present.size(), out.data(), &missing);
      EXPECT(st.ok(), "get: %s", st.ToString().c_str());
      for (size_t i = 0; i < present.size() && st.ok(); ++i) {
        EXPECT(std::memcmp(&out[i * kDim], model[present[i]].data(), kDim * 4) == 0, "key %lld differs",
               (long long)present[i]);
      }
    } else if (op < 80) {
      uint64_t deleted = 0;
      uint64_t expected = 0;
      for (int64_t k : keys) expected += model.erase(k);
      Status st = store->Delete(keys.data(), n, &deleted);
      EXPECT(st.ok() && deleted == expected, "delete: %s, %llu vs %llu", st.ToString().c_str(),
             (unsigned long long)deleted, (unsigned long long)expected);
    } else if (op < 88) {
      EXPECT(store->Lookahead(keys.data(), n).ok(), "lookahead");
    } else if (op < 92) {
      EXPECT(store->Flush().ok(), "flush");
    } else if (op < 95) {
      EXPECT(store->Checkpoint().ok(), "checkpoint");
    } else if (op < 97) {
      EXPECT(store->Compact().ok(), "compact");
    } else {
      EXPECT(store->Close().ok(), "close");
      store.reset();
      store = MustOpen(path, o);
    }
    uint64_t size = 0;
    EXPECT(store->Size(&size).ok() && size == model.size(), "size %llu vs %zu at step %d", (unsigned long long)size,
           model.size(), step);
  }
  mlkv::StoreStats stats;
  EXPECT(store->Stats(&stats).ok() && stats.disk_rows > 0, "the disk path never ran");
  EXPECT(index_budget_bytes == 0 || stats.base_merges > 0, "no base run was made");
  EXPECT(store->Close().ok(), "final close");
}

// `mutable_fraction` below the default leaves the flush task several read-only pages to write at once.
void ConcurrencyTest(const std::string& path, double mutable_fraction, uint64_t index_budget_bytes = 0) {
  auto o = SmallOptions();
  o.mutable_fraction = mutable_fraction;
  o.index_budget_bytes = index_budget_bytes;
  auto store = MustOpen(path, o);
  constexpr int64_t kKeys = 4000;
  std::vector<int64_t> all(kKeys);
  std::vector<float> init(kKeys * kDim);
  for (int64_t k = 0; k < kKeys; ++k) {
    all[k] = k;
    Fill(&init[k * kDim], k, 0);
  }
  EXPECT(store->Put(all.data(), kKeys, init.data()).ok(), "initial put");
  std::atomic<bool> stop{false};
  std::atomic<int64_t> torn{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::mt19937_64 rng(w);
      int64_t version = 0;
      while (!stop) {
        std::vector<int64_t> keys(32);
        std::vector<float> values(32 * kDim);
        ++version;
        for (size_t i = 0; i < keys.size(); ++i) {
          keys[i] = static_cast<int64_t>(rng() % (kKeys / 2)) * 2 + w;  // writer w owns keys of parity w
          Fill(&values[i * kDim], keys[i], version % 1000);  // the row decodes back to its key
        }
        store->Put(keys.data(), keys.size(), values.data());
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::mt19937_64 rng(100 + r);
      while (!stop) {
        std::vector<int64_t> keys(64);
        for (auto& k : keys) k = static_cast<int64_t>(rng() % kKeys);
        if (r == 1) store->Lookahead(keys.data(), keys.size());
        std::vector<float> out(keys.size() * kDim);
        std::vector<int64_t> missing;
        Status st = store->Get(keys.data(), keys.size(), out.data(), &missing);
        if (!st.ok()) {
          std::fprintf(stderr, "get: %s\n", st.ToString().c_str());
          ++torn;
          continue;
        }
        for (size_t i = 0; i < keys.size(); ++i) {
          // A row must be some whole version written for its key.
          float base = out[i * kDim];
          int64_t key = static_cast<int64_t>(base) / 1000;
          bool whole = key == keys[i];
          for (uint32_t d = 0; d < kDim; ++d) whole &= out[i * kDim + d] == base + 0.25f * d;
          if (!whole) ++torn;
        }
      }
    });
  }
  std::atomic<int64_t> unfinished{0};
  threads.emplace_back([&] {
    for (int i = 0; !stop; ++i) {
      if (i % 2 == 0) {
        store->Checkpoint();
      } else if (store->BeginCheckpoint().ok()) {
        // The second half on another thread, as a cache's FinishCut takes it, while puts go on.
        std::thread finisher([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          uint64_t sequence = 0;
          if (!store->FinishCheckpoint(&sequence).ok()) ++unfinished;
        });
        finisher.join();
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  stop = true;
  for (auto& t : threads) t.join();
  EXPECT(torn == 0, "%lld torn or failed reads", (long long)torn.load());
  EXPECT(unfinished == 0, "%lld checkpoints begun could not be finished", (long long)unfinished.load());
  EXPECT(store->Close().ok(), "close");
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = argc > 1 ? argv[1] : "/tmp/mlkv-stress";
  // One random sequence against the model per seed (scripts/sanitize.sh asks fewer of a race detector).
  const uint32_t seeds = argc > 2 ? static_cast<uint32_t>(std::atoi(argv[2])) : 3;
  std::system(("rm -rf " + dir).c_str());
  for (uint32_t seed = 1; seed <= seeds; ++seed) ModelTest(dir + "/model-" + std::to_string(seed), seed);
  ModelTest(dir + "/model-base", 4, 16 << 10);
  ModelTest(dir + "/model-key-limit", 4, 16 << 10, 3000);
  ConcurrencyTest(dir + "/concurrency", 0.9);
  ConcurrencyTest(dir + "/concurrency-batched-flush", 0.5);
  ConcurrencyTest(dir + "/concurrency-base", 0.9, 16 << 10);
  std::printf("%d passed, %d failed\n", mlkv_test::Failures() == 0 ? static_cast<int>(seeds) + 5 : 0,
              mlkv_test::Failures());
  return mlkv_test::Failures() == 0 ? 0 : 1;
}
