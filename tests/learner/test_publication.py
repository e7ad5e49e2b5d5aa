"""Weight publication overlapped with the next (donating) train step."""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelinerl_jax.lag_control import LagController, LagLaw
from pipelinerl_jax.learner.loop import Shipper
from pipelinerl_jax.models import flat_params
from pipelinerl_jax.learner.publication import Publication
from pipelinerl_jax.transport.eval_versions import EvalInbox, EvalOutbox

_step = jax.jit(lambda p: jax.tree.map(lambda x: x + 1.0, p), donate_argnums=0)


def _params():
    return {"a": jnp.zeros((64, 64)), "b": {"c": jnp.zeros((8,))}}


def test_versions_in_order_each_with_its_own_params_despite_donation():
    shipped, release = [], threading.Event()

    def ship(version, host):
        release.wait(5.0)  # slower than the learner: the next step runs meanwhile
        flat = flat_params(host)
        shipped.append((version, float(flat["a"][0, 0]), float(flat["b/c"][0])))
        return flat

    pub = Publication(ship)
    params = _params()
    pub.submit(0, params)
    for v in range(1, 6):
        params = _step(params)  # donates the arrays the snapshot was taken from
        if v == 1:
            release.set()
        pub.submit(v, params)
    pub.close()
    assert shipped == [(v, float(v), float(v)) for v in range(6)]  # in order, none skipped


def test_submit_returns_while_the_publication_runs():
    started, release = threading.Event(), threading.Event()

    def ship(version, host):
        started.set()
        release.wait(5.0)
        return flat_params(host)

    pub = Publication(ship)
    pub.submit(0, _params())  # returns although ship cannot finish before `release`
    assert started.wait(60.0)
    assert not pub._pending.done()  # the learner goes on while version 0 ships
    release.set()
    assert float(pub.result()["a"][0, 0]) == 0.0
    pub.close()


def test_background_error_is_raised_in_the_learner_and_versions_must_increase():
    def ship(version, host):
        if version == 1:
            raise RuntimeError("sink down")
        return flat_params(host)

    pub = Publication(ship)
    pub.submit(0, _params())
    pub.submit(1, _params())
    with pytest.raises(RuntimeError, match="sink down"):
        pub.submit(2, _params())
    with pytest.raises(ValueError, match="published after"):
        pub.submit(1, _params())
    pub.abandon()  # logs, does not raise


def test_blocking_mode_ships_before_returning():
    shipped = []
    pub = Publication(lambda v, h: shipped.append(v) or flat_params(h), background=False)
    pub.submit(3, _params())
    assert shipped == [3]
    np.testing.assert_array_equal(pub.result()["b/c"], np.zeros(8))
    pub.close()


def test_on_device_snapshot_survives_the_donating_step():
    from pipelinerl_jax.learner import multihost
    params = _params()
    snap = multihost.snapshot_params(params, on_device=True)
    assert isinstance(snap["a"], jax.Array)
    _step(params)
    assert params["a"].is_deleted()
    host = jax.device_get(snap)
    np.testing.assert_array_equal(host["a"], np.zeros((64, 64)))


def test_a_version_is_announced_with_the_limit_handed_in_at_submit():
    """The publication thread reads nothing the learner's main thread goes on changing: the
    lag limit travels with the version, so a controller that moved on before the thread ran
    changes nothing it announces."""
    announced, published, gate = [], [], threading.Event()

    class Queue:
        def set_version(self, version, **announce):
            announced.append((version, announce.get("max_lag")))

    class Sink:
        def publish(self, version, flat, policy_version=None):
            published.append(version)

    shipper = Shipper(Queue(), Sink())
    pub = Publication(lambda v, host, announce: gate.wait(60.0) and shipper(v, host, announce))
    ctl = LagController(LagLaw(signal="ess", target=0.9, open_at=0.95, min_lag=0, max_lag=8,
                               window=2, patience=3, decrease=0.5, increase=1, min_tokens=10))
    ctl.limit = 3
    pub.submit(1, _params(), ctl.announce())
    ctl.limit = 1  # the main thread's next decision, before the thread has announced
    gate.set()
    pub.close()
    assert announced == [(1, 3)] and published == [1]
    assert pub.last_duration_s > 0.0  # collected on this thread by close()


def test_a_slow_evaluation_disk_never_holds_up_the_publication_thread(tmp_path):
    """The evaluator's HF-directory writes run on the outbox's own thread: with a disk that
    does not finish a write until released, the learner publishes three more versions (each
    `submit` waits for the previous publication, so a write on the publication thread would
    block the second one for ever), and every due version is written afterwards, in order."""
    written, writing, disk = [], threading.Event(), threading.Event()

    def slow_save(flat, directory):
        writing.set()
        assert disk.wait(60.0), "the disk was never released"
        written.append(int(flat["a"][0, 0]))

    class Queue:
        def set_version(self, version, **announce):
            pass

    class Sink:
        def publish(self, version, flat, policy_version=None):
            published.append(version)

    published = []
    outbox = EvalOutbox(str(tmp_path / "eval"), slow_save, eval_every=1, total_steps=3)
    pub = Publication(Shipper(Queue(), Sink(), evals=outbox))
    params = _params()
    for v in range(4):  # every version is due (eval_every=1)
        pub.submit(v, params, {})
        params = _step(params)
    pub.result()  # version 3 is out while version 0's write still waits for the disk
    assert published == [0, 1, 2, 3] and writing.wait(60.0) and written == []
    disk.set()
    outbox.finish(3, flat_params({"a": jnp.full((64, 64), 3.0)}))
    pub.close()
    assert written == [0, 1, 2, 3]
    assert EvalInbox(str(tmp_path / "eval")).final() == 3
