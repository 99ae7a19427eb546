// The binding of HotRowIndex (mlkv_torch._C.HotRowIndex): a rank's replicated rows by key, and the
// split of a batch's bags into those its replicas pool and those TorchRec's all-to-alls carry
// (mlkv_torch/torchrec/replicas.py), in one pass where tensor operations took a dozen.
#include <torch/extension.h>

#include <vector>

#include "bindings/bindings.h"
#include "bindings/errors.h"
#include "cache/embedding_cache.h"  // TableKey: a row's key, as the cache keys rows
#include "id_map.h"

namespace mlkv::bindings {

namespace {

class HotRowIndex {
 public:
  // `keys`: the hot rows' keys, their slots being their positions.
  explicit HotRowIndex(const torch::Tensor& keys) : slots_(static_cast<size_t>(keys.numel())) {
    CheckKeys(keys);
    const int64_t* k = keys.data_ptr<int64_t>();
    for (int64_t i = 0; i < keys.numel(); ++i) {
      TORCH_CHECK_VALUE(k[i] >= 0, "hot row keys must be non-negative, got ", k[i]);
      TORCH_CHECK_VALUE(slots_.Insert(k[i], static_cast<int32_t>(i)) == i, "hot row key ", k[i], " is given twice");
    }
  }

  int64_t size() const { return static_cast<int64_t>(slots_.size()); }

  // A batch's bags of the group's features (`ids[m]`: member m's ids, of table `tables[m]`; `lengths`:
  // its bags, member after member, `batch` a member). A bag is a hit when every id of it is hot (an
  // empty one too). Returns: every id's key; per id whether its bag is a hit; the hit bags (their
  // indices), their offsets into the hit ids and those ids' slots; of the misses, per member its
  // bags' lengths and ids; and [members, batch] each sample's bag among its member's misses (0 for a hit).
  py::tuple Split(const std::vector<torch::Tensor>& ids, const std::vector<int64_t>& tables,
                  const torch::Tensor& lengths, int64_t batch) const {
    const int64_t members = static_cast<int64_t>(ids.size());
    TORCH_CHECK_VALUE(static_cast<int64_t>(tables.size()) == members, "a table for each member's ids");
    TORCH_CHECK_VALUE(batch >= 0 && lengths.scalar_type() == torch::kInt64 && lengths.device().is_cpu() &&
                          lengths.is_contiguous() && lengths.numel() == members * batch,
                      "lengths must be contiguous int64 [members x batch] on the CPU");
    int64_t total = 0;
    for (const torch::Tensor& m : ids) {
      CheckKeys(m);
      total += m.numel();
    }
    const int64_t* len = lengths.data_ptr<int64_t>();
    torch::Tensor keys = torch::empty({total}, torch::kInt64);
    torch::Tensor value_hit = torch::empty({total}, torch::kBool);
    torch::Tensor inverse = torch::zeros({members, batch}, torch::kInt64);
    std::vector<int64_t> hit_bags, hit_offsets{0}, hit_slots, kept_lengths, kept_ids;
    std::vector<int64_t> kept_bags(members, 0), kept_values(members, 0);
    int64_t* key = keys.data_ptr<int64_t>();
    bool* hit_of = value_hit.data_ptr<bool>();
    int64_t* inv = inverse.data_ptr<int64_t>();
    std::vector<int32_t> bag_slots;
    int64_t at = 0;  // the id's position among the group's
    for (int64_t m = 0; m < members; ++m) {
      const int64_t* id = ids[m].data_ptr<int64_t>();
      const int64_t end = ids[m].numel();
      const int64_t table = tables[m];
      int64_t i = 0;
      for (int64_t b = 0; b < batch; ++b) {
        const int64_t n = len[m * batch + b];
        TORCH_CHECK_VALUE(n >= 0 && n <= end - i, "member ", m, "'s lengths do not match its ", end, " ids");
        bool hit = true;
        bag_slots.clear();
        for (int64_t j = i; j < i + n; ++j) {
          // An id outside [0, 2^40) is no row of a key: it misses here, and TorchRec's lookup names it.
          const bool bad = id[j] < 0 || (id[j] >> kTableShift) != 0;
          key[at + j] = bad ? -1 : TableKey(table, id[j]);
          const int32_t slot = bad ? -1 : slots_.Find(key[at + j]);
          hit = hit && slot >= 0;
          bag_slots.push_back(slot);
        }
        for (int64_t j = i; j < i + n; ++j) hit_of[at + j] = hit;
        if (hit) {
          hit_bags.push_back(m * batch + b);
          hit_slots.insert(hit_slots.end(), bag_slots.begin(), bag_slots.end());
          hit_offsets.push_back(static_cast<int64_t>(hit_slots.size()));
        } else {
          inv[m * batch + b] = kept_bags[m]++;
          kept_lengths.push_back(n);
          kept_ids.insert(kept_ids.end(), id + i, id + i + n);
          kept_values[m] += n;
        }
        i += n;
      }
      TORCH_CHECK_VALUE(i == end, "member ", m, "'s lengths do not match its ", end, " ids");
      at += end;
    }
    auto tensor = [](const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64); };
    return py::make_tuple(keys, value_hit, tensor(hit_bags), tensor(hit_offsets), tensor(hit_slots),
                          tensor(kept_lengths), tensor(kept_ids), kept_bags, kept_values, inverse);
  }

 private:
  IdMap slots_;
};

}  // namespace

void BindHotRows(py::module_& m) {
  py::class_<HotRowIndex>(m, "HotRowIndex", "A rank's replicated rows by key (table << 40 | row) -> slot.")
      .def(py::init<const torch::Tensor&>(), py::arg("keys"))
      .def("__len__", &HotRowIndex::size)
      .def("split", &HotRowIndex::Split, py::arg("ids"), py::arg("tables"), py::arg("lengths"), py::arg("batch"),
           "Splits a batch's bags of a group's features into hits (every id hot) and misses.");
}

}  // namespace mlkv::bindings
