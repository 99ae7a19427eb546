// The binding of the RocksDB baseline store (mlkv_torch._C.RocksStore), when built with RocksDB.
#include <torch/extension.h>

#include <string>

#include "bindings/bindings.h"
#include "bindings/row_store_handle.h"

#ifdef MLKV_WITH_ROCKSDB
#include "engine/rocks_row_store.h"
#endif

namespace mlkv::bindings {

#ifdef MLKV_WITH_ROCKSDB
namespace {

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

}  // namespace
#endif  // MLKV_WITH_ROCKSDB

void BindRocksStore(py::module_& m) {
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
}

}  // namespace mlkv::bindings
