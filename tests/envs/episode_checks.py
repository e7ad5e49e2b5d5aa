"""Checks of rollouts that crossed the pipeline against what the engine actually did: a
multi-turn rollout's completion must be exactly the engine's tokens of each turn plus the
environment's reply tokens, with the loss mask and per-token provenance of those turns."""
import numpy as np

from pipelinerl_jax.envs.tools import decode_turn


def split_turns(r):
    """[(model ids slice, env ids slice)] per turn of a rollout with `turn_index`."""
    out = []
    for k in range(int(r.turn_index[-1]) + 1):
        at = np.nonzero(r.turn_index == k)[0]
        model = at[r.loss_mask[at] == 1]
        env = at[r.loss_mask[at] == 0]
        assert model.size and (not env.size or env[0] > model[-1]), f"turn {k} out of order"
        assert (np.diff(at) == 1).all()
        out.append((slice(int(model[0]), int(model[-1]) + 1),
                    slice(int(env[0]), int(env[-1]) + 1) if env.size else None))
    return out


def match_engine(r, returned, submitted, env_reply=None, tok=None):
    """The episode of group `r.group_id` the rollout is (its index), checking it token by
    token against the engine's completions (`returned`: request id -> Completion) and the
    requests it was sent (`submitted`: request id -> GenerationRequest). `env_reply(k, text)`
    -> the text the environment must have appended after model turn k of that text."""
    turns = split_turns(r)
    for i in range(r.group_size):
        rids = [f"{r.group_id}/e{i}/t{k}" for k in range(len(turns))]
        if not all(rid in returned for rid in rids):
            continue
        if not all(np.array_equal(r.completion_ids[m], returned[rid].token_ids)
                   for rid, (m, _) in zip(rids, turns)):
            continue
        for k, (rid, (m, e)) in enumerate(zip(rids, turns)):
            c = returned[rid]
            seq = np.concatenate([r.prompt_ids, r.completion_ids[:m.start]])
            np.testing.assert_array_equal(submitted[rid].prompt_ids, seq)  # token in
            np.testing.assert_array_equal(r.logp_behaviour[m], c.logp_behaviour)
            np.testing.assert_array_equal(r.version[m], c.version)  # per-turn versions
            np.testing.assert_array_equal(r.kv_version[m], c.kv_version)
            if e is not None:
                assert (r.logp_behaviour[e] == 0).all()
                if env_reply is not None:
                    want = tok.encode(env_reply(k, decode_turn(tok, c.token_ids)))
                    np.testing.assert_array_equal(r.completion_ids[e], want)
        assert f"{r.group_id}/e{i}/t{len(turns)}" not in submitted  # nothing after the end
        return i
    raise AssertionError(f"rollout of group {r.group_id} matches no episode the engine ran")
