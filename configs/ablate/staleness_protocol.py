"""The staleness study's pre-registered grids (docs/staleness_study.md, Protocol), one argument
each, every one in the single-process lag-injected mode but `:async` (real asynchrony):

    python experiments/ablate.py --config=configs/ablate/staleness_protocol.py:ARG \\
        --workdir=W/ARG --config.experiment.warm_start.checkpoint=results/staleness_study/warm_start

  ''          confirmatory grid: the 8 key arms x lags {0, 8, 32} x 32 seeds, lr 2e-4, 60 steps
  mb4         where the decoupled losses act: decoupled_ppo, ppo, staleness_clip at 4
              minibatches, lr 5e-5, lags {0, 8, 16, 32}, 30 seeds
  varlag      the same three at 4 minibatches under a variable injected lag (uniform on
              0..max_k, max_k 8 and 32): staleness_clip's lag schedule against a fixed cap
  async       the same three in real asynchronous runs (mode=async, max_lag 4 and 16, no
              injection), 10 seeds; pipeline mode (timing decides the lags)
  sweep       each key arm's key setting at lag 8 (ppo eps, tis cap, decoupled_ppo
              behaviour cap, staleness_clip cap, m2po tau), 10 seeds: arms at their best
  drift       learning rate {5e-5, 1e-4, 2e-4} x lags {0, 4, 8, 16, 32} x 5 losses, 10 seeds:
              the inputs set before the run (rate, lag) for the drift models
  countdown   external validity: the key comparisons on the countdown task, 160 steps
              (countdown and sort are not run: their feasibility pilots failed, docs/
              staleness_study.md, Deviations 2026-12-05)
  sort        external validity: on the `sort` string task, 160 steps
  large       external validity: a 5.2M-parameter model (13x), the default task, 160 steps

160 steps: at lag 32, 128 of 160 steps (80%) train at the full lag (60 steps: 28 of 60).
`countdown`, `sort` and `large` need their own warm start (the committed one is the
0.4M-parameter reverse model): leave `warm_start.checkpoint` unset and the runner trains one
in W/ARG/warm_start (experiments/sft.py's settings; warm_start.target_accuracy picks the
stopping point) — scripts/staleness_study.sh does both.
"""
from configs.ablate import staleness
from pipelinerl_jax.ablation.grid import sweep, variants


def _tag(x) -> str:
    """A setting as a variant label (no dots: ConfigDict keys): 0.1 -> 0p1."""
    return f"{x:g}".replace(".", "p")

KEY_ARMS = (("reinforce", {"loss": {"name": "reinforce"}}),
            ("ppo", {"loss": {"name": "ppo"}}),
            ("tis", {"loss": {"name": "tis"}}),
            ("decoupled_ppo", {"loss": {"name": "decoupled_ppo"}}),
            ("staleness_clip", {"loss": {"name": "staleness_clip"}}),
            ("m2po_authors", {"loss": {"name": "m2po", "form": "released"}}),
            # issue 40's corrections the literature ties to staleness, joined 2026-12-04
            # before any protocol run: sequence-level truncated IS, and VCPO as its authors
            # ran it (OPOB baseline, ESS-scaled step)
            ("seq_is", {"loss": {"name": "seq_is"}}),
            ("vcpo", {"loss": {"name": "vcpo"}}))
DECOUPLED = ("decoupled_ppo", "ppo", "staleness_clip")
# scripts/staleness_power.py: 5 pts at 80% power, Holm over the larger family (m = 16 at
# 8 key arms x 2 lags: 32 seeds; the 3-arm grids' families hold at most 9: 30 seeds)
SEEDS = tuple(range(32))
SEEDS_3ARM = tuple(range(30))
LONG_STEPS = 160
ARGS = ("", "mb4", "varlag", "async", "sweep", "drift", "countdown", "sort", "large")


def _arms(names):
    return variants(*[a for a in KEY_ARMS if a[0] in names])


def get_config(arg: str = ""):
    if arg not in ARGS:
        raise ValueError(f"unknown config argument {arg!r} (valid: {ARGS})")
    c = staleness.get_config()
    c.runner.mode = "inprocess"
    c.axes.loss = _arms([a for a, _ in KEY_ARMS])
    c.axes.lag.levels = (0, 8, 32)
    c.axes.seed.levels = SEEDS
    if arg in ("mb4", "varlag", "async"):
        c.experiment.learner.optimizer.learning_rate = 5e-5  # 2e-4 at 4 updates a step: no learning
        c.axes.loss = _arms(DECOUPLED)
        c.axes.minibatches = sweep("learner.minibatches", (4,))
        c.axes.lag.levels = (0, 8, 16, 32)
        c.axes.seed.levels = SEEDS_3ARM
    if arg == "varlag":
        c.experiment.lag_injection.kind = "uniform"  # lag drawn on 0..max_k each step
        c.axes.lag = sweep("lag_injection.max_k", (8, 32), also=("lag_injection.k",))
        c.axes.injection = sweep("lag_injection.kind", ("uniform",))
    elif arg == "async":
        c.runner.mode = "pipeline"  # real asynchrony: the pipeline's timing sets the lags
        c.runner.parallel = 1  # one run on both cores, sampler and learner on their own
        c.experiment.lag_injection.enabled = False
        c.experiment.mode = "async"
        del c.axes["lag"]
        c.axes.max_lag = sweep("max_lag", (4, 16))
        c.axes.seed.levels = tuple(range(10))
    elif arg == "sweep":
        c.axes.loss = variants(
            *[(f"ppo_eps{_tag(e)}", {"loss": {"name": "ppo", "eps_low": e, "eps_high": e}})
              for e in (0.1, 0.2, 0.3)],
            *[(f"tis_cap{_tag(k)}", {"loss": {"name": "tis", "cap": k}}) for k in (1.5, 2, 4, 8)],
            *[(f"decoupled_ppo_cap{_tag(k)}", {"loss": {"name": "decoupled_ppo",
                                                    "behave_cap": k}}) for k in (2, 5)],
            *[(f"staleness_clip_cap{_tag(k)}", {"loss": {"name": "staleness_clip", "cap": k}})
              for k in (1.5, 2, 4)],
            *[(f"m2po_authors_tau{_tag(t)}", {"loss": {"name": "m2po", "form": "released",
                                                   "tau": t}}) for t in (0.01, 0.04, 0.16)],
            *[(f"seq_is_high{_tag(k)}", {"loss": {"name": "seq_is", "high": k}})
              for k in (1.5, 2, 4)],
            *[(f"vcpo_cap{_tag(k)}", {"loss": {"name": "vcpo", "cap": k}}) for k in (4, 8, 16)])
        c.axes.lag.levels = (8,)
        c.axes.seed.levels = tuple(range(10))
    elif arg == "drift":
        c.axes.loss = _arms(("reinforce", "ppo", "tis", "decoupled_ppo", "m2po_authors"))
        c.axes.lr = sweep("learner.optimizer.learning_rate", (5e-5, 1e-4, 2e-4))
        c.axes.lag.levels = (0, 4, 8, 16, 32)
        c.axes.seed.levels = tuple(range(10))
    elif arg in ("countdown", "sort", "large"):
        e = c.experiment
        e.warm_start.checkpoint = ""
        e.warm_start.steps = 600
        e.warm_start.target_accuracy = 0.3
        e.learner.total_steps = LONG_STEPS
        e.learner.eval_every = 40
        c.axes.loss = _arms(("reinforce", "ppo", "tis", "m2po_authors"))
        c.axes.seed.levels = SEEDS_3ARM
        if arg == "countdown":
            e.task.name = "countdown"
            e.sampling.max_new_tokens = 40
            e.model.max_seq_len = 128
        elif arg == "sort":
            e.task.name = "sort"
        else:  # 13x the parameters: 3 layers, width 384
            e.model.hidden_size, e.model.intermediate_size = 384, 1152
            e.model.num_layers, e.model.num_heads, e.model.head_dim = 3, 6, 64
    return c
