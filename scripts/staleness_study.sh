#!/usr/bin/env bash
# The staleness study (docs/staleness_study.md), one seed at a time across all of its grids,
# so that whatever has finished is balanced over cells. Resumable: run it again with the same
# ROOT (in another sitting) and finished runs are skipped.
#
#   bash scripts/staleness_study.sh ROOT [FIRST_SEED] [LAST_SEED]
#   FINISHED=1 bash scripts/staleness_study.sh ROOT ...   # skip the committed runs too
#   ONLY=main bash scripts/staleness_study.sh ROOT 1 9      # one grid's seeds first
#   LAGS=0,4,8,16,32 ONLY=main bash scripts/staleness_study.sh ROOT 4 13   # the goal's lags
#   GRIDS=protocol bash scripts/staleness_study.sh ROOT 0 31   # the pre-registered grids
#   GRIDS=protocol ONLY=mb4 bash scripts/staleness_study.sh ROOT 0 31   # one of them
#   (in the background: nice -n 19 and scripts/background_nice.sh, which reaches each run)
#
# Grids, per seed: the full grid (configs/ablate/staleness.py: 10 loss arms x 7 lags), its
# learning-rate-5e-5 subgrid (:lowlr, 7 arms x 7 lags), the tinker KL repro (lag 3, in the
# full grid's workdir) and the
# decoupled PPO repro (4 minibatches, lr 5e-5). The M2PO repro's cells are the two grids'.
# Every grid starts from one committed warm start, results/staleness_study/warm_start
# (trained here once by experiments/sft.py when missing, then committed), so that grids run
# in different sittings, on different machines, share their starting point exactly.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code in every process
ROOT=$(realpath -m "${1:?usage: staleness_study.sh ROOT [FIRST_SEED] [LAST_SEED]}")
FIRST=${2:-0}
LAST=${3:-9}
WARM=results/staleness_study/warm_start
if [ ! -f "$WARM/config.json" ]; then
  python experiments/sft.py --config=configs/default.py --workdir="$ROOT/warm"
  mkdir -p "$WARM"
  cp "$ROOT"/warm/model/* "$WARM"/
  cp "$ROOT"/warm/sft_summary.json "$WARM"/ 2>/dev/null || true
fi
grid() {  # grid NAME CONFIG SEED: runs already committed under results/staleness_study/NAME
  echo "=== $(date -u +%H:%M:%S) $1 seed $3"
  local done=results/staleness_study/$1
  python experiments/ablate.py --config="$2" --workdir="$ROOT/$1" \
    --config.experiment.warm_start.checkpoint="$WARM" \
    --config.axes.seed.levels="($3,)" --config.axes.seed.only="$3" \
    ${LAGS:+--config.axes.lag.only="$LAGS"} \
    ${FINISHED:+--config.runner.finished_tables="$done"}
}
# In a later sitting, on a machine without the earlier workdirs, FINISHED=1 skips the runs
# that scripts/export_results.py committed (results/staleness_study/{main,lowlr,dppo}).
# ONLY=main|lowlr|tinker|dppo runs that grid alone: resolution (the full grid's seeds) comes
# first, the subgrids after (sitting 3 ran `ONLY=main ... 1 9`, then the whole script).
# LAGS=a,b,...: only those lags of the grid (the 5-point goal is stated at lags >= 4, so
# sitting 7 ran main's seeds 4+ at 0,4,8,16,32 first and leaves lags 1-2 for later). Any seed
# number runs (its level is set per call; the configs list seeds 0-9).
want() { [ -z "${ONLY:-}" ] || [ "$ONLY" = "$1" ]; }
# GRIDS=protocol: the pre-registered grids (configs/ablate/staleness_protocol.py, docs/
# staleness_study.md, Protocol), in-process, seed by seed; ONLY=<arg> runs one of them
# ('main' for its '' grid). countdown/sort/large train their own warm start in ROOT/<arg>.
# FINISHED=1 skips the runs scripts/export_results.py committed to results/staleness_protocol/.
if [ "${GRIDS:-}" = "protocol" ]; then
  P=configs/ablate/staleness_protocol.py
  for seed in $(seq "$FIRST" "$LAST"); do
    for arg in main mb4 varlag async sweep drift countdown sort large; do
      want "$arg" || continue
      cfg="$P:${arg#main}"
      [ "$arg" = main ] && cfg="$P"
      echo "=== $(date -u +%H:%M:%S) protocol $arg seed $seed"
      # exit 0: the grid lists this seed; 3: it does not (skip); anything else (the config
      # does not import: no environment, a broken checkout) stops the study here, rather than
      # reading as "not listed" and racing through every grid and seed in a second
      listed=0
      python - "$cfg" "$seed" <<'PY' || listed=$?
import sys; sys.path.insert(0, ".")
import importlib.util
path, _, arg = sys.argv[1].partition(":")
spec = importlib.util.spec_from_file_location("c", path); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
sys.exit(0 if int(sys.argv[2]) in m.get_config(arg).axes.seed.levels else 3)
PY
      case "$listed" in 0|3) ;; *)
        echo "cannot read $cfg with $(command -v python) (exit $listed)" >&2; exit "$listed" ;;
      esac
      if [ "$listed" = 0 ]; then
        warm=()
        case "$arg" in countdown|sort|large) ;; *)
          warm=(--config.experiment.warm_start.checkpoint="$WARM") ;; esac
        python experiments/ablate.py --config="$cfg" --workdir="$ROOT/protocol/$arg" \
          "${warm[@]}" --config.axes.seed.only="$seed" ${LAGS:+--config.axes.lag.only="$LAGS"} \
          ${FINISHED:+--config.runner.finished_tables="results/staleness_protocol/$arg"}
      fi
    done
  done
  echo "=== $(date -u +%H:%M:%S) done: protocol seeds $FIRST-$LAST"
  exit 0
fi
for seed in $(seq "$FIRST" "$LAST"); do
  want main && grid main configs/ablate/staleness.py "$seed"
  want lowlr && grid lowlr configs/ablate/staleness.py:lowlr "$seed"
  want tinker && grid main configs/repro/tinker_kl.py "$seed"   # its lag-0 ppo runs are the grid's
  want dppo && grid dppo configs/repro/decoupled_ppo.py "$seed"
done
echo "=== $(date -u +%H:%M:%S) done: seeds $FIRST-$LAST"
