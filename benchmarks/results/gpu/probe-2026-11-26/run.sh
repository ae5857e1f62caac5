#!/usr/bin/env bash
# one-off diagnosis of the GPU check's SIGSEGVs (not committed)
set -x
OUT=$1
export PYTHONFAULTHANDLER=1
( time TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 python3 setup.py build_ext --inplace ) > $OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
tail -2 $OUT/build.log
command -v gdb && GDB=1
{
  if [[ -n "${GDB:-}" ]]; then
    timeout 40 gdb -q -batch -ex run -ex 'thread apply all bt 25' --args python3 diag/probe1.py
    timeout 40 gdb -q -batch -ex run -ex 'thread apply all bt 25' --args python3 diag/probe1.py check
  else
    timeout 40 python3 -X faulthandler diag/probe1.py
    timeout 40 python3 -X faulthandler diag/probe1.py check
  fi
} > $OUT/probe1.log 2>&1
grep "probe:\|SIG\|Fatal" $OUT/probe1.log | head -60
timeout 100 python3 -m tests.gpu_world --plan quick --size 2 --json $OUT/w2.json --budget 90 --gpus 1 \
  --cases argument_errors,checked_mode,ddp_hooks_and_powerSGD,timeout_aborts_and_raises > $OUT/world2.log 2>&1
grep "gpu_world:" $OUT/world2.log
timeout 90 python3 -m tests.gpu_world --plan rest --size 4 --json $OUT/w4.json --budget 80 --gpus 1 \
  --cases reduce_gather_scatter_all_to_all,p2p_and_batch,groups_split_and_new_group,reduce_scatter_all_gather > $OUT/world4.log 2>&1
grep "gpu_world:" $OUT/world4.log
