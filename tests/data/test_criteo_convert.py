"""The Criteo TSV -> npy converter: torchrec's arrays bit for bit (plain, gzip, DLRM's day split),
converted once (fingerprinted entries, atomic, one conversion under concurrency), bad input
rejected with the file and line, and the command line's convert and generate."""
import fcntl
import gzip
import json
import os
import random
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from mlkv_torch.data.criteo_convert import cache_entry, convert, convert_file
from mlkv_torch.data.criteo_generate import generate
from mlkv_torch.data.criteo_npy import npy_files
from mlkv_torch.data.criteo_tsv import CriteoFormatError
from mlkv_torch.data.criteo_tsv import count_lines, read_blocks

torchrec_criteo = pytest.importorskip("torchrec.datasets.criteo")
pytest.importorskip("pyarrow")
pytestmark = pytest.mark.filterwarnings("ignore:Local function is not supported by pickle:UserWarning")

REPO = Path(__file__).resolve().parents[2]
SPECIAL_HEX = ["ffffffff", "80000000", "7fffffffffffffff", "0", "F", "00000000", "DeadBeef", "123456789abcdef"]


def _random_line(rng: random.Random) -> str:
    """A Criteo line with missing fields, negative ints and hex of every length up to 16 digits."""
    label = rng.choice(["0", "1", "1", ""]) if rng.random() < 0.1 else rng.choice(["0", "1"])
    # Wide ints, yet max - min + 2 stays within int32, where torchrec's shift would wrap.
    ints = ["" if rng.random() < 0.15 else str(rng.randint(-3, 2000) if rng.random() < 0.9
                                               else rng.randint(-2**29, 2**30)) for _ in range(13)]
    cats = []
    for _ in range(26):
        roll = rng.random()
        if roll < 0.1:
            cats.append("")
        elif roll < 0.15:
            cats.append(rng.choice(SPECIAL_HEX))
        elif roll < 0.25:
            cats.append(format(rng.randrange(16 ** rng.randint(1, 15)), "x"))
        else:
            cats.append(format(rng.randrange(2**32), "08x"))
    return "\t".join([label, *ints, *cats])


def _lines(count: int, seed: int = 0):
    rng = random.Random(seed)
    return [_random_line(rng) for _ in range(count)]


def _write(path: Path, lines, trailing_newline: bool = True, compress: bool = False) -> Path:
    text = ("\n".join(lines) + ("\n" if trailing_newline else "")).encode()
    path.write_bytes(gzip.compress(text) if compress else text)
    return path


def _torchrec_arrays(tsv: Path, scratch: Path):
    scratch.mkdir(parents=True, exist_ok=True)
    outputs = [str(scratch / f"{tsv.stem}_{part}.npy") for part in ("dense", "sparse", "labels")]
    torchrec_criteo.BinaryCriteoUtils.tsv_to_npys(str(tsv), *outputs, dataset_name="criteo_1tb")
    return [np.load(path) for path in outputs]


def _assert_same_arrays(prefix: str, expected) -> None:
    for (path,), want in zip(npy_files([prefix]), expected):
        got = np.load(path)
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert np.array_equal(got, want), path


def _entries(out: Path):
    return sorted(p.name for p in out.iterdir() if p.is_dir())


@pytest.mark.parametrize("compress,block_size", [(False, 1 << 14), (True, 1 << 14), (False, 2 << 20)])
def test_arrays_equal_torchrecs_tsv_to_npys(tmp_path, compress, block_size):
    lines = _lines(2000)
    plain = _write(tmp_path / "day.tsv", lines)
    source = _write(tmp_path / "day.tsv.gz", lines, compress=True) if compress else plain
    done = convert_file(str(source), str(tmp_path / "out"), block_size=block_size)
    assert done.converted and done.rows == [2000] and len(done.prefixes) == 1
    assert os.path.basename(done.prefixes[0]) == "day"
    _assert_same_arrays(done.prefixes[0], _torchrec_arrays(plain, tmp_path / "torchrec"))


def test_blocks_number_their_lines_and_count_lines_counts_a_last_line_without_newline(tmp_path):
    source = _write(tmp_path / "day.tsv", _lines(3000), trailing_newline=False)
    blocks = list(read_blocks(str(source), block_size=1 << 15))
    assert len(blocks) > 5 and sum(len(b) for b in blocks) == 3000 == count_lines(str(source))
    assert [b.first_line for b in blocks] == list(np.cumsum([0] + [len(b) for b in blocks[:-1]]) + 1)


def test_days_are_dlrms_consecutive_slices_each_with_its_own_minimum(tmp_path):
    lines = _lines(1000, seed=1)
    lines[900] = "\t".join(["1", "-2000000"] + [""] * 12 + [""] * 26)  # only the last day sees this minimum
    source = _write(tmp_path / "train.txt", lines, trailing_newline=False)
    done = convert_file(str(source), str(tmp_path / "out"), days=3)
    assert done.rows == [334, 333, 333]  # divmod(1000, 3): the first `extras` days get one row more
    assert [os.path.basename(p) for p in done.prefixes] == ["day_0", "day_1", "day_2"]
    first = 0
    for day, (prefix, rows) in enumerate(zip(done.prefixes, done.rows)):
        part = _write(tmp_path / f"slice_{day}.tsv", lines[first:first + rows])
        _assert_same_arrays(prefix, _torchrec_arrays(part, tmp_path / "torchrec"))
        first += rows
    with pytest.raises(CriteoFormatError, match=r"train\.txt: 1001 days need at least 1001 lines, the file has 1000"):
        convert_file(str(source), str(tmp_path / "out"), days=1001)


def test_a_second_call_serves_the_entry_without_converting(tmp_path):
    source = _write(tmp_path / "day.tsv", _lines(300))
    out = tmp_path / "out"
    first = convert_file(str(source), str(out))
    manifest = Path(first.entry) / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    again = convert_file(str(source), str(out))
    assert not again.converted and again.prefixes == first.prefixes and again.rows == first.rows
    assert manifest.stat().st_mtime_ns == stamp
    assert convert([str(source)], str(out)) == [first.prefixes]
    # Days are other options: their own entry, next to the first one.
    days = convert_file(str(source), str(out), days=2)
    assert days.converted and _entries(out) == sorted([Path(first.entry).name, Path(days.entry).name])


@pytest.mark.parametrize("change", ["mtime", "contents"])
def test_a_changed_input_is_converted_again_and_the_old_entry_removed(tmp_path, change):
    source = _write(tmp_path / "day.tsv", _lines(300))
    out = tmp_path / "out"
    old = convert_file(str(source), str(out))
    if change == "mtime":
        stat = source.stat()
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    else:
        _write(source, _lines(301, seed=5))
    new = convert_file(str(source), str(out))
    assert new.converted and new.entry != old.entry and new.rows == [300 if change == "mtime" else 301]
    assert _entries(out) == [Path(new.entry).name]
    assert not Path(old.entry + ".lock").exists()
    _assert_same_arrays(new.prefixes[0], _torchrec_arrays(source, tmp_path / "torchrec"))


@pytest.mark.parametrize("damage", ["missing manifest", "corrupt manifest", "manifest of another source",
                                    "truncated file", "missing file"])
def test_a_damaged_entry_is_converted_again(tmp_path, damage):
    source = _write(tmp_path / "day.tsv", _lines(300))
    out = tmp_path / "out"
    first = convert_file(str(source), str(out))
    entry = Path(first.entry)
    if damage == "missing manifest":  # what a conversion killed before its rename would leave, were it renamed
        (entry / "manifest.json").unlink()
    elif damage == "corrupt manifest":
        (entry / "manifest.json").write_text('{"source": ')
    elif damage == "manifest of another source":
        manifest = json.loads((entry / "manifest.json").read_text())
        manifest["source"]["mtime_ns"] += 1
        (entry / "manifest.json").write_text(json.dumps(manifest))
    elif damage == "truncated file":
        sparse = entry / "day_sparse.npy"
        sparse.write_bytes(sparse.read_bytes()[:-8])
    else:
        (entry / "day_labels.npy").unlink()
    again = convert_file(str(source), str(out))
    assert again.converted and again.entry == first.entry
    _assert_same_arrays(again.prefixes[0], _torchrec_arrays(source, tmp_path / "torchrec"))


_HOLD_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


def test_partial_directories_nobody_writes_are_removed(tmp_path):
    source = _write(tmp_path / "day.tsv", _lines(100))
    out = tmp_path / "out"
    out.mkdir()
    name = Path(cache_entry(str(source), str(out))).name
    own = out / f".{name}.partial-otherhost-17"  # a killed conversion of this entry
    dead = out / ".dead-0123456789ab.partial-otherhost-18"  # of another entry, whose lock nobody holds
    alive = out / ".alive-0123456789ab.partial-otherhost-19"  # being written: its converter holds the lock
    for path in (own, dead, alive):
        path.mkdir()
        (path / "day_dense.npy").write_bytes(b"half")
    writer = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out / "alive-0123456789ab.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "held"
        done = convert_file(str(source), str(out))
    finally:
        writer.communicate("")
    assert done.converted and not own.exists() and not dead.exists() and alive.exists()


def test_an_entry_held_by_a_reader_is_not_removed_when_its_input_changes(tmp_path):
    source = _write(tmp_path / "day.tsv", _lines(200))
    out = tmp_path / "out"
    read = convert_file(str(source), str(out), hold=True)
    _write(source, _lines(201, seed=9))  # changed while a run reads the first conversion
    changed = convert_file(str(source), str(out))
    assert changed.converted and Path(read.entry).exists()  # still readable: not removed under the reader
    assert np.load(read.prefixes[0] + "_dense.npy").shape == (200, 13)
    read.release()
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    again = convert_file(str(source), str(out))  # supersedes both earlier entries: neither is held now
    assert again.converted and _entries(out) == [Path(again.entry).name]


def _converting_in_a_thread(source: Path, out: Path):
    """convert_file(hold=True) run on a thread (another reader), given 30 s: (the thread, its result)."""
    served = []
    other = threading.Thread(target=lambda: served.append(convert_file(str(source), str(out), hold=True)),
                             daemon=True)
    other.start()
    other.join(timeout=30)
    return other, served


def test_an_entry_held_by_a_reader_is_served_to_others_at_once(tmp_path):
    source = _write(tmp_path / "day.tsv", _lines(200))
    out = tmp_path / "out"
    held = convert_file(str(source), str(out), hold=True)  # a run reading it (another rank, another experiment)
    other, served = _converting_in_a_thread(source, out)
    assert not other.is_alive(), "a second reader waited for the first to finish"
    assert not served[0].converted and served[0].prefixes == held.prefixes
    held.release()
    served[0].release()


def test_a_rank_that_found_the_entry_unconverted_while_another_converted_it_does_not_wait_forever(tmp_path,
                                                                                                  monkeypatch):
    # Under torchrun: rank 1 finds the entry unconverted and goes to convert it; rank 0 converts it
    # first and keeps its shared lock for the run. Rank 1 must then find it converted, not wait for
    # the lock alone (once a deadlock: rank 0 waited in a collective for rank 1).
    import mlkv_torch.data.criteo_convert as criteo_convert

    source = _write(tmp_path / "day.tsv", _lines(200))
    out = tmp_path / "out"
    held = convert_file(str(source), str(out), hold=True)  # rank 0: converted, reading it
    valid, seen = criteo_convert._valid_manifest, []

    def unconverted_at_first(entry, fingerprint):  # rank 1's first check ran before rank 0's conversion
        seen.append(entry)
        return None if len(seen) == 1 else valid(entry, fingerprint)

    monkeypatch.setattr(criteo_convert, "_valid_manifest", unconverted_at_first)
    other, served = _converting_in_a_thread(source, out)
    assert not other.is_alive(), "it waited for the lock alone while the converter read the entry"
    assert not served[0].converted and served[0].prefixes == held.prefixes
    held.release()
    served[0].release()


def test_the_dense_log_is_taken_chunk_by_chunk(tmp_path, monkeypatch):
    import mlkv_torch.data.criteo_convert as criteo_convert

    monkeypatch.setattr(criteo_convert, "_DENSE_CHUNK_VALUES", 1000)  # 2000 rows of 13 values: 26 chunks, one partial
    source = _write(tmp_path / "day.tsv", _lines(2000))
    done = convert_file(str(source), str(tmp_path / "out"))
    _assert_same_arrays(done.prefixes[0], _torchrec_arrays(source, tmp_path / "torchrec"))


def test_a_file_without_line_ends_is_refused_before_it_is_read_whole(tmp_path):
    source = tmp_path / "blob.tsv"
    source.write_bytes(b"7" * (4 << 20))  # 4 MiB and no line end: not a Criteo file
    with pytest.raises(CriteoFormatError, match=r"blob\.tsv: line 1: .*longer than 65536 bytes"):
        convert_file(str(source), str(tmp_path / "out"))
    assert not [p for p in (tmp_path / "out").iterdir() if p.is_dir()]


_CONVERT_AND_REPORT = """
import json, sys
print("ready", flush=True)
from mlkv_torch.data.criteo_convert import convert_file
done = convert_file(sys.argv[1], sys.argv[2])
print(json.dumps({"prefixes": done.prefixes, "converted": done.converted}))
"""


def test_concurrent_callers_convert_once_and_share_the_entry(tmp_path):
    source = _write(tmp_path / "day.tsv", _lines(3000))
    out = tmp_path / "out"
    out.mkdir()
    lock = cache_entry(str(source), str(out)) + ".lock"
    with open(lock, "w") as held:  # both callers start while the entry is locked, then race for it
        fcntl.flock(held, fcntl.LOCK_EX)
        callers = [subprocess.Popen([sys.executable, "-c", _CONVERT_AND_REPORT, str(source), str(out)],
                                    stdout=subprocess.PIPE, text=True, cwd=REPO) for _ in range(2)]
        for caller in callers:
            assert caller.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        assert all(caller.poll() is None for caller in callers)
    reports = []
    for caller in callers:
        stdout, _ = caller.communicate(timeout=60)
        assert caller.returncode == 0
        reports.append(json.loads(stdout))
    assert sorted(r["converted"] for r in reports) == [False, True]
    assert reports[0]["prefixes"] == reports[1]["prefixes"]
    manifest = json.loads((Path(reports[0]["prefixes"][0]).parent / "manifest.json").read_text())
    assert manifest["converted_by"]["pid"] == callers[[r["converted"] for r in reports].index(True)].pid
    _assert_same_arrays(reports[0]["prefixes"][0], _torchrec_arrays(source, tmp_path / "torchrec"))


def _line_with(field: int, value: str) -> str:
    fields = _lines(1, seed=9)[0].split("\t")
    fields[field - 1] = value
    return "\t".join(fields)


BAD_LINES = {
    "39 fields": "\t".join(_lines(1, seed=9)[0].split("\t")[:39]),
    "41 fields": _lines(1, seed=9)[0] + "\t0",
    "empty line": "",
    "non-numeric label": _line_with(1, "x"),
    "non-numeric int": _line_with(5, "12a"),
    "int above int32": _line_with(3, str(2**31)),
    "int with a plus sign": _line_with(14, "+5"),
    "non-hex categorical": _line_with(20, "12g4"),
    "hex with a 0x prefix": _line_with(15, "0x1f"),
    "hex of 17 digits": _line_with(40, "1" * 17),
    "hex from 2**63": _line_with(30, "8000000000000000"),
}


@pytest.mark.parametrize("line", [5, 2901])
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_is_rejected_with_the_file_and_line(tmp_path, case, line):
    lines = _lines(3000, seed=2)
    lines[line - 1] = BAD_LINES[case]
    source = _write(tmp_path / "bad.tsv", lines)
    out = tmp_path / "out"
    with pytest.raises(CriteoFormatError, match=rf"bad\.tsv: line {line}: "):
        convert_file(str(source), str(out), block_size=1 << 15)  # line 2901 lies in a later block
    assert _entries(out) == [] and not [p for p in out.iterdir() if "partial" in p.name]


def test_a_truncated_gzip_file_is_rejected_with_its_last_line(tmp_path):
    data = gzip.compress(("\n".join(_lines(3000, seed=3)) + "\n").encode())
    cut = data[:len(data) // 2]
    readable = zlib.decompressobj(wbits=31).decompress(cut)
    line = readable.count(b"\n") + 1  # the line the stream breaks off in
    source = tmp_path / "cut.tsv.gz"
    source.write_bytes(cut)
    for days in (None, 2):
        with pytest.raises(CriteoFormatError, match=rf"cut\.tsv\.gz: line {line}: the gzip stream is truncated"):
            convert_file(str(source), str(tmp_path / "out"), days=days)
    assert _entries(tmp_path / "out") == []


def test_empty_and_missing_files_and_an_unwritable_out_dir(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    with pytest.raises(CriteoFormatError, match=r"empty\.tsv: no lines"):
        convert_file(str(empty), str(tmp_path / "out"))
    with pytest.raises(CriteoFormatError, match=r"empty\.tsv: no lines"):
        convert_file(str(empty), str(tmp_path / "out"), days=2)
    with pytest.raises(FileNotFoundError, match=r"nope\.tsv"):
        convert([str(tmp_path / "nope.tsv")], str(tmp_path / "out"))
    source = _write(tmp_path / "day.tsv", _lines(10))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match=r"a_file"):
        convert([str(source)], str(blocker / "out"))
    with pytest.raises(ValueError, match="days must be positive"):
        convert([str(source)], str(tmp_path / "out"), days=0)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlkv_torch.data.criteo", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


def test_command_line_generate_then_convert(tmp_path):
    cardinalities = [1000 + 37 * i for i in range(26)]
    made = _cli("generate", str(tmp_path / "gen.tsv.gz"), "--rows", "2500", "--seed", "4",
                "--cardinalities", ",".join(map(str, cardinalities)))
    assert made.returncode == 0, made.stderr
    text = gzip.decompress((tmp_path / "gen.tsv.gz").read_bytes())
    (tmp_path / "gen.tsv").write_bytes(text)
    assert text.endswith(b"\n") and text.count(b"\n") == 2500
    rows = [line.split(b"\t") for line in text.split(b"\n")[:-1]]
    assert {len(r) for r in rows} == {40} and {r[0] for r in rows} == {b"0", b"1"}
    ints = [r[1:14] for r in rows]
    assert any(v == b"" for r in ints for v in r) and any(r[1].startswith(b"-") for r in ints)
    cats = [r[14:] for r in rows]
    assert any(v == b"" for r in cats for v in r)
    assert all(len(v) == 8 and v == v.lower() for r in cats for v in r if v)
    assert all(int(v, 16) < cardinalities[j] for r in cats for j, v in enumerate(r) if v)
    expected = _torchrec_arrays(tmp_path / "gen.tsv", tmp_path / "torchrec")  # generated files parse with torchrec's

    converted = _cli("convert", str(tmp_path / "gen.tsv.gz"), "--out", str(tmp_path / "out"), "--days", "2")
    assert converted.returncode == 0, converted.stderr
    lines = converted.stdout.splitlines()
    assert [os.path.basename(p) for p in lines[:2]] == ["day_0", "day_1"]
    assert lines[2].startswith("2500 rows, ") and "rows/s" in lines[2] and lines[2].endswith("(converted)")
    joined = [np.concatenate([np.load(f) for f in files]) for files in npy_files(lines[:2])]
    for got, want in zip(joined[1:], expected[1:]):  # sparse and labels; dense has a minimum per day
        assert np.array_equal(got, want)
    assert _cli("convert", str(tmp_path / "gen.tsv.gz"), "--out", str(tmp_path / "out"),
                "--days", "2").stdout.splitlines()[2].endswith("(cached)")

    # The same seed writes the same file; rows through the API equal those through the CLI. A new
    # directory is made, and the file appears only once whole.
    generate(str(tmp_path / "new" / "again.tsv"), 2500, seed=4, cardinalities=cardinalities)
    assert (tmp_path / "new" / "again.tsv").read_bytes() == text
    assert os.listdir(tmp_path / "new") == ["again.tsv"]


def test_command_line_errors_exit_2_with_the_reason_on_stderr(tmp_path):
    bad = _write(tmp_path / "bad.tsv", _lines(10)[:3] + ["1\tnope"])
    failed = _cli("convert", str(bad), "--out", str(tmp_path / "out"))
    assert failed.returncode == 2 and "bad.tsv: line 4: 2 tab-separated fields" in failed.stderr
    assert failed.stdout == ""
    assert _cli("generate", str(tmp_path / "x.tsv"), "--rows", "5", "--cardinalities", "1,2").returncode == 2
    assert _cli("convert", "--out", str(tmp_path)).returncode == 2  # no files: argparse's usage error
