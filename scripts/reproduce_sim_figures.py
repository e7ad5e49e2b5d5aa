"""Reproduces the systems figures of the "Efficient RL" talk (Applied Compute) with the
simulator, in the talk's setting (`configs/sim/talk.py`): one command, eight PNGs.

  PYTHONPATH=. python scripts/reproduce_sim_figures.py --out=docs/figures/sim

Prints one JSON line with the numbers each figure shows (captions in docs/sim.md).
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from configs.sim import agentic, talk  # noqa: E402
from pipelinerl_jax.sim import plots  # noqa: E402
from pipelinerl_jax.sim.sim_config import build_setup  # noqa: E402
from pipelinerl_jax.sim.hardware import ACCELERATORS, MODELS  # noqa: E402
from pipelinerl_jax.sim.latency import DecodeLatency  # noqa: E402
from pipelinerl_jax.sim.pipeline import simulate  # noqa: E402
from pipelinerl_jax.sim.sweep import sweep_split  # noqa: E402

_OUT = flags.DEFINE_string("out", "docs/figures/sim", "Folder for the PNGs.")
_STEPS = flags.DEFINE_integer("steps", 60, "Learner steps per simulated run.")
_ONLY = flags.DEFINE_list("only", [], "Figure functions to run (e.g. fig9_multiturn); all if empty.")


def cfg(mode, **over):
    c = talk.get_config(mode)
    c.steps = _STEPS.value
    for k, v in over.items():
        node = c
        *path, leaf = k.split("__")
        for p in path:
            node = node[p]
        node[leaf] = v
    return c


def run(mode, **over):
    return simulate(build_setup(cfg(mode, **over)))


def fig1_completion(out, facts):
    r = run("sync", steps=1, output__trace_steps=1)
    t = np.sort(r.sync_completion[0])
    p99, last = np.quantile(t, 0.99), t.max()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(t, np.arange(1, t.size + 1) / t.size * 100, lw=1.5)
    ax.axvline(p99, color="C1", ls="--", lw=1, label=f"99% done at {p99:.0f} s")
    ax.axvline(last, color="C3", ls="--", lw=1, label=f"last sample at {last:.0f} s (+{last - p99:.0f} s)")
    ax.axvspan(p99, last, color="C3", alpha=0.08)
    ax.set(xlabel="seconds since the step started", ylabel="samples finished (%)",
           title=f"one synchronous step: {t.size} samples (40 prompts x 32)")
    ax.legend(fontsize=8, loc="center right")
    plots.save(fig, os.path.join(out, "fig1_sync_completion.png"))
    facts["fig1"] = {"p50_s": float(np.median(t)), "p99_s": float(p99), "max_s": float(last)}


def fig2_sync_throughput(out, facts):
    r = run("sync", steps=5)
    rt = plots.rates(r)
    fig, ax = plt.subplots(figsize=(8, 3.4))
    ax.plot(rt["t"], rt["tokens_per_s"] / 1e3, lw=0.9, label="generation throughput")
    st = r.steps
    for a, b in zip(st["start_t"], st["sync_end_t"]):
        ax.axvspan(a, b, color="C2", alpha=0.15, lw=0)
    ax.plot([], [], color="C2", alpha=0.3, lw=6, label="training + weight sync")
    ax.set(xlabel="time (s)", ylabel="k tokens/s (8 devices)",
           title="synchronous RL: throughput collapses while stragglers finish")
    ax.legend(fontsize=8)
    plots.save(fig, os.path.join(out, "fig2_sync_throughput.png"))
    s = r.summary()
    facts["fig2"] = {"sampler_occupancy": s["sampler_occupancy"],
                     "peak_k_tokens_per_s": float(rt["tokens_per_s"].max() / 1e3),
                     "mean_k_tokens_per_s": s["decode_tokens_per_s"] / 1e3}


def fig3_batch_size(out, facts):
    sync = run("sync", steps=6)
    asyn = run("async", steps=30, max_lag=None, split__samplers=3, split__trainers=5)
    end = sync.steps["sync_end_t"][-1]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for r, name in ((sync, "sync (8 samplers, then 8 trainers)"), (asyn, "async (3 samplers, 5 trainers)")):
        rt = plots.rates(r)
        keep = rt["t"] < end
        ax.plot(rt["t"][keep], rt["batch"][keep], lw=0.9, label=name)
    ax.set(xlabel="time (s)", ylabel="running sequences per engine",
           title="generation batch size: sync decays each step, async stays full")
    ax.legend(fontsize=8)
    plots.save(fig, os.path.join(out, "fig3_batch_size.png"))
    facts["fig3"] = {"sync_occupancy": sync.summary()["sampler_occupancy"],
                     "async_occupancy": asyn.summary()["sampler_occupancy"]}


def fig4_decode_latency(out, facts):
    model = MODELS["qwen3-8b"]
    b = np.unique(np.logspace(0, 13, 200, base=2).astype(int))
    ctx = 128  # short contexts: the weights, not the KV cache, dominate memory traffic
    fig, ax = plt.subplots(figsize=(7, 3.8))
    knees = {}
    for name in ("tpu-v5e", "h100", "h200"):
        acc = ACCELERATORS[name]
        if name == "tpu-v5e":  # 16 GB: an 8B model needs a 4-chip engine
            lat, label = DecodeLatency.roofline(acc, model, tp=4), "TPU v5e x4"
        else:
            lat, label = DecodeLatency.roofline(acc, model), name.upper()
        ax.plot(b, lat.step_time(b, b * ctx) * 1e3, lw=1.5, label=label)
        knees[label] = float(lat.knee_batch(ctx))
    lat = DecodeLatency.roofline(ACCELERATORS["h100"], model)
    ax.plot(b, lat.memory_time(b * ctx) * 1e3, "k:", lw=0.8, label="H100 memory bound")
    ax.plot(b, lat.compute_time(b, b * ctx) * 1e3, "k--", lw=0.8, label="H100 compute bound")
    ax.plot(b, lat.step_time(b, b * 4096) * 1e3, color="C1", ls="-.", lw=1,
            label="H100, 4,096 cached tokens/seq")
    ax.set(xscale="log", yscale="log", xlabel=f"batch size (sequences, {ctx} cached tokens each)",
           ylabel="decode step (ms)", ylim=(3, None),
           title="Qwen3-8B decode latency: flat (memory-bound), then rising (compute-bound)")
    ax.title.set_fontsize(10)
    ax.legend(fontsize=7)
    plots.save(fig, os.path.join(out, "fig4_decode_latency.png"))
    facts["fig4"] = {"knee_batch_at_128_ctx": knees}


def fig5_devices(out, facts):
    devices = [2, 4, 8, 16, 32, 64]
    gen, train = [], []
    for n in devices:
        r = run("sync", steps=4, devices=n)
        st = r.steps
        gen.append(float(np.mean(st["start_t"] - np.concatenate([[0.0], st["sync_end_t"][:-1]]))))
        train.append(float(np.mean(st["sync_end_t"] - st["start_t"])))
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
    ax[0].bar(range(len(devices)), gen, label="generation")
    ax[0].bar(range(len(devices)), train, bottom=gen, label="training + sync")
    ax[0].set_xticks(range(len(devices)), devices)
    ax[0].set(xlabel="devices", ylabel="sync step time (s)", title="more devices barely help")
    ax[0].legend(fontsize=8)
    lengths = build_setup(cfg("sync")).lengths
    x = np.sort(lengths.sample(np.random.default_rng(0), 200_000))
    ax[1].plot(x, np.arange(1, x.size + 1) / x.size, lw=1.5)
    for q in (0.5, 0.99):
        v = np.quantile(x, q)
        ax[1].axvline(v, color="gray", ls=":", lw=1)
        ax[1].text(v, 0.05 + 0.4 * (q > 0.9), f" p{int(q * 100)}={v:.0f}", fontsize=7)
    ax[1].set(xscale="log", xlabel="response length (tokens)", ylabel="CDF",
              title="lengths: lognormal body (median 400, p99 3.8k) + 0.4% cut at 16k")
    ax[1].title.set_fontsize(9)
    plots.save(fig, os.path.join(out, "fig5_sync_vs_devices.png"))
    facts["fig5"] = {"devices": devices, "generation_s": gen, "train_sync_s": train}


def _staleness_by_step(r):
    st = r.steps
    return st["sync_end_t"], st["start_lag_mean"], st["start_lag_max"]


def fig6_bad_splits(out, facts):
    cases = [("too few samplers: 1 sampler / 7 trainers", 1, 7),
             ("too many samplers: 6 samplers / 2 trainers", 6, 2)]
    fig, ax = plt.subplots(2, 2, figsize=(9, 5), sharex="col")
    for j, (title, ns, nt) in enumerate(cases):
        r = run("async", max_lag=None, queue__capacity_batches=None, split__samplers=ns,
                split__trainers=nt, steps=40, output__series_dt_s=5.0)
        rt = plots.rates(r)
        w = 24  # 2-minute moving averages: utilisation, not the on/off of each step
        ax[0, j].plot(rt["t"], plots.smooth(rt["occupancy"], w), lw=1.2, label="samplers (slot occupancy)")
        ax[0, j].plot(rt["t"], plots.smooth(rt["learner_busy"], w), lw=1.2, label="trainers (busy)")
        ax[0, j].set(title=title, ylim=(0, 1.05), ylabel="utilisation (2-min avg)")
        ax[0, j].title.set_fontsize(9)
        ax[0, j].legend(fontsize=7, loc="lower center")
        t, mean, mx = _staleness_by_step(r)
        ax[1, j].plot(t, mean, "o-", ms=2, lw=0.8, label="mean start_lag")
        ax[1, j].plot(t, mx, "s-", ms=2, lw=0.8, label="max start_lag")
        ax[1, j].set(xlabel="time (s)", ylabel="staleness (versions)")
        ax[1, j].legend(fontsize=7)
        s = r.summary()
        facts.setdefault("fig6", {})[f"{ns}s/{nt}t"] = {
            "learner_idle_fraction": s["learner_idle_fraction"],
            "sampler_occupancy": s["sampler_occupancy"], "final_max_lag": int(mx[-1])}
    plots.save(fig, os.path.join(out, "fig6_bad_splits.png"))


def fig7_fading_squares(out, facts):
    r = run("async", max_lag=4, split__samplers=3, split__trainers=5, steps=40,
            output__trace_steps=40)
    tr = r.trace
    steps = np.arange(8, 40)
    G = r.setup.group_size
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for k in steps:
        lags = np.sort(tr["start_lag"][tr["step"] == k][::G])  # one square per group
        for i, lag in enumerate(lags):
            ax.add_patch(plt.Rectangle((k, i), 0.85, 0.85, color="C0", alpha=0.9 / (1 + lag), lw=0))
    for lag in range(5):
        ax.add_patch(plt.Rectangle((0, 0), 0, 0, color="C0", alpha=0.9 / (1 + lag),
                                   label=f"{lag} version{'s' if lag != 1 else ''} old"))
    ax.set(xlim=(steps[0], steps[-1] + 1), ylim=(0, r.setup.batch_size), xlabel="learner step",
           ylabel="groups in the batch (sorted)",
           title="every trained group, fading with its staleness (start_lag)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    plots.save(fig, os.path.join(out, "fig7_staleness_squares.png"))
    facts["fig7"] = {"start_lag_hist": r.summary()["start_lag"]["hist"]}


def fig8_sweep(out, facts):
    c = cfg("sweep", max_lag=1, sweep__max_staleness=1, sweep__steps=_STEPS.value)
    res = sweep_split(c)
    plots.plot_sweep(res, os.path.join(out, "fig8_split_sweep.png"),
                     title="split sweep on 8 x H100, staleness limited to 1 version (max_lag=1)")
    c2 = cfg("sweep", max_lag=2, sweep__max_staleness=2, sweep__steps=_STEPS.value)
    res2 = sweep_split(c2)
    facts["fig8"] = {"best_trainers": res["best"]["trainers"],
                     "speedup_over_sync": res["speedup_over_sync"],
                     "speedup_over_sync_max_lag_2": res2["speedup_over_sync"]}


def _agentic_speedup(turns, tool, steps=12):
    out = {}
    for mode in ("sync", "async"):
        c = agentic.get_config(mode)
        c.steps, c.warmup_steps = steps, 2
        c.workload.turns, c.workload.tool_latency = (turns,), (tool,)
        out[mode] = simulate(build_setup(c)).summary()["samples_per_s"]
    return out["async"] / out["sync"]


def fig9_multiturn(out, facts):
    tools, turns = (0.0, 2.0, 5.0, 10.0), (1, 2, 4, 8)
    by_tool = {n: [_agentic_speedup(n, t) for t in tools] for n in (1, 4)}
    by_turns = [_agentic_speedup(n, 2.0) for n in turns]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for n, ys in by_tool.items():
        a.plot(tools, ys, "o-", label=f"{n} turn{'s' if n > 1 else ''}")
    a.set_xlabel("tool latency per call (s)")
    a.set_ylabel("async / sync samples per s")
    a.legend()
    b.plot(turns, by_turns, "o-")
    b.set_xlabel("turns per episode (tool latency 2 s)")
    for ax in (a, b):
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    fig.suptitle("single- vs multi-turn episodes, 8 x H100 (configs/sim/agentic.py)", fontsize=9)
    plots.save(fig, os.path.join(out, "fig9_multiturn.png"))
    facts["fig9"] = {"tool_latency_s": tools, "speedup_by_tool": by_tool,
                     "turns": turns, "speedup_by_turns": by_turns}


def main(argv):
    del argv
    out = _OUT.value
    os.makedirs(out, exist_ok=True)
    facts = {}
    for fig in (fig1_completion, fig2_sync_throughput, fig3_batch_size, fig4_decode_latency,
                fig5_devices, fig6_bad_splits, fig7_fading_squares, fig8_sweep, fig9_multiturn):
        if not _ONLY.value or fig.__name__ in _ONLY.value:
            fig(out, facts)
    print(json.dumps(facts, default=float))


if __name__ == "__main__":
    app.run(main)
