"""Writes a run directory in the docs/metrics.md schema from a simulated run, so the
calibration reader can be tested against a run whose ground truth is known."""
import json
import os

import numpy as np


def write_run_dir(result, path, rng_seed=0, stats_per_engine=40, noise=0.02):
    s = result.setup
    st, tr = result.steps, result.trace
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(rng_seed)
    # The pipeline's config layout (pipelinerl_jax/run_config.py), with a decoy batch_size.
    json.dump({"mode": s.mode, "seed": 0, "max_lag": s.max_lag,
               "warm_start": {"batch_size": 64},
               "rollout": {"group_size": s.group_size, "prompt_len": s.prompt_len},
               "learner": {"batch_groups": s.batch_size}},
              open(os.path.join(path, "config.json"), "w"))
    dt = s.series_dt_s
    occ = result.series["slot_seconds"] / (dt * s.engines * s.slots)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        prev = 0.0
        for i in range(st["step"].size):
            bins = (result.series_t >= prev) & (result.series_t < st["sync_end_t"][i])
            f.write(json.dumps({
                "step": i + 1, "version": i + 1, "wall_time_s": st["sync_end_t"][i],
                "learner/step_time_s": st["end_t"][i] - st["start_t"][i],
                "learner/wait_time_s": st["start_t"][i] - prev,
                "learner/tokens": st["tokens"][i],
                "weight_sync/time_s": st["sync_end_t"][i] - st["end_t"][i],
                "sampler/occupancy": float(occ[bins].mean()) if bins.any() else 0.0,
                "lag/mean": st["lag_mean"][i], "start_lag/mean": st["start_lag_mean"][i],
            }) + "\n")
            prev = st["sync_end_t"][i]
    with open(os.path.join(path, "samples.jsonl"), "w") as f:
        for i in range(tr["step"].size):
            f.write(json.dumps({
                "step": int(tr["step"][i]), "response_length": int(tr["length"][i]),
                "reward": 0.0, "lag_mean": float(tr["lag_mean"][i]),
                "start_lag": int(tr["start_lag"][i]), "finish_reason": "stop",
                "engine_id": f"e{int(tr['group'][i]) % s.engines}",
                "gen_time_s": float(tr["finish_t"][i] - tr["start_t"][i])}) + "\n")
    # Engine reports: decode step time at the occupancy of the moment, with the cache a
    # running sequence holds on average, and multiplicative measurement noise.
    m1 = tr["length"].mean()
    ctx = s.prompt_len + (tr["length"].astype(float) ** 2).mean() / (2 * m1)
    with open(os.path.join(path, "engine_stats.jsonl"), "w") as f:
        for e in range(s.engines):
            for k in range(stats_per_engine):
                active = int(rng.integers(1, s.slots + 1))
                step = float(s.decode.step_time(active, active * ctx)) * (1 + noise * rng.standard_normal())
                f.write(json.dumps({
                    "time_s": float(k), "engine_id": f"e{e}", "occupancy": active / s.slots,
                    "active_slots": active, "num_slots": s.slots,
                    "tokens_per_s": active / step, "decode_step_time_s": step,
                    "version": k}) + "\n")
