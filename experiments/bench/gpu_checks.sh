#!/usr/bin/env bash
# The project's GPU measurements, sized for a short lease of one GPU: what the
# machine is, then each benchmark under its own time limit, its output in
# $OUT/<name>.txt. All seven take at most 15.3 minutes; CHECKS names a subset,
# so that two calls of under 10 minutes each cover them:
#
#   OUT=/tmp/checks bash experiments/bench/gpu_checks.sh           # on a GPU
#   OUT=/tmp/checks CHECKS="head_gemma2 head_post_training head_filter" \
#       bash experiments/bench/gpu_checks.sh                       # 6.8 min at most
#   OUT=/tmp/checks CHECKS="ensemble_gpu decode speculative attention" \
#       bash experiments/bench/gpu_checks.sh                       # 8.5 min at most
#   OUT=/tmp/checks QUICK=1 bash experiments/bench/gpu_checks.sh   # tiny, any machine
#
# The checks (head_gemma2, head_post_training, head_filter, ensemble_gpu,
# decode, speculative, attention) and what each measures: docs/benchmarks.md, "On a lent GPU". Run
# from the repository root, with jax (with CUDA) and the packages of
# docs/scale_out.md. A benchmark that fails or runs out of time is reported,
# and the next one still runs; the exit status counts the failures.
set -u -o pipefail

out=${OUT:-/tmp/gpu_checks}
mkdir -p "$out"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
# QUICK: each benchmark's --quick sizes (the gemma2 preset has none: the
# quick head run is the default shapes' --quick), to check that it all runs;
# its limits are three times the GPU's, since a loaded CPU is no GPU.
head=(--preset=gemma2)
post_training=(--post_training=dpo,grpo --shapes=8192,2304,256000 --dtype=bfloat16 --repeats=2)
filter=(--filter_eps=auto --peaked --shapes=8192,2304,256000 --dtype=bfloat16 --repeats=2)
decode=(--decoders=greedy --batch_sizes=32 --max_lens=256,1024 --new_tokens=200)
speculative=(--gpt2 --only_gpt2 --batch_sizes=1,8,32 --new_tokens=64 --repeats=3)
attention=()  # its defaults: GPT-2 small's shape, float32 and bfloat16
quick=()
if [ -n "${QUICK:-}" ]; then
    head=(--quick)
    post_training=(--quick --post_training=dpo,grpo)
    filter=(--quick --filter_eps=auto --peaked --dtype=bfloat16)
    decode=(--quick --decoders=greedy)
    speculative=(--quick --gpt2 --only_gpt2 --batch_sizes=1)
    attention=(--quick)
    quick=(--quick)
fi
known="head_gemma2 head_post_training head_filter ensemble_gpu decode speculative attention"
for name in ${CHECKS:-}; do
    case " $known " in
        *" $name "*) ;;
        *) echo "CHECKS: no check $name; the checks are: $known" >&2; exit 2 ;;
    esac
done
failures=0
checks=0

check() {  # check NAME SECONDS COMMAND...
    local name=$1 seconds=$2
    shift 2
    [ -n "${QUICK:-}" ] && seconds=$((3 * seconds))
    case " ${CHECKS:-$name} " in *" $name "*) ;; *) return ;; esac
    echo "== $name (at most ${seconds} s): $*"
    local start=$SECONDS
    checks=$((checks + 1))
    timeout "$seconds" "$@" >"$out/$name.txt" 2>&1
    local status=$?
    tail -n 40 "$out/$name.txt"
    echo "== $name: exit $status after $((SECONDS - start)) s"
    if [ "$status" -ne 0 ]; then
        failures=$((failures + 1))
    fi
}

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    "$python" -c 'import jax, sys; print(sys.version); print("jax", jax.__version__, jax.devices())'
} 2>&1 | tee "$out/machine.txt"

check head_gemma2 200 "$python" experiments/bench/bench_head.py "${head[@]}"
check head_post_training 120 "$python" experiments/bench/bench_head.py "${post_training[@]}"
check head_filter 90 "$python" experiments/bench/bench_head.py "${filter[@]}"
check ensemble_gpu 200 "$python" experiments/bench/bench_ensemble.py --gpu "${quick[@]}"
check decode 130 "$python" experiments/bench/bench_decode.py "${decode[@]}"
check speculative 120 "$python" experiments/bench/bench_speculative.py "${speculative[@]}"
check attention 60 "$python" experiments/bench/bench_attention.py "${attention[@]}"
echo "== $failures of $checks failed; outputs in $out"
exit "$failures"
