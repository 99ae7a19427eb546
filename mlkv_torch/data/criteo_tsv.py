"""Criteo's TSV click logs, read in parsed blocks and written from columns.

A line is one sample: 40 tab-separated fields ending in ``\\n`` (``\\r\\n`` too; the last line
may lack it), plain or gzip-compressed (found by the file's magic bytes):

- field 1, the label, and fields 2-14, the 13 integer features: empty (missing, read as 0) or a
  decimal int32 (``-?[0-9]+``, spaces around it allowed);
- fields 15-40, the 26 categorical features: empty (missing, read as 0) or 1 to 16 hex digits,
  either case, below 2**63 (the value is ``int(field, 16)``).

These are torchrec's ``tsv_to_npys`` semantics, minus what its per-line ``int()`` accepts by
accident (``+5``, ``1_0``, ``0x1f``). Anything else is rejected, never skipped, with a
CriteoFormatError naming the file and the 1-based line: a wrong field count, an empty line, a
non-numeric or out-of-range integer, a non-hex or too long categorical, a truncated or corrupt
gzip stream, a file without rows. The fast path parses blocks with pyarrow's streaming CSV
reader and numpy; when pyarrow rejects a block, the block's lines are read again one by one to
find the first bad line and say what is wrong with it.
"""
from __future__ import annotations

import gzip
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np

from ..read_ahead import read_ahead

__all__ = ["CAT_FEATURES", "INT_FEATURES", "CriteoBlock", "CriteoFormatError", "count_lines", "is_gzip",
           "read_blocks", "write_tsv"]

INT_FEATURES = 13
CAT_FEATURES = 26
FIELDS = 1 + INT_FEATURES + CAT_FEATURES
DEFAULT_BLOCK_SIZE = 2 << 20
"""Bytes of text pyarrow parses at a time (about 8k Criteo lines): pyarrow's memory grows with it,
and larger blocks are no faster."""

_GZIP_MAGIC = b"\x1f\x8b"
_READ_CHUNK = 16 << 20
_MAX_LINE_BYTES = 64 << 10
_COLUMN_NAMES = [f"f{i}" for i in range(FIELDS)]
_INT_PATTERN = re.compile(rb" *-?[0-9]+ *")
_HEX_PATTERN = re.compile(rb"[0-9a-fA-F]{1,16}")
_INT32_RANGE = range(-(1 << 31), 1 << 31)


class CriteoFormatError(ValueError):
    """A Criteo TSV file breaks the format; the message names the file and the 1-based line."""


@dataclass
class CriteoBlock:
    """Consecutive parsed lines of one file.

    Attributes:
        first_line: the 1-based line number of row 0.
        labels: int32 [rows].
        dense: int32 [rows, 13], missing values 0.
        sparse: int64 [rows, 26], missing values 0.
    """

    first_line: int
    labels: np.ndarray
    dense: np.ndarray
    sparse: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def is_gzip(path: str) -> bool:
    """Whether the file starts with gzip's magic bytes; FileNotFoundError names a missing file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Criteo TSV file {path!r} does not exist or is not a file")
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


def _open_text_stream(path: str):
    import pyarrow as pa

    return pa.input_stream(path, compression="gzip" if is_gzip(path) else None, buffer_size=_READ_CHUNK)


def count_lines(path: str) -> int:
    """Lines in the file (decompressed): its newlines, plus one for a last line without one."""
    lines, last = 0, b"\n"
    try:
        with _open_text_stream(path) as stream:
            while True:
                chunk = stream.read(_READ_CHUNK)
                if not chunk:
                    break
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError as error:
        if not _is_format_error(error):
            raise
        raise _format_error(path, lines + 1, error) from error
    return lines + (last != b"\n")


def read_blocks(path: str, block_size: int = DEFAULT_BLOCK_SIZE, threads: int = 0) -> Iterator[CriteoBlock]:
    """The file's lines in order, in blocks of about `block_size` bytes of text.

    pyarrow parses the next blocks in a background thread while the caller handles this one; the
    hex categoricals are parsed by `threads` threads (0: one per core).

    Raises:
        FileNotFoundError: no such file.
        CriteoFormatError: a line breaks the format, the gzip stream is truncated or corrupt, or
            the file has no lines.
    """
    import pyarrow as pa
    import pyarrow.csv as csv

    types = {name: pa.int32() for name in _COLUMN_NAMES[:1 + INT_FEATURES]}
    types.update({name: pa.binary() for name in _COLUMN_NAMES[1 + INT_FEATURES:]})
    options = dict(
        read_options=csv.ReadOptions(column_names=_COLUMN_NAMES, block_size=block_size),
        parse_options=csv.ParseOptions(delimiter="\t", quote_char=False, double_quote=False, escape_char=False,
                                       newlines_in_values=False, ignore_empty_lines=False),
        convert_options=csv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=True,
                                           quoted_strings_can_be_null=False))
    next_line = 1
    hex_threads = ThreadPoolExecutor(threads or len(os.sched_getaffinity(0)), thread_name_prefix="criteo-hex")
    try:
        with _open_text_stream(path) as stream:
            for batch in _batches_read_ahead(lambda: csv.open_csv(stream, **options), path, lambda: next_line):
                try:
                    block = _block_of(batch, next_line, path, hex_threads)
                except CriteoFormatError as error:  # the block's first bad line may be another one
                    raise _format_error(path, next_line, error, limit=batch.num_rows) from error
                if _has_rows_of_missing_fields(batch):  # an empty line reads as one: the text tells them apart
                    line, problem = _locate_bad_line(path, next_line, limit=batch.num_rows)
                    if problem is not None:
                        raise CriteoFormatError(f"{path}: line {line}: {problem}")
                next_line += len(block)
                yield block
    finally:
        hex_threads.shutdown(wait=True)
    if next_line == 1:
        raise CriteoFormatError(f"{path}: no lines (an empty file)")


def _batches_read_ahead(open_reader, path: str, first_unread_line) -> Iterator:
    """The reader's record batches, read one batch ahead in a thread (pyarrow parses without the GIL)."""
    def batches() -> Iterator:
        reader = open_reader()
        while True:
            try:
                yield reader.read_next_batch()
            except StopIteration:
                return

    try:
        yield from read_ahead(batches(), depth=1, name="criteo-csv")
    except Exception as error:  # the reader's, raised here with the line
        if "Empty CSV file" in str(error):  # pyarrow's word for no bytes at all: read_blocks says so
            return
        if not _is_format_error(error):
            raise
        raise _format_error(path, first_unread_line(), error) from error


def _is_format_error(error: BaseException) -> bool:
    """Whether pyarrow's error is about the file's contents (pyarrow says ArrowInvalid or, for gzip, OSError)."""
    return isinstance(error, (ValueError, OSError)) and not isinstance(error, (FileNotFoundError, PermissionError))


def _format_error(path: str, first_line: int, error: BaseException, limit: int = 1 << 22) -> CriteoFormatError:
    """The CriteoFormatError for `error` in the lines from `first_line`, naming the first bad line."""
    line, problem = _locate_bad_line(path, first_line, limit)
    if problem is None:
        if isinstance(error, CriteoFormatError):
            return error
        return CriteoFormatError(f"{path}: at or after line {first_line}: {error}")
    return CriteoFormatError(f"{path}: line {line}: {problem}")


def _block_of(batch, first_line: int, path: str, hex_threads: ThreadPoolExecutor) -> CriteoBlock:
    import pyarrow.compute as pc

    rows = batch.num_rows
    labels = pc.fill_null(batch.column(0), 0).to_numpy()
    dense = np.empty((rows, INT_FEATURES), dtype=np.int32)
    for j in range(INT_FEATURES):
        dense[:, j] = pc.fill_null(batch.column(1 + j), 0).to_numpy()
    sparse = np.empty((rows, CAT_FEATURES), dtype=np.int64)

    def parse(j: int) -> None:
        sparse[:, j] = _parse_hex(batch.column(1 + INT_FEATURES + j), first_line, 1 + INT_FEATURES + j, path)

    for done in [hex_threads.submit(parse, j) for j in range(CAT_FEATURES)]:
        done.result()
    return CriteoBlock(first_line, labels, dense, sparse)


def _parse_hex(column, first_line: int, field: int, path: str) -> np.ndarray:
    """int(x, 16) of each entry of a binary column (missing: 0), from its offsets and bytes."""
    rows = len(column)
    _, offsets_buffer, data_buffer = column.buffers()  # missing entries are empty: their offsets say so
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32, count=rows + 1, offset=4 * column.offset)
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.empty(0, np.uint8)
    lengths = np.diff(offsets)
    longest = int(lengths.max()) if rows else 0
    present = int(np.count_nonzero(lengths))
    values = np.zeros(rows, dtype=np.int64)
    if present == 0:
        return values
    if longest > 16:
        row = int(np.argmax(lengths > 16))
        _raise_bad_field(path, first_line + row, field, bytes(data[offsets[row]:offsets[row + 1]]))
    if present * longest == offsets[-1] - offsets[0]:  # every present entry is `longest` long: no gather
        chars = data[offsets[0]:offsets[-1]].reshape(present, longest)
        if present == rows:
            return _hex_values(chars, first_line, field, path, None)
        rows_present = np.flatnonzero(lengths)
        values[rows_present] = _hex_values(chars, first_line, field, path, rows_present)
        return values
    for length in np.unique(lengths[lengths > 0]):
        rows_of_length = np.flatnonzero(lengths == length)
        chars = data[offsets[rows_of_length][:, None] + np.arange(length)]
        values[rows_of_length] = _hex_values(chars, first_line, field, path, rows_of_length)
    return values


def _hex_values(chars: np.ndarray, first_line: int, field: int, path: str,
                rows: Optional[np.ndarray]) -> np.ndarray:
    """The values of equal-length hex strings, [n, length] ASCII bytes; rows: each one's row (None: i).

    Eight digits at a time as one little-endian uint64 word (SWAR): a few word operations instead
    of a table lookup per digit. Shorter strings are padded on the left with '0' digits.
    """
    length = chars.shape[1]
    width = 8 if length <= 8 else 16
    if length < width:
        padded = np.full((len(chars), width), ord("0"), dtype=np.uint8)
        padded[:, width - length:] = chars
        chars = padded
    # [n, width // 8], first digit in the low byte; unaligned words would take numpy's slow loops
    words = np.require(np.ascontiguousarray(chars).view("<u8"), requirements="A")
    low_words = np.ascontiguousarray(words[:, -1])
    valid = _all_hex_digits(low_words)
    values = _hex_word_values(low_words)
    if width == 16:
        high_words = np.ascontiguousarray(words[:, 0])
        high = _hex_word_values(high_words)
        valid &= _all_hex_digits(high_words) & (high < 1 << 31)  # int64 holds values below 2**63 only
        values |= high << 32
    if not valid.all():
        i = int(np.argmin(valid))
        row = i if rows is None else int(rows[i])
        _raise_bad_field(path, first_line + row, field, chars[i, width - length:].tobytes())
    return values


def _bytes_of(byte: int) -> np.uint64:
    return np.uint64(int.from_bytes(bytes([byte]) * 8, "little"))


_HIGH_BITS, _LOW_NIBBLES, _LOW_BITS, _CASE_BITS = (_bytes_of(b) for b in (0x80, 0x0F, 0x01, 0x20))
_ABOVE_9, _ABOVE_F = _bytes_of(0x7F - ord("9")), _bytes_of(0x7F - ord("f"))
_FROM_0, _FROM_A = _bytes_of(0x80 - ord("0")), _bytes_of(0x80 - ord("a"))
_U64 = {bits: np.uint64(bits) for bits in (4, 6, 8, 9, 16, 32)}


def _all_hex_digits(words: np.ndarray) -> np.ndarray:
    """Whether all 8 bytes of each word are ASCII hex digits (either case).

    Adding 0x80 - low sets a byte's high bit where the byte is >= low, adding 0x7F - high where it
    is > high; with every byte below 0x80 (checked too) no addition carries into the next byte.
    """
    digits = (words + _FROM_0) & ~(words + _ABOVE_9)
    lower = words | _CASE_BITS
    digits |= (lower + _FROM_A) & ~(lower + _ABOVE_F)
    digits &= _HIGH_BITS
    return ((words & _HIGH_BITS) == 0) & (digits == _HIGH_BITS)


def _hex_word_values(words: np.ndarray) -> np.ndarray:
    """int(word's 8 digits, 16) of words of hex digits, as int64."""
    nibbles = (words >> _U64[6]) & _LOW_BITS  # 1 for letters
    nibbles *= _U64[9]
    nibbles += words & _LOW_NIBBLES
    pairs = (nibbles & np.uint64(0x000F000F000F000F)) << _U64[4]
    pairs |= (nibbles >> _U64[8]) & np.uint64(0x000F000F000F000F)
    quads = (pairs & np.uint64(0x000000FF000000FF)) << _U64[8]
    quads |= (pairs >> _U64[16]) & np.uint64(0x000000FF000000FF)
    value = (quads & np.uint64(0xFFFF)) << _U64[16]
    value |= (quads >> _U64[32]) & np.uint64(0xFFFF)
    return value.view(np.int64)


def _raise_bad_field(path: str, line: int, field: int, text: bytes) -> None:
    raise CriteoFormatError(f"{path}: line {line}: field {field + 1} is {text!r}: not 1 to 16 hex digits "
                            f"below 2**63")


def _has_rows_of_missing_fields(batch) -> bool:
    """Whether some row has all 40 fields missing (pyarrow reads an empty line as such a row)."""
    if batch.column(0).null_count == 0:
        return False
    all_missing = np.ones(batch.num_rows, dtype=bool)
    for column in batch.columns:
        if column.null_count == 0:
            return False
        all_missing &= column.is_null().to_numpy(zero_copy_only=False)
    return bool(all_missing.any())


class _UnreadableLine(Exception):
    """Reading failed in line `line` (1-based); `problem` says why."""

    def __init__(self, line: int, problem: str) -> None:
        super().__init__(f"line {line}: {problem}")
        self.line, self.problem = line, problem


def _lines(path: str, first: int, last: Optional[int] = None) -> Iterator[Tuple[int, bytes]]:
    """(number, text without its line end) of lines first..last (1-based; None: to the end), read by
    Python's own readers, which raise at the end of a truncated gzip stream (as _UnreadableLine)."""
    compressed = is_gzip(path)
    with (gzip.open if compressed else open)(path, "rb") as f:
        line, pending = 1, b""
        while True:
            try:
                chunk = f.read1(_READ_CHUNK)  # read() would drop what it decompressed before a truncation
            except (EOFError, OSError, zlib.error) as error:
                raise _UnreadableLine(line, f"the gzip stream is truncated or corrupt ({error})" if compressed
                                      else f"unreadable ({error})") from error
            if not chunk:
                if pending and line >= first:
                    yield line, pending
                return
            if line < first:  # skip whole chunks by counting their newlines
                newlines = chunk.count(b"\n")
                if line + newlines < first:
                    line += newlines
                    pending = chunk[chunk.rfind(b"\n") + 1:] if newlines else pending + chunk
                    _check_line_length(line, pending)
                    continue
            parts = (pending + chunk).split(b"\n")
            pending = parts.pop()
            _check_line_length(line + len(parts), pending)
            for text in parts:
                if line >= first:
                    yield line, text
                line += 1
                if last is not None and line > last:
                    return


def _check_line_length(line: int, text: bytes) -> None:
    """Refuses a line past _MAX_LINE_BYTES before it is read whole (a file with no line ends)."""
    if len(text) > _MAX_LINE_BYTES:
        raise _UnreadableLine(line, f"longer than {_MAX_LINE_BYTES} bytes (a Criteo line has about 250: "
                                    f"is this a Criteo TSV file?)")


def _locate_bad_line(path: str, first: int, limit: int = 1 << 22) -> Tuple[int, Optional[str]]:
    """The first of `limit` lines from `first` that breaks the format, and what is wrong with it
    (None when none does: then `first` and no reason)."""
    try:
        for line, text in _lines(path, first, first + limit):
            problem = _line_problem(text)
            if problem:
                return line, problem
    except _UnreadableLine as unreadable:
        return unreadable.line, unreadable.problem
    return first, None


def _line_problem(text: bytes) -> Optional[str]:
    """What is wrong with one line (its line end removed), or None."""
    text = text.rstrip(b"\r")
    if not text:
        return "an empty line"
    fields = text.split(b"\t")
    if len(fields) != FIELDS:
        return f"{len(fields)} tab-separated fields, expected {FIELDS}"
    for i, field in enumerate(fields[:1 + INT_FEATURES]):
        if field.strip(b" ") and (not _INT_PATTERN.fullmatch(field) or int(field) not in _INT32_RANGE):
            return f"field {i + 1} is {field!r}: not a decimal int32"
    for i, field in enumerate(fields[1 + INT_FEATURES:], start=1 + INT_FEATURES):
        if field and (not _HEX_PATTERN.fullmatch(field) or int(field, 16) >= 1 << 63):
            return f"field {i + 1} is {field!r}: not 1 to 16 hex digits below 2**63"
    return None


def write_tsv(path: str, blocks: Iterator[Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
              compress: Optional[bool] = None) -> int:
    """Writes Criteo TSV lines; returns the rows written.

    Args:
        path: the output file (gzip-compressed when `compress`, None: when it ends in ``.gz``).
        blocks: (labels int [n], ints int32 [n, 13], ints_missing bool [n, 13], ids uint32 [n, 26],
            ids_missing bool [n, 26]) per block; ids are written as 8 lowercase hex digits, missing
            entries as empty fields.
    """
    import pyarrow as pa
    import pyarrow.csv as csv

    compress = path.endswith(".gz") if compress is None else compress
    rows = 0
    # gzip level 1: pyarrow's gzip stream compresses at level 9, several times slower than writing text.
    with (gzip.open(path, "wb", compresslevel=1) if compress else pa.output_stream(path)) as stream:
        writer = None
        for block in _in_background(blocks):
            table = _table_of(*block)
            if writer is None:
                writer = csv.CSVWriter(stream, table.schema, write_options=csv.WriteOptions(
                    include_header=False, delimiter="\t", quoting_style="none", batch_size=max(1, table.num_rows)))
            writer.write_table(table)
            rows += table.num_rows
        if writer is not None:
            writer.close()
    return rows


def _in_background(items: Iterator) -> Iterator:
    """`items`, produced one ahead in a thread, so that producing and writing overlap."""
    with ThreadPoolExecutor(1, thread_name_prefix="criteo-blocks") as producer:
        iterator = iter(items)
        pending = producer.submit(next, iterator, None)
        while True:
            item = pending.result()
            if item is None:
                return
            pending = producer.submit(next, iterator, None)
            yield item


_HEX_PAIRS = np.frombuffer(b"".join(b"%02x" % byte for byte in range(256)), dtype=np.uint16)
"""The two hex digits of each byte value, as the bytes of one uint16 (whatever the machine's byte order)."""


def _table_of(labels: np.ndarray, ints: np.ndarray, ints_missing: np.ndarray, ids: np.ndarray,
              ids_missing: np.ndarray):
    import pyarrow as pa

    rows = len(labels)
    columns = [pa.array(np.asarray(labels, dtype=np.int32))]
    columns += [pa.array(np.ascontiguousarray(ints[:, j]), mask=np.ascontiguousarray(ints_missing[:, j]))
                for j in range(INT_FEATURES)]
    digits = _HEX_PAIRS[np.ascontiguousarray(ids.T, dtype=">u4").view(np.uint8)].view(np.uint8)  # [26, rows * 8]
    offsets = pa.py_buffer(np.arange(0, 8 * (rows + 1), 8, dtype=np.int32))
    for j in range(CAT_FEATURES):
        validity = pa.py_buffer(np.packbits(~ids_missing[:, j], bitorder="little"))
        columns.append(pa.StringArray.from_buffers(rows, offsets, pa.py_buffer(digits[j]), validity))
    return pa.table(columns, names=_COLUMN_NAMES)
