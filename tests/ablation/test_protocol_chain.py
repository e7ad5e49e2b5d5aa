"""scripts/protocol_chain.sh runs the protocol's grids only from the frozen code."""
import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_worktree(wt, default_py, study_sh='echo "call ONLY=$ONLY"\n'):
    """A git repository standing in for the frozen worktree: configs/default.py (the import
    the chain checks first) and a staleness_study.sh that records its calls; its short SHA."""
    (wt / "scripts").mkdir(parents=True)
    (wt / "scripts" / "staleness_study.sh").write_text(study_sh)
    (wt / "configs").mkdir()
    (wt / "configs" / "default.py").write_text(default_py)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(wt)]
    subprocess.run(git[:5] + ["init", "-q", str(wt)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "frozen"], check=True)
    return subprocess.run(git + ["rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.slow  # starts a process
def test_the_chain_refuses_a_worktree_not_at_the_frozen_commit(tmp_path):
    # this checkout is not 23f2b3c: nothing may run from it
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "protocol_chain.sh"),
                          str(tmp_path / "w"), ROOT], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1 and "not at 23f2b3c" in out.stderr
    assert not (tmp_path / "w").exists()


@pytest.mark.slow  # starts a process
def test_an_edit_under_a_running_chain_does_not_cut_it_off(tmp_path):
    """bash reads a script as it runs it; the chain's body is one block, parsed before it
    starts, so overwriting the file while it waits (here for a PID) changes nothing: it
    goes on to its own next step (the refusal of a worktree not at the frozen commit)."""
    script = tmp_path / "scripts" / "protocol_chain.sh"
    script.parent.mkdir()
    script.write_text(open(os.path.join(ROOT, "scripts", "protocol_chain.sh")).read())
    waited = subprocess.Popen(["sleep", "4"])
    chain = subprocess.Popen(["bash", str(script), str(tmp_path / "w"), ROOT, str(waited.pid)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # the chain is in its wait loop
    with open(script, "w") as f:  # in place: the same file bash holds open
        f.write("#!/usr/bin/env bash\n" + "echo overwritten; exit 7\n" * 40)
    waited.wait()
    out, err = chain.communicate(timeout=60)
    assert chain.returncode == 1 and "not at 23f2b3c" in err, (out, err)


@pytest.mark.slow  # starts processes
def test_the_chain_runs_the_grids_in_the_registered_order_skipping_committed_runs(tmp_path):
    """Against a fake worktree (its own commit as FROZEN, a staleness_study.sh that records
    its calls): '' then mb4 whole, then the secondary grids one whole grid at a time,
    cheapest first (the sitting-19 order); the committed runs
    are copied into the worktree and FINISHED is set only for a grid that has some (the
    runner refuses a finished_tables folder without runs.csv); a grid with a committed
    report.md is complete and not called."""
    here = tmp_path / "checkout"
    (here / "scripts").mkdir(parents=True)
    (here / "scripts" / "protocol_chain.sh").write_text(
        open(os.path.join(ROOT, "scripts", "protocol_chain.sh")).read())
    (here / "results" / "staleness_protocol" / "main").mkdir(parents=True)
    (here / "results" / "staleness_protocol" / "main" / "runs.csv").write_text("run\n")
    (here / "results" / "staleness_protocol" / "mb4").mkdir()
    (here / "results" / "staleness_protocol" / "mb4" / "runs.csv").write_text("run\n")
    (here / "results" / "staleness_protocol" / "mb4" / "report.md").write_text("analysed\n")
    _pinned_warm_start(here)
    wt = tmp_path / "wt"
    sha = _fake_worktree(wt, "", 'echo "call ONLY=$ONLY FINISHED=${FINISHED:-} GRIDS=$GRIDS '
                         '$2-$3 nice=$(nice)"\n')
    out = subprocess.run(["bash", str(here / "scripts" / "protocol_chain.sh"),
                          str(tmp_path / "w"), str(wt)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, FROZEN=sha, FINISHED=""))
    assert out.returncode == 0, out.stderr
    calls = [line.split(" ", 1)[1] for line in out.stdout.splitlines()
             if line.startswith("call ")]
    secondary = [f"ONLY={g} FINISHED= GRIDS=protocol 0-{last} nice=19"
                 for g, last in (("async", 9), ("sweep", 9), ("varlag", 29), ("drift", 9),
                                 ("large", 29))]
    # mb4 has a report (analysed, so complete): skipped whole
    assert calls == ["ONLY=main FINISHED=1 GRIDS=protocol 0-31 nice=19"] + secondary
    assert "mb4: analysed, skipped" in out.stdout
    assert (wt / "results" / "staleness_protocol" / "main" / "runs.csv").exists()
    assert subprocess.run(["git", "-C", str(wt), "rev-parse", "--short=7", "HEAD"],
                          capture_output=True, text=True).stdout.strip() == sha


@pytest.mark.slow  # starts processes
def test_the_chain_stops_before_any_grid_when_python_cannot_import_the_frozen_code(tmp_path):
    """Sitting 17 started the chain without the venv: every grid's seed check failed on the
    import and read as 'seed not listed'. The chain now imports configs.default from the
    worktree first and stops, naming the python, with no grid called."""
    sha = _fake_worktree(tmp_path / "wt", "import no_such_module_xyz\n")
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "protocol_chain.sh"),
                          str(tmp_path / "w"), str(tmp_path / "wt")], capture_output=True,
                         text=True, timeout=60, env=dict(os.environ, FROZEN=sha))
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert "cannot import" in out.stderr and "call " not in out.stdout


def _fake_checkout(root, protocol_py):
    """A copy of staleness_study.sh beside a protocol config and an ablate.py that records
    its calls (a warm start present, so nothing trains)."""
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "staleness_study.sh").write_text(
        open(os.path.join(ROOT, "scripts", "staleness_study.sh")).read())
    (root / "configs" / "ablate").mkdir(parents=True)
    (root / "configs" / "ablate" / "staleness_protocol.py").write_text(protocol_py)
    (root / "experiments").mkdir()
    (root / "experiments" / "ablate.py").write_text(
        "import sys\nprint('ablate', *[a for a in sys.argv[1:] if 'seed.only' in a])\n")
    warm = root / "results" / "staleness_study" / "warm_start"
    warm.mkdir(parents=True)
    (warm / "config.json").write_text("{}")


LISTS_SEED_0 = """import types
def get_config(arg):
    return types.SimpleNamespace(axes=types.SimpleNamespace(
        seed=types.SimpleNamespace(levels=(0,))))
"""


@pytest.mark.slow  # starts processes
def test_the_study_runs_listed_seeds_skips_unlisted_and_stops_on_a_config_that_fails(tmp_path):
    """The protocol branch asks the config whether it lists each seed: listed runs, not
    listed is skipped, and a config that does not import stops the study (exit non-zero,
    nothing run) instead of reading as 'not listed' for every grid and seed."""
    good = tmp_path / "good"
    _fake_checkout(good, LISTS_SEED_0)
    env = dict(os.environ, GRIDS="protocol", ONLY="mb4")
    out = subprocess.run(["bash", str(good / "scripts" / "staleness_study.sh"),
                          str(tmp_path / "w"), "0", "1"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    calls = [line for line in out.stdout.splitlines() if line.startswith("ablate")]
    assert calls == ["ablate --config.axes.seed.only=0"], out.stdout
    bad = tmp_path / "bad"
    _fake_checkout(bad, "import no_such_module_xyz\n" + LISTS_SEED_0)
    out = subprocess.run(["bash", str(bad / "scripts" / "staleness_study.sh"),
                          str(tmp_path / "w"), "0", "1"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode != 0 and "cannot read" in out.stderr, (out.stdout, out.stderr)
    assert "ablate" not in out.stdout and "seed 1" not in out.stdout


@pytest.mark.slow  # starts processes
def test_large_runs_from_the_committed_warm_start_and_a_different_one_stops_the_chain(tmp_path):
    """The same config retrains a different `large` warm start on another CPU (sitting 23),
    so the chain copies the committed one into W before `large`, and stops before `large`
    when W already holds a different one or the checkout lacks the committed one (the
    frozen runner would then retrain its own)."""
    here = tmp_path / "checkout"
    (here / "scripts").mkdir(parents=True)
    (here / "scripts" / "protocol_chain.sh").write_text(
        open(os.path.join(ROOT, "scripts", "protocol_chain.sh")).read())
    pinned = _pinned_warm_start(here)
    sha = _fake_worktree(tmp_path / "wt", "", 'echo "call ONLY=$ONLY"\n')
    run = lambda: subprocess.run(  # noqa: E731
        ["bash", str(here / "scripts" / "protocol_chain.sh"), str(tmp_path / "w"),
         str(tmp_path / "wt")], capture_output=True, text=True, timeout=120,
        env=dict(os.environ, FROZEN=sha))
    out = run()
    assert out.returncode == 0, out.stderr
    copied = tmp_path / "w" / "protocol" / "large" / "warm_start" / "model"
    assert (copied / "model.safetensors").read_bytes() == b"the committed weights"
    assert (copied / "config.json").exists() and "call ONLY=large" in out.stdout
    (copied / "model.safetensors").write_bytes(b"weights retrained on another CPU")
    out = run()
    assert out.returncode == 1 and "not the committed" in out.stderr, (out.stdout, out.stderr)
    assert "call ONLY=large" not in out.stdout
    assert (copied / "model.safetensors").read_bytes() == b"weights retrained on another CPU"
    (pinned / "model.safetensors").unlink()  # a checkout without the committed weights
    shutil.rmtree(tmp_path / "w" / "protocol" / "large" / "warm_start")  # and a fresh W
    out = run()
    assert out.returncode == 1 and "is pinned" in out.stderr, (out.stdout, out.stderr)
    assert "call ONLY=large" not in out.stdout and not (copied / "model.safetensors").exists()


def _pinned_warm_start(checkout):
    """The committed `large` warm start (results/staleness_protocol/large_warm_start/model)
    in a fake checkout; returns its model folder."""
    pinned = checkout / "results" / "staleness_protocol" / "large_warm_start" / "model"
    pinned.mkdir(parents=True)
    (pinned / "config.json").write_text("{}")
    (pinned / "model.safetensors").write_bytes(b"the committed weights")
    return pinned
