"""The evaluator role builds its engine with the run's backend, through the factory the rollout
workers use (a backend registered for this test stands in for JAX or SGLang), sized by
`eval_view`; it installs each handed-over version by its directory and records exactly what
that version's weights answer, then ends once the learner's last version is done."""
import os
import threading

import numpy as np
import pytest

from pipelinerl_jax.config_checks import ConfigError
from pipelinerl_jax.envs import build_task
from pipelinerl_jax.metrics import read_jsonl
from pipelinerl_jax.rollout import factory
from pipelinerl_jax.rollout.eval_role import run_evaluator
from pipelinerl_jax.transport.eval_versions import EvalInbox, EvalOutbox, eval_root
from pipelinerl_jax.rollout.evaluator import eval_slots, eval_view
from pipelinerl_jax.run_config import base_config, validate
from pipelinerl_jax.tokenizer import get_tokenizer
from pipelinerl_jax.transport.weight_version import WeightVersion
from pipelinerl_jax.records import Completion


class _Engine:
    """Weights 'v' answer the first v eval problems right (the task's own demonstration) and
    the others with an empty answer, so a record's accuracy says which version answered."""

    def __init__(self, cfg, calls):
        self.task, self.tok = build_task(cfg), get_tokenizer(cfg.tokenizer)
        problems = self.task.eval_problems(cfg.learner.eval_size)
        self.rank = {tuple(self.tok.encode_prompt(p.prompt)): (i, p)
                     for i, p in enumerate(problems)}
        self.version, self.calls, self.closed = -1, calls, False
        self.serves = WeightVersion("full")

    def update_weights(self, weights, version, *, wait=True, timeout=None, allow_older=False):
        assert weights.kind == "full" and weights.version == version  # the directory's message
        with open(os.path.join(weights.path, "weights.txt")) as f:
            assert int(f.read()) == version
        self.calls.append(("update_weights", version))
        self.version = version

    def generate(self, requests, timeout=None):
        out = []
        for r in requests:
            i, p = self.rank[tuple(int(t) for t in r.prompt_ids)]
            text = self.task.demonstration(p) if i < self.version else ""
            ids = np.asarray(self.tok.encode(text) + [self.tok.eos_id], np.int32)
            z = np.zeros(len(ids), np.int32)
            out.append(Completion(r.request_id, 0, r.prompt_ids, ids,
                                  np.zeros(len(ids), np.float32), z + self.version,
                                  z + self.version, "stop", self.version))
        return out

    def close(self):
        self.closed = True


def _save_version(flat, directory):  # what the learner's outbox would write, in miniature
    with open(os.path.join(directory, "weights.txt"), "w") as f:
        f.write(str(int(flat["v"])))


def test_the_role_evaluates_with_the_configured_backend_until_the_last_version(
        tmp_path, monkeypatch):
    cfg = base_config()
    cfg.learner.eval_size, cfg.learner.eval_every, cfg.learner.total_steps = 4, 2, 3
    calls, built = [], []

    def make_engine(run_cfg, init_checkpoint, index, workdir):
        built.append((run_cfg.engine.max_slots, run_cfg.engine.kv_budget_tokens,
                      run_cfg.rollout.num_workers, init_checkpoint, index))
        engine = _Engine(run_cfg, calls)
        built.append(engine)
        return engine
    jax_row = factory.backend("jax")
    monkeypatch.setitem(factory.BACKENDS, "test", factory.Backend(
        "engine", jax_row.config, lambda cfg, selected: None, make_engine, "stream"))
    cfg.sampler.kind = "test"
    cfg.rollout.num_workers = 3

    workdir = str(tmp_path)
    outbox = EvalOutbox(eval_root(workdir), _save_version, 2, 3)
    for v in range(4):  # what the learner hands over: 0, 2, and 3 (its last)
        outbox.put(v, {"v": np.int32(v)})
    outbox.finish(3, {"v": np.int32(3)})
    out = run_evaluator(cfg, workdir, "INIT", threading.Event())

    assert out["evaluator"] == "finished" and out["evaluated"] == [0, 2, 3]
    assert built[0] == (eval_slots(cfg), 0, 1, "INIT", 0)  # eval_view, through the factory
    assert built[1].closed
    assert calls == [("update_weights", 0), ("update_weights", 2), ("update_weights", 3)]
    records = read_jsonl(os.path.join(workdir, "eval.jsonl"))
    assert [(r["step"], r["version"], r["eval/accuracy"]) for r in records] == \
        [(0, 0, 0.0), (2, 2, 0.5), (3, 3, 0.75)]
    assert not EvalInbox(eval_root(workdir)).pending()


def test_a_stopped_role_leaves_what_it_did_not_evaluate(tmp_path):
    inbox = EvalInbox(eval_root(str(tmp_path)))
    outbox = EvalOutbox(inbox.root, _save_version, 1, 5)
    outbox.put(1, {"v": np.int32(1)})
    outbox.wait()
    stop = threading.Event()
    stop.set()
    from pipelinerl_jax.rollout.eval_role import EvalLoop
    assert EvalLoop(inbox, lambda p, v: {}, lambda v, r: None).run(stop) is False
    assert [v for v, _ in inbox.pending()] == [1] and inbox.final() is None


def test_eval_view_of_sglang_samples_on_the_eval_servers():
    cfg = base_config()
    cfg.sampler.kind = "sglang"
    cfg.sglang.urls = ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    cfg.sglang.eval_urls = ("http://127.0.0.1:30002",)
    view = eval_view(cfg)
    assert tuple(view.sglang.urls) == ("http://127.0.0.1:30002",)
    from pipelinerl_jax.rollout.sglang_config import validate_sglang_config
    validate_sglang_config(view.sglang, required=True, num_workers=1)  # as its engine checks
    assert view.rollout.num_workers == 1 and tuple(cfg.sglang.urls)[1].endswith("30001")
    # LoRA: the evaluator is handed the adapters (its engine serves what the run publishes)
    cfg.lora.enabled = True
    assert eval_view(cfg).lora.enabled is True


@pytest.mark.parametrize("eval_urls,eval_every,message", [
    ((), 5, "servers of its own"),
    (("http://127.0.0.1:30000",), 5, "also in sglang.urls"),
    (("nonsense",), 5, "sglang.eval_urls"),
])
def test_sglang_evaluation_needs_servers_of_its_own(eval_urls, eval_every, message):
    cfg = base_config()
    cfg.sampler.kind = "sglang"
    cfg.sglang.urls = ("http://127.0.0.1:30000",)
    cfg.sglang.eval_urls = eval_urls
    cfg.learner.eval_every = eval_every
    with pytest.raises(ConfigError, match="sglang.eval_urls") as e:
        validate(cfg)
    assert message in str(e.value)


def test_sglang_without_evaluation_needs_no_eval_servers():
    cfg = base_config()
    cfg.sampler.kind = "sglang"
    cfg.sglang.urls = ("http://127.0.0.1:30000",)
    cfg.learner.eval_every = 0
    validate(cfg)
