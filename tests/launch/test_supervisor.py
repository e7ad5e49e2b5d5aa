"""The process supervisor (restarts with a limit, events, ordered stop, kill after a grace
period, timeouts) and the learner's structured stop record, on tiny Python children."""
import json
import sys
import time

import pytest

from pipelinerl_jax.launch import outcome, roles
from pipelinerl_jax.launch.supervisor import Child, LaunchError, stop_all, tail


def _child(tmp_path, name, code, **kw):
    return Child(name, [sys.executable, "-c", code], str(tmp_path / "logs" / f"{name}.log"), **kw)


def _events(tmp_path):
    with open(tmp_path / "events.jsonl") as f:
        return [json.loads(line) for line in f]


def _wait_for_line(path, text, timeout=30.0):
    deadline = time.time() + timeout
    while text not in tail(path):
        assert time.time() < deadline, f"{text!r} never in {path}"
        time.sleep(0.05)


@pytest.mark.slow  # starts child processes
def test_a_child_is_restarted_up_to_its_limit_then_fails_with_its_log(tmp_path):
    c = _child(tmp_path, "flaky", "import sys; print('boom', flush=True); sys.exit(3)",
               events=str(tmp_path / "events.jsonl")).start()
    assert c.wait(interval=0.05) == 3
    c.restart(3, limit=1)
    assert c.wait(interval=0.05) == 3
    with pytest.raises(LaunchError, match=r"flaky exited with 3 and was restarted 1 times"
                                          r"[^\n]*\n(.|\n)*boom"):
        c.restart(3, limit=1)
    assert [(e["event"], e["restarts"]) for e in _events(tmp_path)] == \
        [("start", 0), ("exit", 0), ("start", 1), ("exit", 1)]
    assert "[launcher] flaky exited with 3; restart 1" in tail(c.log_path)


@pytest.mark.slow  # starts child processes
def test_stop_kills_a_child_that_ignores_sigterm(tmp_path):
    c = _child(tmp_path, "stubborn", "import signal, time; "
               "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
               "time.sleep(120)").start()
    _wait_for_line(c.log_path, "up")
    c.stop(0.5)
    assert c.poll() == -9  # killed: it would have slept 120 s otherwise


@pytest.mark.slow  # starts child processes
def test_wait_past_its_timeout_stops_the_child_and_returns_minus_one(tmp_path):
    c = _child(tmp_path, "slow", "import time; time.sleep(120)").start()
    assert c.wait(0.3, grace=5.0, interval=0.05) == -1
    assert c.poll() is not None


@pytest.mark.slow  # starts child processes
def test_an_exception_while_waiting_stops_the_child(tmp_path):
    c = _child(tmp_path, "slow", "import time; time.sleep(120)").start()

    def interrupt():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        c.wait(grace=5.0, every=interrupt, interval=0.05)
    assert c.poll() is not None


@pytest.mark.slow  # starts child processes
def test_stop_all_stops_producers_before_consumers(tmp_path):
    order = tmp_path / "order.txt"
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye); print('up', flush=True)\n"
            "time.sleep(120)\n")
    made = []
    for name, rank in (("queue", 2), ("learner", 1), ("worker0", 0)):
        c = Child(name, [sys.executable, "-c", code, name], str(tmp_path / f"{name}.log"),
                  stop_rank=rank).start()
        made.append(c)
    for c in made:
        _wait_for_line(c.log_path, "up")
    stop_all(made, 10.0)
    assert order.read_text().split() == ["worker0", "learner", "queue"]


def test_role_children_log_in_the_workdir_and_stop_in_role_order(tmp_path):
    w = roles.child("worker", str(tmp_path), 1)
    assert w.name == "worker1" and w.log_path == str(tmp_path / "logs" / "worker1.log")
    assert w.events == str(tmp_path / "events.jsonl")
    assert w.cmd[-3:] == ["--role=worker", f"--workdir={tmp_path}", "--index=1"]
    ranks = {r: roles.child(r, str(tmp_path)).stop_rank for r in roles.ROLES}
    assert ranks["worker"] == ranks["sft"] < ranks["learner"] < ranks["queue"]
    assert ranks["evaluator"] == ranks["worker"]  # stopped before what it reads from


def test_a_learner_that_gives_up_on_non_finite_steps_leaves_a_diverged_record(
        tmp_path, monkeypatch):
    from pipelinerl_jax.learner.loop import TooManySkippedSteps
    workdir = str(tmp_path)

    def fail(role, workdir, index, *_):
        raise TooManySkippedSteps("3 consecutive steps had a non-finite loss or gradient")
    monkeypatch.setattr(roles, "_run_role", fail)
    with pytest.raises(TooManySkippedSteps):
        roles.run_role("learner", workdir)
    (stop,) = outcome.learner_stops(workdir)
    assert stop["reason"] == "diverged" and stop["error"] == "TooManySkippedSteps"
    assert "non-finite" in stop["message"]
    assert outcome.diverged(workdir) and not outcome.diverged(workdir, time.time() + 1)

    def crash(role, workdir, index, *_):
        raise ValueError("TooManySkippedSteps is only a word here")
    monkeypatch.setattr(roles, "_run_role", crash)
    later = time.time()
    with pytest.raises(ValueError):
        roles.run_role("learner", workdir)
    assert [e["reason"] for e in outcome.learner_stops(workdir, later)] == ["error"]
    assert not outcome.diverged(workdir, later)


@pytest.mark.slow  # starts child processes
def test_exit_now_finishes_what_python_would_then_skips_finalization(tmp_path):
    """A role's process ends as a normal exit would (non-daemon threads joined, idle
    executor workers woken, atexit handlers run, output flushed) with its exit code, but
    without tearing down native libraries (seconds for a JAX process)."""
    done = tmp_path / "done"
    code = ("import atexit, concurrent.futures, sys, threading, time\n"
            "from pipelinerl_jax.launch.supervisor import exit_now\n"
            "concurrent.futures.ThreadPoolExecutor(1).submit(lambda: None).result()  # idle\n"
            f"def late(): time.sleep(0.3); open({str(done)!r}, 'a').write('thread\\n')\n"
            "threading.Thread(target=late).start()\n"
            f"atexit.register(lambda: open({str(done)!r}, 'a').write('atexit\\n'))\n"
            "sys.stdout.write('buffered, no newline')\n"
            "exit_now(3)\n")
    c = _child(tmp_path, "role", code).start()
    assert c.wait(30.0, interval=0.05) == 3
    assert done.read_text().split() == ["thread", "atexit"]
    assert tail(c.log_path).endswith("buffered, no newline")


@pytest.mark.slow  # starts child processes
def test_stop_records_how_long_the_child_took(tmp_path):
    events = str(tmp_path / "events.jsonl")
    c = _child(tmp_path, "w", "import time; print('up', flush=True); time.sleep(120)",
               events=events).start()
    _wait_for_line(c.log_path, "up")
    c.stop(10.0)
    c.exited(c.poll())
    start, stop, exit_ = _events(tmp_path)
    assert (stop["event"], stop["child"], stop["killed"]) == ("stop", "w", False)
    assert stop["seconds"] >= 0 and stop["code"] == -15
    assert (exit_["event"], exit_["code"]) == ("exit", -15)


@pytest.mark.slow  # starts child processes
def test_poll_with_a_timeout_returns_as_soon_as_the_child_exits(tmp_path):
    c = _child(tmp_path, "quick", "import time; time.sleep(0.2)").start()
    # A poll that waited out its timeout instead would hold this test for an hour (a hang,
    # never a pass); no duration is measured, so a slow machine cannot fail it.
    assert c.poll(timeout=3600.0) == 0
    slow = _child(tmp_path, "slow", "import time; time.sleep(120)").start()
    assert slow.poll(timeout=0.1) is None
    slow.stop(5.0)
