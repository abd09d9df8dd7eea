#!/usr/bin/env bash
# One lent GPU's checks, prepared to fit a short lease (under 10 minutes): the CUDA tests, then the
# benchmark on the 1.1B-class synthetic pair in bfloat16, compiled, at batch 1 and 16. Everything it
# reports lands in $OUT (at most 4 files): gpu.log (the machine, the copy bandwidth, the tests),
# bench.log, report.md and results.json. Compiling is most of the time (docs/benchmarks.md, "On a
# GPU"): the benchmark warms up every shape its methods use before it times anything (adaptive k,
# left out here, adds a graph per draft length). benchmarks/gpu_probe.py reports stage by stage.
#
# On a GPU machine without network, from the repository root, with wheels of packages newer than the
# machine's in .whl/ (ignored by git; transformers is the one the project's pin needs: the H200 image
# had 5.17.0), fetched beforehand where there is network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl transformers==5.23.0
# then:   OUT=/some/dir bash benchmarks/gpu_session.sh
# Dry run on a CPU:   DEVICE=cpu SIZE=tiny DTYPE=float32 OUT=/tmp/gpu bash benchmarks/gpu_session.sh
set -u
OUT=${OUT:?set OUT to the folder the results go to}
DEVICE=${DEVICE:-cuda} SIZE=${SIZE:-1b} DTYPE=${DTYPE:-bfloat16}
TEST_SECONDS=${TEST_SECONDS:-180} BENCH_SECONDS=${BENCH_SECONDS:-390}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
        export PYTHONPATH=/tmp/site:$PYTHONPATH || exit 1
fi
log=$OUT/gpu.log
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
    lscpu | grep -E "^(Model name|CPU\(s\))"
    python3 - <<EOF
import torch, transformers
from speculative.bench.memory import copy_bandwidth
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print(f"copy bandwidth (read + write): {copy_bandwidth(torch.device('$DEVICE')) / 1e9:.0f} GB/s")
EOF
} >"$log" 2>&1

start=$SECONDS
timeout "$TEST_SECONDS" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py >>"$log" 2>&1
echo "tests/test_cuda.py: exit $? in $((SECONDS - start)) s" >>"$log"

start=$SECONDS
timeout "$BENCH_SECONDS" python3 -m speculative bench --device "$DEVICE" --dtype "$DTYPE" --synthetic "$SIZE" \
    --compile --batch-size 1 16 --prompts chat --num-prompts 2 --max-tokens 128 --sweep-k 4 \
    --methods 'ours_ar*' 'ours_draft' 'ours_draft_compiled' 'hf_generate' 'hf_assisted' 'hf_static' \
    --out /tmp/gpu-bench >"$OUT/bench.log" 2>&1
echo "bench: exit $? in $((SECONDS - start)) s" >>"$log"
cp /tmp/gpu-bench/report.md /tmp/gpu-bench/results.json "$OUT"/ 2>/dev/null
tail -n 4 "$log"
