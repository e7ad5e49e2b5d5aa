"""GSM8K-format JSONL: loading errors, the held-out split and answer extraction."""
import itertools
import json
import random

import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.tasks import GSM8KTask, Problem, get_task, task_config
from pipelinerl_jax.tasks.gsm8k import DatasetError, extract_answer

PROBLEM = Problem("p", "q", "1000")


@pytest.mark.parametrize("text,correct", [
    ("so the answer is\n#### 1000", True),
    ("#### 1,000", True),
    ("#### $1,000.", True),
    ("#### 1000.0 beads", True),
    ("The answer is \\boxed{1000}.", True),
    ("#### 999\nwait, no: \\boxed{1000}", True),  # the last marker wins
    ("\\boxed{1000} hmm, actually #### 999", False),
    ("#### 999", False),
    ("1000", False),  # no marker, no answer
    ("\\boxed{1000", False),  # unbalanced, as when truncated
    ("#### ", False),
    ("#### -1000", False),
])
def test_reward_extraction(gsm8k_file, text, correct):
    got = GSM8KTask(gsm8k_file, eval_size=0).reward(PROBLEM, text)
    assert got.correct is correct and got.reward == float(correct), got


def test_extract_answer_reads_nested_braces_and_the_rest_of_the_line():
    assert extract_answer("\\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert extract_answer("#### 42 apples\nmore text") == "42 apples"
    assert extract_answer("nothing here") is None


def test_split_sizes_demonstrations_and_streams(gsm8k_file):
    task = GSM8KTask(gsm8k_file, eval_size=8)
    assert task.num_train == 32 and len(task.eval_problems(100)) == 8
    problem = task.eval_problems(1)[0]
    assert problem.prompt.startswith("Question: Mia has") and problem.prompt.endswith("Answer:\n")
    assert problem.id.startswith("gsm8k/train.jsonl:")
    demo = task.demonstration(problem)
    assert "<<" not in demo and demo.rstrip().endswith(f"#### {problem.answer}")
    epoch = list(itertools.islice(task.problems(0), 32))
    assert len({p.id for p in epoch}) == 32  # one epoch visits every training problem once


def test_held_out_slice_ignores_file_order_and_keeps_duplicates_together(tmp_path, gsm8k_file,
                                                                         gsm8k_data):
    rows = [json.loads(line) for line in open(gsm8k_file)]
    shuffled = rows + rows[:5]  # five questions appear twice
    random.Random(0).shuffle(shuffled)
    a = GSM8KTask(gsm8k_file, eval_size=8)
    b = GSM8KTask(gsm8k_data.write(tmp_path / "shuffled.jsonl", shuffled), eval_size=8)
    questions = lambda ps: [p.meta["question"] for p in ps]  # noqa: E731
    assert sorted(questions(a.eval_problems(8))) == sorted(set(questions(b.eval_problems(20))))
    train_b = {p.meta["question"] for p in itertools.islice(b.problems(0), 500)}
    assert not train_b & set(questions(b.eval_problems(20)))


def test_separate_eval_file_drops_overlapping_training_questions(tmp_path, gsm8k_data):
    train = gsm8k_data.write(tmp_path / "train.jsonl", gsm8k_data.rows(10))
    test = gsm8k_data.write(tmp_path / "test.jsonl", gsm8k_data.rows(4, start=8))  # 2 overlap
    task = GSM8KTask(train, eval_path=test)
    assert task.num_train == 8 and task.num_dropped_overlap == 2
    assert len(task.eval_problems(10)) == 4


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"question": "q"}', "field 'answer'"),
    ('{"question": "", "answer": "#### 1"}', "field 'question'"),
    ('{"question": "q", "answer": "it is 1"}', "no '#### <answer>'"),
    ('{"question": "q", "answer": "it is ####  "}', "nothing after '####'"),
])
def test_malformed_lines_name_the_path_and_line(tmp_path, gsm8k_data, line, message):
    path = tmp_path / "bad.jsonl"
    rows = [json.dumps(r) for r in gsm8k_data.rows(2)]
    path.write_text(f"{rows[0]}\n\n{line}\n{rows[1]}\n")
    with pytest.raises(DatasetError, match=message) as e:
        GSM8KTask(str(path), eval_size=0)
    assert str(e.value).startswith(f"{path}:3:")  # blank lines still count


def test_config_errors_name_the_key(tmp_path, gsm8k_file):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=r"^task\.path: .*nope\.jsonl"):
        get_task(task_config("gsm8k", path=missing))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(ConfigError, match=rf"^task\.path: {bad}:1: not valid JSON"):
        get_task(task_config("gsm8k", path=str(bad)))
    with pytest.raises(ConfigError, match=r"^task\.eval_size: .*leaves no training"):
        get_task(task_config("gsm8k", path=gsm8k_file, eval_size=40))
    with pytest.raises(ConfigError, match=r"^task\.eval_path: .*does not exist"):
        get_task(task_config("gsm8k", path=gsm8k_file, eval_path=missing))
    with pytest.raises(ConfigError, match=r"^task\.prompt_template"):
        get_task(task_config("gsm8k", path=gsm8k_file, prompt_template="Q: {q}"))
