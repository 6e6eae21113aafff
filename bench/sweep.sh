#!/usr/bin/env bash
# Which strategy trains best, averaged over seeds: queue every batching strategy (those
# dflash.batching.choices lists, plug-ins included) over several seeds as DVC experiments, run
# the queue, then print mean ± std per strategy and `dflash compare` of every strategy against
# bucketed, its seeds pooled (paired intervals over prompts and seeds).
#
#   bench/sweep.sh [SEEDS...]        # default seeds: 0 1 2 (4 strategies x 3 seeds = 12 runs)
#
# Each experiment reruns plan -> train -> evaluate only (the target and data are shared).
# On 2 CPU cores one run takes ~3 minutes; `dvc queue start -j 1` runs them one at a time.
set -euo pipefail
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
base=$(git rev-parse HEAD)  # `dvc exp show` lists only HEAD's experiments: name their baseline
strategies=$(python -c 'from dflash.batching.choices import strategy_names; print(*strategy_names())')
for s in $strategies; do
  for k in "${seeds[@]}"; do
    dvc exp run --queue -n "sweep-$s-$k" \
      -S batching.strategy=$s -S batching.seed=$k -S train.seed=$k
  done
done
dvc queue start -j 1
# The worker can die on a half-written message of kombu's file broker (JSONDecodeError in
# .dvc/tmp/exps/celery/*.out), leaving runs queued: start one again whenever none runs.
while status=$(dvc queue status) && grep -qE 'Queued|Running' <<<"$status"; do
  if ! grep -q Running <<<"$status"; then dvc queue start -j 1; fi
  sleep 30
done
dvc exp show --json --rev "$base" > sweep.json
python bench/sweep_table.py --json sweep.json
names=()
for s in bucketed sorted shuffle packed; do
  for k in "${seeds[@]}"; do names+=("sweep-$s-$k"); done
done
dflash compare "${names[@]}"
