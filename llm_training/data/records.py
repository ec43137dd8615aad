"""Random-access readers for the raw records of a chat data set, each record tagged with its location.

Two sources, picked from `[training] dataset_path`:
- a `*.jsonl` file or a folder of them (read with our own line index: no `datasets` needed, and every record
  knows its `file:line` for error messages and exact resumption);
- a `datasets.save_to_disk` directory (a Dataset, or a DatasetDict from which `[huggingface_dataset] split`
  is taken); `datasets` is imported only here, lazily.

`fetch(indices)` returns, per index, `(location, conversation)` where `conversation` is the raw value of the
conversations field, or a `BadRecord` saying why the record has none.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np

from llm_training.data.chat import BadRecord

NEWLINE = 10
SCAN_CHUNK_BYTES = 1 << 26


def is_save_to_disk_dir(path: Path) -> bool:
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file())
    )


class JsonlRecords:
    """All non-empty lines of one `*.jsonl` file or of every `*.jsonl` file under a folder (sorted, recursive)."""

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


def jsonl_files(path: Path) -> list[Path]:
    """`path` itself, or every `*.jsonl` file under the folder `path` (sorted, recursive); at least one."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.jsonl") if p.is_file())
    if not files:
        raise FileNotFoundError(f"[training] dataset_path: no *.jsonl files under {str(path)!r}")
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


class SaveToDiskRecords:
    """Rows of a `datasets.save_to_disk` directory (memory-mapped arrow; only the conversations column is read)."""

    def __init__(self, path: Path, conversations_field: str, split: str):
        try:
            import datasets
        except ImportError as exc:
            raise ImportError(
                f"[training] dataset_path {str(path)!r} is a datasets.save_to_disk directory, which needs the "
                "'datasets' package (pip install datasets); jsonl input does not."
            ) from exc
        data = datasets.load_from_disk(str(path))
        self.name = str(path)
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise KeyError(
                    f"[huggingface_dataset] split: {split!r} is not in {str(path)!r}; available splits: {sorted(data)}"
                )
            data = data[split]
            self.name = f"{path} (split {split!r})"
        if conversations_field not in data.column_names:
            raise KeyError(
                f"[huggingface_dataset] conversations_field: {conversations_field!r} is not a column of "
                f"{self.name}; columns: {data.column_names}"
            )
        self.field = conversations_field
        self.empty_files: list[Path] = []
        self._data = data.select_columns([conversations_field])

    def __len__(self) -> int:
        return len(self._data)

    def location(self, index: int) -> str:
        return f"{self.name} row {index}"

    def fetch(self, indices) -> list[tuple[str, object]]:
        indices = [int(i) for i in indices]
        column = self._data[indices][self.field] if indices else []
        return [
            (self.location(i), BadRecord(f"{self.field!r} is null") if value is None else value)
            for i, value in zip(indices, column)
        ]


def check_dataset(dataset_path: str | Path, conversations_field: str, split: str) -> None:
    """Fail fast, naming the config key, when `dataset_path` cannot give a record: missing path, no jsonl files,
    only empty files, a split or column that is not there, `datasets` not installed. Cheap: jsonl files are
    read only up to their first line, a save_to_disk directory is memory-mapped."""
    path = Path(dataset_path).expanduser()
    if dataset_path and path.exists() and not is_save_to_disk_dir(path):
        files = jsonl_files(path)
        if not any(_has_a_line(file) for file in files):
            raise ValueError(
                f"[training] dataset_path: {str(path)!r} has no records ({len(files)} jsonl file(s), all empty); "
                "point it at the data"
            )
        return
    records = open_records(dataset_path, conversations_field, split)
    if len(records) == 0:
        raise ValueError(f"[training] dataset_path: {records.name} has no rows; point it at the data")


def open_records(dataset_path: str | Path, conversations_field: str, split: str) -> JsonlRecords | SaveToDiskRecords:
    """Pick the reader for `dataset_path`; fail with the key name when the path does not exist."""
    if not dataset_path:
        raise ValueError(
            "[training] dataset_path is empty: set it to a *.jsonl file, a folder of them, or a "
            "datasets.save_to_disk directory"
        )
    path = Path(dataset_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"[training] dataset_path: {str(path)!r} does not exist")
    if is_save_to_disk_dir(path):
        return SaveToDiskRecords(path, conversations_field, split)
    return JsonlRecords(path, conversations_field)


__all__ = ["JsonlRecords", "SaveToDiskRecords", "check_dataset", "is_save_to_disk_dir", "jsonl_files", "open_records"]
