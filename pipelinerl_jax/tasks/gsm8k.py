"""Math word problems from a local GSM8K-format JSONL file.

Each non-blank line is ``{"question": "...", "answer": "... #### 42"}``: the text after the
last '####' is the reference answer, the whole answer text (with GSM8K's ``<<48/2=24>>``
calculator annotations removed) is the demonstration. A missing file, bad JSON, a missing
field or a missing '####' raises `DatasetError` (a ValueError) naming the path and the line
number.

Eval split: `eval_path` when given (training questions that also appear there are dropped);
otherwise the `eval_size` distinct questions with the smallest `stable_hash(question)`. The
hash makes the held-out slice independent of file order, and duplicates of one question
always land on the same side.

Answer extraction from a completion: the last occurrence of either ``#### <answer>`` (the
rest of that line) or ``\\boxed{<answer>}`` (balanced braces), whichever comes later. Both
sides are normalised: '$', '\\$', '%', spaces and thousands commas removed, then the first
number is compared as a `Decimal` (so ``42.0 == 42``, ``1,000. == 1000``); a non-numeric
reference answer is compared as normalised text. Fractions like ``\\frac{1}{2}`` are not
understood (GSM8K answers are integers). Reward 1.0 iff equal, else 0.0.
"""
from __future__ import annotations

import json
import logging
import os
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Iterator, Optional

import numpy as np

from pipelinerl_jax import config_checks as cfglib
from pipelinerl_jax.tasks.base import Problem, Task, nested, non_negative_int, stable_hash

DEFAULTS = {"path": "", "eval_path": "", "eval_size": 200,
            "prompt_template": "Question: {question}\nAnswer:\n", "max_completion_tokens": 512}
_CALCULATOR = re.compile(r"<<[^<>]*>>")
_NUMBER = re.compile(r"[-+]?[0-9][0-9,]*(?:\.[0-9]+)?")
_MAX_ANSWER_CHARS = 200


def _normalise(text: str) -> str:
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", " "):
        text = text.replace(junk, "")
    return text.strip().rstrip(".")


def parse_number(text: str) -> Optional[Decimal]:
    """The first number in `text` after normalisation, or None."""
    m = _NUMBER.search(_normalise(text)[:_MAX_ANSWER_CHARS])
    if not m:
        return None
    try:
        return Decimal(m.group(0).replace(",", ""))
    except InvalidOperation:
        return None


def extract_answer(text: str) -> Optional[str]:
    """The raw answer text after the last '####' or inside the last '\\boxed{...}'."""
    hashes, boxed = text.rfind("####"), text.rfind("\\boxed{")
    if hashes < 0 and boxed < 0:
        return None
    if hashes > boxed:
        return text[hashes + 4:].split("\n", 1)[0].strip()[:_MAX_ANSWER_CHARS]
    depth, start = 1, boxed + len("\\boxed{")
    for i in range(start, min(len(text), start + _MAX_ANSWER_CHARS)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None  # unbalanced (usually truncated) box


def answers_equal(predicted: str, reference: str) -> bool:
    ref_num = parse_number(reference)
    if ref_num is None:
        return _normalise(predicted) == _normalise(reference)
    pred_num = parse_number(predicted)
    return pred_num is not None and pred_num == ref_num


class DatasetError(ValueError):
    """A bad data file; `field` names the constructor argument / config key at fault."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def load_jsonl(path: str, template: str, field: str = "path") -> list[Problem]:
    """Problems of a GSM8K-format file; errors name `path:line`."""
    if not os.path.isfile(path):
        raise DatasetError(field, f"{path}: GSM8K-format JSONL file not found")
    base, problems = os.path.basename(path), []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(field, f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(field, f"{path}:{lineno}: expected a JSON object")
            question, solution = row.get("question"), row.get("answer")
            for key, value in (("question", question), ("answer", solution)):
                if not isinstance(value, str) or not value.strip():
                    raise DatasetError(field, f"{path}:{lineno}: field {key!r} must be a "
                                              "non-empty string")
            if "####" not in solution:
                raise DatasetError(field,
                                   f"{path}:{lineno}: field 'answer' has no '#### <answer>'")
            reference = solution[solution.rfind("####") + 4:].strip()
            if not reference:
                raise DatasetError(field,
                                   f"{path}:{lineno}: nothing after '####' in field 'answer'")
            prompt = template.replace("{question}", question)
            problems.append(Problem(f"gsm8k/{base}:{lineno}", prompt, reference,
                                    {"question": question,
                                     "solution": _CALCULATOR.sub("", solution)}))
    if not problems:
        raise DatasetError(field, f"{path}: contains no problems")
    return problems


class GSM8KTask(Task):
    name = "gsm8k"

    def __init__(self, path: str, eval_path: str = "", eval_size: int = 200,
                 prompt_template: str = DEFAULTS["prompt_template"],
                 max_completion_tokens: int = 512, truncated_reward: float = 0.0):
        rows = load_jsonl(path, prompt_template)
        if eval_path:
            self._eval = load_jsonl(eval_path, prompt_template, "eval_path")
            held_out = {p.meta["question"] for p in self._eval}
        else:
            ranked = sorted({p.meta["question"] for p in rows}, key=stable_hash)
            if eval_size >= len(ranked):
                raise DatasetError("eval_size", f"{path}: eval_size={eval_size} leaves no training "
                                   f"problems ({len(ranked)} distinct questions); lower it or "
                                   "give eval_path")
            held_out = set(ranked[:eval_size])
            order = {q: i for i, q in enumerate(ranked)}
            self._eval = sorted((p for p in rows if p.meta["question"] in held_out),
                                key=lambda p: order[p.meta["question"]])
        self._train = [p for p in rows if p.meta["question"] not in held_out]
        self.num_dropped_overlap = len(rows) - len(self._train)
        if not self._train:
            raise DatasetError("eval_path",
                               f"{path}: every question is also in the eval split {eval_path!r}")
        self.max_prompt_chars = max(len(p.prompt) for p in self._train + self._eval)
        self.max_completion_tokens = int(max_completion_tokens)
        self.truncated_reward = float(truncated_reward)
        self.reward_range = (min(0.0, self.truncated_reward), 1.0)

    @property
    def num_train(self) -> int:
        return len(self._train)

    def problems(self, seed: int) -> Iterator[Problem]:
        """Endless epochs over the training split, each in a fresh seeded order."""
        seed = non_negative_int(seed, "seed")
        rng = np.random.default_rng(np.random.SeedSequence([stable_hash(self.name) & 0xFFFFFFFF,
                                                            seed]))
        while True:
            for i in rng.permutation(len(self._train)):
                yield self._train[i]

    def eval_problems(self, n: int) -> list[Problem]:
        n = non_negative_int(n, "n")
        if n > len(self._eval):
            logging.warning("gsm8k: %d eval problems asked for, the eval split has %d",
                            n, len(self._eval))
        return self._eval[:n]

    def demonstration(self, problem: Problem) -> str:
        return problem.meta["solution"]

    def _score(self, problem: Problem, text: str) -> tuple[float, bool, dict]:
        predicted = extract_answer(text)
        if predicted is None:
            return 0.0, False, {"reason": "no_answer"}
        correct = answers_equal(predicted, problem.answer)
        return float(correct), correct, {"reason": "correct" if correct else "wrong_answer",
                                         "extracted": predicted[:64]}


def from_config(name: str, cfg: Any, prefix: str = "task") -> GSM8KTask:
    """Validates the gsm8k keys of a task section (errors name the key) and builds it."""
    c = nested(prefix, cfg)
    for key in ("path", "eval_path"):
        value = cfglib.get(c, f"{prefix}.{key}")
        if not isinstance(value, str) or (key == "path" and not value):
            raise cfglib.ConfigError(f"{prefix}.{key}",
                                     f"must name a local JSONL file, got {value!r}")
        if value and not os.path.isfile(value):
            raise cfglib.ConfigError(f"{prefix}.{key}", f"file {value!r} does not exist")
    template = cfglib.get(c, f"{prefix}.prompt_template")
    if not isinstance(template, str) or "{question}" not in template:
        raise cfglib.ConfigError(f"{prefix}.prompt_template",
                                 f"must be a string containing '{{question}}', got {template!r}")
    args = (cfglib.get(c, f"{prefix}.path"), cfglib.get(c, f"{prefix}.eval_path"),
            cfglib.positive_int(c, f"{prefix}.eval_size", allow_zero=True), template,
            cfglib.positive_int(c, f"{prefix}.max_completion_tokens"),
            cfglib.number(c, f"{prefix}.truncated_reward", lo=-1.0, hi=1.0))
    try:
        return GSM8KTask(*args)
    except DatasetError as e:  # the file is part of the config: fail before any process starts
        raise cfglib.ConfigError(f"{prefix}.{e.field}", str(e)) from e
