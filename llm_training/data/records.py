"""Readers for the raw records of a chat data set, each record tagged with its location.

Picked from a path (`[training] dataset_path`, or `path` of a `[[training.sources]]` table):
- a `*.jsonl` file or a folder of them (read with our own line index: no `datasets` needed, and every record
  knows its `file:line` for error messages and exact resumption);
- a `*.parquet` file or a folder of them (converted once by `datasets` into memory-mapped arrow files in its cache,
  `[huggingface_dataset] cache_dir`, for random access; every record knows its `file row k`);
- a `datasets.save_to_disk` directory (a Dataset, or a DatasetDict from which the split is taken).
HuggingFace Hub data sets come through `data.hub` as the same `DatasetRecords` (downloaded) or as `StreamRecords`
(streamed, parquet files too). `datasets` is imported only where needed, lazily.

Random-access readers (`streamed = False`) have `len()` and `fetch(indices)`, which returns, per index,
`(location, conversation)` where `conversation` is the raw value of the conversations field, or a `BadRecord`
saying why the record has none. A stream (`streamed = True`) has no length or random access: `read(epoch,
positions, seed)` returns the same pairs for ascending positions of the epoch's order, fewer at its end.
"""

from __future__ import annotations

import json
import logging
import mmap
from pathlib import Path

import numpy as np

from llm_training.data.chat import BadRecord

logger = logging.getLogger(__name__)

NEWLINE = 10
SCAN_CHUNK_BYTES = 1 << 26
STREAM_SKIP_WARNING = 10000  # records a stream is read again (on a resume) from which that cost is reported


def is_save_to_disk_dir(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file())
    )


class JsonlRecords:
    """All non-empty lines of one `*.jsonl` file or of every `*.jsonl` file under a folder (sorted, recursive)."""

    streamed = False

    def __init__(self, path: Path, conversations_field: str):
        self.field = conversations_field
        self.files = jsonl_files(path)
        self.empty_files: list[Path] = []
        file_idx, starts, ends, line_nos = [], [], [], []
        for k, file in enumerate(self.files):
            s, e, n = _line_spans(file)
            if len(s) == 0:
                self.empty_files.append(file)
            file_idx.append(np.full(len(s), k, dtype=np.int32))
            starts.append(s)
            ends.append(e)
            line_nos.append(n)
        self._file_idx = np.concatenate(file_idx)
        self._starts = np.concatenate(starts)
        self._ends = np.concatenate(ends)
        self._line_nos = np.concatenate(line_nos)

    def __len__(self) -> int:
        return len(self._starts)

    def location(self, index: int) -> str:
        return f"{self.files[self._file_idx[index]]}:{self._line_nos[index]}"

    def fetch(self, indices) -> list[tuple[str, object]]:
        indices = [int(i) for i in indices]
        lines: dict[int, bytes] = {}
        by_file: dict[int, list[int]] = {}
        for i in indices:
            by_file.setdefault(int(self._file_idx[i]), []).append(i)
        for k, members in by_file.items():  # one open per file per call: no file handles kept between calls
            with open(self.files[k], "rb") as f:
                for i in members:
                    f.seek(self._starts[i])
                    lines[i] = f.read(self._ends[i] - self._starts[i])
        return [(self.location(i), self._parse(lines[i])) for i in indices]

    def _parse(self, line: bytes) -> object:
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return BadRecord(f"malformed JSON ({exc})")
        if not isinstance(record, dict):
            return BadRecord(f"the line is a JSON {type(record).__name__}, expected an object")
        if self.field not in record:
            return BadRecord(f"no {self.field!r} field (keys: {sorted(record)[:8]})")
        return record[self.field]


def data_files(path: Path) -> tuple[str, list[Path]]:
    """("jsonl" or "parquet", the files): `path` itself, or every `*.jsonl` file under the folder `path` (sorted,
    recursive), else every `*.parquet` file; at least one, and not both kinds in one folder."""
    if path.is_file():
        return ("parquet" if path.suffix == ".parquet" else "jsonl"), [path]
    found = {kind: sorted(p for p in path.rglob(f"*.{kind}") if p.is_file()) for kind in ("jsonl", "parquet")}
    if found["jsonl"] and found["parquet"]:
        raise ValueError(
            f"[training] dataset_path: {str(path)!r} holds both *.jsonl and *.parquet files; put each kind in its "
            "own folder (two [[training.sources]] tables mix them)"
        )
    kind = "jsonl" if found["jsonl"] else "parquet"
    if not found[kind]:
        raise FileNotFoundError(f"[training] dataset_path: no *.jsonl files (nor *.parquet files) under {str(path)!r}")
    return kind, found[kind]


def jsonl_files(path: Path) -> list[Path]:
    """`path` itself, or every `*.jsonl` file under the folder `path` (sorted, recursive); at least one."""
    kind, files = data_files(path)
    if kind != "jsonl":
        raise ValueError(f"[training] dataset_path: {str(path)!r} holds parquet files, not jsonl")
    return files


def _has_a_line(file: Path) -> bool:
    """Whether `file` holds anything but whitespace (reads only up to the first such byte)."""
    with open(file, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return True
    return False


def _line_spans(file: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, 1-based line number) of every line of `file` holding more than a line ending."""
    with open(file, "rb") as f:
        if f.seek(0, 2) == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _spans_of(buf)


def _spans_of(buf: mmap.mmap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = np.frombuffer(buf, dtype=np.uint8)
    newlines = np.concatenate(  # scanned in chunks so a huge file never needs a file-sized temporary
        [np.flatnonzero(data[c : c + SCAN_CHUNK_BYTES] == NEWLINE) + c for c in range(0, len(data), SCAN_CHUNK_BYTES)]
    )
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    ends = np.concatenate([newlines, [len(data)]]).astype(np.int64)
    line_nos = np.arange(1, len(starts) + 1, dtype=np.int64)
    # strip a trailing '\r' (CRLF files), then drop empty lines (incl. the one after the final newline)
    crlf = (ends > starts) & (data[np.maximum(ends - 1, 0)] == 13)
    ends = ends - crlf
    keep = ends > starts
    return starts[keep], ends[keep], line_nos[keep]


def import_datasets(what: str):
    """The `datasets` module, or an ImportError saying that `what` needs it."""
    try:
        import datasets
    except ImportError as exc:
        raise ImportError(f"{what} needs the 'datasets' package (pip install datasets); jsonl input does not.") from exc
    return datasets


def _check_column(column_names, field: str, name: str) -> None:
    if column_names is not None and field not in column_names:
        raise KeyError(
            f"[huggingface_dataset] conversations_field: {field!r} is not a column of {name}; columns: {column_names}"
        )


def _value(field: str, record_value) -> object:
    return BadRecord(f"{field!r} is null") if record_value is None else record_value


class DatasetRecords:
    """Rows of a `datasets.Dataset` (memory-mapped arrow; only the conversations column is read), named `name` in
    messages; `row_location(i)` names row i (default: `<name> row i`)."""

    streamed = False

    def __init__(self, data, name: str, conversations_field: str, row_location=None, empty_files=()):
        _check_column(data.column_names, conversations_field, name)
        self.name, self.field = name, conversations_field
        self.empty_files: list[Path] = list(empty_files)
        self._data = data.select_columns([conversations_field])
        self._row_location = row_location or (lambda index: f"{name} row {index}")

    def __len__(self) -> int:
        return len(self._data)

    def location(self, index: int) -> str:
        return self._row_location(index)

    def fetch(self, indices) -> list[tuple[str, object]]:
        indices = [int(i) for i in indices]
        column = self._data[indices][self.field] if indices else []
        return [(self.location(i), _value(self.field, value)) for i, value in zip(indices, column)]


class SaveToDiskRecords(DatasetRecords):
    """Rows of a `datasets.save_to_disk` directory (a Dataset, or the `split` of a DatasetDict)."""

    def __init__(self, path: Path, conversations_field: str, split: str):
        datasets = import_datasets(f"[training] dataset_path {str(path)!r} is a datasets.save_to_disk directory, which")
        data = datasets.load_from_disk(str(path))
        name = str(path)
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise KeyError(
                    f"[huggingface_dataset] split: {split!r} is not in {str(path)!r}; available splits: {sorted(data)}"
                )
            data = data[split]
            name = f"{path} (split {split!r})"
        super().__init__(data, name, conversations_field)


def parquet_dataset(files: list[Path], cache_dir: str, streaming: bool):
    """The rows of `files` in order as a `datasets` Dataset (converted into the cache once) or IterableDataset."""
    datasets = import_datasets("[training] dataset_path with *.parquet files")
    return datasets.load_dataset(
        "parquet",
        data_files=[str(f) for f in files],
        split="train",
        cache_dir=cache_dir or None,
        streaming=streaming,
    )


class ParquetRecords(DatasetRecords):
    """Rows of `*.parquet` files, in file order (converted for random access into the `datasets` cache)."""

    def __init__(self, files: list[Path], conversations_field: str, cache_dir: str):
        import pyarrow.parquet as pq

        starts = np.cumsum([0] + [pq.ParquetFile(f).metadata.num_rows for f in files])

        def row_location(index: int) -> str:
            k = int(np.searchsorted(starts, index, side="right")) - 1
            return f"{files[k]} row {index - starts[k]}"

        empty_files = [f for f, n in zip(files, np.diff(starts)) if n == 0]
        name = str(files[0]) if len(files) == 1 else f"{files[0].parent} ({len(files)} parquet files)"
        data = parquet_dataset(files, cache_dir, streaming=False)
        super().__init__(data, name, conversations_field, row_location, empty_files)


class StreamRecords:
    """The records of a `datasets.IterableDataset`, read in order (no random access, no length until the end has
    been read). Epoch e's order is the stream itself, or, with a seed, the stream shuffled in a buffer of
    `buffer_size` records with seed + e (`IterableDataset.shuffle` + `set_epoch`): the same on every rank."""

    streamed = True

    def __init__(self, data, name: str, conversations_field: str, buffer_size: int):
        _check_column(data.column_names, conversations_field, name)
        self.name, self.field, self.buffer_size = name, conversations_field, buffer_size
        self.empty_files: list[Path] = []
        self.length: int | None = None  # records in the stream, once its end has been read
        self._data = data.select_columns([conversations_field]) if data.column_names is not None else data
        self._key: tuple | None = None  # (epoch, seed) of the open iterator
        self._iterator = None
        self._cursor = 0  # position of the next record the iterator yields

    def location(self, epoch: int, position: int) -> str:
        return f"{self.name} record {position} of epoch {epoch}"

    def _open(self, epoch: int, seed: int | None, first: int) -> None:
        stream = self._data if seed is None else self._data.shuffle(seed=seed, buffer_size=self.buffer_size)
        stream.set_epoch(epoch)
        if first >= STREAM_SKIP_WARNING:
            logger.warning(
                "data: %s is a stream (no random access): reading its first %d records of epoch %d again to reach "
                "the resumed position; they are not tokenized, but they are downloaded",
                self.name, first, epoch,
            )  # fmt: skip
        self._iterator, self._key, self._cursor = iter(stream), (epoch, seed), 0

    def read(self, epoch: int, positions, seed: int | None) -> list[tuple[str, object]]:
        """(location, conversation) of the records at ascending `positions` of epoch `epoch`'s order; fewer when the
        stream ends before the last of them (`length` is then known)."""
        positions = [int(p) for p in positions]
        if not positions:
            return []
        if self._key != (epoch, seed) or positions[0] < self._cursor:
            self._open(epoch, seed, positions[0])
        out = []
        for position in positions:
            try:
                while self._cursor < position:  # the records of the other ranks (and, on a resume, those trained)
                    next(self._iterator)
                    self._cursor += 1
                record = next(self._iterator)
            except StopIteration:
                self.length = self._cursor
                break
            self._cursor += 1
            out.append((self.location(epoch, position), _value(self.field, record.get(self.field))))
        return out


def check_dataset(
    dataset_path: str | Path, conversations_field: str, split: str, cache_dir: str = "", streaming: bool = False
) -> None:
    """Fail fast, naming the config key, when `dataset_path` cannot give a record: missing path, no jsonl or parquet
    files, only empty files, a split or column that is not there, `datasets` not installed, streaming asked of jsonl
    or save_to_disk data. Cheap: jsonl files are read only up to their first line, parquet files only to their
    metadata (and converted into the cache once), a save_to_disk directory is memory-mapped."""
    path = Path(dataset_path).expanduser()
    if dataset_path and path.exists() and not is_save_to_disk_dir(path):
        kind, files = data_files(path)
        if streaming and kind != "parquet":
            raise ValueError(
                f"[training] dataset_path: {str(path)!r} holds *.jsonl files, read lazily already: streaming "
                "applies to hub and parquet data; set streaming = false"
            )
        if kind == "jsonl" and not any(_has_a_line(file) for file in files):
            raise ValueError(
                f"[training] dataset_path: {str(path)!r} has no records ({len(files)} jsonl file(s), all empty); "
                "point it at the data"
            )
        if kind == "jsonl":
            return
    elif streaming and dataset_path and is_save_to_disk_dir(path):
        raise ValueError(
            f"[training] dataset_path: {str(path)!r} is a save_to_disk directory, memory-mapped already: streaming "
            "applies to hub and parquet data; set streaming = false"
        )
    records = open_records(dataset_path, conversations_field, split, cache_dir=cache_dir, streaming=streaming)
    check_records(records)


def check_records(records) -> None:
    """The records hold at least one record (a stream: its first record is read)."""
    empty = not records.read(0, [0], None) if records.streamed else len(records) == 0
    if empty:
        raise ValueError(f"[training] dataset_path: {records.name} has no rows; point it at the data")


def open_records(
    dataset_path: str | Path,
    conversations_field: str,
    split: str,
    *,
    cache_dir: str = "",
    streaming: bool = False,
    shuffle_buffer: int = 10000,
):
    """Pick the reader for `dataset_path` (a `StreamRecords` for parquet files with `streaming`); fail with the key
    name when the path does not exist."""
    if not dataset_path:
        raise ValueError(
            "[training] dataset_path is empty: set it to a *.jsonl or *.parquet file, a folder of them, or a "
            "datasets.save_to_disk directory"
        )
    path = Path(dataset_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"[training] dataset_path: {str(path)!r} does not exist")
    if is_save_to_disk_dir(path):
        return SaveToDiskRecords(path, conversations_field, split)
    kind, files = data_files(path)
    if kind == "jsonl":
        return JsonlRecords(path, conversations_field)
    if streaming:
        name = str(path)
        return StreamRecords(
            parquet_dataset(files, cache_dir, streaming=True), name, conversations_field, shuffle_buffer
        )
    return ParquetRecords(files, conversations_field, cache_dir)


__all__ = [
    "DatasetRecords",
    "JsonlRecords",
    "ParquetRecords",
    "SaveToDiskRecords",
    "StreamRecords",
    "check_dataset",
    "check_records",
    "data_files",
    "import_datasets",
    "is_save_to_disk_dir",
    "jsonl_files",
    "open_records",
]
