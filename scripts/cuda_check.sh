#!/usr/bin/env bash
# The CUDA checks, in one command for a lent GPU machine (no package index there; its python3 holds torch+CUDA).
#   here, first:   bash scripts/cuda_check.sh wheels   (downloads the dependencies that machine lacks into .whl/;
#                  add /.whl/ to .git/info/exclude and carry .whl)
#                  bash scripts/cuda_check.sh llamacpp-src   (llama.cpp's source from the llama-cpp-python sdist, cut
#                  to what llama-bench needs, into .devwork/llama.cpp; add /.devwork/ to .git/info/exclude and carry it)
#   there:         bash scripts/cuda_check.sh bandwidth tests bench profile host llamacpp
# Installs the carried wheels and spec-cli (no dependencies), then the steps named: tests (the suite on CUDA;
# real-model tests deselected: their files come from PyPI), bench (plain decode eager vs CUDA graphs and the verify
# cost of a 1.5b-shaped F16 model: scripts/shaped_gguf.py; verify: the compiled curve alone), compile-tests (tests/test_compile.py alone, its CUDA
# cases included), profile (scripts/cuda_profile.py on that model, CUDA graphs and eager), host (its --host:
# cProfile of the host's side of a CUDA-graph step), llamacpp (llama-bench
# built for CUDA, sm_90, on the same model). Logs go to $OUT (the device tool brings them back).
WHEELS="gguf==0.19.0 fastapi==0.165.0 opentelemetry-api==1.45.2 starlette==1.10.0 pydantic==2.14.4
  pydantic_core==2.50.5 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0
  uvicorn==0.54.0 click==8.5.1 h11==0.16.0 anyio==4.16.0 idna==3.20 sniffio==1.3.1 typer==0.29.2 rich==15.0.0
  openai==3.57.0 jiter==0.19.0 distro==1.9.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5"
if [ "${1:-}" = wheels ]; then
  exec python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $WHEELS
fi
if [ "${1:-}" = llamacpp-src ]; then  # llama-cpp-python 0.3.36's vendored llama.cpp, the version compare_peers runs
  set -e; tmp=$(mktemp -d); dst=.devwork/llama.cpp
  python3 -m pip download -q --no-deps --no-binary=:all: llama-cpp-python==0.3.36 -d "$tmp"
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"; src="$tmp"/llama_cpp_python-0.3.36/vendor/llama.cpp
  rm -rf "$dst"; mkdir -p "$dst"/tools "$dst"/ggml/src
  cp -r "$src"/{CMakeLists.txt,LICENSE,cmake,include,src,common,vendor} "$dst"/
  cp -r "$src"/ggml/{CMakeLists.txt,include,cmake} "$dst"/ggml/
  for f in "$src"/ggml/src/*; do case ${f##*/} in ggml-*) [ -d "$f" ] || cp "$f" "$dst"/ggml/src/ ;; *) cp -r "$f" "$dst"/ggml/src/ ;; esac; done
  cp -r "$src"/ggml/src/{ggml-cpu,ggml-cuda} "$dst"/ggml/src/
  cp -r "$src"/tools/llama-bench "$dst"/tools/
  printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\n' > "$dst"/tools/CMakeLists.txt
  rm -rf "$tmp"; du -sh "$dst"; exit 0
fi
set -uo pipefail
OUT=${OUT:-/tmp/cuda-check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

shaped() { [ -f /tmp/m/q15.gguf ] || python3 scripts/shaped_gguf.py qwen2.5-coder-1.5b /tmp/m/q15.gguf; }
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
    compile-tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_compile.py 2>&1 | tee "$OUT/compile-tests.log" | tail -30 ;;
    bench)
      shaped
      spec-cli bench -m /tmp/m/q15.gguf -p 0 -n 128 --compile off,on -r 3 -o md 2>&1 | tee "$OUT/bench.md"
      spec-cli bench -m /tmp/m/q15.gguf -p 0 -n 0 --verify-cost 16 --compile off,on -r 3 -o md 2>&1 \
        | tee "$OUT/verify.md" ;;
    profile)
      shaped
      for mode in on off; do python3 scripts/cuda_profile.py /tmp/m/q15.gguf --compile $mode 2>&1 | tee "$OUT/profile-$mode.log"; done ;;
    host)  # where the host's time goes in a CUDA-graph step (cProfile), and the unprofiled wall time per token
      shaped
      python3 scripts/cuda_profile.py /tmp/m/q15.gguf --compile on --host --tokens 48 2>&1 | tee "$OUT/host.log" ;;
    llamacpp)  # resumable: /tmp/lb survives while the machine stays warm, so a build cut by the timeout goes on
      shaped & writer=$!
      [ -f /tmp/lb/build.ninja ] || cmake -S .devwork/llama.cpp -B /tmp/lb -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$OUT/llamacpp-build.log" 2>&1
      start=$(date +%s)
      timeout "${BUILD_S:-420}" cmake --build /tmp/lb --target llama-bench -j 16 >> "$OUT/llamacpp-build.log" 2>&1 \
        || { tail -5 "$OUT/llamacpp-build.log"; echo "build stopped after $(( $(date +%s) - start )) s"; exit 1; }
      echo "llama-bench built in $(( $(date +%s) - start )) s"; wait $writer
      /tmp/lb/bin/llama-bench -m /tmp/m/q15.gguf -ngl 99 -p 0 -n 128 -r 3 -o md 2>&1 | tee "$OUT/llamacpp-bench.md" ;;
    verify)  # the verify-cost curve under CUDA graphs alone (k = 1..16 rows; eager's is in the bench step)
      shaped
      timeout 200 spec-cli bench -m /tmp/m/q15.gguf -p 0 -n 0 --verify-cost 16 --compile on -r 3 -o md 2>&1 \
        | tee "$OUT/verify-on.md" ;;
    decode)  # ours beside llama-bench on the same warm machine: plain decode under CUDA graphs
      shaped
      spec-cli bench -m /tmp/m/q15.gguf -p 0 -n 128 --compile on -r 3 -o md 2>&1 | tee "$OUT/decode.md" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
