// Torch-free tests of BaseRun (csrc/engine/base_run.h), built and run under AddressSanitizer and
// ThreadSanitizer by scripts/sanitize.sh: runs written and read back against std::map, a block
// per key read once, the cursor's order, damaged files refused by name, and overlays (rows and
// deletions over a bottom, merged by base_merge.h) read, scanned and merged as the map says.
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tests/expect.h"
#include "engine/base_merge.h"
#include "engine/base_run.h"
#include "engine/crc32c.h"

using mlkv::BaseRun;
using mlkv::BaseRunWriter;
using mlkv::Status;

namespace {

int passed = 0;

std::vector<uint8_t> ValueOf(int64_t key, uint32_t value_bytes) {
  std::vector<uint8_t> v(value_bytes);
  for (uint32_t i = 0; i < value_bytes; ++i) v[i] = static_cast<uint8_t>(key * 31 + i * 7);
  return v;
}

// Writes the keys (sorted) as a run of `format`; returns the model.
std::map<int64_t, std::vector<uint8_t>> WriteRun(const std::string& path, const std::vector<int64_t>& keys,
                                                 uint32_t value_bytes, uint32_t format = mlkv::kBaseRunFormat) {
  std::unique_ptr<BaseRunWriter> writer;
  Status st = BaseRunWriter::Create(path, value_bytes, 1, mlkv::FilterSize{}, &writer, format);
  EXPECT(st.ok(), "create: %s", st.ToString().c_str());
  std::map<int64_t, std::vector<uint8_t>> model;
  for (int64_t key : keys) {
    model[key] = ValueOf(key, value_bytes);
    st = writer->Add(key, model[key].data());
    EXPECT(st.ok(), "add %lld: %s", static_cast<long long>(key), st.ToString().c_str());
  }
  st = writer->Finish();
  EXPECT(st.ok(), "finish: %s", st.ToString().c_str());
  return model;
}

std::shared_ptr<mlkv::BlockReader> Reader() {
  std::shared_ptr<mlkv::BlockReader> reader;
  Status st = mlkv::BlockReader::Create(mlkv::IoEngine::kThreads, 16, 4, false, &reader);
  if (!st.ok()) std::exit(2);
  return reader;
}

// Every key, and keys around them, looked up against the model; the cursor gives every row in order.
// Runs of format 2 (no per-row checksums, as builds before them wrote) read as well.
void ReadBackTest(const std::string& dir, uint32_t value_bytes, size_t rows, uint32_t seed,
                  uint32_t format = mlkv::kBaseRunFormat) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> keys;
  int64_t key = static_cast<int64_t>(rng() % 5);
  for (size_t i = 0; i < rows; ++i, key += 1 + static_cast<int64_t>(rng() % 3)) keys.push_back(key);
  const std::string path = dir + "/run-" + std::to_string(value_bytes) + ".run";
  auto model = WriteRun(path, keys, value_bytes, format);
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  EXPECT(run->rows() == rows, "rows %llu", static_cast<unsigned long long>(run->rows()));
  std::vector<int64_t> probes;
  for (int64_t k = 0; k <= key + 2; ++k) probes.push_back(k);
  std::shuffle(probes.begin(), probes.end(), rng);
  probes.push_back(probes.front());  // a key asked twice
  std::vector<uint8_t> out(probes.size() * value_bytes);
  std::unique_ptr<bool[]> found(new bool[probes.size()]);
  auto reader = Reader();
  uint64_t blocks_read = 0;
  st = run->Lookup(probes.data(), probes.size(), out.data(), found.get(), reader.get(), &blocks_read);
  EXPECT(st.ok(), "lookup: %s", st.ToString().c_str());
  size_t wrong = 0;
  for (size_t i = 0; i < probes.size(); ++i) {
    auto it = model.find(probes[i]);
    const bool in_model = it != model.end();
    if (found[i] != in_model ||
        (in_model && std::memcmp(out.data() + i * value_bytes, it->second.data(), value_bytes) != 0)) {
      ++wrong;
    }
  }
  EXPECT(wrong == 0, "%zu of %zu lookups wrong", wrong, probes.size());
  size_t wrong_presence = 0;  // what the fences tell never contradicts the rows
  for (int64_t probe : probes) {
    const BaseRun::Presence p = run->PresenceOf(probe);
    if ((p == BaseRun::Presence::kPresent && !model.count(probe)) ||
        (p == BaseRun::Presence::kAbsent && model.count(probe))) {
      ++wrong_presence;
    }
  }
  EXPECT(wrong_presence == 0, "%zu presences wrong", wrong_presence);
  EXPECT(blocks_read == run->blocks(), "read %llu blocks for %llu: each once",
         static_cast<unsigned long long>(blocks_read), static_cast<unsigned long long>(run->blocks()));
  BaseRun::Cursor cursor(*run);
  std::vector<int64_t> scanned;
  std::vector<uint8_t> values;
  for (bool more = true; more;) {
    st = cursor.Next(&scanned, &values, &more);
    EXPECT(st.ok(), "cursor: %s", st.ToString().c_str());
    if (!st.ok()) break;
  }
  EXPECT(scanned == keys, "the cursor gave %zu rows for %zu", scanned.size(), keys.size());
  bool values_match = values.size() == keys.size() * value_bytes;
  for (size_t i = 0; values_match && i < keys.size(); ++i) {
    values_match = std::memcmp(values.data() + i * value_bytes, model[keys[i]].data(), value_bytes) == 0;
  }
  EXPECT(values_match, "cursor values");
  ++passed;
}

// A run of every key in a range (a table written in full) tells each key present from its fences
// alone; one gap makes its block's keys unknown, and only those.
void GaplessTest(const std::string& dir) {
  std::vector<int64_t> keys;
  for (int64_t k = 100; k < 5100; ++k) keys.push_back(k);
  const std::string path = dir + "/gapless.run";
  WriteRun(path, keys, 32);
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, 32, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  size_t present = 0;
  for (int64_t k = 100; k < 5100; ++k) present += run->PresenceOf(k) == BaseRun::Presence::kPresent;
  EXPECT(present == keys.size(), "%zu of %zu present", present, keys.size());
  EXPECT(run->PresenceOf(99) == BaseRun::Presence::kAbsent && run->PresenceOf(5100) == BaseRun::Presence::kAbsent,
         "keys outside the range");
  keys.erase(keys.begin() + 1000);  // key 1100 missing
  WriteRun(path, keys, 32);
  st = BaseRun::Open(path, 32, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  size_t maybe = 0;
  for (int64_t k = 100; k < 5100; ++k) maybe += run->PresenceOf(k) == BaseRun::Presence::kMaybe;
  const size_t rows_per_block = mlkv::BaseBlockLayout(32, mlkv::kBaseRunFormat).rows_per_block;
  EXPECT(maybe > 0 && maybe < rows_per_block + 1, "%zu keys unknown: those of the block with the gap", maybe);
  ++passed;
}

// A run written with a filter keeps it where its fences cannot tell a key (sparse keys: absent ones
// are then told without a read), and drops it where they can (every key of its range present).
void FilterKeptWhereFencesCannotTellTest(const std::string& dir) {
  auto write = [&](const std::string& path, int64_t step) {
    std::unique_ptr<BaseRunWriter> writer;
    Status st = BaseRunWriter::Create(path, 32, 1, mlkv::FilterSize{5000}, &writer);
    std::vector<uint8_t> value(32, 1);
    for (int64_t k = 0; st.ok() && k < 5000; ++k) st = writer->Add(k * step, value.data());
    if (st.ok()) st = writer->Finish();
    std::unique_ptr<BaseRun> run;
    if (st.ok()) st = BaseRun::Open(path, 32, 1, false, &run);
    EXPECT(st.ok(), "writing %s: %s", path.c_str(), st.ToString().c_str());
    if (!st.ok()) std::exit(2);
    return run;
  };
  auto dense = write(dir + "/dense.run", 1), sparse = write(dir + "/sparse.run", 3);
  size_t told_absent = 0;
  for (int64_t k = 0; k < 5000; ++k) told_absent += sparse->PresenceOf(k * 3 + 1) == BaseRun::Presence::kAbsent;
  EXPECT(told_absent > 4900, "%zu of 5000 absent keys told absent by the filter", told_absent);
  EXPECT(dense->memory_bytes() * 4 < sparse->memory_bytes(), "the dense run keeps %llu bytes, the sparse %llu",
         static_cast<unsigned long long>(dense->memory_bytes()),
         static_cast<unsigned long long>(sparse->memory_bytes()));
  ++passed;
}

void EmptyAndOrderTest(const std::string& dir) {
  const std::string path = dir + "/empty.run";
  WriteRun(path, {}, 12);
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, 12, 1, true, &run);
  EXPECT(st.ok() && run->rows() == 0 && run->blocks() == 0, "empty run: %s", st.ToString().c_str());
  if (st.ok()) {
    int64_t k = 7;
    uint8_t out[12];
    bool found = true;
    auto reader = Reader();
    st = run->Lookup(&k, 1, out, &found, reader.get());
    EXPECT(st.ok() && !found, "lookup in an empty run");
  }
  std::unique_ptr<BaseRunWriter> writer;
  st = BaseRunWriter::Create(dir + "/order.run", 12, 1, mlkv::FilterSize{}, &writer);
  uint8_t value[12] = {};
  st = writer->Add(5, value);
  EXPECT(st.ok(), "first add");
  st = writer->Add(5, value);
  EXPECT(st.code() == Status::Code::kInvalidArgument, "a repeated key: %s", st.ToString().c_str());
  st = BaseRun::Open(dir + "/order.run", 12, 1, true, &run);  // never finished: not a run
  EXPECT(st.code() == Status::Code::kCorruption, "an unfinished run: %s", st.ToString().c_str());
  st = BaseRun::Open(path, 12, 2, true, &run);
  EXPECT(st.code() == Status::Code::kCorruption, "another run's number: %s", st.ToString().c_str());
  st = BaseRun::Open(path, 16, 1, true, &run);
  EXPECT(st.code() == Status::Code::kInvalidArgument, "other row width: %s", st.ToString().c_str());
  ++passed;
}

void FlipByte(const std::string& path, uint64_t offset) {
  const int fd = open(path.c_str(), O_RDWR);
  uint8_t b = 0;
  if (pread(fd, &b, 1, static_cast<off_t>(offset)) != 1) std::exit(2);
  b ^= 0x40;
  if (pwrite(fd, &b, 1, static_cast<off_t>(offset)) != 1) std::exit(2);
  close(fd);
}

// A flipped byte in a block's row fails the lookups that take that row, naming the block (in
// format 2 every lookup in the block: its checksum is the block's alone); from format 3 a lookup
// takes an intact row of the block (checked alone), and a key the block does not hold fails (the
// whole block checked). The fences' and the trailer's fail the open; a truncated file too.
void DamageTest(const std::string& dir, uint32_t format) {
  const uint32_t value_bytes = 64;
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < 2000; ++k) keys.push_back(k * 2);
  const std::string path = dir + "/damaged-" + std::to_string(format) + ".run";
  WriteRun(path, keys, value_bytes, format);
  const mlkv::BaseBlockLayout layout(value_bytes, format);
  FlipByte(path, 3 * 4096 + 16 + layout.row_bytes() + 20);  // inside block 3's row 1
  std::unique_ptr<BaseRun> run;
  Status st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.ok(), "open: %s", st.ToString().c_str());
  if (!st.ok()) return;
  auto reader = Reader();
  uint8_t out[64];
  bool found = false;
  auto lookup = [&](int64_t key) { return run->Lookup(&key, 1, out, &found, reader.get()); };
  auto names_block_3 = [&](const Status& s) {
    return s.code() == Status::Code::kCorruption && s.message().find("block 3") != std::string::npos &&
           s.message().find(path) != std::string::npos;
  };
  st = lookup(0);
  EXPECT(st.ok() && found, "a key of an undamaged block: %s", st.ToString().c_str());
  const int64_t first_of_block_3 = static_cast<int64_t>(3 * layout.rows_per_block) * 2;
  st = lookup(first_of_block_3 + 2);  // row 1
  EXPECT(names_block_3(st), "the damaged row: %s", st.ToString().c_str());
  st = lookup(first_of_block_3 + 4);  // row 2, intact
  if (format >= 3) {
    EXPECT(st.ok() && found && std::memcmp(out, ValueOf(first_of_block_3 + 4, value_bytes).data(), value_bytes) == 0,
           "an intact row of the damaged block: %s", st.ToString().c_str());
  } else {
    EXPECT(names_block_3(st), "another row of the damaged block: %s", st.ToString().c_str());
  }
  st = lookup(first_of_block_3 + 5);  // not in the run: the block's keys must be its own to say so
  EXPECT(names_block_3(st), "a key the damaged block does not hold: %s", st.ToString().c_str());
  if (format >= 3) {  // a row's checksum damaged: the row is not taken
    FlipByte(path, 3 * 4096 + 16 + layout.row_bytes() + 20);
    FlipByte(path, 3 * 4096 + layout.row_crc_offset() + 2 * 4 + 1);  // row 2's
    st = lookup(first_of_block_3 + 4);
    EXPECT(names_block_3(st), "a row whose checksum is damaged: %s", st.ToString().c_str());
    st = lookup(first_of_block_3 + 2);
    EXPECT(st.ok() && found, "the row before it, intact again: %s", st.ToString().c_str());
  }
  const uint64_t size = [&] {
    const int fd = open(path.c_str(), O_RDONLY);
    const off_t end = lseek(fd, 0, SEEK_END);
    close(fd);
    return static_cast<uint64_t>(end);
  }();
  FlipByte(path, size - 64 - 8);  // a fence
  st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.code() == Status::Code::kCorruption && st.message().find("fences") != std::string::npos,
         "damaged fences: %s", st.ToString().c_str());
  if (truncate(path.c_str(), static_cast<off_t>(size - 10)) != 0) std::exit(2);
  st = BaseRun::Open(path, value_bytes, 1, true, &run);
  EXPECT(st.code() == Status::Code::kCorruption, "a truncated run: %s", st.ToString().c_str());
  ++passed;
}

// Crc32c (three streams at once on long inputs) against CRC-32C bit by bit, whole and in pieces.
void CrcTest() {
  auto bitwise = [](uint32_t crc, const uint8_t* p, size_t n) {
    crc = ~crc;
    for (size_t i = 0; i < n; ++i) {
      crc ^= p[i];
      for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    }
    return ~crc;
  };
  std::mt19937_64 rng(5);
  std::vector<uint8_t> data(20000);
  for (uint8_t& b : data) b = static_cast<uint8_t>(rng());
  size_t wrong = 0;
  const char* check = "123456789";
  wrong += mlkv::Crc32c(0, check, 9) != 0xE3069283u;  // the standard check value
  for (size_t n : {size_t{0}, size_t{7}, size_t{4080}, size_t{4092}, size_t{4093}, size_t{8191}, size_t{20000}}) {
    const size_t split = n / 3;
    wrong += mlkv::Crc32c(0, data.data(), n) != bitwise(0, data.data(), n);
    wrong +=
        mlkv::Crc32c(mlkv::Crc32c(0, data.data(), split), data.data() + split, n - split) != bitwise(0, data.data(), n);
  }
  EXPECT(wrong == 0, "%zu checksums differ from CRC-32C's", wrong);
  ++passed;
}

// No key added is ever denied, and about one in 120 of the others passes.
void FilterTest() {
  // bits a key -> the most other keys (of 100,000) that may pass: about 0.8%, 9% and 39% of them.
  for (const auto& [bits, most] : {std::pair<uint64_t, size_t>{10, 1500}, {5, 12000}, {2, 45000}}) {
    mlkv::BloomFilter filter(mlkv::FilterSize{10000, bits});
    for (int64_t k = 0; k < 10000; ++k) filter.Add(k * 7);
    size_t denied = 0, passed_wrongly = 0;
    for (int64_t k = 0; k < 10000; ++k) denied += !filter.MayHold(k * 7);
    for (int64_t k = 0; k < 100000; ++k) passed_wrongly += filter.MayHold(k * 7 + 3);
    EXPECT(denied == 0, "%zu keys denied at %llu bits", denied, static_cast<unsigned long long>(bits));
    EXPECT(passed_wrongly < most && filter.words().size() == (10000 * bits + 63) / 64,
           "%zu of 100000 other keys passed at %llu bits", passed_wrongly, static_cast<unsigned long long>(bits));
  }
  ++passed;
}

using Model = std::map<int64_t, std::vector<uint8_t>>;

// Writes `entries` (a value per key; an empty one a deletion) as run `id` from MergeEntries.
std::shared_ptr<const BaseRun> WriteEntries(const std::string& path, uint64_t id,
                                            const std::map<int64_t, std::vector<uint8_t>>& entries) {
  std::vector<mlkv::BaseEntry> list;
  for (const auto& [key, value] : entries) list.push_back({key, value.empty() ? nullptr : value.data()});
  std::unique_ptr<BaseRunWriter> writer;
  Status st = BaseRunWriter::Create(path, 20, id, mlkv::FilterSize{entries.size()}, &writer);
  mlkv::VectorSource source(list);
  if (st.ok()) st = mlkv::MergeEntries({&source}, true, writer.get());
  if (st.ok()) st = writer->Finish();
  std::unique_ptr<BaseRun> run;
  if (st.ok()) st = BaseRun::Open(path, 20, id, false, &run);
  EXPECT(st.ok(), "writing %s: %s", path.c_str(), st.ToString().c_str());
  if (!st.ok()) std::exit(2);
  return std::shared_ptr<const BaseRun>(std::move(run));
}

// Every key's answer from the base: lookups, presence, a scan, and a merge of it all into one run.
void CheckBase(const mlkv::BaseRuns& base, const Model& model, int64_t end, const std::string& dir) {
  std::vector<int64_t> keys;
  for (int64_t k = 0; k < end; ++k) keys.push_back(k);
  std::vector<uint8_t> out(keys.size() * 20);
  std::unique_ptr<bool[]> found(new bool[keys.size()]);
  auto reader = Reader();
  Status st = base.Lookup(keys.data(), keys.size(), out.data(), found.get(), reader.get(), nullptr);
  EXPECT(st.ok(), "lookup: %s", st.ToString().c_str());
  size_t wrong = 0, wrong_presence = 0;
  for (int64_t k : keys) {
    auto it = model.find(k);
    if (found[k] != (it != model.end()) || (found[k] && std::memcmp(out.data() + k * 20, it->second.data(), 20)))
      ++wrong;
    const BaseRun::Presence p = base.PresenceOf(k);
    wrong_presence +=
        (p == BaseRun::Presence::kPresent && !model.count(k)) || (p == BaseRun::Presence::kAbsent && model.count(k));
  }
  EXPECT(wrong == 0 && wrong_presence == 0, "%zu lookups, %zu presences wrong", wrong, wrong_presence);
  Model scanned;
  std::vector<int64_t> scan_keys;
  std::vector<uint8_t> scan_values;
  for (uint64_t block = 0; block < base.blocks();) {
    scan_keys.clear();
    scan_values.clear();
    st = base.ReadBlocks(block, &scan_keys, &scan_values, &block);
    EXPECT(st.ok(), "scan: %s", st.ToString().c_str());
    for (size_t j = 0; j < scan_keys.size(); ++j) {
      EXPECT(!scanned.count(scan_keys[j]), "key %lld scanned twice", static_cast<long long>(scan_keys[j]));
      scanned[scan_keys[j]].assign(scan_values.begin() + j * 20, scan_values.begin() + (j + 1) * 20);
    }
  }
  EXPECT(scanned == model, "the scan gave %zu rows for %zu", scanned.size(), model.size());
  std::vector<std::unique_ptr<mlkv::RunsSource>> owned;
  std::vector<mlkv::EntrySource*> sources;
  for (auto it = base.overlays().rbegin(); it != base.overlays().rend(); ++it) {
    owned.push_back(std::make_unique<mlkv::RunsSource>(std::vector<std::shared_ptr<const BaseRun>>{*it}));
    sources.push_back(owned.back().get());
  }
  owned.push_back(std::make_unique<mlkv::RunsSource>(base.runs()));
  sources.push_back(owned.back().get());
  std::unique_ptr<BaseRunWriter> writer;
  st = BaseRunWriter::Create(dir + "/merged.run", 20, 9, mlkv::FilterSize{}, &writer);
  if (st.ok()) st = mlkv::MergeEntries(sources, false, writer.get());
  if (st.ok()) st = writer->Finish();
  std::unique_ptr<BaseRun> merged;
  if (st.ok()) st = BaseRun::Open(dir + "/merged.run", 20, 9, false, &merged);
  EXPECT(st.ok() && merged->rows() == model.size() && merged->deletions().empty(), "merged: %s", st.ToString().c_str());
}

// A bottom of two disjoint runs, and two overlays of rows and deletions over it (a key deleted in
// the first written again in the second, a key deleted in the second that the first wrote), its
// files named from `prefix`; *model: its rows.
mlkv::BaseRuns OverlaidBase(const std::string& prefix, Model* model) {
  std::mt19937_64 rng(11);
  Model low, high;
  for (int64_t k = 0; k < 6000; ++k) (k < 3000 ? low : high)[k] = ValueOf(k, 20);
  model->insert(low.begin(), low.end());
  model->insert(high.begin(), high.end());
  auto bottom_low = WriteEntries(prefix + "-bottom-1.run", 1, low);
  auto bottom_high = WriteEntries(prefix + "-bottom-2.run", 2, high);
  std::vector<std::shared_ptr<const BaseRun>> overlays;
  for (uint64_t id = 3; id < 5; ++id) {
    Model entries;
    for (int i = 0; i < 900; ++i) {
      const int64_t k = static_cast<int64_t>(rng() % 6500);
      if (rng() % 3 == 0) {
        entries[k] = {};
        model->erase(k);
      } else {
        entries[k] = ValueOf(k * 1000 + static_cast<int64_t>(id), 20);
        (*model)[k] = entries[k];
      }
    }
    overlays.push_back(WriteEntries(prefix + "-overlay-" + std::to_string(id) + ".run", id, entries));
  }
  return mlkv::BaseRuns({bottom_low, bottom_high}, overlays, mlkv::BaseManifest{{1, 2}, {3, 4}, model->size()});
}

void OverlayTest(const std::string& dir) {
  Model model;
  const mlkv::BaseRuns base = OverlaidBase(dir + "/overlaid", &model);
  const mlkv::BaseManifest& manifest = base.manifest();
  CheckBase(base, model, 6600, dir);
  Status st = mlkv::WriteBaseManifest(dir + "/base-7.runs", 7, manifest);
  mlkv::BaseManifest read;
  if (st.ok()) st = mlkv::ReadBaseManifest(dir + "/base-7.runs", 7, &read);
  EXPECT(st.ok() && read.runs == manifest.runs && read.overlays == manifest.overlays && read.rows == manifest.rows,
         "the manifest read back: %s", st.ToString().c_str());
  st = mlkv::ReadBaseManifest(dir + "/base-7.runs", 8, &read);
  EXPECT(st.code() == Status::Code::kCorruption, "another generation's manifest: %s", st.ToString().c_str());
  ++passed;
}

// Lookups that share read rounds (RunReadRounds) get what each would alone: rows of one 4 KiB block
// each, so three lookups of every key need more reads than a round holds (rounds fill, then go on),
// beside a lookup in a base with overlays (a second round for its filters' false yeses) and one
// reading nothing; through `engine`'s reader (io_uring: reads started, then taken lookup by lookup).
void RoundsWith(const std::string& dir, mlkv::IoEngine engine) {
  constexpr uint32_t kValueBytes = 4068;  // one row (and its checksum) a block
  Model rows;
  for (int64_t k = 0; k < 2000; ++k) rows[k * 3] = ValueOf(k * 3, kValueBytes);
  std::unique_ptr<BaseRunWriter> writer;
  Status st = BaseRunWriter::Create(dir + "/rounds.run", kValueBytes, 20, mlkv::FilterSize{rows.size()}, &writer);
  for (const auto& [key, value] : rows)
    if (st.ok()) st = writer->Add(key, value.data());
  if (st.ok()) st = writer->Finish();
  std::unique_ptr<BaseRun> run;
  if (st.ok()) st = BaseRun::Open(dir + "/rounds.run", kValueBytes, 20, false, &run);
  EXPECT(st.ok(), "writing the run: %s", st.ToString().c_str());
  if (!st.ok()) return;
  const mlkv::BaseRuns base({std::shared_ptr<const BaseRun>(std::move(run))}, {}, mlkv::BaseManifest{{20}, {}, 2000});
  std::shared_ptr<mlkv::BlockReader> reader;
  st = mlkv::BlockReader::Create(engine, 64, 4, false, &reader);
  EXPECT(st.ok(), "a reader: %s", st.ToString().c_str());
  if (!st.ok()) return;
  constexpr int kLookups = 3;
  std::vector<int64_t> keys;  // every key, those between them (absent) and beyond
  for (int64_t k = 6100; k >= 0; --k) keys.push_back(k);
  std::vector<std::vector<uint8_t>> out(kLookups, std::vector<uint8_t>(keys.size() * kValueBytes));
  std::vector<std::unique_ptr<bool[]>> found;
  std::vector<std::unique_ptr<mlkv::BaseLookup>> lookups;
  std::vector<mlkv::RoundedLookup*> rounds;
  for (int l = 0; l < kLookups; ++l) {
    found.emplace_back(new bool[keys.size()]);
    lookups.push_back(base.StartLookup(keys.data(), keys.size(), out[l].data(), found[l].get(), reader.get()));
    rounds.push_back(lookups.back().get());
  }
  // The overlay test's base, and a lookup of no keys, in the same rounds.
  Model model;
  const mlkv::BaseRuns overlaid = OverlaidBase(dir + "/rounds", &model);
  std::vector<int64_t> overlaid_keys;
  for (int64_t k = 0; k < 6600; ++k) overlaid_keys.push_back(k);
  std::vector<uint8_t> overlaid_out(overlaid_keys.size() * 20);
  std::unique_ptr<bool[]> overlaid_found(new bool[overlaid_keys.size()]);
  auto overlaid_lookup = overlaid.StartLookup(overlaid_keys.data(), overlaid_keys.size(), overlaid_out.data(),
                                              overlaid_found.get(), reader.get());
  rounds.push_back(overlaid_lookup.get());
  auto none = base.StartLookup(nullptr, 0, nullptr, nullptr, reader.get());
  rounds.push_back(none.get());
  st = mlkv::RunReadRounds(rounds);
  EXPECT(st.ok(), "the rounds: %s", st.ToString().c_str());
  size_t wrong = 0;
  for (int l = 0; l < kLookups; ++l) {
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = rows.find(keys[i]);
      wrong += found[l][i] != (it != rows.end()) ||
               (found[l][i] && std::memcmp(out[l].data() + i * kValueBytes, it->second.data(), kValueBytes));
    }
    wrong += lookups[l]->blocks_read() != rows.size();  // a block a row, each read once
  }
  for (int64_t k : overlaid_keys) {
    auto it = model.find(k);
    wrong += overlaid_found[k] != (it != model.end()) ||
             (overlaid_found[k] && std::memcmp(overlaid_out.data() + k * 20, it->second.data(), 20));
  }
  EXPECT(wrong == 0 && kLookups * rows.size() > mlkv::kMaxReadsPerRound,
         "%zu answers of lookups in shared rounds wrong", wrong);
}

void RoundsTest(const std::string& dir) {
  RoundsWith(dir, mlkv::IoEngine::kThreads);
  if (mlkv::UringAvailable()) RoundsWith(dir, mlkv::IoEngine::kUring);
  ++passed;
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = argc > 1 ? argv[1] : "/tmp/mlkv-base-run-test";
  std::system(("rm -rf " + dir + " && mkdir -p " + dir).c_str());
  ReadBackTest(dir, 68, 20000, 1);    // many rows a block
  ReadBackTest(dir, 5000, 300, 2);    // a row wider than 4 KiB: 8 KiB blocks
  ReadBackTest(dir, 4068, 100, 3);    // exactly one row (and its checksum) a 4 KiB block
  ReadBackTest(dir, 68, 20000, 4, 2);  // format 2: no per-row checksums
  ReadBackTest(dir, 4072, 100, 5, 2);
  GaplessTest(dir);
  FilterKeptWhereFencesCannotTellTest(dir);
  EmptyAndOrderTest(dir);
  DamageTest(dir, 2);
  DamageTest(dir, mlkv::kBaseRunFormat);
  CrcTest();
  FilterTest();
  OverlayTest(dir);
  RoundsTest(dir);
  std::printf("base_run: %d passed, %d failed\n", mlkv_test::Failures() == 0 ? passed : 0, mlkv_test::Failures());
  return mlkv_test::Failures() == 0 ? 0 : 1;
}
