// Python binding of the storage engines (mlkv_torch._C.Store, and RocksStore when built with RocksDB)
// and of the embedding cache.
// Tensors are checked here (the Python wrapper checks them first, with
// friendlier messages); engine calls run with the GIL released, and a non-OK
// Status becomes a typed Python exception.
#include <torch/extension.h>

#include <limits>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "embedding_cache.h"
#include "engine/kv_store.h"
#include "engine/rocks_row_store.h"
#include "row_ops.h"

namespace py = pybind11;
using mlkv::Status;

namespace {

struct CorruptionException : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct StoreIOException : std::runtime_error {
  using std::runtime_error::runtime_error;
};

void Check(const Status& st, const std::vector<int64_t>* missing = nullptr) {
  if (st.ok()) return;
  switch (st.code()) {
    case Status::Code::kNotFound: {
      std::ostringstream msg;
      msg << st.message();
      if (missing && !missing->empty()) {
        // Distinct keys, in order of first appearance, the first ten of them.
        std::vector<int64_t> distinct;
        std::unordered_set<int64_t> seen;
        for (int64_t k : *missing) {
          if (seen.insert(k).second) distinct.push_back(k);
        }
        msg << ": ";
        for (size_t i = 0; i < distinct.size() && i < 10; ++i) msg << (i ? ", " : "") << distinct[i];
        if (distinct.size() > 10) msg << ", ... (" << distinct.size() << " distinct)";
      }
      throw py::key_error(msg.str());
    }
    case Status::Code::kInvalidArgument:
    case Status::Code::kBusy: throw py::value_error(st.message());
    case Status::Code::kCorruption: throw CorruptionException(st.message());
    default: throw StoreIOException(st.message());
  }
}

// Runs an engine call with the GIL released (it may wait on the disk or on other threads).
template <typename F>
auto Unlocked(F&& f) {
  py::gil_scoped_release release;
  return f();
}

void CheckKeys(const torch::Tensor& keys) {
  TORCH_CHECK_TYPE(keys.scalar_type() == torch::kInt64, "keys must be int64, got ", keys.scalar_type());
  TORCH_CHECK_VALUE(keys.dim() == 1, "keys must be 1-D, got shape ", keys.sizes());
  TORCH_CHECK_VALUE(keys.device().is_cpu() && keys.is_contiguous(), "keys must be a contiguous CPU tensor");
}

// What every store binding offers, over the RowStore a table's cache shares.
class RowStoreHandle {
 public:
  // The store, shared with a table's cache, which keeps it alive.
  std::shared_ptr<mlkv::RowStore> rows() const { return rows_; }

  void Put(const torch::Tensor& keys, const torch::Tensor& values) {
    CheckKeys(keys);
    TORCH_CHECK_VALUE(values.device().is_cpu() && values.is_contiguous(), "values must be a contiguous CPU tensor");
    TORCH_CHECK_VALUE(static_cast<uint64_t>(values.numel() * values.element_size()) ==
                          static_cast<uint64_t>(keys.numel()) * rows_->value_bytes(),
                      "values must hold ", keys.numel(), " rows of ", rows_->value_bytes(), " bytes");
    Status st;
    {
      py::gil_scoped_release release;
      st = rows_->Put(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), values.data_ptr());
    }
    Check(st);
  }

  torch::Tensor Lookup(const torch::Tensor& keys, torch::Tensor& out) {
    CheckKeys(keys);
    CheckRowsOut(keys, out);
    torch::Tensor found = torch::empty({keys.numel()}, torch::kBool);
    Status st;
    {
      py::gil_scoped_release release;
      st = rows_->Lookup(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), out.data_ptr(),
                         found.data_ptr<bool>());
    }
    Check(st);
    return found;
  }

 protected:
  void CheckRowsOut(const torch::Tensor& keys, const torch::Tensor& out) const {
    TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() &&
                          static_cast<uint64_t>(out.numel() * out.element_size()) ==
                              static_cast<uint64_t>(keys.numel()) * rows_->value_bytes(),
                      "out must be a contiguous CPU tensor of ", keys.numel(), " rows");
  }

  std::shared_ptr<mlkv::RowStore> rows_;
};

class Store : public RowStoreHandle {
 public:
  Store(const std::string& path, int64_t dim, int64_t element_type, int64_t memory_budget_bytes, int64_t expected_keys,
        int64_t segment_bytes, int64_t page_bytes, double mutable_fraction, int64_t io_depth,
        const std::string& io_engine, int64_t io_threads, bool direct_io, double compaction_ratio,
        bool promote_hot_reads, bool cut_checkpoints, int64_t checkpoint_sequence) {
    TORCH_CHECK_VALUE(dim > 0 && memory_budget_bytes > 0 && expected_keys >= 0 && segment_bytes > 0 &&
                          page_bytes >= 0 && io_depth > 0 && io_threads > 0,
                      "store sizes must be positive");
    // 32-bit options: a larger value is refused by name, not cut to its low bits.
    const auto u32 = [](int64_t value, const char* name) {
      TORCH_CHECK_VALUE(value <= static_cast<int64_t>(UINT32_MAX), name, " must be at most ", UINT32_MAX, ", got ",
                        value);
      return static_cast<uint32_t>(value);
    };
    mlkv::StoreOptions o;
    o.dim = u32(dim, "dim");
    o.element_type = static_cast<mlkv::ElementType>(element_type);
    o.memory_budget_bytes = static_cast<uint64_t>(memory_budget_bytes);
    o.expected_keys = static_cast<uint64_t>(expected_keys);
    o.segment_bytes = static_cast<uint64_t>(segment_bytes);
    o.page_bytes = static_cast<uint64_t>(page_bytes);
    o.mutable_fraction = mutable_fraction;
    o.io_depth = u32(io_depth, "io_depth");
    if (io_engine == "auto") {
      o.io_engine = mlkv::IoEngine::kAuto;
    } else if (io_engine == "uring") {
      o.io_engine = mlkv::IoEngine::kUring;
    } else if (io_engine == "threads") {
      o.io_engine = mlkv::IoEngine::kThreads;
    } else {
      throw py::value_error("io_engine must be 'auto', 'uring' or 'threads', got '" + io_engine + "'");
    }
    o.io_threads = u32(io_threads, "io_threads");
    o.direct_io = direct_io;
    o.compaction_ratio = compaction_ratio;
    o.promote_hot_reads = promote_hot_reads;
    o.cut_checkpoints = cut_checkpoints;
    TORCH_CHECK_VALUE(checkpoint_sequence >= 0, "checkpoint_sequence must be non-negative");
    o.checkpoint_sequence = static_cast<uint64_t>(checkpoint_sequence);
    Status st;
    std::unique_ptr<mlkv::KVStore> store;
    {
      py::gil_scoped_release release;
      st = mlkv::KVStore::Open(path, o, &store);
    }
    Check(st);
    store_ = std::move(store);
    rows_ = store_;
  }

  void Get(const torch::Tensor& keys, torch::Tensor& out) {
    CheckKeys(keys);
    CheckRowsOut(keys, out);
    std::vector<int64_t> missing;
    Status st;
    {
      py::gil_scoped_release release;
      st = store_->Get(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), out.data_ptr(), &missing);
    }
    Check(st, &missing);
  }

  torch::Tensor Contains(const torch::Tensor& keys) {
    CheckKeys(keys);
    torch::Tensor found = torch::empty({keys.numel()}, torch::kBool);
    Status st;
    {
      py::gil_scoped_release release;
      st = store_->Contains(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), found.data_ptr<bool>());
    }
    Check(st);
    return found;
  }

  int64_t Delete(const torch::Tensor& keys) {
    CheckKeys(keys);
    uint64_t deleted = 0;
    Status st;
    {
      py::gil_scoped_release release;
      st = store_->Delete(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), &deleted);
    }
    Check(st);
    return static_cast<int64_t>(deleted);
  }

  void Lookahead(const torch::Tensor& keys) {
    CheckKeys(keys);
    Status st;
    {
      py::gil_scoped_release release;
      st = store_->Lookahead(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()));
    }
    Check(st);
  }

  template <Status (mlkv::KVStore::*Method)()>
  void Call() {
    Check(Unlocked([&] { return (store_.get()->*Method)(); }));
  }

  // (keys int64 [n], values uint8 [n, value bytes], next cursor or -1 at the end): one step of a scan.
  py::tuple ScanRows(int64_t cursor, int64_t max_rows) {
    TORCH_CHECK_VALUE(cursor >= 0 && max_rows > 0, "cursor must be non-negative and max_rows positive");
    uint64_t at = static_cast<uint64_t>(cursor);
    std::vector<int64_t> keys;
    std::vector<uint8_t> values;
    Check(Unlocked([&] { return store_->ScanRows(&at, static_cast<size_t>(max_rows), &keys, &values); }));
    const int64_t n = static_cast<int64_t>(keys.size());
    torch::Tensor key_tensor = torch::empty({n}, torch::kInt64);
    torch::Tensor value_tensor = torch::empty({n, static_cast<int64_t>(store_->value_bytes())}, torch::kUInt8);
    if (n) {
      std::memcpy(key_tensor.data_ptr<int64_t>(), keys.data(), keys.size() * sizeof(int64_t));
      std::memcpy(value_tensor.data_ptr<uint8_t>(), values.data(), values.size());
    }
    return py::make_tuple(key_tensor, value_tensor,
                          at == mlkv::KVStore::kScanDone ? int64_t{-1} : static_cast<int64_t>(at));
  }

  int64_t Checkpoint() {
    uint64_t sequence = 0;
    Check(Unlocked([&] { return store_->Checkpoint(&sequence); }));
    return static_cast<int64_t>(sequence);
  }

  void BeginCheckpoint() {
    Check(Unlocked([&] { return store_->BeginCheckpoint(); }));
  }

  int64_t FinishCheckpoint() {
    uint64_t sequence = 0;
    Check(Unlocked([&] { return store_->FinishCheckpoint(&sequence); }));
    return static_cast<int64_t>(sequence);
  }

  void CommitCheckpoint(int64_t sequence) {
    TORCH_CHECK_VALUE(sequence > 0, "checkpoint must be positive, got ", sequence);
    Check(Unlocked([&] { return store_->CommitCheckpoint(static_cast<uint64_t>(sequence)); }));
  }

  py::dict Stats() {
    const mlkv::StoreStats s = Unlocked([&] { return store_->Stats(); });
    py::dict d;
    d["rows"] = s.rows;
    d["memory_bytes"] = s.memory_bytes;
    d["index_bytes"] = s.index_bytes;
    d["log_memory_bytes"] = s.log_memory_bytes;
    d["disk_bytes"] = s.disk_bytes;
    d["memory_hits"] = s.memory_hits;
    d["disk_reads"] = s.disk_reads;
    d["disk_rows"] = s.disk_rows;
    d["lookahead_rows"] = s.lookahead_rows;
    d["promoted_rows"] = s.promoted_rows;
    d["lookahead_dropped_rows"] = s.lookahead_dropped_rows;
    d["write_stalls"] = s.write_stalls;
    d["frame_waits"] = s.frame_waits;
    d["frame_wait_seconds"] = s.frame_wait_seconds;
    d["in_place_updates"] = s.in_place_updates;
    d["appends"] = s.appends;
    d["compactions"] = s.compactions;
    d["compacted_rows"] = s.compacted_rows;
    d["checkpoints"] = s.checkpoints;
    d["recovered_from_index_image"] = s.recovered_from_index_image;
    d["begin_address"] = s.begin_address;
    d["head_address"] = s.head_address;
    d["read_only_address"] = s.read_only_address;
    d["tail_address"] = s.tail_address;
    d["page_bytes"] = s.page_bytes;
    d["record_bytes"] = s.record_bytes;
    d["direct_io"] = s.direct_io;
    d["io_engine"] = s.io_engine;
    return d;
  }

  int64_t Size() { return static_cast<int64_t>(store_->Size()); }
  bool Closed() { return store_->Closed(); }

 private:
  std::shared_ptr<mlkv::KVStore> store_;
};

#ifdef MLKV_WITH_ROCKSDB
// The RocksDB baseline: the same rows and calls a table's cache uses, over RocksDB.
class RocksStore : public RowStoreHandle {
 public:
  RocksStore(const std::string& path, int64_t value_bytes, int64_t memory_budget_bytes, bool direct_io) {
    TORCH_CHECK_VALUE(value_bytes > 0 && memory_budget_bytes > 0, "store sizes must be positive");
    Status st;
    std::unique_ptr<mlkv::RocksRowStore> store;
    {
      py::gil_scoped_release release;
      st = mlkv::RocksRowStore::Open(path, static_cast<uint32_t>(value_bytes),
                                     static_cast<uint64_t>(memory_budget_bytes), direct_io, &store);
    }
    Check(st);
    store_ = std::move(store);
    rows_ = store_;
  }

  template <Status (mlkv::RocksRowStore::*Method)()>
  void Call() {
    Check(Unlocked([&] { return (store_.get()->*Method)(); }));
  }

  py::dict Stats() {
    const mlkv::RocksStats s = Unlocked([&] { return store_->Stats(); });
    py::dict d;
    d["rows_estimate"] = s.rows_estimate;
    d["disk_bytes"] = s.disk_bytes;
    d["memtable_bytes"] = s.memtable_bytes;
    d["block_cache_bytes"] = s.block_cache_bytes;
    d["block_cache_hits"] = s.block_cache_hits;
    d["block_cache_misses"] = s.block_cache_misses;
    d["rows_read"] = s.rows_read;
    d["rows_found"] = s.rows_found;
    d["rows_written"] = s.rows_written;
    d["direct_io"] = s.direct_io;
    return d;
  }

 private:
  std::shared_ptr<mlkv::RocksRowStore> store_;
};
#endif  // MLKV_WITH_ROCKSDB

// Rows never written: element j of row `id` is uniform in [a, b) (normal: mean a, deviation b),
// a function of (seed, id, j) alone, so every batch order gives the same rows.
torch::Tensor InitialRows(const torch::Tensor& ids, int64_t dim, int64_t seed, double a, double b,
                          torch::ScalarType dtype, int64_t first_column, bool normal) {
  CheckKeys(ids);
  TORCH_CHECK_VALUE(dim > 0, "dim must be positive, got ", dim);
  if (normal) {
    TORCH_CHECK_VALUE(b >= 0, "std must be non-negative, got ", b);
  } else {
    TORCH_CHECK_VALUE(a <= b, "low must not exceed high, got [", a, ", ", b, ")");
  }
  torch::Tensor rows = torch::empty({ids.numel(), dim}, torch::kFloat32);
  const int64_t* id = ids.data_ptr<int64_t>();
  float* out = rows.data_ptr<float>();
  TORCH_CHECK_VALUE(first_column >= 0, "first_column must be non-negative, got ", first_column);
  const mlkv::RowInit init{static_cast<uint64_t>(seed), static_cast<float>(a), static_cast<float>(normal ? b : b - a),
                           first_column, normal};
  at::parallel_for(0, ids.numel(), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) mlkv::InitialRow(init, id[i], dim, out + i * dim);
  });
  return dtype == torch::kFloat32 ? rows : rows.to(dtype);
}

// Backward of the bag pooling on the CPU, in one pass: gradient rows per
// distinct id (duplicates summed, as a coalesced sparse gradient) and, when
// `weights` is given, the gradient of per_sample_weights.
std::tuple<torch::Tensor, torch::Tensor> BagBackward(const torch::Tensor& grad_out, const torch::Tensor& offsets,
                                                     const torch::Tensor& inverse, int64_t distinct, bool mean,
                                                     const c10::optional<torch::Tensor>& per_sample_weights,
                                                     const c10::optional<torch::Tensor>& weights) {
  TORCH_CHECK_VALUE(grad_out.device().is_cpu() && grad_out.dim() == 2, "grad_out must be a 2-D CPU tensor");
  const torch::Tensor g = grad_out.to(torch::kFloat32).contiguous();
  const int64_t bags = g.size(0), dim = g.size(1);
  TORCH_CHECK_VALUE(offsets.scalar_type() == torch::kInt64 && offsets.numel() == bags + 1 && offsets.is_contiguous(),
                    "offsets must be int64 [bags + 1]");
  TORCH_CHECK_VALUE(inverse.scalar_type() == torch::kInt64 && inverse.is_contiguous(), "inverse must be int64");
  const int64_t* off = offsets.data_ptr<int64_t>();
  const int64_t* inv = inverse.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(off[bags] == inverse.numel(), "offsets must end at the input length");
  torch::Tensor psw = per_sample_weights ? per_sample_weights->to(torch::kFloat32).contiguous() : torch::Tensor();
  torch::Tensor w = weights ? weights->to(torch::kFloat32).contiguous() : torch::Tensor();
  torch::Tensor grads = torch::zeros({distinct, dim}, torch::kFloat32);
  torch::Tensor grad_psw = w.defined() ? torch::empty({inverse.numel()}, torch::kFloat32) : torch::Tensor();
  const float* gp = g.data_ptr<float>();
  const float* pp = psw.defined() ? psw.data_ptr<float>() : nullptr;
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  float* out = grads.data_ptr<float>();
  float* gpsw = grad_psw.defined() ? grad_psw.data_ptr<float>() : nullptr;
  {
    py::gil_scoped_release release;
    for (int64_t b = 0; b < bags; ++b) {
      const float* row = gp + b * dim;
      const int64_t begin = off[b], end = off[b + 1];
      const float bag_scale = mean && end > begin ? 1.0f / static_cast<float>(end - begin) : 1.0f;
      for (int64_t j = begin; j < end; ++j) {
        TORCH_CHECK_VALUE(inv[j] >= 0 && inv[j] < distinct, "inverse index out of range");
        float* dst = out + inv[j] * dim;
        if (gpsw) {
          const float* wr = wp + inv[j] * dim;
          float dot = 0.f;
          for (int64_t k = 0; k < dim; ++k) dot += row[k] * wr[k];
          gpsw[j] = dot;
        }
        const float scale = pp ? pp[j] * bag_scale : bag_scale;
        for (int64_t k = 0; k < dim; ++k) dst[k] += row[k] * scale;
      }
    }
  }
  return {grads, grad_psw};
}

mlkv::OptimizerSpec MakeSpec(int64_t kind, double lr, double eps, double beta1, double beta2) {
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 3, "unknown optimizer kind ", kind);
  return {static_cast<mlkv::OptimizerKind>(kind), static_cast<float>(lr), static_cast<float>(eps),
          static_cast<float>(beta1), static_cast<float>(beta2)};
}

// The fused rule on separate weight and state tensors (CPU float32, rows of
// unit stride); mlkv_torch.optim calls it, so its tests check the same code
// the cache runs.
void ApplyOptimizer(int64_t kind, double lr, double eps, double beta1, double beta2, torch::Tensor weights,
                    torch::Tensor state, const torch::Tensor& grads, int64_t step) {
  const mlkv::OptimizerSpec spec = MakeSpec(kind, lr, eps, beta1, beta2);
  const int64_t n = weights.size(0), dim = weights.size(1);
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&weights, &state, &grads}) {
    TORCH_CHECK_VALUE(t->scalar_type() == torch::kFloat32 && t->device().is_cpu() && t->dim() == 2 && t->size(0) == n &&
                          (t->size(1) == 0 || t->stride(1) == 1),
                      "weights, state and grads must be 2-D float32 CPU tensors of ", n,
                      " rows with unit column stride");
  }
  TORCH_CHECK_VALUE(grads.size(1) == dim && state.size(1) == mlkv::StateColumns(spec.kind, dim), "grads must be [n, ",
                    dim, "] and state [n, ", mlkv::StateColumns(spec.kind, dim), "]");
  TORCH_CHECK_VALUE(spec.kind != mlkv::OptimizerKind::kAdam || step >= 1, "step counts from 1, got ", step);
  const float adam_scale = spec.kind == mlkv::OptimizerKind::kAdam ? mlkv::AdamStepScale(spec, step) : 0.f;
  float* w = weights.data_ptr<float>();
  float* st = state.data_ptr<float>();
  const float* g = grads.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    mlkv::UpdateRow<float>(spec, adam_scale, w + i * weights.stride(0), st + i * state.stride(0),
                           g + i * grads.stride(0), dim);
  }
}

// One table of a cache, as Python describes it: (name, store, num_embeddings, seed, normal, a, b, first_column):
// rows never written start uniform in [a, b), or normal with mean a and deviation b.
using TableArgs = std::tuple<std::string, const RowStoreHandle*, int64_t, int64_t, bool, double, double, int64_t>;

std::unique_ptr<mlkv::EmbeddingCache> MakeCache(const std::vector<TableArgs>& tables, int64_t capacity, int64_t dim,
                                                int64_t weight_type, int64_t kind, double eps, double beta1,
                                                double beta2, std::vector<float> initial_state,
                                                const std::string& policy, int64_t staleness, const std::string& device,
                                                int64_t staging_rows, int64_t write_back_rows) {
  std::vector<mlkv::CacheTable> cache_tables;
  for (const auto& [name, store, num_embeddings, seed, normal, a, b, first_column] : tables) {
    TORCH_CHECK_VALUE(store != nullptr, "table '", name, "' has no store");
    TORCH_CHECK_VALUE(first_column >= 0, "table '", name, "': first_column must be non-negative, got ", first_column);
    cache_tables.push_back({name,
                            store->rows(),
                            {static_cast<uint64_t>(seed), static_cast<float>(a), static_cast<float>(normal ? b : b - a),
                             first_column, normal},
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
  return std::make_unique<mlkv::EmbeddingCache>(std::move(cache_tables), std::move(o), torch::Device(device));
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
  d["prefetched_rows"] = s.lookahead_rows;
  d["prefetch_hits"] = s.lookahead_hits;
  d["prefetch_dropped_rows"] = s.lookahead_dropped;
  d["prefetch_latency_ms"] = s.lookahead_latency_us / 1e3;
  d["prefetch_wait_ms"] = static_cast<double>(s.lookahead_wait_us) / 1e3;
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
    d["prefetch_hits"] = t.lookahead_hits;
    d["written_back"] = t.written_back;
    out.append(d);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mlkv-torch storage engine";
  static PyObject* corruption_error =
      py::register_exception<CorruptionException>(m, "CorruptionError", PyExc_RuntimeError).ptr();
  static PyObject* store_io_error = py::register_exception<StoreIOException>(m, "StoreIOError", PyExc_OSError).ptr();
#ifdef MLKV_WITH_ROCKSDB
  m.attr("with_rocksdb") = true;
#else
  m.attr("with_rocksdb") = false;
#endif
  m.def("uring_available", &mlkv::UringAvailable, "Whether this kernel allows io_uring.");
  m.def("cache_bytes_beside_rows", &mlkv::EmbeddingCache::HostBytesBesideRows, py::arg("capacity"),
        "Host bytes an EmbeddingCache of `capacity` rows keeps beside the rows (index, slot state, policy).");
  m.def("cache_buffer_bytes", &mlkv::EmbeddingCache::HostBytesOfBuffers, py::arg("staging_rows"),
        py::arg("write_back_rows"), py::arg("row_words"),
        "Host bytes of an EmbeddingCache's staging area and write-back buffer at these many rows.");
  m.def("initial_rows", &InitialRows, py::arg("ids"), py::arg("dim"), py::arg("seed"), py::arg("a"), py::arg("b"),
        py::arg("dtype"), py::arg("first_column") = 0, py::arg("normal") = false,
        "Deterministic initial rows from (seed, id, column): uniform [a, b), or normal(mean a, std b).");
  py::class_<RowStoreHandle>(m, "RowStore");  // what EmbeddingCache takes
  py::class_<Store, RowStoreHandle>(m, "Store")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                    const std::string&, int64_t, bool, double, bool, bool, int64_t>(),
           py::arg("path"), py::arg("dim"), py::arg("element_type"), py::arg("memory_budget_bytes"),
           py::arg("expected_keys"), py::arg("segment_bytes"), py::arg("page_bytes"), py::arg("mutable_fraction"),
           py::arg("io_depth"), py::arg("io_engine"), py::arg("io_threads"), py::arg("direct_io"),
           py::arg("compaction_ratio"), py::arg("promote_hot_reads"), py::arg("cut_checkpoints") = false,
           py::arg("checkpoint_sequence") = 0)
      .def("put", &Store::Put)
      .def("get", &Store::Get)
      .def("lookup", &Store::Lookup)
      .def("contains", &Store::Contains)
      .def("delete", &Store::Delete)
      .def("lookahead", &Store::Lookahead)
      .def("flush", &Store::Call<&mlkv::KVStore::Flush>)
      .def("scan_rows", &Store::ScanRows, py::arg("cursor"), py::arg("max_rows"))
      .def("checkpoint", &Store::Checkpoint, "Checkpoints; returns the checkpoint's sequence number.")
      .def("begin_checkpoint", &Store::BeginCheckpoint)
      .def("finish_checkpoint", &Store::FinishCheckpoint)
      .def("commit_checkpoint", &Store::CommitCheckpoint, py::arg("sequence"))
      .def("compact", &Store::Call<&mlkv::KVStore::Compact>)
      .def("close", &Store::Call<&mlkv::KVStore::Close>)
      .def("stats", &Store::Stats)
      .def("size", &Store::Size)
      .def("closed", &Store::Closed)
      .def_static(
          "destroy", [](const std::string& path) { Check(mlkv::KVStore::Destroy(path)); }, py::arg("path"),
          py::call_guard<py::gil_scoped_release>())
      .def_static(
          "minimum_memory_bytes",
          [](const std::string& path) {
            uint64_t bytes = 0;
            Check(mlkv::KVStore::MinimumMemoryBytes(path, &bytes));
            return bytes;
          },
          py::arg("path"), py::call_guard<py::gil_scoped_release>());

#ifdef MLKV_WITH_ROCKSDB
  py::class_<RocksStore, RowStoreHandle>(m, "RocksStore")
      .def(py::init<const std::string&, int64_t, int64_t, bool>(), py::arg("path"), py::arg("value_bytes"),
           py::arg("memory_budget_bytes"), py::arg("direct_io"))
      .def("put", &RocksStore::Put)
      .def("lookup", &RocksStore::Lookup)
      .def("checkpoint", &RocksStore::Call<&mlkv::RocksRowStore::Checkpoint>)
      .def("close", &RocksStore::Call<&mlkv::RocksRowStore::Close>)
      .def("stats", &RocksStore::Stats);
#endif
  // Every exception this module throws becomes a Python exception here, rethrown by this module's
  // own C++ runtime, never by another module's translator (torch's, for c10::Error), which may be
  // built against another runtime. StatusError from the cache maps to the exceptions of the
  // store's own calls.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mlkv::StatusError& e) {
      try {
        Check(e.status);
      } catch (py::builtin_exception& py_error) {
        py_error.set_error();
      } catch (const CorruptionException& c) {
        PyErr_SetString(corruption_error, c.what());
      } catch (const StoreIOException& io) {
        PyErr_SetString(store_io_error, io.what());
      }
    } catch (const CorruptionException& c) {
      PyErr_SetString(corruption_error, c.what());
    } catch (const StoreIOException& io) {
      PyErr_SetString(store_io_error, io.what());
    } catch (py::builtin_exception& py_error) {
      py_error.set_error();
    } catch (const c10::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::NotImplementedError& e) {
      PyErr_SetString(PyExc_NotImplementedError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "out of memory");
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  m.def("bag_backward", &BagBackward, py::arg("grad_out"), py::arg("offsets"), py::arg("inverse"), py::arg("distinct"),
        py::arg("mean"), py::arg("per_sample_weights"), py::arg("weights"),
        "Gradient rows per distinct id of a pooled bag, and of per_sample_weights, on the CPU.");
  m.def("apply_optimizer", &ApplyOptimizer, py::arg("kind"), py::arg("lr"), py::arg("eps"), py::arg("beta1"),
        py::arg("beta2"), py::arg("weights"), py::arg("state"), py::arg("grads"), py::arg("step"),
        "One fused optimizer step on CPU float32 rows, in place.");
  using mlkv::EmbeddingCache;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<EmbeddingCache>(m, "EmbeddingCache")
      // Named arguments only: fourteen numbers in a row are too easy to swap.
      .def(py::init(&MakeCache), py::arg("tables"), py::kw_only(), py::arg("capacity"), py::arg("dim"),
           py::arg("weight_type"), py::arg("kind"), py::arg("eps"), py::arg("beta1"), py::arg("beta2"),
           py::arg("initial_state"), py::arg("policy"), py::arg("staleness"), py::arg("device"),
           py::arg("staging_rows") = 4096, py::arg("write_back_rows") = 4096)
      .def("unique_keys", &EmbeddingCache::UniqueKeys, nogil)
      .def("fetch", &EmbeddingCache::Fetch, nogil)
      .def("queue_update", &EmbeddingCache::QueueUpdate, nogil)
      .def("drain", &EmbeddingCache::Drain, nogil)
      .def("pause_applier", &EmbeddingCache::PauseApplier, nogil)
      .def("pause_writer", &EmbeddingCache::PauseWriter, nogil)
      .def("read_rows", &EmbeddingCache::ReadRows, nogil)
      .def("write_rows", &EmbeddingCache::WriteRows, nogil)
      .def("lookahead", &EmbeddingCache::ReadAhead, nogil)
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
