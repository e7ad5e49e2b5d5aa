"""scripts/protocol_chain.sh runs the protocol's grids only from the frozen code."""
import os
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
