// The binding of IdActivity (mlkv_torch._C.IdActivity): each id's lookups and age for the
// frequency filter and the eviction of virtual tables (mlkv_torch/virtual_tables.py).
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings/bindings.h"
#include "id_activity.h"

namespace mlkv::bindings {

namespace {

// One table's policy, as Python describes it: (tracked, admit_after, rule (kEvictionRuleNames), count_threshold,
// decay_rate, ttl, trigger_ids, keep_ids).
using PolicyArgs = std::tuple<bool, int64_t, int64_t, double, double, int64_t, int64_t, int64_t>;

std::unique_ptr<IdActivity> MakeActivity(const std::vector<PolicyArgs>& tables) {
  std::vector<ActivityPolicy> policies;
  for (const auto& [tracked, admit_after, rule, threshold, decay, ttl, trigger, keep] : tables) {
    TORCH_CHECK_VALUE(rule >= 0 && rule < static_cast<int64_t>(kEvictionRuleNames.size()), "unknown eviction rule ",
                      rule);
    policies.push_back({tracked, admit_after, static_cast<EvictionRule>(rule), threshold, decay, ttl, trigger, keep});
  }
  return std::make_unique<IdActivity>(std::move(policies));
}

}  // namespace

void BindIdActivity(py::module_& m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<IdActivity>(m, "IdActivity")
      .def(py::init(&MakeActivity), py::arg("tables"))
      .def("observe", &IdActivity::Observe, py::arg("keys"), py::arg("now"), nogil)
      .def("holds", &IdActivity::Holds, py::arg("keys"), nogil)
      .def("pick", &IdActivity::Pick, py::arg("table"), py::arg("now"), nogil)
      .def("forget", &IdActivity::Forget, py::arg("keys"), nogil)
      .def("mark", &IdActivity::Mark, nogil)
      .def("changes", &IdActivity::Changes, nogil)
      .def("due", &IdActivity::Due, py::arg("table"))
      .def("live", &IdActivity::live, py::arg("table"))
      .def_property_readonly("tracked", &IdActivity::tracked)
      .def_property_readonly_static("bytes_per_id", [](const py::object&) { return IdActivity::BytesPerId(); })
      .def_property_readonly_static("rules",
                                    [](const py::object&) {
                                      return std::vector<std::string>(kEvictionRuleNames.begin(),
                                                                      kEvictionRuleNames.end());
                                    })
      .def("state", &IdActivity::State)
      .def("restore", &IdActivity::Restore, py::arg("keys"), py::arg("counts"), py::arg("last"), py::arg("holds_row"),
           nogil);
}

}  // namespace mlkv::bindings
