"""Held-out evaluation off the learner's step: `run_learner` hands the due versions (0, every
`eval_every`, the last) to an `EvalOutbox` and trains on; an `EvalLoop` (the evaluator role's
loop) evaluates them elsewhere. Event ordering, no wall-clock: the learner publishes newer
versions while an evaluation is still running, every due version is evaluated (the last one
included) with the learner's own weights (under lag injection too), and the records land in
the run's metrics with their version."""
import glob
import threading

import numpy as np

from pipelinerl_jax.learner import loop
from pipelinerl_jax.metrics import EVAL_LOG, MetricsWriter, read_metrics
from pipelinerl_jax.models import flat_params, from_pretrained, save_pretrained
from pipelinerl_jax.models.factory import build_model
from pipelinerl_jax.rollout.eval_role import EvalLoop
from pipelinerl_jax.transport.eval_versions import EvalInbox, EvalOutbox, due, eval_root
from pipelinerl_jax.run_config import base_config
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport.weight_sink import hf_checkpoint_writer
from pipelinerl_jax.records import Rollout

WAIT_S = 300.0  # only reached when the learner blocks on an evaluation: the test then fails


class _Batch:
    def __init__(self, i, rollouts):
        self.batch_id, self.rollouts = f"b{i}", rollouts
        self.delivery_count, self.redelivered = 1, False


class _Queue:
    """A batch of one group at every call."""

    def __init__(self, vocab):
        self.vocab, self.calls = vocab, 0

    def get_batch(self, num_groups, timeout_s, learner_version=None, **announce):
        self.calls += 1
        rng = np.random.default_rng(self.calls)
        return _Batch(self.calls, [
            Rollout(prompt_ids=rng.integers(3, self.vocab, 4).astype(np.int32),
                    completion_ids=rng.integers(3, self.vocab, 6).astype(np.int32),
                    logp_behaviour=-rng.uniform(0.5, 2.0, 6).astype(np.float32),
                    version=np.zeros(6, np.int32), kv_version=np.zeros(6, np.int32),
                    reward=float(k), advantage=float(k) - 0.5, group_id=f"g-{self.calls}",
                    group_size=2, finish_reason="stop", metrics={"correct": float(k)})
            for k in range(2)])

    def wait_ready(self, timeout):
        pass

    def set_version(self, version, **announce):
        return version

    def ack(self, batch_ids):
        return len(batch_ids)


class _Sink:
    """Records what goes out to the samplers, in order; `on_publish(version)` after each."""

    def __init__(self, events, on_publish=lambda v: None):
        self.events, self.on_publish = events, on_publish
        self.params = {}  # stream version -> (policy version, copy of the flat params)

    def publish(self, version, params, policy_version=None):
        self.params[version] = (policy_version, {k: np.array(v) for k, v in params.items()})
        self.events.append(("published", version))
        self.on_publish(version)


def _setup(tmp_path, total_steps, eval_every):
    cfg = base_config()
    cfg.learner.total_steps, cfg.learner.batch_groups = total_steps, 1
    cfg.learner.checkpoint_every, cfg.learner.eval_every = 100, eval_every
    cfg.rollout.group_size = 2
    cfg.sampling.max_new_tokens, cfg.model.max_seq_len = 8, 16
    cfg.learner.optimizer.learning_rate = 1e-2  # versions visibly differ
    tok = get_tokenizer(cfg.tokenizer)
    init = str(tmp_path / "init")
    save_pretrained(build_model(cfg.model, tok.vocab_size), init)
    workdir = str(tmp_path / "run")
    outbox = EvalOutbox(eval_root(workdir), hf_checkpoint_writer(init, cfg.model.dtype,
                                                                 cfg.model.param_dtype),
                        eval_every, total_steps)
    return cfg, tok, init, workdir, outbox


def _flat_of(path):
    return {k: np.asarray(v) for k, v in flat_params(from_pretrained(path)).items()}


def test_learner_trains_on_while_a_version_is_evaluated_and_the_last_is_evaluated(tmp_path):
    cfg, tok, init, workdir, outbox = _setup(tmp_path, total_steps=5, eval_every=2)
    events = []
    all_out = threading.Event()  # the learner published its last version
    sink = _Sink(events, lambda v: v == 5 and all_out.set())
    seen = {}

    def evaluate(path, version):  # the evaluator: version 0's evaluation outlasts training
        events.append(("eval_start", version))
        seen[version] = _flat_of(path)
        if version == 0:
            assert all_out.wait(WAIT_S), "the learner waited for the evaluation of version 0"
        events.append(("eval_end", version))
        return {"eval/accuracy": version / 10, "eval/time_s": 0.0}

    writer = MetricsWriter(workdir, EVAL_LOG, tb_suffix=".evaluator")
    eval_loop = EvalLoop(EvalInbox(eval_root(workdir)), evaluate, writer.write, poll_s=0.01)
    result = {}
    thread = threading.Thread(target=lambda: result.update(done=eval_loop.run()))
    thread.start()
    try:
        out = loop.run_learner(cfg, workdir, init, batches=_Queue(tok.vocab_size),
                               weight_sink=sink, evals=outbox)
    finally:
        all_out.set()
        thread.join(WAIT_S)
    writer.close()
    assert out == {"step": 5, "version": 5}
    assert result == {"done": True}  # it ended by itself, once the last version was done
    # Versions 1..5 went out while version 0 was being evaluated.
    assert events.index(("published", 5)) < events.index(("eval_end", 0))
    # Every due version once, oldest first; the last (5, not a multiple of 2) included.
    assert eval_loop.evaluated == [v for v in range(6) if due(v, 2, 5)] == [0, 2, 4, 5]
    assert not EvalInbox(eval_root(workdir)).pending()  # handed-over directories forgotten
    # The weights evaluated are the versions the samplers got.
    for v in (0, 2, 4, 5):
        for name, value in sink.params[v][1].items():
            np.testing.assert_allclose(seen[v][name], value, rtol=1e-6, atol=0)
    assert any(not np.array_equal(seen[0][k], seen[5][k]) for k in seen[0])
    # The records join the learner's rows of their step, with their version.
    rows = {r["step"]: r for r in read_metrics(workdir)}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]
    for v in (0, 2, 4, 5):
        assert rows[v]["eval/accuracy"] == v / 10 and rows[v]["version"] == v
        assert "wall_time_s" in rows[v]
    assert all("eval/accuracy" not in rows[v] for v in (1, 3))
    assert "reward/mean" in rows[4]  # merged into the learner's row, not beside it
    assert glob.glob(f"{workdir}/tb/events.out.tfevents.*.evaluator")


def test_under_lag_injection_the_learners_own_weights_are_evaluated(tmp_path):
    """Stream version v carries policy v-1 (fixed lag 1); the evaluation of version v is of the
    learner's version v, which went out as stream version v+1, and the last version, which
    never goes out, is evaluated too."""
    cfg, tok, init, workdir, outbox = _setup(tmp_path, total_steps=3, eval_every=2)
    cfg.lag_injection.enabled, cfg.lag_injection.kind, cfg.lag_injection.k = True, "fixed", 1
    sink = _Sink([])
    loop.run_learner(cfg, workdir, init, batches=_Queue(tok.vocab_size), weight_sink=sink,
                     evals=outbox)
    assert [sink.params[v][0] for v in (1, 2, 3)] == [0, 1, 2]
    seen = {}

    def evaluate(path, version):
        seen[version] = _flat_of(path)
        return {"eval/accuracy": 0.0}
    eval_loop = EvalLoop(EvalInbox(eval_root(workdir)), evaluate, lambda v, r: None, poll_s=0)
    assert eval_loop.run()
    assert eval_loop.evaluated == [0, 2, 3]
    for name, value in sink.params[3][1].items():  # policy 2 went out as stream version 3
        np.testing.assert_allclose(seen[2][name], value, rtol=1e-6, atol=0)
    assert any(not np.allclose(seen[3][k], sink.params[3][1][k]) for k in seen[3])


def test_eval_every_zero_hands_nothing_over_and_writes_no_step_zero_row(tmp_path):
    cfg, tok, init, workdir, _ = _setup(tmp_path, total_steps=2, eval_every=0)
    loop.run_learner(cfg, workdir, init, batches=_Queue(tok.vocab_size),
                     weight_sink=_Sink([]), evals=None)
    assert [r["step"] for r in read_metrics(workdir)] == [1, 2]
    assert not due(0, 0, 2) and not due(2, 0, 2)
