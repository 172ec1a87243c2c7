"""Prompt datasets: JSONL, parquet and Hugging Face directories, configurable fields, bad rows named."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollart.config import ConfigError, DatasetSpec, build_config
from rollart.datasets import eval_rows, load_rows, training_rows
from rollart.stages.feeder import sources_from, task_spec

ROWS = [{"question": "What is 6 * 7?", "solution": "42", "level": 1},
        {"question": "What is 2 + 2?", "solution": "4", "level": 3}]
EXPECTED = (("What is 6 * 7?", {"answer": "42", "level": "1"}), ("What is 2 + 2?", {"answer": "4", "level": "3"}))
FIELDS = {"prompt_field": "question", "answer_field": "solution", "label_fields": ("level",)}


def test_jsonl_with_its_own_field_names_and_a_bad_row_named(tmp_path):
    path = tmp_path / "math.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert load_rows(DatasetSpec(path=path, **FIELDS)) == EXPECTED
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "no solution"}) + "\n")
    with pytest.raises(ValueError, match=r"math.jsonl:2: missing 'solution', 'level' \(has 'question'\)"):
        load_rows(DatasetSpec(path=path, **FIELDS))
    path.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\nnot json\n")
    with pytest.raises(ValueError, match="math.jsonl:2: not JSON"):
        load_rows(DatasetSpec(path=path))


def test_parquet_rows_and_a_value_that_is_not_text(tmp_path):
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_rows(DatasetSpec(path=path, **FIELDS)) == EXPECTED  # format from the suffix
    pq.write_table(pa.Table.from_pylist([{**row, "level": [row["level"]]} for row in ROWS]), path)
    with pytest.raises(ValueError, match=r"math.parquet:1: field 'level' is a list"):
        load_rows(DatasetSpec(path=path, **FIELDS))
    (tmp_path / "fake.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable parquet file"):
        load_rows(DatasetSpec(path=tmp_path / "fake.parquet"))


def test_a_hugging_face_directory_and_its_splits(tmp_path):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                   "test": datasets.Dataset.from_list(ROWS[:1])})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert load_rows(DatasetSpec(path=tmp_path / "dict", **FIELDS)) == EXPECTED, "train by default"
    assert load_rows(DatasetSpec(path=tmp_path / "dict", split="test", **FIELDS)) == EXPECTED[:1]
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\]"):
        load_rows(DatasetSpec(path=tmp_path / "dict", split="validation", **FIELDS))
    held_out = DatasetSpec(path=tmp_path / "dict", eval_split="test", **FIELDS)
    assert training_rows(held_out) == EXPECTED and eval_rows(held_out) == EXPECTED[:1], "train trains, test evaluates"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert load_rows(DatasetSpec(path=tmp_path / "one", format="hf", **FIELDS)) == EXPECTED
    with pytest.raises(ValueError, match="a single split; split 'test' names none of it"):
        eval_rows(DatasetSpec(path=tmp_path / "one", format="hf", eval_split="test", **FIELDS))
    with pytest.raises(ValueError, match="not a Hugging Face dataset directory"):
        load_rows(DatasetSpec(path=tmp_path))


def test_a_tag_takes_a_plain_path_or_a_spec_and_its_tasks_carry_the_labels(tmp_path):
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    plain = build_config({"tags": {"m": {"env": "math", "dataset": str(tmp_path / "x.jsonl")}}})
    assert plain.tags["m"].dataset == DatasetSpec(path=tmp_path / "x.jsonl")
    config = build_config({"tags": {"m": {"env": "math", "dataset": {"path": str(path), **FIELDS}}}})
    tasks = [task_spec(config, sources_from(config), n) for n in range(8)]
    assert {(t.prompt, tuple(sorted(t.labels.items()))) for t in tasks} <= \
        {(p, tuple(sorted(labels.items()))) for p, labels in EXPECTED}
    with pytest.raises(ConfigError, match=r"tags.m.dataset.format"):
        build_config({"tags": {"m": {"env": "math", "dataset": {"path": str(path), "format": "csv"}}}})


def test_a_dataset_that_cannot_load_fails_at_start_up_naming_its_tag(tmp_path):
    config = build_config({"tags": {"m": {"env": "math", "dataset": str(tmp_path / "missing.jsonl")}}})
    with pytest.raises(ConfigError, match=r"tags.m.dataset: dataset .*missing.jsonl does not exist"):
        sources_from(config)  # what the feeder, `rollart run` and `rollart rollout` call before anything starts
