#!/usr/bin/env bash
# The pre-registered staleness grids in the order docs/staleness_study.md (Deviations,
# 2026-12-05 and 2026-12-06 sitting 19) fixes, each from the frozen worktree WT (commit
# 23f2b3c), results in W:
#   bash scripts/protocol_chain.sh W WT [PID]
# '' to its 32 seeds, then mb4 to its 30, then the secondary grids one whole grid at a time,
# in order of the machine time each has left: async, sweep (10 seeds each), varlag (30),
# drift (10), large (30) (the order of the Deviation of 2026-12-06, sitting 19, in
# docs/staleness_study.md, set on run time alone). countdown and sort are not run (their
# feasibility pilots failed). Finished runs are skipped, so it resumes; with PID it
# first waits for that process (a runner already going) to end. Runs at nice 19.
# The runs this checkout committed (results/staleness_protocol) are copied into WT (untracked
# there, so WT stays at the frozen commit) and skipped (FINISHED=1 for each grid that has
# committed runs): a machine whose W was
# lost between sittings resumes where the committed export ends, never re-running a seed.
# The body is one block, parsed whole before it runs: bash reads a script as it goes, so an
# edit to this file under a running chain (a checkout, a commit) would otherwise cut it off
# mid-line (sitting 16: it stopped after '' with a syntax error).
{
set -euo pipefail
W=$(realpath "$1"); WT=$(realpath "$2"); PID=${3:-}
HERE=$(dirname "$(dirname "$(realpath "$0")")")
if [ -n "$PID" ]; then while kill -0 "$PID" 2>/dev/null; do sleep 20; done; fi
cd "$WT"
FROZEN=${FROZEN:-23f2b3c}  # the protocol's commit (a test points it at a fake worktree)
[ "$(git rev-parse --short=7 HEAD)" = "$FROZEN" ] || { echo "WT is not at $FROZEN" >&2; exit 1; }
# the environment must import the frozen code before any grid starts (sitting 17 started the
# chain without the venv: the frozen runner read each failed import as "seed not listed" and
# ran through every grid and seed in 20 s, running nothing)
PYTHONPATH="$WT" python -c "import configs.default" || {
  echo "$(command -v python) cannot import $WT/configs/default.py: activate the environment" \
    "the project is installed in" >&2; exit 1; }
if [ "$HERE" != "$WT" ]; then mkdir -p results && cp -r "$HERE/results/staleness_protocol" results/; fi
grid() {  # grid first_seed last_seed
  echo "=== $(date -u +%H:%M:%S) chain: $1 seeds $2-$3"
  # a grid is analysed once, after its last seed ("Stopping"): a committed report.md means
  # every run finished, so skip it whole (checking its seeds one by one costs ~11 s each)
  if [ -f "results/staleness_protocol/$1/report.md" ]; then echo "$1: analysed, skipped"; return; fi
  # skip the committed runs of a grid that has some (the runner refuses an empty folder)
  local fin=""; [ -f "results/staleness_protocol/$1/runs.csv" ] && fin=1
  FINISHED="$fin" GRIDS=protocol ONLY="$1" nice -n 19 bash scripts/staleness_study.sh \
    "$W" "$2" "$3"
}
grid main 0 31
grid mb4 0 29
grid async 0 9
grid sweep 0 9
grid varlag 0 29
grid drift 0 9
# large's warm start is pinned (Deviations, sitting 23): the same config retrains a different
# one on another CPU (AMD EPYC: 34.4% after 400 steps; Intel Xeon: 30.1% after 430), so every
# machine runs from the committed copy; a W holding any other, or a checkout without it (the
# frozen runner would retrain one), stops the chain
LWS="$HERE/results/staleness_protocol/large_warm_start"
[ -f "$LWS/model/model.safetensors" ] && [ -f "$LWS/model/config.json" ] || {
  echo "$LWS/model lacks model.safetensors or config.json: large's warm start is pinned" >&2
  exit 1; }
if [ -d "$W/protocol/large/warm_start/model" ]; then
  cmp -s "$LWS/model/model.safetensors" "$W/protocol/large/warm_start/model/model.safetensors" || {
    echo "$W/protocol/large/warm_start is not the committed $LWS: move it aside" >&2; exit 1; }
else
  mkdir -p "$W/protocol/large/warm_start" && cp -r "$LWS/." "$W/protocol/large/warm_start/"
fi
grid large 0 29
echo "=== $(date -u +%H:%M:%S) chain: done"
exit
}
