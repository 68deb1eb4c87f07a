# pi0 - build the library (static + shared), the `pi0` command and the tests.
#
#   make            build/libpi0.a, build/libpi0.so, build/pi0
#   make deps       install what the build and the tests need (Debian packages, PyPI packages)
#   make run        the main job: `pi0 bench` on built-in random weights of the real size
#   make test       every CPU test (and a compile of every CUDA source when nvcc is present)
#   make test-asan  the same tests built with AddressSanitizer + UndefinedBehaviorSanitizer
#   make test-gpu   the GPU tests (needs nvcc and a GPU)
#   make fuzz       the libFuzzer harnesses of tests/fuzz/, built with clang + ASan + UBSan (build-fuzz/fuzz/)
#   make fuzz-smoke each harness for FUZZ_SECONDS (default 30) from its seed corpus; fails on any finding
#
# Dependencies: OpenBLAS (GEMMs) and jansson (JSON), found through pkg-config; override
# BLAS_CFLAGS/BLAS_LIBS/JSON_CFLAGS/JSON_LIBS to point elsewhere. CUDA is used when nvcc is found.
# The server side (`pi0 infer`, `pi0 serve`) needs msgpack-c and libwebsockets; without them the
# library and the other commands still build (WITH_SERVER= leaves them out on purpose).
#
# The configuration (compilers, flags, which optional parts are in) is recorded in build/config.txt
# and every object depends on that file, which is rewritten only when the configuration changes: a
# library installed, CFLAGS=..., WITH_SERVER= all rebuild what they affect, and nothing else.

BUILD ?= build
VERSION = 0.5.0
VERSION_MAJOR = 0

# `make deps GOAL...`: what `deps` installs changes the configuration, and one make decides its
# configuration before it runs any recipe. So the other goals run in a second make once deps is done.
GOALS_AFTER_DEPS := $(filter-out deps,$(MAKECMDGOALS))
ifneq ($(and $(filter deps,$(MAKECMDGOALS)),$(GOALS_AFTER_DEPS)),)
FIRST_GOAL := $(firstword $(GOALS_AFTER_DEPS))
.PHONY: $(GOALS_AFTER_DEPS)
$(FIRST_GOAL): deps
	@$(MAKE) --no-print-directory $(GOALS_AFTER_DEPS)
$(filter-out $(FIRST_GOAL),$(GOALS_AFTER_DEPS)): $(FIRST_GOAL)
	@:
else

CC ?= cc
OPT ?= -O2
SANITIZE ?=

PKG_CONFIG ?= pkg-config
BLAS_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags openblas 2>/dev/null || echo -I/usr/include/x86_64-linux-gnu/openblas-openmp)
BLAS_LIBS ?= $(shell $(PKG_CONFIG) --libs openblas 2>/dev/null || echo -lopenblas)
JSON_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags jansson 2>/dev/null)
JSON_LIBS ?= $(shell $(PKG_CONFIG) --libs jansson 2>/dev/null || echo -ljansson)

# Hidden visibility: libpi0.so exports the PI0_API functions of include/ and nothing else.
CFLAGS_ALL = -std=c11 $(OPT) -g -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -fPIC -fvisibility=hidden -fopenmp \
             -D_GNU_SOURCE -Iinclude -Isrc $(BLAS_CFLAGS) $(JSON_CFLAGS) $(SANITIZE) $(CFLAGS)
LDLIBS_ALL = $(BLAS_LIBS) $(JSON_LIBS) -fopenmp -lm -lpthread $(SANITIZE) $(LDLIBS)

# The server side: openpi's wire format, the server and the commands that read msgpack; only with
# msgpack-c and libwebsockets. The policy (src/policy/) is always in the library.
SERVER_LIB_SRC = $(wildcard src/server/*.c)
SERVER_CLI_SRC = $(wildcard cli/infer.c cli/serve.c)
SERVER_TEST_SRC = $(wildcard tests/test_msgpack_numpy.c tests/test_infer.c tests/test_queue.c)
SERVER_TOOL_SRC = $(wildcard tests/msgpack_tool.c)
WITH_SERVER ?= $(shell $(PKG_CONFIG) --exists msgpack libwebsockets 2>/dev/null && echo 1)
SERVER_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags msgpack libwebsockets 2>/dev/null)
SERVER_LIBS ?= $(shell $(PKG_CONFIG) --libs msgpack libwebsockets 2>/dev/null || echo -lmsgpackc -lwebsockets)

LIB_SRC = $(wildcard src/*.c src/util/*.c src/io/*.c src/model/*.c src/cpu/*.c src/policy/*.c)
CLI_SRC = $(filter-out $(SERVER_CLI_SRC),$(wildcard cli/*.c))
TEST_SRC = $(filter-out $(SERVER_TEST_SRC),$(wildcard tests/test_*.c))
TOOL_SRC = $(filter-out $(SERVER_TOOL_SRC),$(wildcard tests/*_tool.c))
SERVER_FUZZ_SRC = $(wildcard tests/fuzz/fuzz_msgpack.c)
FUZZ_SRC = $(filter-out $(SERVER_FUZZ_SRC),$(wildcard tests/fuzz/fuzz_*.c))
ifeq ($(WITH_SERVER),1)
CLI_SRC += $(SERVER_CLI_SRC)
TEST_SRC += $(SERVER_TEST_SRC)
TOOL_SRC += $(SERVER_TOOL_SRC)
FUZZ_SRC += $(SERVER_FUZZ_SRC)
CFLAGS_ALL += -DPI0_WITH_SERVER $(SERVER_CFLAGS)
endif

# --- CUDA (optional) ----------------------------------------------------------------------------
NVCC ?= $(shell command -v nvcc 2>/dev/null)
CUDA_SRC = $(wildcard src/cuda/*.cu)
CUDA_ARCHS ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_86,code=sm_86 \
              -gencode arch=compute_89,code=sm_89 -gencode arch=compute_90a,code=sm_90a
ifneq ($(NVCC),)
ifneq ($(CUDA_SRC),)
WITH_CUDA = 1
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
LIB_SRC += $(wildcard src/cuda/*.c)
CFLAGS_ALL += -DPI0_WITH_CUDA -isystem $(CUDA_HOME)/include
LDLIBS_ALL += -L$(CUDA_HOME)/lib64 -lcublasLt -lcudart -lstdc++
GPU_TEST_BIN = $(patsubst tests/gpu/%.c,$(BUILD)/tests/gpu/%,$(wildcard tests/gpu/test_*.c))
LAB_BIN = $(BUILD)/bench/layer_lab $(BUILD)/bench/gate_up_lab $(BUILD)/bench/clock_lab
# PI0_SM90A_BUILD: the build has Hopper's sm_90a code (wgmma, tensor copies), which the attention's Hopper kernel needs.
NVCCFLAGS = -O3 -std=c++17 $(CUDA_ARCHS) -Xcompiler -fPIC,-fvisibility=hidden -Iinclude -Isrc --expt-relaxed-constexpr \
            -Werror all-warnings $(if $(findstring 90a,$(CUDA_ARCHS)),-DPI0_SM90A_BUILD)
endif
endif

LIB_OBJ = $(LIB_SRC:%.c=$(BUILD)/%.o) $(if $(WITH_CUDA),$(CUDA_SRC:%.cu=$(BUILD)/%.cu.o))
CLI_OBJ = $(CLI_SRC:%.c=$(BUILD)/%.o)
# The server side is part of the `pi0` program (and its tests), not of libpi0: the library needs
# neither msgpack-c nor libwebsockets.
SERVER_OBJ = $(if $(filter 1,$(WITH_SERVER)),$(SERVER_LIB_SRC:%.c=$(BUILD)/%.o))
SERVER_ARCHIVE = $(if $(SERVER_OBJ),$(BUILD)/libpi0_server.a)
PROGRAM_LIBS = $(SERVER_ARCHIVE) $(BUILD)/libpi0.a $(LDLIBS_ALL) $(if $(SERVER_OBJ),$(SERVER_LIBS))
TEST_BIN = $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
TOOL_BIN = $(patsubst tests/%.c,$(BUILD)/tests/%,$(TOOL_SRC))
FUZZ_BIN = $(patsubst tests/fuzz/%.c,$(BUILD)/fuzz/%,$(FUZZ_SRC))
CONFIG = $(BUILD)/config.txt

.PHONY: all run test test-asan test-gpu fuzz fuzz-programs fuzz-smoke deps install clean FORCE
all: $(BUILD)/libpi0.a $(BUILD)/libpi0.so $(BUILD)/pi0

# What a build was made with; rewritten only when it changes, so that depending on it is cheap.
CONFIG_TEXT = CC=$(CC) | CFLAGS=$(CFLAGS_ALL) | LDLIBS=$(LDLIBS_ALL) | WITH_SERVER=$(WITH_SERVER) | \
              WITH_CUDA=$(WITH_CUDA) | NVCC=$(NVCC) | NVCCFLAGS=$(NVCCFLAGS)
$(CONFIG): FORCE
	@mkdir -p $(dir $@)
	@printf '%s\n' '$(subst ','\'',$(CONFIG_TEXT))' | tr '|' '\n' | sed 's/^ *//; s/ *$$//' > $@.new
	@if cmp -s $@.new $@; then rm -f $@.new; else mv $@.new $@; $(report_optional_parts); fi

# Said once per configuration: which optional parts are left out, and how to get them.
report_optional_parts = \
	$(if $(filter 1,$(WITH_SERVER)),,echo "pi0: building without pi0 infer/serve: $(if $(filter command line,$(origin \
WITH_SERVER)),WITH_SERVER=$(WITH_SERVER) was given,msgpack-c and libwebsockets not found (install them with 'make deps', \
or 'sudo apt-get install libmsgpack-dev libwebsockets-dev'))";) \
	$(if $(WITH_CUDA),,echo "pi0: building the CPU backend only: nvcc (CUDA toolkit 12+) not found on PATH";) true

$(BUILD)/%.o: %.c $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -MMD -MP -c $< -o $@

$(BUILD)/%.cu.o: %.cu $(CONFIG)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libpi0.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libpi0.so: $(LIB_OBJ)
	$(CC) -shared -Wl,-soname,libpi0.so.$(VERSION_MAJOR) -o $@ $^ $(LDLIBS_ALL)

$(BUILD)/libpi0_server.a: $(SERVER_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/pi0: $(CLI_OBJ) $(BUILD)/libpi0.a $(SERVER_ARCHIVE)
	$(CC) -o $@ $(CLI_OBJ) $(PROGRAM_LIBS)

$(BUILD)/bench/%: bench/%.c $(BUILD)/libpi0.a $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -MMD -MP -o $@ $< $(PROGRAM_LIBS)

# The clock lab's kernels are its own, not the library's.
$(BUILD)/bench/clock_lab: bench/clock_lab.c $(BUILD)/bench/clock_lab_kernels.cu.o $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -MMD -MP -o $@ $< $(BUILD)/bench/clock_lab_kernels.cu.o $(LDLIBS_ALL)

$(BUILD)/tests/%: tests/%.c $(BUILD)/libpi0.a $(SERVER_ARCHIVE) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -Itests -MMD -MP -o $@ $< $(PROGRAM_LIBS)

run: $(BUILD)/pi0
	$(BUILD)/pi0 bench

# The GPU tests are built here too (so a CPU-only machine with nvcc still compiles every CUDA
# source and GPU test), but only run by test-gpu. server.sh always runs: in a build without the
# server it reports itself skipped, never passed.
test: $(TEST_BIN) $(GPU_TEST_BIN) $(LAB_BIN) $(TOOL_BIN) $(BUILD)/pi0 $(BUILD)/libpi0.so
	BUILD=$(BUILD) SANITIZE="$(SANITIZE)" PI0_BIN=$(BUILD)/pi0 PI0_TOOLS=$(BUILD)/tests PI0_LOG_DIR=$(BUILD)/logs NVCC=$(NVCC) \
	  tests/run.sh $(TEST_BIN) tests/crosscheck.sh tests/server.sh tests/convert_test.py tests/library.sh tests/pdl_loads.sh

test-gpu: $(GPU_TEST_BIN) $(LAB_BIN) $(BUILD)/pi0
	@test -n "$(GPU_TEST_BIN)" || { echo "test-gpu needs nvcc (CUDA toolkit) at build time"; exit 1; }
	PI0_BIN=$(BUILD)/pi0 PI0_LOG_DIR=$(BUILD)/logs tests/run.sh $(GPU_TEST_BIN) tests/gpu/footprint.sh

test-asan:
	$(MAKE) BUILD=build-asan OPT=-O1 SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" test

# The fuzzers: the library (CPU backend) and the harnesses built by clang with libFuzzer's coverage, ASan and UBSan
# (-Wno-pass-failed: clang reports the `omp simd` loops it cannot vectorize in sanitized code, an error with -Werror).
# Each harness writes its own seed corpus; tests/fuzz/smoke.sh says how to run one longer.
FUZZ_SECONDS ?= 30
fuzz:
	$(MAKE) BUILD=build-fuzz CC=clang NVCC= OPT=-O1 CFLAGS="-Wno-pass-failed $(CFLAGS)" \
	  SANITIZE="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" fuzz-programs

fuzz-programs: $(FUZZ_BIN)

$(BUILD)/fuzz/%: tests/fuzz/%.c tests/fuzz/fuzz.h $(BUILD)/libpi0.a $(SERVER_ARCHIVE) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -fsanitize=fuzzer -Itests/fuzz -MMD -MP -o $@ $< $(PROGRAM_LIBS)

fuzz-smoke: fuzz
	tests/fuzz/smoke.sh build-fuzz/fuzz $(FUZZ_SECONDS)

# make install PREFIX=DIR: the headers, both libraries, a pkg-config file, the pi0 command and the
# converter it runs; a C program then builds with `cc prog.c $$(pkg-config --cflags --libs pi0)`.
PREFIX ?= /usr/local
install: all
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/bin \
	  $(DESTDIR)$(PREFIX)/share/pi0
	install -m 644 include/pi0.h include/pi0_policy.h $(DESTDIR)$(PREFIX)/include/
	install -m 644 $(BUILD)/libpi0.a $(DESTDIR)$(PREFIX)/lib/
	install -m 755 $(BUILD)/libpi0.so $(DESTDIR)$(PREFIX)/lib/libpi0.so.$(VERSION)
	ln -sf libpi0.so.$(VERSION) $(DESTDIR)$(PREFIX)/lib/libpi0.so.$(VERSION_MAJOR)
	ln -sf libpi0.so.$(VERSION_MAJOR) $(DESTDIR)$(PREFIX)/lib/libpi0.so
	install -m 755 $(BUILD)/pi0 $(DESTDIR)$(PREFIX)/bin/
	$(if $(wildcard tools/*.py),install -m 644 $(wildcard tools/*.py) $(DESTDIR)$(PREFIX)/share/pi0/)
	printf '%s\n' 'prefix=$(PREFIX)' 'includedir=$${prefix}/include' 'libdir=$${prefix}/lib' '' \
	  'Name: pi0' 'Description: inference engine for the Pi0 and Pi0.5 robot policies' 'Version: $(VERSION)' \
	  'Cflags: -I$${includedir}' 'Libs: -L$${libdir} -lpi0' 'Libs.private: $(LDLIBS_ALL)' \
	  > $(DESTDIR)$(PREFIX)/lib/pkgconfig/pi0.pc

clean:
	rm -rf build build-asan build-fuzz

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d) $(SERVER_OBJ:.o=.d) $(TEST_BIN:=.d) $(TOOL_BIN:=.d) $(GPU_TEST_BIN:=.d) $(LAB_BIN:=.d) \
         $(FUZZ_BIN:=.d)
endif

# Installs what the build and the tests need: the Debian packages (when missing; with sudo when not
# root) and the PyPI packages of tests/requirements.txt, the reference libraries the cross-checks
# compare against, at the versions CI tests with.
APT_PACKAGES = build-essential pkg-config libopenblas-openmp-dev libjansson-dev libmsgpack-dev libwebsockets-dev \
               python3-pip
PIP_IMPORTS = numpy, sentencepiece, google.protobuf, PIL, msgpack, websockets, tensorstore, ml_dtypes, \
              openpi_client.msgpack_numpy, openpi_client.websocket_client_policy
# openpi-client pins numpy<2 although the modules the tests use (msgpack_numpy, websocket_client_policy)
# work with numpy 2: it is installed without its dependencies, which tests/requirements.txt lists.
OPENPI_CLIENT = openpi-client==0.1.2
SUDO = $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PIP = python3 -m pip install -q --disable-pip-version-check
deps:
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES); }
	@python3 -c "import $(PIP_IMPORTS)" 2>/dev/null || \
	  { $(PIP) -r tests/requirements.txt && $(PIP) --no-deps $(OPENPI_CLIENT); } || \
	  { $(PIP) --break-system-packages -r tests/requirements.txt && $(PIP) --break-system-packages --no-deps $(OPENPI_CLIENT); }
	@python3 -c "import $(PIP_IMPORTS)" || { echo "make deps: the Python packages above did not install"; exit 1; }
