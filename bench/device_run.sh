#!/usr/bin/env bash
# What runs on the GPU machine, in one call: build there, C tests (CUDA
# device included), the same under ASan+UBSan, pytest, then the benchmark
# of the section asked for:
#   bash bench/device_run.sh [read|cache|vram|stream|tests]   (default:
#   read; several sections separated by commas run in that call, e.g.
#   vram,cache; "tests" runs only the build and the tests)
#   SKIP_TESTS=1 skips the C tests, ASan and pytest (the build and the
#   pip install still run): for a second call in one session.
#   SKIP_ASAN=1 skips only the ASan build and run.
#   read:  laden probe, bench/read.py
#   cache: bench/cache.py with piper-offload (wheels from .whl/, carried);
#          CACHE_ARGS are passed to it (e.g. "--peers vbar")
#   vram:  the C VBAR costs and bench/vbar.py with comfy-aimdo (.whl/)
#   stream: bench/stream.py without peers (STREAM_ARGS are passed to it;
#          STREAM_PEERS=1: with diffusers' group offloading and accelerate,
#          whose wheels .whl/hf brings)
#   load:  bench/load.py, cold and warm (LOAD_ARGS are passed to it)
#   hf:    bench/hf.py (HF_ARGS are passed to it)
#   adapters: bench/adapters.py (ADAPTERS_ARGS are passed to it)
#   expand: bench/expand.py (device expansion GB/s per format)
#   train: bench/train.py (training through streamed blocks; TRAIN_ARGS)
#   cold:  bench/cold.py --drop-all (cold and warm starts in fresh
#          processes: cat, dd, load_file, transformers, laden; COLD_ARGS)
#   unet:  bench/unet.py --config sdxl (call-order prefetch; UNET_ARGS)
#   moe:   bench/moe.py on CUDA (routed experts' rows against whole layers
#          and device_map="auto"; MOE_ARGS replace the shape)
#   lossless: bench/lossless.py on CUDA (the device decoder's GB/s
#          against the CPU one and the link; LOSSLESS_ARGS)
#   quant: bench/quant.py (bf16, fp8, GGUF Q8_0/Q4_K streamed and resident;
#          QUANT_ARGS are passed to it)
#   Wheels in .whl/hf/ (transformers, diffusers and their dependencies,
#   carried: the machine has no network) are installed into /tmp/hfsite
#   first, for pytest's test_hf.py and bench/hf.py.
#   trace: the trace's C tests and test_trace.py, then bench/trace.py
#          (TRACE_ARGS are passed to it; the trace and picture in $OUT/trace)
#   multi: several GPUs (nvidia-h200-x2): the C tests of several devices
#          in one process, pytest of test_shared.py,
#          test_tensor_parallel.py, test_multi_device.py, then
#          bench/shared.py and bench/tp.py over every GPU
#   PYTEST_LIMIT=seconds bounds the pytest run (a hang costs the call).
#   PYTEST_FILES="test_a.py test_b.py" runs only those pytest files.
# Logs go to $OUT (or bench/out).
set -uo pipefail
SECTION=${1:-read}
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
# NVRTC from torch's CUDA wheels, for the C tests of device expansion
# (Python finds it by itself).
LADEN_NVRTC=$(python3 -c 'import glob,site,sys; f=sorted(g for p in site.getsitepackages()+sys.path for g in glob.glob(p+"/nvidia/*/lib/libnvrtc.so.*") if "builtins" not in g); print(f[0] if f else "")' 2>/dev/null)
[ -n "$LADEN_NVRTC" ] && export LADEN_NVRTC
if [ -d .whl/hf ]; then
  python3 -m pip install -q --no-deps --target /tmp/hfsite .whl/hf/*.whl 2>&1 | grep -v WARNING | tail -2
  export PYTHONPATH=/tmp/hfsite${PYTHONPATH:+:$PYTHONPATH}
fi
want() { case ",$SECTION," in *",$1,"*) return 0;; esac; return 1; }
log() { echo "== $* (+$(( $(date +%s) - T0 )) s)"; }
{
  log "machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nproc; free -g | head -2; df -h . | tail -1; python3 --version
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.is_available())'
} 2>&1 | tee "$OUT/machine.log"
if [ "${SKIP_TESTS:-0}" = 1 ]; then
  log "build (tests skipped)"
  cmake -S . -B build -DLADEN_WERROR=ON >/dev/null && cmake --build build -j16 2>&1 | grep -E "error|warning"
  log "pip install"
  python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -3
else
  log "build + C tests"
  ( cmake -S . -B build -DLADEN_WERROR=ON >/dev/null && cmake --build build -j16 2>&1 | grep -E "error|warning" ;
    ./build/laden_tests ) 2>&1 | tee "$OUT/ctest.log" | tail -40
  if [ "${SKIP_ASAN:-0}" != 1 ]; then
  log "C tests under ASan+UBSan"
  ( cmake -S . -B build-asan -DLADEN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null &&
    cmake --build build-asan -j16 2>&1 | grep -E "error|warning" ;
    ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 ./build-asan/laden_tests dev_ host_ engine_ vram_ stream_ io_ expand_ grads_ ) \
    2>&1 | tee "$OUT/asan.log" | tail -12
  fi
  log "pip install + pytest"
  python3 -m pip install -q --no-build-isolation --no-deps . 2>&1 | tail -3
  (cd python/tests && timeout ${PYTEST_LIMIT:-86400} python3 -m pytest -q -rfs -p no:cacheprovider ${PYTEST_FILES:-.} 2>&1) | tee "$OUT/pytest.log" | tail -5
fi
if want read; then
  log "laden probe"
  laden probe --dir . 2>&1 | tee "$OUT/probe.log"
  log "bench/read.py"
  python3 bench/read.py --size 4GB --sweep --dir bench/out 2>&1 | tee "$OUT/read.log"
fi
if want vram; then
  log "comfy-aimdo wheel"
  python3 -m pip install -q --no-deps --upgrade --target /tmp/site .whl/comfy_aimdo-*.whl 2>&1 | grep -v WARNING | tail -2
  log "bench/vbar.py"
  PYTHONPATH=/tmp/site python3 bench/vbar.py 2>&1 | tee "$OUT/vbar.log"
fi
if want cache; then
  log "piper-offload wheels"
  python3 -m pip install -q --no-deps --ignore-requires-python --target /tmp/site \
    .whl/piper_offload-*.whl .whl/piper_kernels-*.whl 2>&1 | tail -2
  log "bench/cache.py"
  PYTHONPATH=/tmp/site python3 bench/cache.py ${CACHE_ARGS:-} 2>&1 | tee "$OUT/cache.log"
fi
if want stream; then
  log "bench/stream.py"
  python3 bench/stream.py $([ "${STREAM_PEERS:-0}" = 1 ] || echo --no-peers) \
    --json "$OUT/stream.json" ${STREAM_ARGS:-} 2>&1 | tee "$OUT/stream.log"
fi
if want load; then
  log "bench/load.py"
  python3 bench/load.py ${LOAD_ARGS:-} 2>&1 | tee "$OUT/load.log"
fi
if want hf; then
  log "bench/hf.py"
  python3 bench/hf.py ${HF_ARGS:-} 2>&1 | tee "$OUT/hf.log"
fi
if want adapters; then
  log "bench/adapters.py"
  python3 bench/adapters.py ${ADAPTERS_ARGS:-} 2>&1 | tee "$OUT/adapters.log"
fi
if want expand; then
  log "bench/expand.py"
  python3 bench/expand.py 2>&1 | tee "$OUT/expand.log"
fi
if want lossless; then
  log "bench/lossless.py (device decoder)"
  python3 bench/lossless.py --device cuda ${LOSSLESS_ARGS:-} 2>&1 | tee "$OUT/lossless.log"
fi
if want quant; then
  log "bench/quant.py"
  python3 bench/quant.py ${QUANT_ARGS:-} 2>&1 | tee "$OUT/quant.log"
fi
if want cold; then
  # Issue 35's table: fresh processes, cold (drop_caches as root) and warm.
  log "bench/cold.py"
  # eval: COLD_ARGS may quote method names, which hold spaces
  eval "python3 bench/cold.py --drop-all ${COLD_ARGS:-}" 2>&1 | tee "$OUT/cold.log"
fi
if want moe; then
  log "bench/moe.py (a Qwen3-MoE-shaped model under a quarter of its size)"
  python3 bench/moe.py --device cuda ${MOE_ARGS:---layers 16 --experts 128 --top-k 8 --hidden 2048 --expert-width 768 --budget 0.25 --prompt 2048} 2>&1 | tee "$OUT/moe.log"
fi
if want unet; then
  log "bench/unet.py (SDXL-shaped UNet under half its size)"
  python3 bench/unet.py --config sdxl ${UNET_ARGS:-} 2>&1 | tee "$OUT/unet.log"
fi
if want train; then
  log "bench/train.py"
  python3 bench/train.py ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train.log"
fi
if want trace; then
  log "C trace tests (CUDA device included)"
  ./build/laden_tests trace_ stream_trace 2>&1 | tee "$OUT/ctrace.log" | tail -8
  log "pytest test_trace.py"
  (cd python/tests && python3 -m pytest -q -p no:cacheprovider test_trace.py 2>&1) | tee "$OUT/pytest-trace.log" | tail -15
  log "bench/trace.py"
  python3 bench/trace.py --out "$OUT/trace" ${TRACE_ARGS:-} 2>&1 | tee "$OUT/trace.log"
fi
if want multi; then
  NG=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  log "multi-GPU tests ($NG GPUs)"
  ./build/laden_tests dev_keeps dev_threads_on_several stream_two_devices \
    stream_shared_copy_two_devices engine_a_cache_per_device \
    engine_caches_of_a_host 2>&1 | tee "$OUT/ctest-multi.log" | tail -8
  (cd python/tests && python3 -m pytest -q -p no:cacheprovider test_shared.py \
    test_tensor_parallel.py test_multi_device.py 2>&1) | tee "$OUT/pytest-multi.log" | tail -5
  log "bench/shared.py"
  python3 bench/shared.py --procs "$NG" 2>&1 | tee "$OUT/shared.log"
  log "bench/tp.py"
  python3 bench/tp.py --procs "$NG" 2>&1 | tee "$OUT/tp.log"
fi
log "done"
