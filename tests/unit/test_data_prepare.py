"""python -m rollpacker.data.prepare: GSM8K / MATH raw rows -> verl rows that PromptDataset reads."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollpacker.data.dataset import PromptDataset
from rollpacker.data.prepare import INSTRUCTION, last_boxed, main
from rollpacker.examples.tokenizer import save_tokenizer
from rollpacker.reward.scorers import MATH, scorer_for
from rollpacker.reward.scorers.math_answer import score_math

GSM8K_RAW = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A shop sells 1,000 pens a day. How many in 2 days?", "answer": "1,000 * 2 = 2,000\n#### 2,000"},
    {"question": "What is 2 + 2?", "answer": "It is four."},  # no "####": skipped
]
MATH_RAW = [
    {"problem": "What is $\\frac{2}{4}$ in lowest terms?",
     "solution": "Divide by 2: $\\frac{2}{4} = \\boxed{\\frac{1}{2}}$.", "level": "Level 1", "type": "Prealgebra"},
    {"problem": "Solve $x + 1 = 3$.", "solution": "So $x = \\boxed{1}$ at first, then $x=\\boxed{2}$."},
    {"problem": "Prove the claim.", "solution": "It follows directly."},  # no \boxed: skipped
]


def user(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_last_boxed_keeps_nested_braces_and_refuses_unbalanced():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} then \\boxed {x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{\\frac{1}{2}") is None
    assert last_boxed("no box") is None


def test_gsm8k_rows_exact_and_skipped_row_counted(tmp_path, capsys):
    out = tmp_path / "gsm8k.jsonl"
    assert main(["--source", "gsm8k", "--input", str(write_jsonl(tmp_path / "raw.jsonl", GSM8K_RAW)),
                 "--output", str(out)]) == 0
    assert read_jsonl(out) == [
        {"data_source": "gsm8k", "prompt": user(GSM8K_RAW[0]["question"]), "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": {"index": 0}},
        {"data_source": "gsm8k", "prompt": user(GSM8K_RAW[1]["question"]), "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "2000"}, "extra_info": {"index": 1}},
    ]
    assert "skipped 1 rows without an extractable answer (0-based row numbers: 2)" in capsys.readouterr().err


def test_math_rows_exact_from_parquet_with_eval_split(tmp_path, capsys):
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist(MATH_RAW), raw)
    out = tmp_path / "math.jsonl"
    assert main(["--source", "math", "--input", str(raw), "--output", str(out), "--split-eval", "1"]) == 0
    assert read_jsonl(out) == [
        {"data_source": "math", "prompt": user(MATH_RAW[0]["problem"]), "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
         "extra_info": {"index": 0, "level": "Level 1", "type": "Prealgebra"}},
    ]
    # Parquet fills the columns a row lacks with None; those are left out of extra_info.
    assert read_jsonl(tmp_path / "math.eval.jsonl") == [
        {"data_source": "math", "prompt": user(MATH_RAW[1]["problem"]), "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 1}},
    ]
    assert "skipped 1 rows without an extractable answer (0-based row numbers: 2)" in capsys.readouterr().err


@pytest.mark.parametrize("source,raw", [("gsm8k", GSM8K_RAW), ("math", MATH_RAW)])
def test_ground_truth_scores_correct_and_prompt_dataset_reads_the_output(tmp_path, tokenizer, source, raw):
    out = tmp_path / "out.parquet"
    assert main(["--source", source, "--input", str(write_jsonl(tmp_path / "raw.jsonl", raw)),
                 "--output", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    for row in rows:
        assert scorer_for(row["data_source"]) == MATH
        truth = row["reward_model"]["ground_truth"]
        assert score_math(f"Working... so the answer is \\boxed{{{truth}}}.", truth, timeout=5).correct
        assert not score_math("The answer is \\boxed{12345}.", truth, timeout=5).correct
    ds = PromptDataset([str(out)], tokenizer, max_prompt_length=4096, shuffle=False)
    assert ds.skipped == {}
    prompts = ds.take(len(rows))
    assert [p.uid for p in prompts] == list(range(len(rows)))
    assert [p.ground_truth for p in prompts] == [r["reward_model"]["ground_truth"] for r in rows]
    assert [p.data_source for p in prompts] == [source] * len(rows)
    expected = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(prompts[0].input_ids) == expected


def test_input_without_any_answer_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--source", "gsm8k", "--input", str(write_jsonl(tmp_path / "raw.jsonl", GSM8K_RAW[2:])),
              "--output", str(tmp_path / "out.jsonl")])
