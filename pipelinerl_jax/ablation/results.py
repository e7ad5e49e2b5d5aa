"""Reading run directories back: one tidy table, a summary per run and per grid cell.

    runs, problems = load_runs(["runs/ablate"])     # every run directory found under the roots
    write_tables(workdir, analysis)                  # results.csv, runs.csv, cells.csv, summary.json

A run directory is what `experiments/train.py` writes (docs/metrics.md); the ablation runner
adds `spec.json` (its grid labels and cell) and `status.json`. A directory that is missing or
malformed (no `metrics.jsonl`, no config, no logged step) is reported in `problems` by name
and skipped; nothing here raises on a bad run.

Per run (`summarize_run`), from the held-out greedy accuracy `eval/accuracy` logged every
`learner.eval_every` steps (and at step 0, the warm start):
  initial / final / best eval accuracy, steps, wall-clock;
  time_to_target_s, steps_to_target   first eval at or above `analysis.target_accuracy`;
  nonfinite_steps                     steps the learner skipped (non-finite loss or gradient);
  collapse_step                       first eval below `collapse_ratio` x the initial accuracy
                                      (only when that is >= `collapse_min_accuracy`);
  kl_spike_steps                      steps with KL(behaviour || current) k3 > `kl_spike`;
  drift_flag                          any such step: the behaviour policy drifted far from the
                                      current one (at lr 2e-4 and large lag that is the norm,
                                      not by itself a failure);
  collapsed                           non-finite steps, an accuracy collapse, or a diverged
                                      run: the run failed;
  stalest_bucket, {ess,clip_frac,kl_k3}_stalest   the stalest lag bucket that holds trained
                                      tokens, and its token-weighted mean diagnostics.
Per cell (`summarize_cells`): mean, std (ddof 0), min, max, n and the 95% Student-t interval
of the mean (`_half`, `_lo`, `_hi`; stats.t_interval, n-1 df) over the seeds of each numeric
run figure.

Committed tables (`export_tables` / `load_tables`): runs.csv, cells.csv, a compact
steps.csv (the STEP_COLUMNS and per-bucket diagnostics of every step, 6 significant digits,
bucket columns blank where the bucket has no tokens) and histograms.csv (response lengths
and per-token lag, as counts) rebuild `Run`s for every figure but occupancy_vs_sim (which
calibrates the simulator from the raw logs); `load_runs` reads such a folder (it holds
steps.csv) as runs.
"""
from __future__ import annotations

import csv
import dataclasses
import glob
import json
import math
import os
import shutil
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from pipelinerl_jax.ablation.stats import t_interval
from pipelinerl_jax.lag_buckets import LAG_BUCKETS  # loss/lag_<bucket>/<name> columns
from pipelinerl_jax.metrics import EVAL_LOG, merge_evals, read_jsonl
from pipelinerl_jax.provenance import FIELDS as PROVENANCE_FIELDS

# Config values every table carries (column -> dotted key in the experiment config).
CONFIG_COLUMNS = {
    "mode": "mode", "max_lag": "max_lag", "loss": "loss.name",
    "kv_policy": "engine.kv_policy", "learning_rate": "learner.optimizer.learning_rate",
    "seed": "seed", "lag_injection": "lag_injection.enabled", "injected_lag": "lag_injection.k",
    "injection_kind": "lag_injection.kind", "batch_groups": "learner.batch_groups",
    "group_size": "rollout.group_size", "total_steps": "learner.total_steps",
    "minibatches": "learner.minibatches", "max_k": "lag_injection.max_k",
    "eval_size": "learner.eval_size", "loss_cap": "loss.cap", "loss_tau": "loss.tau",
    "loss_form": "loss.form", "loss_floor_low": "loss.floor_low",
    "loss_floor_high": "loss.floor_high",
    # the `sweep` grid's other key settings (ablation/sweep_grid.py): without them a table's
    # decoupled_ppo read as uncapped whatever its behaviour cap
    "loss_behave_cap": "loss.behave_cap", "loss_eps_low": "loss.eps_low",
    "loss_eps_high": "loss.eps_high", "loss_high": "loss.high",
}
_FIRST_METRICS = ("step", "version", "wall_time_s", "eval/accuracy", "accuracy", "reward/mean",
                  "lag/mean", "loss/ess", "loss/clip_frac", "loss/kl_k3")


# Where a run ran (pipelinerl_jax/provenance.py, recorded by the runner in status.json) and
# how (runner.mode): runs.csv columns. A run whose status holds none (every run before these
# were recorded) reads "unrecorded" in each, never a guess.
PROVENANCE_COLUMNS = PROVENANCE_FIELDS + ("runner_mode",)
PROVENANCE_UNRECORDED = "unrecorded"

# Folders of a grid directory that hold no results (runner.py).
NOT_RUNS = ("warm_start", "xla_cache", "warmup")


class RunError(ValueError):
    pass


@dataclasses.dataclass
class Run:
    name: str
    path: str
    labels: Dict[str, str]
    cell: str
    config: dict  # the experiment config (nested dict)
    rows: List[dict]  # metrics.jsonl, one per step (the last record of a step wins), with
    # the evaluator's eval.jsonl merged in (metrics.merge_evals)
    status: str  # done | diverged | failed | partial | unknown
    # From committed tables: "response_lengths" {length: count}, "lag_hist" [tokens per lag]
    extras: dict = dataclasses.field(default_factory=dict)
    provenance: dict = dataclasses.field(default_factory=dict)  # PROVENANCE_COLUMNS, or {}
    # From committed tables: the run's runs.csv row as committed, as text. An export keeps it
    # verbatim: re-deriving it from the 6-digit steps.csv moves means in their last digit
    committed: dict = dataclasses.field(default_factory=dict)

    def get(self, key: str, default=None):
        return config_value(self.config, key, default)

    @property
    def evals(self) -> List[Tuple[int, float, float]]:
        """(step, wall_time_s, eval/accuracy) of every evaluation."""
        return [(r["step"], r.get("wall_time_s", math.nan), r["eval/accuracy"])
                for r in self.rows if _num(r.get("eval/accuracy")) is not None]

    def series(self, key: str) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(steps, wall_time_s, values) of the rows logging `key` as a number."""
        pts = [(r["step"], r.get("wall_time_s", math.nan), _num(r.get(key)))
               for r in self.rows if _num(r.get(key)) is not None]
        if not pts:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        s, t, v = zip(*pts)
        return np.asarray(s), np.asarray(t, float), np.asarray(v, float)


def response_lengths(run: Run, limit: int = 200_000) -> Dict[int, int]:
    """{response length: samples} over the run's samples*.jsonl (or its committed table)."""
    if "response_lengths" in run.extras:
        return dict(run.extras["response_lengths"])
    counts: Dict[int, int] = {}
    n = 0
    for path in sorted(glob.glob(os.path.join(run.path, "samples*.jsonl"))):
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    k = int(json.loads(line)["response_length"])
                except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                    continue
                counts[k] = counts.get(k, 0) + 1
                n += 1
        if n >= limit:
            break
    return counts


def lag_hist(run: Run) -> np.ndarray:
    """Trained tokens per lag, summed over the run's steps (`lag/hist`)."""
    if "lag_hist" in run.extras:
        return np.asarray(run.extras["lag_hist"], float)
    h = np.zeros(0)
    for row in run.rows:
        v = row.get("lag/hist")
        if isinstance(v, list) and v:
            v = np.asarray(v, float)
            if v.size > h.size:
                h = np.pad(h, (0, v.size - h.size))
            h[: v.size] += v
    return h


def config_value(cfg: dict, key: str, default=None):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _num(v) -> Optional[float]:
    """A logged number as float ('nan'/'inf' strings are how JSONL keeps non-finite values)."""
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and v.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(v)
    return None


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def load_run(path: str) -> Run:
    """Reads one run directory; raises RunError saying what is wrong with it."""
    if not os.path.isdir(path):
        raise RunError(f"{path}: not a directory")
    spec, config = None, None
    try:
        if os.path.exists(os.path.join(path, "spec.json")):
            spec = _read_json(os.path.join(path, "spec.json"))
            config = spec.get("experiment")
        if config is None and os.path.exists(os.path.join(path, "config.json")):
            config = _read_json(os.path.join(path, "config.json"))
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise RunError(f"{path}: unreadable spec.json/config.json ({e})") from None
    if not isinstance(config, dict):
        raise RunError(f"{path}: no experiment config (spec.json or config.json)")
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.exists(metrics):
        raise RunError(f"{path}: no metrics.jsonl")
    by_step, bad = {}, 0
    with open(metrics, errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                by_step[int(row["step"])] = row
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                bad += 1  # a line cut short by a crash, or not a metrics record
    if not by_step:
        raise RunError(f"{path}: metrics.jsonl has no step records"
                       + (f" ({bad} malformed lines)" if bad else ""))
    rows = merge_evals([by_step[s] for s in sorted(by_step)],
                       read_jsonl(os.path.join(path, EVAL_LOG)))  # the evaluator's records
    status, provenance = "unknown", {}
    try:
        st = _read_json(os.path.join(path, "status.json"))
        status = st.get("status", status)
        provenance = dict(st.get("provenance") or {})
        if st.get("mode"):
            provenance["runner_mode"] = st["mode"]
    except (OSError, json.JSONDecodeError, AttributeError):
        if os.path.exists(os.path.join(path, "summary.json")):
            status = "done"
        elif os.path.exists(os.path.join(path, "status.json")):
            status = "unknown"
    labels = dict(spec.get("labels", {})) if spec else {}
    name = spec.get("name") if spec else None
    name = name or os.path.basename(os.path.normpath(path))
    cell = spec.get("cell", name) if spec else name
    return Run(name, os.path.abspath(path), labels, cell, config, rows, status,
               provenance=provenance)


def find_run_dirs(roots: Iterable[str], max_depth: int = 3) -> Tuple[List[str], List[str]]:
    """(run directories, problems): a run directory holds metrics.jsonl or spec.json; roots
    may be run directories, grid workdirs or folders of either."""
    found, problems = [], []
    for root in roots:
        if not os.path.isdir(root):
            problems.append(f"{root}: no such directory")
            continue
        before = len(found)
        for dirpath, dirnames, filenames in os.walk(root):
            depth = os.path.relpath(dirpath, root).count(os.sep) + (dirpath != root)
            if "metrics.jsonl" in filenames or "spec.json" in filenames:
                found.append(dirpath)
                dirnames[:] = []  # a run's own subfolders (checkpoints, tb) are not runs
                continue
            dirnames[:] = sorted(d for d in dirnames if d not in NOT_RUNS) \
                if depth < max_depth else []
        if len(found) == before:
            problems.append(f"{root}: no run directories found")
    return sorted(set(found)), problems


# A folder of committed tables may carry the raw logs of a few runs in RAW_DIR/<run name>/
# (`export_raw`): what the simulator calibrates from (occupancy_vs_sim), too big for every run.
RAW_DIR = "raw"
RAW_FILES = ("config.json", "spec.json", "status.json", "metrics.jsonl", "eval.jsonl",
             "engine_stats.jsonl", "samples*.jsonl")


def raw_dir(run: Run) -> Optional[str]:
    """The directory holding `run`'s raw logs (engine_stats.jsonl): its own run directory, or
    `<tables>/raw/<name>` for a run read from committed tables; None when neither has them."""
    for d in (run.path, os.path.join(run.path, RAW_DIR, run.name)):
        if os.path.isfile(os.path.join(d, "engine_stats.jsonl")):
            return d
    return None


def export_raw(roots: Sequence[str], names: Sequence[str], out: str) -> List[str]:
    """Copies the RAW_FILES of the runs called `names` (under `roots`) into out/raw/<name>/;
    returns the directories written. Raises RunError naming a run that is absent."""
    runs = {r.name: r for r in load_runs(roots)[0]}
    written = []
    for name in names:
        if name not in runs or not os.path.isdir(runs[name].path):
            raise RunError(f"--raw_run {name!r}: no such run directory under {list(roots)}")
        dst = os.path.join(out, RAW_DIR, name)
        os.makedirs(dst, exist_ok=True)
        for pattern in RAW_FILES:
            for src in sorted(glob.glob(os.path.join(runs[name].path, pattern))):
                shutil.copyfile(src, os.path.join(dst, os.path.basename(src)))
        written.append(dst)
    return written


def load_runs(roots: Iterable[str]) -> Tuple[List[Run], List[str]]:
    """Every run under `roots`, one per run name; a root holding steps.csv is a folder of
    committed tables (`export_tables`) and is read with `load_tables`.

    A grid that runs across sittings is exported from its live workdir together with the
    tables committed earlier (`--results=WORKDIR,TABLES --out=TABLES`): a run in both is the
    same run, and its directory (the whole record) replaces its table row; two directories
    or two tables with one name are an error in `problems` (the first is kept)."""
    roots = list(roots)
    problems = []
    by_name: Dict[str, Run] = {}
    from_table = set()
    tables = [r for r in roots if os.path.isfile(os.path.join(r, STEPS_CSV))]
    for root in tables:
        got, bad = load_tables(root)
        problems += bad
        for run in got:
            if run.name in by_name:
                problems.append(f"{root}: run {run.name} is in two table folders; kept the first")
                continue
            by_name[run.name] = run
            from_table.add(run.name)
    dirs, bad = find_run_dirs([r for r in roots if r not in tables])
    problems += bad
    for d in dirs:
        try:
            run = load_run(d)
        except RunError as e:
            problems.append(str(e))
            continue
        if run.name in by_name and run.name not in from_table:
            problems.append(f"{d}: run {run.name} is also at {by_name[run.name].path}; "
                            f"kept that one")
            continue
        from_table.discard(run.name)
        by_name[run.name] = run
    return list(by_name.values()), problems


# ---------------------------------------------------------------------------- summaries

def summarize_run(run: Run, analysis) -> dict:
    a = _analysis(analysis)
    evals = run.evals
    last = run.rows[-1]
    out = {"run": run.name, "cell": run.cell, "status": run.status, "path": run.path}
    out.update(run.labels)
    out.update({col: run.get(key) for col, key in CONFIG_COLUMNS.items()})
    out["steps"] = int(last.get("step", 0))
    out["wall_time_s"] = _num(last.get("wall_time_s"))
    accs = [e[2] for e in evals]
    out["initial_eval_accuracy"] = accs[0] if evals and evals[0][0] == 0 else None
    out["final_eval_accuracy"] = accs[-1] if accs else None
    out["best_eval_accuracy"] = max(accs) if accs else None
    hit = next((e for e in evals if e[2] >= a["target_accuracy"]), None)
    out["target_accuracy"] = a["target_accuracy"]
    out["time_to_target_s"] = hit[1] if hit else None
    out["steps_to_target"] = hit[0] if hit else None
    trained = [r for r in run.rows if r.get("step", 0) > 0]
    nonfinite = sum(1 for r in trained if (_num(r.get("learner/skipped_steps")) or 0) > 0
                    or not math.isfinite(_num(r.get("loss/loss")) or 0.0))
    out["nonfinite_steps"] = nonfinite
    init = out["initial_eval_accuracy"]
    collapse = None
    if init is not None and init >= a["collapse_min_accuracy"]:
        collapse = next((s for s, _, acc in evals if acc < a["collapse_ratio"] * init), None)
    out["collapse_step"] = collapse
    kl = [_num(r.get("loss/kl_k3")) for r in trained]
    kl = [k for k in kl if k is not None]
    out["max_kl_k3"] = max(kl) if kl else None
    out["kl_spike_steps"] = sum(1 for k in kl if not k <= a["kl_spike"])
    for key, col in (("lag/mean", "lag_mean"), ("loss/ess", "ess_mean"),
                     ("loss/clip_frac", "clip_frac_mean"), ("loss/kl_k3", "kl_k3_mean")):
        vals = [v for v in (_num(r.get(key)) for r in trained) if v is not None]
        out[col] = float(np.mean(vals)) if vals else None
    out.update(stalest_diagnostics(run))
    span = out["wall_time_s"]
    out["steps_per_min"] = 60 * out["steps"] / span if span else None
    out["drift_flag"] = bool(out["kl_spike_steps"])
    out["collapsed"] = bool(nonfinite or collapse is not None or run.status == "diverged")
    out.update(provenance_of(run))
    return out


def provenance_of(run: Run) -> Dict[str, str]:
    """Where and how `run` ran (PROVENANCE_COLUMNS), "unrecorded" where it was not kept."""
    return {col: run.provenance.get(col) or PROVENANCE_UNRECORDED for col in PROVENANCE_COLUMNS}


def mixed_provenance(runs: Sequence[Run]) -> dict:
    """{"values": {column: {value: runs}}, "mixed_cells": [{cell, column, values}]}: how the
    runs' provenance is spread, and every cell whose runs disagree on a column (machines,
    library versions, code, mode; "unrecorded" beside a recorded value counts as a
    disagreement: nobody knows whether those runs match)."""
    values: Dict[str, Dict[str, int]] = {c: {} for c in PROVENANCE_COLUMNS}
    cells: Dict[str, List[Dict[str, str]]] = {}
    for r in runs:
        p = provenance_of(r)
        for c, v in p.items():
            values[c][v] = values[c].get(v, 0) + 1
        cells.setdefault(r.cell, []).append(p)
    mixed = []
    for cell, ps in sorted(cells.items()):
        for c in PROVENANCE_COLUMNS:
            seen = sorted({p[c] for p in ps})
            if len(seen) > 1:
                mixed.append({"cell": cell, "column": c, "values": seen})
    return {"values": values, "mixed_cells": mixed}


def stalest_diagnostics(run: Run) -> dict:
    """The stalest lag bucket holding trained tokens in the run and its token-weighted mean
    ESS, clip fraction and KL k3 over the steps (None where nothing is logged per bucket)."""
    tokens = {b: sum(_num(r.get(f"loss/lag_{b}/tokens")) or 0.0 for r in run.rows)
              for b in LAG_BUCKETS}
    full = [b for b in LAG_BUCKETS if tokens[b] > 0]
    out = {"stalest_bucket": full[-1] if full else None}
    for name in ("ess", "clip_frac", "kl_k3"):
        num = den = 0.0
        for r in run.rows if full else ():
            n = _num(r.get(f"loss/lag_{full[-1]}/tokens"))
            v = _num(r.get(f"loss/lag_{full[-1]}/{name}"))
            if n and n > 0 and v is not None and math.isfinite(v):
                num, den = num + n * v, den + n
        out[f"{name}_stalest"] = num / den if den else None
    return out


def _analysis(analysis) -> dict:
    a = {"target_accuracy": 0.4, "collapse_ratio": 0.5, "collapse_min_accuracy": 0.05,
         "kl_spike": 0.5}
    if analysis is not None:
        a.update({k: analysis[k] for k in a if k in analysis})
    return a


CELL_FIGURES = ("final_eval_accuracy", "best_eval_accuracy", "time_to_target_s",
                "steps_to_target", "nonfinite_steps", "kl_spike_steps", "max_kl_k3",
                "lag_mean", "ess_mean", "clip_frac_mean", "kl_k3_mean", "wall_time_s",
                "steps_per_min", "drift_flag", "collapsed", "ess_stalest", "clip_frac_stalest",
                "kl_k3_stalest")


def summarize_cells(run_rows: Sequence[dict]) -> List[dict]:
    """One row per cell: its labels (without the seed axis), then `<figure>_{mean,std,min,
    max,n,half,lo,hi}` over the cell's runs for each figure in CELL_FIGURES (half, lo, hi:
    the 95% t-interval of the mean; blank with one seed)."""
    cells: Dict[str, List[dict]] = {}
    for r in run_rows:
        cells.setdefault(r["cell"], []).append(r)
    out = []
    for cell, rows in cells.items():
        row = {"cell": cell, "runs": len(rows)}
        for k, v in (kv.split("=", 1) for kv in cell.split(",") if "=" in kv):
            row[k] = v
        for fig in CELL_FIGURES:
            vals = [float(r[fig]) for r in rows if isinstance(r.get(fig), (int, float))]
            row[f"{fig}_n"] = len(vals)
            if vals:
                row[f"{fig}_mean"] = float(np.mean(vals))
                row[f"{fig}_std"] = float(np.std(vals))
                row[f"{fig}_min"] = float(np.min(vals))
                row[f"{fig}_max"] = float(np.max(vals))
                iv = t_interval(vals)
                if iv.n > 1:
                    row[f"{fig}_half"], row[f"{fig}_lo"], row[f"{fig}_hi"] = iv.half, iv.lo, iv.hi
        out.append(row)
    return out


# ---------------------------------------------------------------------------- tables

def tidy_rows(runs: Sequence[Run]) -> Tuple[List[str], List[dict]]:
    """(columns, rows): one row per run per logged step; scalar metrics only (lists such as
    `lag/hist` stay in metrics.jsonl)."""
    axes = sorted({k for r in runs for k in r.labels})
    metric_keys = set()
    for r in runs:
        for row in r.rows:
            metric_keys.update(k for k, v in row.items() if _num(v) is not None)
    first = [k for k in _FIRST_METRICS if k in metric_keys]
    metrics = first + sorted(metric_keys - set(first))
    head = ["run", "cell", "status"] + [a for a in axes if a not in CONFIG_COLUMNS] \
        + list(CONFIG_COLUMNS)
    rows = []
    for r in runs:
        fixed = {"run": r.name, "cell": r.cell, "status": r.status, **r.labels}
        fixed.update({col: r.get(key) for col, key in CONFIG_COLUMNS.items()})
        for row in r.rows:
            out = dict(fixed)
            out.update({k: row[k] for k in metrics if _num(row.get(k)) is not None})
            rows.append(out)
    return head + metrics, rows


def write_csv(path: str, rows: Sequence[dict], columns: Optional[List[str]] = None) -> str:
    if columns is None:
        columns = []
        for r in rows:
            columns += [k for k in r if k not in columns]
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    os.replace(tmp, path)
    return path


def write_tables(workdir: str, analysis=None) -> dict:
    """results.csv (tidy, per run per step), runs.csv (per run), cells.csv (per cell over
    seeds) and summary.json (both summaries + problems) for the runs under workdir/runs."""
    runs, problems = load_runs([os.path.join(workdir, "runs")])
    columns, rows = tidy_rows(runs)
    paths = {"results_csv": write_csv(os.path.join(workdir, "results.csv"), rows, columns)}
    run_rows = [summarize_run(r, analysis) for r in runs]
    cell_rows = summarize_cells(run_rows)
    paths["runs_csv"] = write_csv(os.path.join(workdir, "runs.csv"), run_rows)
    paths["cells_csv"] = write_csv(os.path.join(workdir, "cells.csv"), cell_rows)
    summary = {"analysis": _analysis(analysis), "runs": run_rows, "cells": cell_rows,
               "problems": problems}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    paths["summary_json"] = os.path.join(workdir, "summary.json")
    return {"tables": paths, "problems": problems}


# ---------------------------------------------------------------------------- committed tables

STEPS_CSV = "steps.csv"
HISTOGRAMS_CSV = "histograms.csv"  # run, kind (response_length | lag), value, count
# Per-step metrics kept in the committed steps.csv (every figure drawn from step metrics needs
# only these), plus `loss/lag_<bucket>/{tokens,ess,clip_frac,kl_k3}`.
STEP_COLUMNS = ("step", "wall_time_s", "eval/accuracy", "accuracy", "reward/mean", "lag/mean",
                "kv_lag/mean", "loss/loss", "loss/ess", "loss/clip_frac", "loss/kl_k3",
                "loss/masked_frac", "learner/step_time_s", "learner/wait_time_s",
                "learner/tokens", "learner/skipped_steps", "weight_sync/time_s",
                "sampler/occupancy",
                # blank but for the losses that log them: how hard the correction acted
                "loss/staleness_cap_frac", "loss/m2po_clip_low", "loss/m2po_clip_high")
BUCKET_METRICS = ("tokens", "ess", "clip_frac", "kl_k3")


def _short(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def export_tables(roots: Sequence[str], out: str, analysis=None,
                  finished_only: bool = False) -> dict:
    """runs.csv, cells.csv and the compact steps.csv of the runs under `roots`, small enough
    to commit (figures and reports regenerate from them: `load_tables`). `finished_only`:
    leave out runs that are not done or diverged (reported in `problems`)."""
    runs, problems = load_runs(roots)
    if finished_only:  # a run stopped mid-way (its grid resumes it) is not a result yet
        problems += [f"{r.path}: not finished ({r.status})" for r in runs
                     if r.status not in ("done", "diverged")]
        runs = [r for r in runs if r.status in ("done", "diverged")]
    os.makedirs(out, exist_ok=True)
    bucket_cols = [f"loss/lag_{b}/{m}" for b in LAG_BUCKETS for m in BUCKET_METRICS]
    rows = []
    for r in sorted(runs, key=lambda r: r.name):
        for row in r.rows:
            o = {"run": r.name}
            o.update({k: _short(_num(row[k]) if not isinstance(row[k], int) else row[k])
                      for k in STEP_COLUMNS if _num(row.get(k)) is not None})
            for b in LAG_BUCKETS:
                if (_num(row.get(f"loss/lag_{b}/tokens")) or 0) > 0:
                    o.update({f"loss/lag_{b}/{m}": _short(_num(row[f"loss/lag_{b}/{m}"]))
                              for m in BUCKET_METRICS
                              if _num(row.get(f"loss/lag_{b}/{m}")) is not None})
            rows.append(o)
    paths = {"steps_csv": write_csv(os.path.join(out, STEPS_CSV), rows,
                                    ["run", *STEP_COLUMNS, *bucket_cols])}
    hist_rows = []  # the lengths-and-lag figure's inputs, as counts
    for r in sorted(runs, key=lambda r: r.name):
        hist_rows += [{"run": r.name, "kind": "response_length", "value": k, "count": c}
                      for k, c in sorted(response_lengths(r).items())]
        hist_rows += [{"run": r.name, "kind": "lag", "value": k, "count": int(c)}
                      for k, c in enumerate(lag_hist(r)) if c]
    paths["histograms_csv"] = write_csv(os.path.join(out, HISTOGRAMS_CSV), hist_rows,
                                        ["run", "kind", "value", "count"])
    run_rows = [summarize_run(r, analysis) for r in sorted(runs, key=lambda r: r.name)]
    for r in run_rows:
        r.pop("path", None)  # a path on the machine that ran it
    # a run from committed tables keeps its committed row (columns added since: derived)
    committed = {r.name: r.committed for r in runs}
    text_rows = [{**{k: _short(v) for k, v in r.items()}, **committed[r["run"]]}
                 for r in run_rows]
    paths["runs_csv"] = write_csv(os.path.join(out, "runs.csv"), text_rows)
    # the cells from runs.csv as written, so that an export of an export is the same
    paths["cells_csv"] = write_csv(os.path.join(out, "cells.csv"),
                                   [{k: _short(v) for k, v in c.items()} for c in
                                    summarize_cells([{k: _parse("" if v is None else str(v))
                                                      for k, v in r.items()}
                                                     for r in text_rows])])
    return {"tables": paths, "problems": problems, "runs": len(runs)}


def _parse(v: str):
    if v == "":
        return None
    if v in ("True", "False"):
        return v == "True"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


def _labels_of(name: str) -> Dict[str, str]:
    parts = [p.split("=", 1) for p in name.split(",")]
    return dict(p for p in parts if len(p) == 2) if all(len(p) == 2 for p in parts) else {}


def load_tables(folder: str) -> Tuple[List[Run], List[str]]:
    """`Run`s rebuilt from a folder of committed tables (runs.csv + steps.csv): the config
    holds the CONFIG_COLUMNS keys, the labels come from the run name, the rows from
    steps.csv; figures needing other files (engine_stats, samples) skip these runs."""
    problems = []
    try:
        with open(os.path.join(folder, "runs.csv")) as f:
            meta = list(csv.DictReader(f))
        steps: Dict[str, List[dict]] = {}
        with open(os.path.join(folder, STEPS_CSV)) as f:
            for row in csv.DictReader(f):
                steps.setdefault(row.pop("run"), []).append(
                    {k: _parse(v) for k, v in row.items() if v != ""})
        extras: Dict[str, dict] = {}
        if os.path.exists(os.path.join(folder, HISTOGRAMS_CSV)):
            with open(os.path.join(folder, HISTOGRAMS_CSV)) as f:
                for row in csv.DictReader(f):
                    e = extras.setdefault(row["run"], {"response_lengths": {}, "lag_hist": []})
                    v, c = int(row["value"]), int(row["count"])
                    if row["kind"] == "response_length":
                        e["response_lengths"][v] = c
                    elif row["kind"] == "lag":
                        e["lag_hist"] += [0] * (v + 1 - len(e["lag_hist"]))
                        e["lag_hist"][v] = c
    except (OSError, csv.Error, KeyError, ValueError) as e:
        return [], [f"{folder}: unreadable tables ({e})"]
    runs = []
    for m in meta:
        rows = sorted(steps.get(m["run"], []), key=lambda r: r.get("step", 0))
        if not rows:
            problems.append(f"{folder}: run {m['run']} has no rows in {STEPS_CSV}")
            continue
        config: dict = {}
        for col, key in CONFIG_COLUMNS.items():
            value = _parse(m.get(col, ""))
            node = config
            *parents, last = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        runs.append(Run(m["run"], os.path.abspath(folder), _labels_of(m["run"]),
                        m.get("cell") or m["run"], config, rows, m.get("status", "unknown"),
                        extras.get(m["run"], {"response_lengths": {}, "lag_hist": []}),
                        {col: m[col] for col in PROVENANCE_COLUMNS
                         if m.get(col) and m[col] != PROVENANCE_UNRECORDED},
                        dict(m)))
    return runs, problems
