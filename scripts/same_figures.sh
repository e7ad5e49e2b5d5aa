#!/usr/bin/env bash
# After a refactor: do the product's headline runs still give the same figures?
#
#   bash scripts/same_figures.sh ROOT [quick|main|agent|agent_kv|two_process]...
#
# Runs each named check (default: all) from this checkout into ROOT/<name> and prints one JSON
# line per check: held-out accuracy first -> last and wall time (the main job, the agent
# configs, the 2-process learner), or every run's held-out accuracy (the quick staleness
# ablation). The quick ablation's runs are lag-injected and lock-step, hence bit-reproducible:
# its accuracies must be IDENTICAL before and after a change that should not alter sampling or
# training; the async runs agree within noise (BENCHMARKS.md has earlier figures).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
ROOT=$(realpath -m "${1:?usage: same_figures.sh ROOT [check]...}")
shift
CHECKS=${*:-quick main agent agent_kv two_process}
mkdir -p "$ROOT"
train() {  # train NAME ARGS...
  local name=$1; shift
  local t0=$SECONDS
  python experiments/train.py --workdir="$ROOT/$name" "$@" > "$ROOT/$name.log" 2>&1
  python - "$ROOT/$name/summary.json" "$name" $((SECONDS - t0)) <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({"check": sys.argv[2], "wall_s": int(sys.argv[3]),
                  "heldout_first": s.get("eval_accuracy_first"),
                  "heldout_last": s.get("eval_accuracy_last")}))
PY
}
for check in $CHECKS; do
  case $check in
    main) train main --config=configs/default.py ;;
    agent) train agent --config=configs/agent_calculator.py ;;
    agent_kv) train agent_kv --config=configs/agent_kv.py ;;
    two_process) train two_process --config=configs/default.py \
        --config.launch.learner_processes=2 "--config.mesh.shape=(2,1,1)" ;;
    quick)
      t0=$SECONDS
      python experiments/ablate.py --config=configs/ablate/staleness.py:quick \
        --workdir="$ROOT/quick" > "$ROOT/quick.log" 2>&1
      python - "$ROOT/quick.log" $((SECONDS - t0)) <<'PY'
import json, re, sys
runs = dict(re.findall(r"done\s+(\S+) in \d+ s \(held-out accuracy ([0-9.]+)\)",
                       open(sys.argv[1]).read()))
print(json.dumps({"check": "quick", "wall_s": int(sys.argv[2]), "runs": runs}))
PY
      ;;
    *) echo "unknown check $check" >&2; exit 2 ;;
  esac
done
