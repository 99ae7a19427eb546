#include "bindings/errors.h"

#include <sstream>
#include <unordered_set>

#include "cache/embedding_cache.h"

namespace mlkv::bindings {

namespace {

// The module's exception types, registered once at import.
PyObject* corruption_error = nullptr;
PyObject* store_io_error = nullptr;

}  // namespace

void Check(const Status& st, const std::vector<int64_t>* missing) {
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

void CheckKeys(const torch::Tensor& keys) {
  TORCH_CHECK_TYPE(keys.scalar_type() == torch::kInt64, "keys must be int64, got ", keys.scalar_type());
  TORCH_CHECK_VALUE(keys.dim() == 1, "keys must be 1-D, got shape ", keys.sizes());
  TORCH_CHECK_VALUE(keys.device().is_cpu() && keys.is_contiguous(), "keys must be a contiguous CPU tensor");
}

void RegisterErrors(py::module_& m) {
  corruption_error = py::register_exception<CorruptionException>(m, "CorruptionError", PyExc_RuntimeError).ptr();
  store_io_error = py::register_exception<StoreIOException>(m, "StoreIOError", PyExc_OSError).ptr();
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
}

}  // namespace mlkv::bindings
