"""scripts/protocol_chain.sh runs the protocol's grids only from the frozen code."""
import os
import subprocess

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
