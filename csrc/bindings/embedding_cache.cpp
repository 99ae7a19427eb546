// The binding of the embedding cache (mlkv_torch._C.EmbeddingCache) and of its memory rules.
#include <torch/extension.h>

#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/gil_for_teardown.h"
#include "bindings/row_store_handle.h"
#include "cache/embedding_cache.h"

namespace mlkv::bindings {

namespace {

// One table of a cache, as Python describes it: (name, store, num_embeddings, seed, normal, a, b, first_column,
// first_row): rows never written start uniform in [a, b), or normal with mean a and deviation b, as the block of
// the full table that starts at (first_row, first_column).
using TableArgs =
    std::tuple<std::string, const RowStoreHandle*, int64_t, int64_t, bool, double, double, int64_t, int64_t>;

// Destroys a cache with the GIL released where this thread can take it back: its threads may need
// the GIL (to drop tensors Python saw) while its destructor waits for them.
struct CacheDeleter {
  void operator()(mlkv::EmbeddingCache* cache) const {
    GilReleasedForTeardown released;
    delete cache;
  }
};
using CacheHolder = std::unique_ptr<mlkv::EmbeddingCache, CacheDeleter>;

CacheHolder MakeCache(const std::vector<TableArgs>& tables, int64_t capacity, int64_t dim, int64_t weight_type,
                      int64_t kind, double eps, double beta1, double beta2, std::vector<float> initial_state,
                      const std::string& policy, int64_t staleness, const std::string& device, int64_t staging_rows,
                      int64_t write_back_rows, bool read_ahead_into_slots, int64_t transfer_delay_us) {
  std::vector<mlkv::CacheTable> cache_tables;
  for (const auto& [name, store, num_embeddings, seed, normal, a, b, first_column, first_row] : tables) {
    TORCH_CHECK_VALUE(store != nullptr, "table '", name, "' has no store");
    TORCH_CHECK_VALUE(first_column >= 0, "table '", name, "': first_column must be non-negative, got ", first_column);
    TORCH_CHECK_VALUE(first_row >= 0, "table '", name, "': first_row must be non-negative, got ", first_row);
    cache_tables.push_back({name,
                            store->rows(),
                            {static_cast<uint64_t>(seed), static_cast<float>(a), static_cast<float>(normal ? b : b - a),
                             first_column, normal, first_row},
                            num_embeddings});
  }
  mlkv::CacheOptions o;
  o.capacity = capacity;
  o.dim = dim;
  TORCH_CHECK_VALUE(weight_type >= 0 && weight_type <= 3, "unknown weight type ", weight_type);
  o.weight_type = static_cast<mlkv::WeightType>(weight_type);
  // Each update carries its learning rate (a schedule changes it between steps): the cache keeps none.
  o.optimizer = MakeSpec(kind, std::numeric_limits<double>::quiet_NaN(), eps, beta1, beta2);
  o.initial_state = std::move(initial_state);
  if (policy == "lfu") {
    o.policy = mlkv::CachePolicy::kLfu;
  } else if (policy == "lru") {
    o.policy = mlkv::CachePolicy::kLru;
  } else {
    throw py::value_error("cache_policy must be 'lfu' or 'lru', got '" + policy + "'");
  }
  o.staleness = staleness;
  o.staging_rows = staging_rows;
  o.write_back_rows = write_back_rows;
  o.read_ahead_into_slots = read_ahead_into_slots;
  o.transfer_delay_us = transfer_delay_us;
  return CacheHolder(new mlkv::EmbeddingCache(std::move(cache_tables), std::move(o), torch::Device(device)));
}

py::dict CacheStatsDict(mlkv::EmbeddingCache& cache) {
  const mlkv::CacheStats s = cache.Stats();
  py::dict d;
  d["cache_hits"] = s.hits;
  d["cache_misses"] = s.misses;
  d["store_reads"] = s.store_reads;
  d["fresh_rows"] = s.fresh_rows;
  d["admitted"] = s.admitted;
  d["rejected"] = s.rejected;
  d["evictions"] = s.evictions;
  d["written_back"] = s.written_back;
  d["updates_applied"] = s.updates_applied;
  d["rows_updated"] = s.rows_updated;
  d["pending_updates"] = s.queued_updates;
  d["pending_rows"] = s.pending_rows;
  d["max_staleness"] = s.max_staleness;
  d["cached_rows"] = s.cached_rows;
  d["staleness_waits"] = s.waits;
  d["read_ahead_rows"] = s.read_ahead_rows;
  d["read_ahead_hits"] = s.read_ahead_hits;
  d["read_ahead_dropped_rows"] = s.read_ahead_dropped;
  d["read_ahead_latency_ms"] = s.read_ahead_latency_us / 1e3;
  d["read_ahead_wait_ms"] = static_cast<double>(s.read_ahead_wait_us) / 1e3;
  d["read_ahead_placed_rows"] = s.read_ahead_placed;
  d["read_ahead_unplaced_rows"] = s.read_ahead_unplaced;
  d["read_ahead_lookups"] = s.read_ahead_lookups;
  d["write_back_rows"] = s.write_back_rows;
  d["write_back_waits"] = s.write_back_waits;
  d["write_back_wait_ms"] = static_cast<double>(s.write_back_wait_us) / 1e3;
  d["cut_rows"] = s.cut_rows;
  return d;
}

// The per-table part of the cache's counters, one dict per table, under CacheStatsDict's names.
py::list TableStatsList(mlkv::EmbeddingCache& cache) {
  std::vector<mlkv::TableCounters> counters;
  {
    py::gil_scoped_release release;
    counters = cache.TableStats();
  }
  py::list out;
  for (const mlkv::TableCounters& t : counters) {
    py::dict d;
    d["cache_hits"] = t.hits;
    d["cache_misses"] = t.misses;
    d["store_reads"] = t.store_reads;
    d["fresh_rows"] = t.fresh_rows;
    d["cached_rows"] = t.cached_rows;
    d["read_ahead_hits"] = t.read_ahead_hits;
    d["written_back"] = t.written_back;
    out.append(d);
  }
  return out;
}

}  // namespace

void BindEmbeddingCache(py::module_& m) {
  m.def("cache_bytes_beside_rows", &mlkv::EmbeddingCache::HostBytesBesideRows, py::arg("capacity"),
        "Host bytes an EmbeddingCache of `capacity` rows keeps beside the rows (index, slot state, policy).");
  m.def("cache_buffer_bytes", &mlkv::EmbeddingCache::HostBytesOfBuffers, py::arg("staging_rows"),
        py::arg("write_back_rows"), py::arg("row_words"),
        "Host bytes of an EmbeddingCache's staging area and write-back buffer at these many rows.");
  using mlkv::EmbeddingCache;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  WaitForTeardownsAtExit();
  py::class_<EmbeddingCache, CacheHolder>(m, "EmbeddingCache")
      // Named arguments only: fourteen numbers in a row are too easy to swap.
      .def(py::init(&MakeCache), py::arg("tables"), py::kw_only(), py::arg("capacity"), py::arg("dim"),
           py::arg("weight_type"), py::arg("kind"), py::arg("eps"), py::arg("beta1"), py::arg("beta2"),
           py::arg("initial_state"), py::arg("policy"), py::arg("staleness"), py::arg("device"),
           py::arg("staging_rows") = 4096, py::arg("write_back_rows") = 4096, py::arg("read_ahead_into_slots") = false,
           py::arg("transfer_delay_us") = 0)
      .def("unique_keys", &EmbeddingCache::UniqueKeys, nogil)
      .def("fetch", &EmbeddingCache::FetchBatch, nogil)
      .def("queue_update", &EmbeddingCache::QueueUpdate, nogil)
      .def("drain", &EmbeddingCache::Drain, nogil)
      .def("pause_applier", &EmbeddingCache::PauseApplier, nogil)
      .def("pause_writer", &EmbeddingCache::PauseWriter, nogil)
      .def("read_rows", &EmbeddingCache::ReadRows, nogil)
      .def("write_rows", &EmbeddingCache::WriteRows, nogil)
      .def("delete_rows", &EmbeddingCache::DeleteRows, nogil)
      .def("lookahead", &EmbeddingCache::ReadAheadBatch, nogil)
      .def("lookup_read_ahead", &EmbeddingCache::LookupReadAhead, nogil)
      .def("read_ahead_waiting", &EmbeddingCache::ReadAheadWaiting, nogil)
      .def("write_back", &EmbeddingCache::WriteBack, nogil)
      .def("begin_cut", &EmbeddingCache::BeginCut, nogil)
      .def("finish_cut", &EmbeddingCache::FinishCut, py::arg("superseded") = false, nogil)
      .def_property_readonly("cut_pending", &EmbeddingCache::CutPending)
      .def_property_readonly("cut_sealed", &EmbeddingCache::CutSealed)
#ifdef MLKV_WITH_CUDA
      .def("lookup_on_device", &EmbeddingCache::LookupOnDevice, nogil)
      .def("update_on_device", &EmbeddingCache::UpdateOnDevice, nogil)
#endif
      .def("close", &EmbeddingCache::Close, nogil)
      .def("stats", &CacheStatsDict)
      .def("table_stats", &TableStatsList)
      .def_property_readonly_static("table_shift", [](py::object) { return mlkv::kTableShift; })
      .def_property_readonly("row_words", &EmbeddingCache::row_words)
      .def_property_readonly("weight_words", &EmbeddingCache::weight_words);
}

}  // namespace mlkv::bindings
