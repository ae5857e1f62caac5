#!/usr/bin/env bash
# The main job: sets up .venv from scratch and runs an all-reduce study on the
# CPU with 2 local ranks: every pycomm algorithm (ring, recursive doubling,
# halving-doubling, tree, auto) and symmetric memory beside torch.distributed's
# gloo, nccl-tests' table on stdout, JSON + PNG under results/.
#   bash scripts/study.sh [extra bench args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh
# shellcheck disable=SC1091
source .venv/bin/activate
mkdir -p results
python -m pycomm.bench allreduce --nproc 2 -b 1K -e 64M -f 4 --algo all,symmetric \
  --json results/allreduce_cpu.json --plot results/allreduce_cpu.png "$@"
python -m pycomm.bench model results/allreduce_cpu.json  # fits, crossovers, best per world size
echo "study: wrote results/allreduce_cpu.json and results/allreduce_cpu.png"
