#!/usr/bin/env bash
# DFlash against DFlash 2 on the default, over several seeds: four arms of DVC experiments,
# then `dflash compare` of each arm against DFlash, its seeds pooled (paired intervals over
# prompts and seeds).
#
#   bench/dflash2_compare.sh [SEEDS...]     # default seeds: 0 1 2 (4 arms x 3 seeds = 12 runs)
#
# Arms, each seed k setting train.seed and batching.seed:
#   dflash-k       drafter.family dflash, from scratch (the baseline)
#   dflash2-k      drafter.family dflash2, from scratch
#   dflash2-ft-k   dflash2 fine-tuned for FT_EPOCHS (default 2) from the DFlash drafter of the
#                  first seed: the upgrade path
#   dflash-ft-k    dflash fine-tuned from that same drafter as long: as much training, no new
#                  modules, which tells the gain of DFlash 2's modules from that of training longer
# Run it in a workspace that has made `make repro`; each experiment reruns train -> evaluate
# only. On 2 CPU cores one run takes 4-5 minutes.
set -euo pipefail
seeds=("$@")
[ ${#seeds[@]} -gt 0 ] || seeds=(0 1 2)
ft=${FT_EPOCHS:-2}
# Every run names the params it sets: each `dvc exp run` leaves its own in params.yaml.
epochs=$(python -c 'import yaml; print(yaml.safe_load(open("params.yaml"))["train"]["epochs"])')
run() { dvc exp run -n "$1" -S batching.seed="$2" -S train.seed="$2" "${@:3}"; }
# The first seed runs last, so its drafter is the workspace's when it is copied.
for ((i = ${#seeds[@]} - 1; i >= 0; i--)); do
  run "dflash-${seeds[i]}" "${seeds[i]}" -S drafter.family=dflash -S drafter.init_from=null \
    -S train.epochs="$epochs"
done
first=models/init/dflash-seed${seeds[0]}
rm -rf "$first" && mkdir -p models/init && cp -r models/drafter "$first"
dvc add -q "$first"
for k in "${seeds[@]}"; do
  run "dflash2-$k" "$k" -S drafter.family=dflash2 -S drafter.init_from=null -S train.epochs="$epochs"
  run "dflash2-ft-$k" "$k" -S drafter.family=dflash2 -S drafter.init_from="$first" -S train.epochs="$ft"
  run "dflash-ft-$k" "$k" -S drafter.family=dflash -S drafter.init_from="$first" -S train.epochs="$ft"
done
arm() { for k in "${seeds[@]}"; do echo "$1-$k"; done; }
# shellcheck disable=SC2046
dflash compare $(arm dflash) $(arm dflash2) $(arm dflash2-ft) $(arm dflash-ft)
