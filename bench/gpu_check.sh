#!/usr/bin/env bash
# The GPU device check: one script, under 8 minutes on one H200, one table at the end.
#
#   bench/gpu_check.sh                  on the GPU machine, from anywhere in the repo
#   bench/gpu_check.sh --fetch-wheels   on a machine that reaches PyPI: put the packages vx
#                                       needs and the device image lacks into .whl/ (ignored
#                                       by git; carry it to the device with the working tree)
#
# Sections (each guarded: a failing or timed-out section becomes a FAIL row, the rest go on):
#   env     device, versions, the per-hardware defaults vx picks on it
#   pytest  pytest -m gpu tests/gpu/test_gpu_marked.py
#   triton  the Triton kernels against their torch references at Llama-8B head sizes
#   parity  greedy tokens vs HF transformers on the GPU (SmolLM2-135M if its converted weights
#           are in $VX_CACHE or $VX_SMOLLM2_DIR, else a random SmolLM2-shaped model)
#   decode  Llama-3.1-8B-shaped random bf16 model: decode step at batch 1/8/64/256, eager and
#           with CUDA graphs, against the weight-streaming floor (weights / measured copy BW)
#   serve   `vx serve --device cuda` + `vx bench serve` at concurrency 64
#   cpu     the host's own CPU (often a Xeon with AMX): bench/forward.py and bench/step_profile.py
#           with 2 threads on two physical cores, random SmolLM2-shaped weights (bench/host_cpu.py)
#
# Python: $PY if set; else .venv/bin/python when its torch sees CUDA (`make setup
# TORCH_SPEC=...` with a CUDA build); else python3 (the device image's, with torch, triton and
# transformers). Nothing is downloaded here: missing pure packages come from .whl/ if present.
# Results: $OUT/gpu_check.jsonl (or /tmp), the serve JSON and logs beside it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"

# Importable names of what vx needs beyond the image (see pyproject.toml), and their wheels.
NEEDED_MODULES="msgspec starlette hypercorn h2 orjson gguf anyio"
WHEELS="msgspec orjson starlette hypercorn h2 hpack hyperframe priority wsproto h11 gguf anyio typing_extensions"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$w"
  done
  ls -la .whl
  exit 0
fi

OUTDIR=${OUT:-/tmp}/gpu_check
mkdir -p "$OUTDIR"
RES=${VX_GPU_CHECK_RESULTS:-$OUTDIR/gpu_check.jsonl}
: > "$RES"
BUDGET_S=${VX_GPU_CHECK_BUDGET_S:-470}   # the whole script stays under 8 minutes
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

fail_row() {  # section, check, message: a row written without Python (it may be what broke)
  local msg=${3//\"/\'}
  printf '{"section": "%s", "check": "%s", "result": "%s", "status": "FAIL"}\n' "$1" "$2" "$msg" >> "$RES"
  echo "[$1] $2: FAIL: $3"
}

pick_python() {
  if [[ -n "${PY:-}" ]]; then echo "$PY"; return; fi
  if [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
    echo "$ROOT/.venv/bin/python"; return
  fi
  echo python3
}
PY=$(pick_python)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import $(echo $NEEDED_MODULES | tr ' ' ',')" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/vx-site .whl/*.whl >/dev/null 2>&1 || true
    export PYTHONPATH="$ROOT:/tmp/vx-site${PYTHONPATH#$ROOT}"
  fi
fi
echo "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

# run_section NAME CAP_SECONDS CMD...: runs CMD under min(CAP, time left); failure -> FAIL row.
run_section() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET_S - SECONDS))
  if (( left < 20 )); then fail_row "$name" "section" "skipped: the time budget is spent"; return 0; fi
  local t=$(( cap < left ? cap : left ))
  echo "=== $name (up to ${t}s, ${SECONDS}s elapsed)"
  local rc=0
  if declare -F "$1" >/dev/null; then  # a function of this script: run it in a child bash
    set -- bash -c "set -euo pipefail; $*"
  fi
  timeout --kill-after=10 "$t" "$@" > >(tee "$OUTDIR/$name.log") 2>&1 || rc=$?
  if (( rc == 124 || rc == 137 )); then fail_row "$name" "section" "timed out after ${t}s (see $name.log)"
  elif (( rc != 0 )); then fail_row "$name" "section" "exit $rc: $(tail -n 3 "$OUTDIR/$name.log" | tr '\n' ' ' | cut -c1-300)"
  fi
  return 0
}

if ! "$PY" -c "import torch, msgspec, vx.config; assert torch.cuda.is_available()" 2>"$OUTDIR/import.log"; then
  fail_row env "python" "cannot import torch (with CUDA), msgspec and vx: $(tail -n 1 "$OUTDIR/import.log") -- run --fetch-wheels where PyPI is reachable and carry .whl/"
  cat "$RES"
  exit 1
fi

run_section env 45 "$PY" bench/gpu_check.py env --results "$RES"
run_section triton 75 "$PY" bench/gpu_check.py triton --results "$RES"

pytest_section() {
  local rc=0 line
  "$PY" -m pytest -q -m gpu tests/gpu/test_gpu_marked.py -p no:cacheprovider \
    -o addopts="-ra -p anyio" --timeout 60 > "$OUTDIR/pytest-run.log" 2>&1 || rc=$?
  cat "$OUTDIR/pytest-run.log"
  line=$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$OUTDIR/pytest-run.log" | tail -n 1 || true)
  printf '{"section": "pytest", "check": "pytest -m gpu", "result": "%s", "status": "%s"}\n' \
    "${line//\"/\'}" "$([[ $rc == 0 ]] && echo ok || echo FAIL)" >> "$RES"
  return 0
}
export PY RES OUTDIR ROOT PYTHONPATH
export -f fail_row pytest_section
run_section pytest 120 pytest_section
run_section parity 90 "$PY" bench/gpu_check.py parity --results "$RES" ${VX_SMOLLM2_DIR:+--model "$VX_SMOLLM2_DIR"}

serve_section() {
  local model label="" ids=()
  model=${VX_SMOLLM2_DIR:-$(ls -d "${VX_CACHE:-$HOME/.cache/vx}"/converted/smollm2-135m* 2>/dev/null | head -n 1 || true)}
  if [[ -z "$model" ]]; then
    model="$OUTDIR/random-smollm2"
    "$PY" bench/gpu_check.py make-model "$model" >/dev/null
    label="(random SmolLM2-shaped)"
    ids=(--min-token-id 10 --max-token-id 400)
  else
    label="(SmolLM2-135M)"
  fi
  local port=18123
  setsid "$PY" -m vx serve "$model" --device cuda --port $port --max-model-len 2048 \
    --log-level warning > "$OUTDIR/serve-server.log" 2>&1 &
  local spid=$!
  trap 'kill -TERM -- -'"$spid"' 2>/dev/null || true' RETURN
  local up=0
  for _ in $(seq 1 150); do
    if "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/ready', timeout=2)" 2>/dev/null; then up=1; break; fi
    kill -0 "$spid" 2>/dev/null || break
    sleep 1
  done
  if (( ! up )); then
    echo "server did not come up; its log:"; tail -n 20 "$OUTDIR/serve-server.log"; return 1
  fi
  "$PY" -m vx bench serve --base-url "http://127.0.0.1:$port" --concurrency 64 --num-prompts 256 \
    --input-len 128 --output-len 128 "${ids[@]}" --json "$OUTDIR/serve.json"
  "$PY" bench/gpu_check.py serve-row --results "$RES" --json "$OUTDIR/serve.json" --label "$label"
  kill -TERM -- -"$spid" 2>/dev/null || true
  for _ in $(seq 1 30); do kill -0 "$spid" 2>/dev/null || break; sleep 1; done
  kill -KILL -- -"$spid" 2>/dev/null || true
}
export -f serve_section
run_section serve 120 serve_section
run_section decode 120 "$PY" bench/gpu_check.py decode --results "$RES"
run_section cpu 240 "$PY" bench/host_cpu.py --results "$RES" --budget-s 220

"$PY" bench/gpu_check.py table --results "$RES" || cat "$RES"
echo "total ${SECONDS}s; results in $RES"
