#!/usr/bin/env bash
# The CUDA checks, in one command for a lent GPU machine (no package index there; its python3 holds torch+CUDA).
#   here, first:   bash scripts/cuda_check.sh wheels   (downloads the dependencies that machine lacks into .whl/;
#                  add /.whl/ to .git/info/exclude and carry .whl)
#   there:         bash scripts/cuda_check.sh bandwidth tests bench
# Installs the carried wheels and spec-cli (no dependencies), then the steps named: tests (the suite on CUDA;
# real-model tests deselected: their files come from PyPI), bench (plain decode eager vs CUDA graphs and the verify
# cost of a 1.5b-shaped F16 model: scripts/shaped_gguf.py). Logs go to $OUT (the device tool brings them back).
WHEELS="gguf==0.19.0 fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 pydantic==2.14.4
  pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0
  uvicorn==0.54.0 click==8.5.1 h11==0.16.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1 typer==0.29.2 rich==15.0.0
  openai==3.57.0 jiter==0.19.0 distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5"
if [ "${1:-}" = wheels ]; then
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $WHEELS
fi
set -uo pipefail
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

for step in "$@"; do
  case $step in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -n 12 -m "not real_model" tests 2>&1 | tee "$OUT/tests.log" | tail -40 ;;
    bandwidth)
      python3 - <<'EOF' 2>&1 | tee "$OUT/bandwidth.log"
import torch
x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record(); [y.copy_(x) for _ in range(10)]; e.record(); torch.cuda.synchronize()
print(f"device-to-device copy: {2 * x.numel() * 10 / (s.elapsed_time(e) / 1e3) / 1e12:.2f} TB/s (read + write)")
EOF
      ;;
    bench)
      python3 scripts/shaped_gguf.py qwen2.5-coder-1.5b /tmp/m/q15.gguf
      spec-cli bench -m /tmp/m/q15.gguf -p 0 -n 128 --compile off,on -r 3 -o md 2>&1 | tee "$OUT/bench.md"
      spec-cli bench -m /tmp/m/q15.gguf -p 0 -n 0 --verify-cost 16 --compile off,on -r 3 -o md 2>&1 \
        | tee "$OUT/verify.md" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
