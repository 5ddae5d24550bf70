"""Prompt data pipeline: verl-style rows from JSONL and Parquet, skipping, order, resume."""
from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollpacker.data.config import DataConfig
from rollpacker.data.dataset import PromptDataset
from rollpacker.examples.task import generate_rows
from rollpacker.examples.tokenizer import save_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "wb") as f:
        for row in rows:
            f.write((json.dumps(row) + "\n").encode())
        for line in raw_lines:
            f.write(line + b"\n")
    return str(path)


def good_row(content="Start at 1, apply +2 1 times mod 10.", truth="3"):
    return {"prompt": [{"role": "user", "content": content}], "data_source": "stepchain",
            "reward_model": {"ground_truth": truth, "style": "rule"}, "extra_info": {"num_steps": 1}}


def test_each_bad_row_reason_is_skipped_counted_and_reported_once(tmp_path, tokenizer, caplog):
    long_content = "Start at 1, apply " + "+2 " * 80 + "mod 10."
    rows = [
        good_row(),
        {"data_source": "stepchain", "reward_model": {"ground_truth": "1"}},            # no prompt
        {"prompt": "Start at 1.", "reward_model": {"ground_truth": "1"}},               # no data_source
        {"prompt": "Start at 1.", "data_source": "x"},                                  # no ground truth
        {"prompt": 7, "data_source": "x", "reward_model": {"ground_truth": "1"}},       # wrong type
        {**good_row(), "extra_info": "not a dict"},                                     # wrong type
        {"prompt": [{"role": "user"}], "data_source": "x", "reward_model": {"ground_truth": "1"}},
        {"prompt": "   ", "data_source": "x", "reward_model": {"ground_truth": "1"}},   # empty
        {"prompt": [{"role": "user", "content": ""}], "data_source": "x", "reward_model": {"ground_truth": "1"}},
        good_row(long_content),                                                         # too long
        good_row("Start at 2, apply *3 1 times mod 10.", "6"),
    ]
    raw = [b'{"prompt": "\xff\xfe bad utf-8", "data_source": "x"}', b"{not json"]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows, raw)
    with caplog.at_level(logging.WARNING, logger="rollpacker.data.dataset"):
        ds = PromptDataset([path], tokenizer, max_prompt_length=128, shuffle=False)
    assert len(ds) == 2
    assert ds.skipped == {"missing_field": 3, "wrong_type": 3, "empty_prompt": 2, "too_long": 1,
                          "undecodable": 2}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "skipped 11 of 13 rows" in warnings[0].getMessage()
    first, second = ds.take(2)
    assert (first.uid, second.uid) == (0, 10)  # uid = row index, skipped rows included
    assert first.ground_truth == "3" and first.data_source == "stepchain"
    assert first.extra_info == {"num_steps": 1}
    expected = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(first.input_ids) == expected


def test_plain_text_prompt_and_code_ground_truth_kept_as_is(tmp_path, tokenizer):
    tests = [{"input": "1", "output": "2"}]
    rows = [{"prompt": "Start at 4.", "data_source": "code", "reward_model": {"ground_truth": tests}},
            {"prompt": "Start at 5.", "data_source": "code", "extra_info": {"tests": tests}}]
    ds = PromptDataset([write_jsonl(tmp_path / "code.jsonl", rows)], tokenizer, max_prompt_length=64,
                       apply_chat_template=False, shuffle=False)
    a, b = ds.take(2)
    assert a.ground_truth == tests and b.ground_truth == tests
    assert tokenizer.decode(a.input_ids) == "Start at 4."


def test_parquet_and_jsonl_give_the_same_prompts(tmp_path, tokenizer):
    rows = generate_rows(40, seed=3)
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    from_jsonl = PromptDataset([jsonl], tokenizer, max_prompt_length=128, seed=5)
    from_parquet = PromptDataset([str(parquet)], tokenizer, max_prompt_length=128, seed=5)
    assert from_parquet.take(40) == from_jsonl.take(40)
    assert not from_parquet.skipped


def test_file_without_usable_rows_is_an_error_naming_it(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "good.jsonl", [good_row()])
    bad = write_jsonl(tmp_path / "all_bad.jsonl", [{"prompt": ""}, {"data_source": "x"}])
    with pytest.raises(ValueError, match="all_bad.jsonl has no usable rows"):
        PromptDataset([good, bad], tokenizer, max_prompt_length=128)


def test_epochs_are_seeded_permutations_and_uids_span_files(tmp_path, tokenizer):
    a = write_jsonl(tmp_path / "a.jsonl", generate_rows(6, seed=1))
    b = write_jsonl(tmp_path / "b.jsonl", generate_rows(4, seed=2))
    ds = PromptDataset([a, b], tokenizer, max_prompt_length=128, seed=7)
    served = ds.take(25)
    for epoch in range(2):
        chunk = served[epoch * 10 : (epoch + 1) * 10]
        assert sorted(p.uid for p in chunk) == list(range(10))
        assert {p.epoch for p in chunk} == {epoch}
    assert [p.uid for p in served[:10]] != [p.uid for p in served[10:20]]  # a new order each epoch
    again = PromptDataset([a, b], tokenizer, max_prompt_length=128, seed=7)
    assert [p.uid for p in again.take(25)] == [p.uid for p in served]
    unshuffled = PromptDataset([a, b], tokenizer, max_prompt_length=128, shuffle=False)
    assert [p.uid for p in unshuffled.take(10)] == list(range(10))


def test_resume_serves_exactly_the_prompts_not_yet_served(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "rows.jsonl", generate_rows(30, seed=4))
    ds = PromptDataset([path], tokenizer, max_prompt_length=128, seed=3)
    first_epoch_head = ds.take(40)[30:]  # one full epoch, then 10 of the second
    state = json.loads(json.dumps(ds.state_dict()))  # survives a checkpoint file
    rest = ds.take(25)
    resumed = PromptDataset([path], tokenizer, max_prompt_length=128, seed=3)
    resumed.load_state_dict(state)
    assert resumed.take(25) == rest
    assert sorted(p.uid for p in first_epoch_head + rest[:20]) == list(range(30))
    assert {p.epoch for p in rest[:20]} == {1} and {p.epoch for p in rest[20:]} == {2}


def test_resume_refuses_state_of_other_data(tmp_path, tokenizer):
    ds = PromptDataset([write_jsonl(tmp_path / "a.jsonl", generate_rows(8, seed=1))], tokenizer,
                       max_prompt_length=128)
    other = PromptDataset([write_jsonl(tmp_path / "b.jsonl", generate_rows(9, seed=1))], tokenizer,
                          max_prompt_length=128)
    with pytest.raises(ValueError, match="saved for 8 prompts"):
        other.load_state_dict(ds.state_dict())


def test_from_config_uses_the_data_section(tmp_path, tokenizer):
    train = write_jsonl(tmp_path / "train.jsonl", generate_rows(12, seed=1))
    evalf = write_jsonl(tmp_path / "eval.jsonl", generate_rows(5, seed=2))
    cfg = DataConfig(train_files=[train], eval_files=[evalf], max_prompt_length=128, seed=9)
    train_ds = PromptDataset.from_config(cfg, tokenizer)
    eval_ds = PromptDataset.from_config(cfg, tokenizer, split="eval")
    assert (len(train_ds), len(eval_ds)) == (12, 5)
    assert [p.uid for p in eval_ds.take(5)] == list(range(5))  # eval is served in file order
    assert [p.uid for p in train_ds.take(12)] == [
        p.uid for p in PromptDataset([train], tokenizer, max_prompt_length=128, seed=9).take(12)]
