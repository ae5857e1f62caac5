#!/usr/bin/env bash
# Regenerates this folder, in two steps run from the repository root on a
# quiet machine (about 8 + 15 minutes on 2 cores):
#   bash benchmarks/algorithms/record.sh tune    # the built-in auto table's CPU
#                                                # entries (gloo, 2 and 4 ranks, on
#                                                # one host and on as many simulated
#                                                # hosts at 1 Gbit/s, root; + 15
#                                                # minutes); commit pycomm/auto_table.json
#   bash benchmarks/algorithms/record.sh study   # every all-reduce algorithm on
#                                                # 4 ranks: shm, gloo, 2 x 2 hosts,
#                                                # and the model's crossovers
set -euo pipefail
out=benchmarks/algorithms
study() {  # name, then the study's arguments
    local name=$1; shift
    python -m pycomm.bench allreduce "$@" -b 1K -e 64M -f 4 \
        --json "$out/$name.json" --plot "$out/$name.png" | tee "$out/table_$name.txt"
    python -m pycomm.bench model "$out/$name.json" --worlds 8,64,1024 | tee "$out/model_$name.txt"
}
case "${1:-}" in
    tune)
        for n in 2 4; do
            python -m pycomm.bench tune --nproc "$n" --transport gloo --out pycomm/auto_table.json
            python -m pycomm.bench tune --hosts "$n" --nproc 1 --transport gloo --link-rate 1gbit \
                -b 1K -e 64M --out pycomm/auto_table.json | tee "$out/tune_hosts_${n}x1_1gbit.txt"
        done ;;
    study)
        study shm_4ranks --nproc 4 --transport shm --algo all,direct
        study gloo_4ranks --nproc 4 --transport gloo --algo all
        study hosts_2x2 --hosts 2 --nproc 2 --algo all,flat ;;
    *) echo "usage: $0 tune|study" >&2; exit 2 ;;
esac
