#!/usr/bin/env bash
# Records this folder's results (README.md): the four collectives, pycomm vs
# gloo on 2 CPU ranks (shm), at 4 KiB and 64 MiB, then DTensor full_tensor()
# of a 64 MiB parameter. Run from the checkout with the extension built.
set -euo pipefail
cd "$(dirname "$0")"
export PYTHONPATH="$(cd ../.. && pwd)${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
uptime | tee load.txt
for c in reduce alltoall gather scatter; do
    python -m pycomm.bench "$c" --nproc 2 -b 4K -e 64M -f 16384 -n 50 -w 10 \
        --json "${c}_2ranks.json" | tee "table_${c}_2ranks.txt"
done
python -m torch.distributed.run --nproc-per-node 2 --master-addr 127.0.0.1 --master-port 29541 \
    bench_full_tensor.py --mib 64 --iters 10 --rounds 5 --json full_tensor_2ranks.json \
    | tee table_full_tensor_2ranks.txt
uptime | tee -a load.txt
