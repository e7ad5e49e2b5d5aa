"""Synthetic run directories in the docs/metrics.md schema, for testing the results tables and
the figures without training anything. The numbers follow simple laws (accuracy rises with
steps and falls with lag; sync is slower per step) so every figure has something to draw."""
import json
import os

import numpy as np

BUCKETS = ("0", "1", "2", "3-4", "5-8", "9+")


def _bucket(lag):
    return 0 if lag <= 0 else 1 if lag == 1 else 2 if lag == 2 else 3 if lag <= 4 else \
        4 if lag <= 8 else 5


def _config(mode="async", max_lag=4, loss="tis", kv="keep", injected=False, k=0, seed=0,
            cap=None, minibatches=1, steps=12, lr=1e-4, form=None, loss_hp=None):
    return {"mode": mode, "max_lag": max_lag, "seed": seed,
            "loss": {"name": loss, "cap": cap, **({"form": form} if form else {}),
                     **(loss_hp or {})}, "engine": {"kv_policy": kv},
            "lag_injection": {"enabled": injected, "kind": "fixed", "k": k, "max_k": k},
            "learner": {"batch_groups": 2, "total_steps": steps, "eval_every": 4,
                        "minibatches": minibatches, "optimizer": {"learning_rate": lr}},
            "rollout": {"group_size": 4}}


def write_run(path, *, mode="async", max_lag=4, loss="tis", kv="keep", injected=False, k=0,
              seed=0, steps=12, spec=True, labels=None, cap=None, minibatches=1, acc_fn=None,
              kl_fn=None, ess_fn=None, lr=1e-4, form=None, lag=None, loss_hp=None):
    """One run directory; returns its path. `acc_fn(step)`, `kl_fn(step)`, `ess_fn(step)`
    replace the default laws of the accuracy, KL k3 and ESS; `lag`, the lag every trained
    token has (default: the injected one, 0 in sync, min(max_lag, 2) in async); `loss_hp`,
    more of the loss's hyperparameters (e.g. {"behave_cap": 2})."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed * 101 + k + 7 * max_lag + len(loss))
    cfg = _config(mode, max_lag, loss, kv, injected, k, seed, cap, minibatches, steps, lr, form,
                  loss_hp)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    if spec:
        labels = labels or {"seed": str(seed)}
        name = ",".join(f"{a}={b}" for a, b in sorted(labels.items()))
        cell = ",".join(f"{a}={b}" for a, b in sorted(labels.items()) if a != "seed") or "all"
        with open(os.path.join(path, "spec.json"), "w") as f:
            json.dump({"name": name, "labels": labels, "cell": cell, "experiment": cfg}, f)
        with open(os.path.join(path, "status.json"), "w") as f:
            json.dump({"status": "done"}, f)
    step_s = 3.0 if mode == "sync" else 1.5
    if lag is None:
        lag = k if injected else (0 if mode == "sync" else min(max_lag, 2))
    t0 = 1.7e9
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 0, "version": 0, "wall_time_s": 1.0,
                            "eval/accuracy": 0.3}) + "\n")
        for s in range(1, steps + 1):
            acc = min(0.95, 0.3 + 0.04 * s / (1 + 0.1 * lag)) + rng.normal(0, 0.01)
            if acc_fn is not None:
                acc = acc_fn(s)
            row = {"step": s, "version": s, "wall_time_s": 1.0 + step_s * s,
                   "learner/step_time_s": 0.8, "learner/wait_time_s": step_s - 0.9,
                   "weight_sync/time_s": 0.1, "learner/tokens": 200 + int(rng.integers(50)),
                   "learner/skipped_steps": 0, "reward/mean": acc, "accuracy": acc,
                   "lag/mean": float(lag), "lag/max": lag, "start_lag/mean": float(lag), "kv_lag/mean": lag + (kv == "keep"),
                   "lag/hist": [0] * lag + [200], "loss/loss": -0.1,
                   "loss/ess": ess_fn(s) if ess_fn else 1 / (1 + 0.05 * lag),
                   "loss/clip_frac": 0.01 * lag,
                   "loss/kl_k3": kl_fn(s) if kl_fn else 0.001 * (1 + lag),
                   "sampler/occupancy": 0.4 if mode == "sync" else 0.8}
            b = _bucket(min(lag, s))
            for i, name in enumerate(BUCKETS):
                on = i == b
                row[f"loss/lag_{name}/tokens"] = 200.0 if on else 0.0
                row[f"loss/lag_{name}/ess"] = row["loss/ess"] if on else 0.0
                row[f"loss/lag_{name}/clip_frac"] = row["loss/clip_frac"] if on else 0.0
                row[f"loss/lag_{name}/kl_k3"] = row["loss/kl_k3"] if on else 0.0
            if s % 4 == 0:
                row["eval/accuracy"] = acc
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(path, "engine_stats.jsonl"), "w") as f:
        for i in range(int(step_s * steps) + 2):
            occ = 0.4 + 0.4 * (mode == "async") + 0.05 * rng.standard_normal()
            f.write(json.dumps({"time_s": t0 + i, "engine_id": "jax-0", "version": 0 if i else -1,
                                "occupancy": float(np.clip(occ, 0, 1)),
                                "active_slots": 6.0 * occ + 1, "num_slots": 8,
                                "decode_step_time_s": 0.01 + 0.001 * occ,
                                "tokens_per_s": 500.0}) + "\n")
    with open(os.path.join(path, "samples.w0.jsonl"), "w") as f:
        for i in range(steps * 8):
            f.write(json.dumps({"time_s": t0 + i * 0.2, "engine_id": "jax-0",
                                "response_length": int(rng.lognormal(2.5, 0.6)) + 1,
                                "reward": 1.0, "correct": True, "finish_reason": "stop",
                                "start_version": 0, "gen_time_s": 1.0,
                                "queue_time_s": 0.0}) + "\n")
    return path


def write_results(root):
    """A results directory every figure can draw from, plus one malformed run."""
    runs = os.path.join(root, "runs")
    for seed in (0, 1):
        write_run(os.path.join(runs, f"sync_s{seed}"), mode="sync", max_lag=0, seed=seed,
                  labels={"schedule": "sync", "seed": str(seed)})
        for m in (1, 4):
            for kv in ("keep", "recompute"):
                write_run(os.path.join(runs, f"async{m}_{kv}_s{seed}"), max_lag=m, kv=kv,
                          seed=seed, labels={"schedule": f"async{m}", "kv": kv,
                                             "seed": str(seed)})
        for loss in ("reinforce", "tis"):
            for k in (0, 2, 8):
                write_run(os.path.join(runs, f"inj_{loss}_{k}_s{seed}"), loss=loss,
                          injected=True, k=k, seed=seed,
                          labels={"loss": loss, "lag": str(k), "seed": str(seed)})
        # The published-phenomenon arms (configs/repro): runs picked by their config.
        for label, loss, extra, lags in (("tis_nocap", "tis", {"cap": 1e6}, (0, 3)),
                                         ("ppo", "ppo", {}, (0, 3)), ("m2po", "m2po", {}, (0, 32)),
                                         ("tis", "tis", {}, (32,)),
                                         ("dppo_mb4", "decoupled_ppo", {"minibatches": 4}, (0, 2)),
                                         ("ppo_mb4", "ppo", {"minibatches": 4}, (0, 2))):
            for k in lags:
                write_run(os.path.join(runs, f"inj_{label}_{k}_s{seed}"), loss=loss,
                          injected=True, k=k, seed=seed, **extra,
                          labels={"loss": label, "lag": str(k), "seed": str(seed)})
        # configs/ablate/staleness.py:lowlr: a quarter of the learning rate, so a sixteenth of
        # the drift per version; the accuracy drop follows the drift, not the lag.
        for loss in ("reinforce", "tis"):
            for k in (0, 2, 8):
                drift = 0.001 * (1 + k) / 16
                write_run(os.path.join(runs, f"inj_{loss}_{k}_lowlr_s{seed}"), loss=loss,
                          injected=True, k=k, seed=seed, lr=2.5e-5,
                          kl_fn=lambda s, d=drift: d,
                          acc_fn=lambda s, kk=k, sd=seed: 0.3 + 0.02 * s / (1 + 0.1 * kk / 16)
                          + 0.002 * sd,
                          labels={"loss": loss, "lag": str(k), "lr": "2.5e-05",
                                  "seed": str(seed)})
        # configs/repro/m2po_stale.py:long: its own axis (steps=16) keeps it apart.
        for loss in ("m2po", "tis"):
            for k in (0, 64):
                write_run(os.path.join(runs, f"inj_{loss}_long_{k}_s{seed}"), loss=loss,
                          injected=True, k=k, seed=seed, steps=16,
                          labels={"loss": loss, "lag": str(k), "steps": "16",
                                  "seed": str(seed)})
    bad = os.path.join(runs, "broken_run")
    os.makedirs(bad, exist_ok=True)
    with open(os.path.join(bad, "metrics.jsonl"), "w") as f:
        f.write("{not json\n")
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({"mode": "async"}, f)
    return root
