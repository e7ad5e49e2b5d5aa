"""One tiny random init checkpoint shared by every run in this folder (saves a warm start)."""
import pytest

from tests.pipeline_testlib import make_init_checkpoint


@pytest.fixture(scope="session")
def init_ckpt(tmp_path_factory):
    return make_init_checkpoint(str(tmp_path_factory.mktemp("reliability_init") / "model"))
