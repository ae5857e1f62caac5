#!/bin/bash
# Device run: compile and run the probe; output in $1.
set -u
out=${1:?outdir}; here=$(dirname "$0")
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm --format=csv > "$out/smi.txt" 2>&1
time nvcc -O3 -std=c++17 --expt-relaxed-constexpr -fmad=false -arch=sm_90a -Xptxas -v -o /tmp/probe "$here/probe.cu" > "$out/compile.log" 2>&1 || { tail -30 "$out/compile.log"; exit 1; }
/tmp/probe 2>&1 | tee "$out/probe.log"
