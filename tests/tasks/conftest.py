"""Fixtures for the task tests: a small GSM8K-format file written on the fly (never downloaded)."""
import json

import pytest


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    """`n` distinct two-step word problems in the GSM8K format, with calculator annotations."""
    rows = []
    for i in range(start, start + n):
        a, b, c = 3 + i, 7 + 2 * i, 2 + i % 9
        total = (a + b) * c
        rows.append({
            "question": f"Mia has {a} red beads and {b} blue beads. She makes {c} identical "
                        f"copies of the set. How many beads does she use?",
            "answer": f"One set has {a}+{b} = <<{a}+{b}={a + b}>>{a + b} beads.\n"
                      f"{c} sets use {a + b}*{c} = <<{a + b}*{c}={total}>>{total} beads.\n"
                      f"#### {total:,}",
        })
    return rows


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


class GSM8KData:
    """Helpers as a fixture: test modules must not import conftest by name."""
    rows = staticmethod(gsm8k_rows)
    write = staticmethod(write_jsonl)


@pytest.fixture(scope="session")
def gsm8k_data():
    return GSM8KData


@pytest.fixture(scope="session")
def gsm8k_file(tmp_path_factory):
    """40 problems; answers above 999 are written with a thousands comma, as in GSM8K."""
    return write_jsonl(tmp_path_factory.mktemp("gsm8k") / "train.jsonl", gsm8k_rows(40))
