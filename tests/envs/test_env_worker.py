"""`RolloutWorker` in environment mode (the task is an `EnvTask`): groups of episodes through
the same admission control, advantages over episodes, one rollout per episode with its loss
mask and turn index, and dynamic sampling / failed groups replaced so batches stay full."""
import numpy as np

from pipelinerl_jax.envs import CalculatorTask
from pipelinerl_jax.rollout.worker import RolloutWorker
from pipelinerl_jax.run_config import base_config, resolve, validate
from pipelinerl_jax.transport import codec
from tests.envs.scripted_engine import ScriptedEngine


class FakeQueue:
    """The two calls a worker makes: stats() and put_group(); every group is checked the
    way the queue server checks it."""

    def __init__(self, vocab_size):
        self.vocab_size, self.groups = vocab_size, []

    def stats(self):
        return {"server_id": "q", "learner_version": 0}

    def put_group(self, rollouts):
        for r in rollouts:
            codec.validate_rollout(codec.rollout_to_pb(r), codec.Limits(
                vocab_size=self.vocab_size, max_completion_tokens=128), max_version=0)
        self.groups.append(rollouts)


class FlakyCalculator(CalculatorTask):
    """Every 5th problem's environment cannot be built: the whole group fails."""

    def make_env(self, problem):
        if int(problem.id.rsplit("i", 1)[1]) % 5 == 4:
            raise RuntimeError("no calculator today")
        return super().make_env(problem)


def demo_policy(task, tok):
    """Plays the demonstration of the problem in the prompt when the group's sequence number
    is odd and episode 0 is asked, else answers 0 at once: even groups are all wrong
    (all-equal rewards), odd groups have one right episode."""
    def policy(req, i):
        rid = req.request_id  # w0-<nonce>-<seq>/e<i>/t<k>
        seq = int(rid.split("/")[0].rsplit("-", 1)[1])
        episode, turn = int(rid.split("/")[1][1:]), int(rid.split("/")[2][1:])
        text = tok.decode(req.prompt_ids)
        if seq % 2 == 0 or episode != 0:
            return tok.encode("0") + [tok.eos_id]
        problem_prompt = text.split("=")[0] + "="
        steps = policy.steps[problem_prompt]
        turns = [f"calc {a}{op}{b};" for a, op, b, _ in steps]
        if turn < len(turns):
            return tok.encode(turns[turn])
        return tok.encode(str(steps[-1][3])) + [tok.eos_id]
    policy.steps = {}
    return policy


def make_worker(tok, task, dynamic_sampling=True):
    cfg = base_config()
    cfg.task.name = "calculator"
    cfg.env.dynamic_sampling = dynamic_sampling
    cfg.env.max_episode_tokens = 128
    cfg.model.max_seq_len = 128
    cfg.rollout.group_size = 3
    cfg.learner.batch_groups = 4
    cfg.max_lag = 1
    validate(cfg)
    cfg = resolve(cfg)
    policy = demo_policy(task, tok)
    # the policy looks a problem's steps up by its prompt
    for p in _take(task.problems(cfg.seed * 1009), 200):
        policy.steps[p.prompt] = p.meta["steps"]
    engine = ScriptedEngine(policy, vocab_size=tok.vocab_size, max_seq_len=128, delay=0.001)
    client = FakeQueue(tok.vocab_size)
    return RolloutWorker(cfg, engine, task, tok, client), client


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_dynamic_sampling_and_failures_are_replaced_so_batches_stay_full(tok):
    worker, client = make_worker(tok, FlakyCalculator())
    slots = worker.share * (worker.max_lag + 1)  # batches 0 and 1 at learner version 0
    try:
        worker.run(max_seconds=30, max_groups=slots)
    finally:
        worker.close()
    c = worker.counts
    assert c["groups_put"] == slots == len(client.groups), dict(c)
    assert not worker.can_admit()  # every place of batches 0 and 1 filled, none freed
    assert c["groups_dropped_equal_rewards"] >= 1 and c["groups_failed"] >= 1, dict(c)
    assert c["started"] == slots + c["groups_dropped_equal_rewards"] + c["groups_failed"]
    for group in client.groups:
        rewards = [r.reward for r in group]
        assert len(group) == 3 and len(set(rewards)) > 1  # no all-equal group got through
        assert len({r.group_id for r in group}) == 1 and group[0].group_size == 3
        adv = np.asarray([r.advantage for r in group])
        np.testing.assert_allclose(adv, (rewards - np.mean(rewards)) / (np.std(rewards) + 1e-6),
                                   rtol=1e-4, atol=1e-5)  # GRPO over the group's episodes


def test_rollouts_are_whole_episodes_with_mask_and_turns(tok):
    worker, client = make_worker(tok, CalculatorTask(), dynamic_sampling=False)
    try:
        worker.run(max_seconds=30, max_groups=4)
    finally:
        worker.close()
    multi = [r for g in client.groups for r in g if r.reward == 1.0]
    assert multi, "no correct episode"
    for r in multi:
        text = tok.decode(r.completion_ids)
        model = tok.decode(r.completion_ids[r.loss_mask == 1])
        env = tok.decode(r.completion_ids[r.loss_mask == 0])
        assert text.startswith("calc ") and model.startswith("calc ") and env.startswith("=")
        turns = int(r.metrics["turns"])
        assert r.turn_index[-1] == turns - 1 and (np.diff(r.turn_index) >= 0).all()
        assert r.metrics["end/done"] == 1.0 and r.finish_reason == "stop"
        assert (r.logp_behaviour[r.loss_mask == 0] == 0).all()
    wrong = [r for g in client.groups for r in g if r.reward == 0.0]
    assert all(r.loss_mask.tolist() == [1, 1] for r in wrong)  # '0' <eos>
    stats = worker.source.stats()["env"]  # the episode runner's counters
    assert stats["episodes_finished"] >= 12 and stats["end.done"] >= 12
