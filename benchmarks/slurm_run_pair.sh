#!/bin/bash
# pearl vs roll-fixed on the dev cluster, 10 updates each, the example config
# (examples/runs/dev-cluster.yaml); pearl's run has its first elastic node taken back by
# its owner once its engines serve. Writes OUT/{pearl,roll-fixed}/analyze.json (pearl
# analyze --json --sacct-query). Run as root: sudo benchmarks/slurm_run_pair.sh [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
out_root="${1:-/tmp/pearl-slurm-pair}"
export PATH=$PWD/.venv/bin:$PATH PEARL_DEV_CLUSTER_DIR=/tmp/mdc PEARL_DEV_CLUSTER_PORT_BASE=25800
slurm/dev-cluster up >/dev/null 2>&1 || { echo "cluster failed"; exit 1; }
export SLURM_CONF=/tmp/mdc/etc/slurm.conf
wait_done() { for i in $(seq 600); do s=$(sacct -j "$1" -X -n -P -o State | head -1); case "$s" in COMPLETED|FAILED*|CANCELLED*) echo "$s"; return;; esac; sleep 1; done; echo timeout; }
for policy in pearl roll-fixed; do
  dir=$out_root/$policy; rm -rf $dir; mkdir -p $dir
  sed "s/^coordinator:/coordinator:\n  policy_name: $policy/" examples/runs/dev-cluster.yaml > $dir/run.yaml
  job=$(pearl run $dir/run.yaml --submit --folder $dir/jobs --run-dir $dir/out --steps 10)
  echo "$policy: job $job"
  if [ $policy = pearl ]; then
    for i in $(seq 300); do grep -q '"served_by":\["e-h20' $dir/out/rollout.jsonl 2>/dev/null && break; sleep 1; done
    node=$(grep -o '"served_by":\["e-h20-[0-9]' $dir/out/rollout.jsonl | head -1 | grep -o 'h20-[0-9]')
    echo "taking back $node at $(date +%T)"
    sbatch -p owner -w $node --gres=gpu:h20:2 -o /dev/null --wrap "sleep 120" >/dev/null
  fi
  echo "$policy: $(wait_done $job)"
  pearl analyze $dir/out --json --sacct-query > $dir/analyze.json 2> $dir/analyze.err
  echo "analyze rc $?"; tail -c 300 $dir/analyze.err
  scancel -u root; sleep 3
done
slurm/dev-cluster down >/dev/null 2>&1
