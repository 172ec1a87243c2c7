"""Prompt datasets for a tag: JSONL, parquet, or a Hugging Face ``datasets`` directory (``save_to_disk``).

Each row gives one task's prompt and its labels (the answer a rule or a Python reward checks, and any
other columns named in ``label_fields``), as strings. Field names are configurable; a row without the
prompt or answer field, or with a value that is not a string or number, fails at start-up naming the
file and the row (1-based: a JSONL line number, a parquet / Hugging Face row index + 1). The whole
dataset is loaded once (the feeder samples rows by index; a task is a pure function of its number).

Rows held out for evaluation (``eval_rows``: the last N; ``eval_split``: another split of a Hugging Face
DatasetDict) are never trained on: :func:`training_rows` leaves them out, :func:`eval_rows` gives them.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator

from rollart.config import DatasetSpec

Row = tuple[str, dict[str, str]]  # (prompt, labels)


def dataset_format(spec: DatasetSpec) -> str:
    if spec.format != "auto":
        return spec.format
    if spec.path.is_dir():
        return "hf"
    return "parquet" if spec.path.suffix == ".parquet" else "jsonl"


def load_rows(spec: DatasetSpec, split: str | None = None) -> tuple[Row, ...]:
    """Every row of the dataset (of ``split``, default ``spec.split``) as (prompt, labels); ValueError
    naming the file and row if one is bad."""
    if not spec.path.exists():
        raise ValueError(f"dataset {spec.path} does not exist")
    fmt = dataset_format(spec)
    if fmt == "hf":
        records = _hf(spec, split or spec.split)
    elif split is not None:
        raise ValueError(f"dataset {spec.path}: a {fmt} file has no splits (eval_split {split!r}); use eval_rows")
    else:
        records = {"jsonl": _jsonl, "parquet": _parquet}[fmt](spec)
    rows = tuple(_row(spec, n, record) for n, record in records)
    if not rows:
        raise ValueError(f"dataset {spec.path} is empty")
    return rows


def training_rows(spec: DatasetSpec) -> tuple[Row, ...]:
    """The rows a tag trains on: all but those held out for evaluation."""
    rows = load_rows(spec)
    if spec.eval_rows and not spec.eval_split:
        if spec.eval_rows >= len(rows):
            raise ValueError(f"dataset {spec.path}: eval_rows {spec.eval_rows} leaves none of its {len(rows)} "
                             "rows to train on")
        return rows[:-spec.eval_rows]
    return rows


def eval_rows(spec: DatasetSpec) -> tuple[Row, ...]:
    """The rows held out for evaluation (every row of a dataset with no held-out part: a tag that does not train)."""
    if spec.eval_split:
        return load_rows(spec, spec.eval_split)
    rows = load_rows(spec)
    return rows[-spec.eval_rows:] if spec.eval_rows else rows


def _row(spec: DatasetSpec, n: int, record: Any) -> Row:
    where = f"{spec.path}:{n}"
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with {spec.prompt_field!r}, got {type(record).__name__}")
    fields = [spec.prompt_field, *([spec.answer_field] if spec.answer_field else []), *spec.label_fields]
    missing = [f for f in fields if f not in record or record[f] is None]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(map(repr, missing))} (has {', '.join(map(repr, record))})")
    values = {f: _text(where, f, record[f]) for f in fields}
    labels = {("answer" if f == spec.answer_field else f): values[f] for f in fields[1:]}
    return values[spec.prompt_field], labels


def _text(where: str, name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: field {name!r} is a {type(value).__name__}; expected a string or a number")
    return str(value)


def _jsonl(spec: DatasetSpec) -> Iterator[tuple[int, Any]]:
    for n, line in enumerate(spec.path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{spec.path}:{n}: not JSON ({exc})") from None


def _parquet(spec: DatasetSpec) -> Iterable[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("parquet datasets need pyarrow (pip install 'rollart[data]')") from None
    try:
        table = pq.read_table(spec.path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors: not parquet, truncated, unreadable
        raise ValueError(f"dataset {spec.path}: not a readable parquet file ({exc})") from None
    return enumerate(table.to_pylist(), 1)


def _hf(spec: DatasetSpec, split: str | None) -> Iterable[tuple[int, Any]]:
    try:
        import datasets
    except ImportError:
        raise ValueError("Hugging Face dataset directories need `datasets` (pip install 'rollart[data]')") from None
    try:
        loaded = datasets.load_from_disk(str(spec.path))
    except Exception as exc:  # noqa: BLE001 - not a save_to_disk directory
        raise ValueError(f"dataset {spec.path}: not a Hugging Face dataset directory ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = split or ("train" if "train" in loaded else None)
        if split not in loaded:
            raise ValueError(f"dataset {spec.path}: has splits {sorted(loaded)}; name one with split:"
                             + (f" ({split!r} is none of them)" if split else ""))
        loaded = loaded[split]
    elif split is not None:
        raise ValueError(f"dataset {spec.path}: a single split; split {split!r} names none of it")
    return enumerate(loaded, 1)
