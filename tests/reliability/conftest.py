"""One tiny random init checkpoint shared by every run in this folder (saves a warm start)."""
import pytest

from tests.pipeline_testlib import make_init_checkpoint


@pytest.fixture(scope="session")
def init_ckpt(tmp_path_factory):
    return make_init_checkpoint(str(tmp_path_factory.mktemp("reliability_init") / "model"))


@pytest.fixture
def report(request):
    """`report(line)` prints a line to the terminal, past output capture (fuzz case counts)."""
    capman = request.config.pluginmanager.getplugin("capturemanager")

    def write(line):
        with capman.global_and_fixture_disabled():
            print("\n" + line, flush=True)
    return write
