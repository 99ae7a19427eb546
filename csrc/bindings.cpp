// Python binding of the storage engine: mlkv_torch._C.Store.
// Tensors are checked here (the Python wrapper checks them first, with
// friendlier messages); engine calls run with the GIL released, and a non-OK
// Status becomes a typed Python exception.
#include <torch/extension.h>

#include <sstream>
#include <stdexcept>
#include <unordered_set>

#include "engine/kv_store.h"

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
    case Status::Code::kBusy:
      throw py::value_error(st.message());
    case Status::Code::kCorruption:
      throw CorruptionException(st.message());
    default:
      throw StoreIOException(st.message());
  }
}

void CheckKeys(const torch::Tensor& keys) {
  TORCH_CHECK_TYPE(keys.scalar_type() == torch::kInt64, "keys must be int64, got ", keys.scalar_type());
  TORCH_CHECK_VALUE(keys.dim() == 1, "keys must be 1-D, got shape ", keys.sizes());
  TORCH_CHECK_VALUE(keys.device().is_cpu() && keys.is_contiguous(), "keys must be a contiguous CPU tensor");
}

class Store {
 public:
  Store(const std::string& path, int64_t dim, int64_t element_type, int64_t memory_budget_bytes, int64_t expected_keys,
        int64_t segment_bytes, int64_t page_bytes, double mutable_fraction, int64_t io_depth, const std::string& io_engine,
        int64_t io_threads, bool direct_io, double compaction_ratio, bool promote_hot_reads) {
    TORCH_CHECK_VALUE(dim > 0 && memory_budget_bytes > 0 && expected_keys >= 0 && segment_bytes > 0 && page_bytes >= 0 &&
                          io_depth > 0 && io_threads > 0,
                      "store sizes must be positive");
    mlkv::StoreOptions o;
    o.dim = static_cast<uint32_t>(dim);
    o.element_type = static_cast<mlkv::ElementType>(element_type);
    o.memory_budget_bytes = static_cast<uint64_t>(memory_budget_bytes);
    o.expected_keys = static_cast<uint64_t>(expected_keys);
    o.segment_bytes = static_cast<uint64_t>(segment_bytes);
    o.page_bytes = static_cast<uint64_t>(page_bytes);
    o.mutable_fraction = mutable_fraction;
    o.io_depth = static_cast<uint32_t>(io_depth);
    if (io_engine == "auto") {
      o.io_engine = mlkv::IoEngine::kAuto;
    } else if (io_engine == "uring") {
      o.io_engine = mlkv::IoEngine::kUring;
    } else if (io_engine == "threads") {
      o.io_engine = mlkv::IoEngine::kThreads;
    } else {
      throw py::value_error("io_engine must be 'auto', 'uring' or 'threads', got '" + io_engine + "'");
    }
    o.io_threads = static_cast<uint32_t>(io_threads);
    o.direct_io = direct_io;
    o.compaction_ratio = compaction_ratio;
    o.promote_hot_reads = promote_hot_reads;
    Status st;
    {
      py::gil_scoped_release release;
      st = mlkv::KVStore::Open(path, o, &store_);
    }
    Check(st);
  }

  void Put(const torch::Tensor& keys, const torch::Tensor& values) {
    CheckKeys(keys);
    TORCH_CHECK_VALUE(values.device().is_cpu() && values.is_contiguous(), "values must be a contiguous CPU tensor");
    TORCH_CHECK_VALUE(static_cast<uint64_t>(values.numel() * values.element_size()) ==
                          static_cast<uint64_t>(keys.numel()) * store_->value_bytes(),
                      "values must hold ", keys.numel(), " rows of ", store_->value_bytes(), " bytes");
    Status st;
    {
      py::gil_scoped_release release;
      st = store_->Put(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), values.data_ptr());
    }
    Check(st);
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

  torch::Tensor Lookup(const torch::Tensor& keys, torch::Tensor& out) {
    CheckKeys(keys);
    CheckRowsOut(keys, out);
    torch::Tensor found = torch::empty({keys.numel()}, torch::kBool);
    Status st;
    {
      py::gil_scoped_release release;
      st = store_->Lookup(keys.data_ptr<int64_t>(), static_cast<size_t>(keys.numel()), out.data_ptr(), found.data_ptr<bool>());
    }
    Check(st);
    return found;
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
    Status st;
    {
      py::gil_scoped_release release;
      st = (store_.get()->*Method)();
    }
    Check(st);
  }

  py::dict Stats() {
    mlkv::StoreStats s;
    {
      py::gil_scoped_release release;
      s = store_->Stats();
    }
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
    d["in_place_updates"] = s.in_place_updates;
    d["appends"] = s.appends;
    d["compactions"] = s.compactions;
    d["compacted_rows"] = s.compacted_rows;
    d["checkpoints"] = s.checkpoints;
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

 private:
  void CheckRowsOut(const torch::Tensor& keys, const torch::Tensor& out) const {
    TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() &&
                          static_cast<uint64_t>(out.numel() * out.element_size()) ==
                              static_cast<uint64_t>(keys.numel()) * store_->value_bytes(),
                      "out must be a contiguous CPU tensor of ", keys.numel(), " rows");
  }

  std::unique_ptr<mlkv::KVStore> store_;
};

// SplitMix64's finalizer: a bijection of 64-bit values with strong mixing.
uint64_t SplitMix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xbf58476d1ce4e5b9ull;
  z ^= z >> 27;
  z *= 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Rows never written: element j of row `id` is uniform in [low, high), a
// function of (seed, id, j) alone, so every batch order gives the same rows.
torch::Tensor InitialRows(const torch::Tensor& ids, int64_t dim, int64_t seed, double low, double high,
                          torch::ScalarType dtype) {
  CheckKeys(ids);
  TORCH_CHECK_VALUE(dim > 0, "dim must be positive, got ", dim);
  TORCH_CHECK_VALUE(low <= high, "low must not exceed high, got [", low, ", ", high, ")");
  torch::Tensor rows = torch::empty({ids.numel(), dim}, torch::kFloat32);
  const int64_t* id = ids.data_ptr<int64_t>();
  float* out = rows.data_ptr<float>();
  const float lo = static_cast<float>(low), span = static_cast<float>(high - low);
  const uint64_t seed_part = static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ull;
  at::parallel_for(0, ids.numel(), 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint64_t row_part = seed_part ^ SplitMix64(static_cast<uint64_t>(id[i]) + 0xD1B54A32D192ED03ull);
      for (int64_t j = 0; j < dim; ++j) {
        const uint64_t z = SplitMix64(row_part + static_cast<uint64_t>(j) * 0x8CB92BA72F3D8DD7ull);
        out[i * dim + j] = lo + span * (static_cast<float>(z >> 40) * (1.0f / 16777216.0f));  // 24 random bits
      }
    }
  });
  return dtype == torch::kFloat32 ? rows : rows.to(dtype);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mlkv-torch storage engine";
  py::register_exception<CorruptionException>(m, "CorruptionError", PyExc_RuntimeError);
  py::register_exception<StoreIOException>(m, "StoreIOError", PyExc_OSError);
  m.def("uring_available", &mlkv::UringAvailable, "Whether this kernel allows io_uring.");
  m.def("initial_rows", &InitialRows, py::arg("ids"), py::arg("dim"), py::arg("seed"), py::arg("low"), py::arg("high"),
        py::arg("dtype"), "Deterministic initial rows: uniform [low, high) from (seed, id, column).");
  py::class_<Store>(m, "Store")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                    const std::string&, int64_t, bool, double, bool>(),
           py::arg("path"), py::arg("dim"), py::arg("element_type"), py::arg("memory_budget_bytes"),
           py::arg("expected_keys"), py::arg("segment_bytes"), py::arg("page_bytes"), py::arg("mutable_fraction"),
           py::arg("io_depth"), py::arg("io_engine"), py::arg("io_threads"), py::arg("direct_io"),
           py::arg("compaction_ratio"), py::arg("promote_hot_reads"))
      .def("put", &Store::Put)
      .def("get", &Store::Get)
      .def("lookup", &Store::Lookup)
      .def("contains", &Store::Contains)
      .def("delete", &Store::Delete)
      .def("lookahead", &Store::Lookahead)
      .def("flush", &Store::Call<&mlkv::KVStore::Flush>)
      .def("checkpoint", &Store::Call<&mlkv::KVStore::Checkpoint>)
      .def("compact", &Store::Call<&mlkv::KVStore::Compact>)
      .def("close", &Store::Call<&mlkv::KVStore::Close>)
      .def("stats", &Store::Stats)
      .def("size", &Store::Size);
}
