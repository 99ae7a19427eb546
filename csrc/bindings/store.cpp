// The binding of the storage engine (mlkv_torch._C.Store) and of the RowStore a cache takes.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/row_store_handle.h"
#include "engine/kv_store.h"

namespace mlkv::bindings {

namespace {

class Store : public RowStoreHandle {
 public:
  Store(const std::string& path, int64_t dim, int64_t element_type, int64_t memory_budget_bytes, int64_t expected_keys,
        int64_t segment_bytes, int64_t page_bytes, double mutable_fraction, int64_t io_depth,
        const std::string& io_engine, int64_t io_threads, bool direct_io, double compaction_ratio,
        bool promote_hot_reads, bool cut_checkpoints, int64_t checkpoint_sequence, int64_t index_budget_bytes,
        int64_t key_limit, bool read_only) {
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
    } else if (io_engine == "pread") {
      o.io_engine = mlkv::IoEngine::kPread;
    } else {
      throw py::value_error("io_engine must be 'auto', 'uring', 'threads' or 'pread', got '" + io_engine + "'");
    }
    o.io_threads = u32(io_threads, "io_threads");
    o.direct_io = direct_io;
    o.compaction_ratio = compaction_ratio;
    o.promote_hot_reads = promote_hot_reads;
    o.cut_checkpoints = cut_checkpoints;
    TORCH_CHECK_VALUE(checkpoint_sequence >= 0, "checkpoint_sequence must be non-negative");
    o.checkpoint_sequence = static_cast<uint64_t>(checkpoint_sequence);
    TORCH_CHECK_VALUE(index_budget_bytes >= 0, "index_budget_bytes must be non-negative");
    o.index_budget_bytes = static_cast<uint64_t>(index_budget_bytes);
    TORCH_CHECK_VALUE(key_limit >= 0, "key_limit must be non-negative (0: any non-negative int64 key), got ",
                      key_limit);
    o.key_limit = static_cast<uint64_t>(key_limit);
    o.read_only = read_only;
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

  bool BeginLoad(int64_t expected_rows) {
    TORCH_CHECK_VALUE(expected_rows >= 0, "expected_rows must be non-negative, got ", expected_rows);
    bool begun = false;
    Check(Unlocked([&] { return store_->BeginLoad(static_cast<uint64_t>(expected_rows), &begun); }));
    return begun;
  }

  void LoadRows(const torch::Tensor& keys, const torch::Tensor& values) {
    CheckKeys(keys);
    CheckRowsIn(keys, values);
    Check(Unlocked([&] {
      return store_->LoadRows(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), values.data_ptr());
    }));
  }

  int64_t EndLoad() {
    uint64_t rows = 0;
    Check(Unlocked([&] { return store_->EndLoad(&rows); }));
    return static_cast<int64_t>(rows);
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
    mlkv::StoreStats s;
    Check(Unlocked([&] { return store_->Stats(&s); }));
    py::dict d;
    d["rows"] = s.rows;
    d["memory_bytes"] = s.memory_bytes;
    d["index_bytes"] = s.index_bytes;
    d["log_memory_bytes"] = s.log_memory_bytes;
    d["base_memory_bytes"] = s.base_memory_bytes;
    d["disk_bytes"] = s.disk_bytes;
    d["base_rows"] = s.base_rows;
    d["base_runs"] = s.base_runs;
    d["base_overlays"] = s.base_overlays;
    d["base_disk_bytes"] = s.base_disk_bytes;
    d["base_reads"] = s.base_reads;
    d["base_merges"] = s.base_merges;
    d["base_rows_written"] = s.base_rows_written;
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

  int64_t Size() {
    uint64_t rows = 0;
    Check(Unlocked([&] { return store_->Size(&rows); }));
    return static_cast<int64_t>(rows);
  }
  bool Closed() { return store_->Closed(); }

 private:
  std::shared_ptr<mlkv::KVStore> store_;
};

}  // namespace

void BindStore(py::module_& m) {
  py::class_<RowStoreHandle>(m, "RowStore");  // what EmbeddingCache takes
  py::class_<Store, RowStoreHandle>(m, "Store")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                    const std::string&, int64_t, bool, double, bool, bool, int64_t, int64_t, int64_t, bool>(),
           py::arg("path"), py::arg("dim"), py::arg("element_type"), py::arg("memory_budget_bytes"),
           py::arg("expected_keys"), py::arg("segment_bytes"), py::arg("page_bytes"), py::arg("mutable_fraction"),
           py::arg("io_depth"), py::arg("io_engine"), py::arg("io_threads"), py::arg("direct_io"),
           py::arg("compaction_ratio"), py::arg("promote_hot_reads"), py::arg("cut_checkpoints") = false,
           py::arg("checkpoint_sequence") = 0, py::arg("index_budget_bytes") = 0, py::arg("key_limit") = 0,
           py::arg("read_only") = false)
      .def("put", &Store::Put)
      .def("get", &Store::Get)
      .def("lookup", &Store::Lookup)
      .def("contains", &Store::Contains)
      .def("delete", &Store::Delete)
      .def("lookahead", &Store::Lookahead)
      .def("flush", &Store::Call<&mlkv::KVStore::Flush>)
      .def("scan_rows", &Store::ScanRows, py::arg("cursor"), py::arg("max_rows"))
      .def("begin_load", &Store::BeginLoad, py::arg("expected_rows"))
      .def("load_rows", &Store::LoadRows)
      .def("end_load", &Store::EndLoad)
      .def_property_readonly_static("SCAN_BASE",
                                    [](py::object) { return static_cast<int64_t>(mlkv::KVStore::kScanBase); })
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
}

}  // namespace mlkv::bindings
