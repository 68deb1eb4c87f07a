# pi0 - build the library (static + shared), the `pi0` command and the tests.
#
#   make            build/libpi0.a, build/libpi0.so, build/pi0
#   make run        the main job: `pi0 bench` on built-in random weights of the real size
#   make test       every CPU test (and a compile of every CUDA source when nvcc is present)
#   make test-asan  the same tests built with AddressSanitizer + UndefinedBehaviorSanitizer
#   make test-gpu   the GPU tests (needs nvcc and a GPU)
#
# Dependencies: OpenBLAS (GEMMs) and jansson (JSON), found through pkg-config; override
# BLAS_CFLAGS/BLAS_LIBS/JSON_CFLAGS/JSON_LIBS to point elsewhere. CUDA is used when nvcc is found.
# The server side (`pi0 infer`, `pi0 serve`) needs msgpack-c and libwebsockets; without them the
# library and the other commands still build.

BUILD ?= build
CC ?= cc
OPT ?= -O2
SANITIZE ?=

PKG_CONFIG ?= pkg-config
BLAS_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags openblas 2>/dev/null || echo -I/usr/include/x86_64-linux-gnu/openblas-openmp)
BLAS_LIBS ?= $(shell $(PKG_CONFIG) --libs openblas 2>/dev/null || echo -lopenblas)
JSON_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags jansson 2>/dev/null)
JSON_LIBS ?= $(shell $(PKG_CONFIG) --libs jansson 2>/dev/null || echo -ljansson)

CFLAGS_ALL = -std=c11 $(OPT) -g -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -fPIC -fopenmp \
             -D_GNU_SOURCE -Iinclude -Isrc $(BLAS_CFLAGS) $(JSON_CFLAGS) $(SANITIZE) $(CFLAGS)
LDLIBS_ALL = $(BLAS_LIBS) $(JSON_LIBS) -fopenmp -lm -lpthread $(SANITIZE) $(LDLIBS)

# The wire format, the policy, the server and their commands: only with msgpack-c and libwebsockets.
SERVER_LIB_SRC = $(wildcard src/io/msgpack_numpy.c src/policy/policy.c src/server/*.c)
SERVER_CLI_SRC = $(wildcard cli/infer.c cli/serve.c)
SERVER_TEST_SRC = $(wildcard tests/test_msgpack_numpy.c tests/test_policy.c tests/test_infer.c tests/test_server.c)
SERVER_TOOL_SRC = $(wildcard tests/msgpack_tool.c)
WITH_SERVER ?= $(shell $(PKG_CONFIG) --exists msgpack libwebsockets 2>/dev/null && echo 1)
SERVER_CFLAGS ?= $(shell $(PKG_CONFIG) --cflags msgpack libwebsockets 2>/dev/null)
SERVER_LIBS ?= $(shell $(PKG_CONFIG) --libs msgpack libwebsockets 2>/dev/null || echo -lmsgpackc -lwebsockets)

LIB_SRC = $(filter-out $(SERVER_LIB_SRC),$(wildcard src/*.c src/util/*.c src/io/*.c src/model/*.c src/cpu/*.c \
          src/policy/*.c src/server/*.c))
CLI_SRC = $(filter-out $(SERVER_CLI_SRC),$(wildcard cli/*.c))
TEST_SRC = $(filter-out $(SERVER_TEST_SRC),$(wildcard tests/test_*.c))
TOOL_SRC = $(filter-out $(SERVER_TOOL_SRC),$(wildcard tests/*_tool.c))
ifeq ($(WITH_SERVER),1)
LIB_SRC += $(SERVER_LIB_SRC)
CLI_SRC += $(SERVER_CLI_SRC)
TEST_SRC += $(SERVER_TEST_SRC)
TOOL_SRC += $(SERVER_TOOL_SRC)
CFLAGS_ALL += -DPI0_WITH_SERVER $(SERVER_CFLAGS)
LDLIBS_ALL += $(SERVER_LIBS)
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
LAB_BIN = $(BUILD)/bench/layer_lab
NVCCFLAGS = -O3 -std=c++17 $(CUDA_ARCHS) -Xcompiler -fPIC -Iinclude -Isrc --expt-relaxed-constexpr \
            -Werror all-warnings
endif
endif

LIB_OBJ = $(LIB_SRC:%.c=$(BUILD)/%.o) $(if $(WITH_CUDA),$(CUDA_SRC:%.cu=$(BUILD)/%.cu.o))
CLI_OBJ = $(CLI_SRC:%.c=$(BUILD)/%.o)
TEST_BIN = $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
TOOL_BIN = $(patsubst tests/%.c,$(BUILD)/tests/%,$(TOOL_SRC))

.PHONY: all run test test-asan test-gpu deps clean
all: $(BUILD)/libpi0.a $(BUILD)/libpi0.so $(BUILD)/pi0

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -MMD -MP -c $< -o $@

$(BUILD)/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(BUILD)/libpi0.a: $(LIB_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libpi0.so: $(LIB_OBJ)
	$(CC) -shared -o $@ $^ $(LDLIBS_ALL)

$(BUILD)/pi0: $(CLI_OBJ) $(BUILD)/libpi0.a
	$(CC) -o $@ $^ $(LDLIBS_ALL)

$(BUILD)/bench/%: bench/%.c $(BUILD)/libpi0.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -o $@ $< $(BUILD)/libpi0.a $(LDLIBS_ALL)

$(BUILD)/tests/gpu/%: tests/gpu/%.c $(BUILD)/libpi0.a tests/check.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -Itests -o $@ $< $(BUILD)/libpi0.a $(LDLIBS_ALL)

$(BUILD)/tests/%: tests/%.c $(BUILD)/libpi0.a tests/check.h tests/cli_run.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_ALL) -Itests -o $@ $< $(BUILD)/libpi0.a $(LDLIBS_ALL)

run: $(BUILD)/pi0
	$(BUILD)/pi0 bench

# The GPU tests are built here too (so a CPU-only machine with nvcc still compiles every CUDA
# source and GPU test), but only run by test-gpu.
test: $(TEST_BIN) $(GPU_TEST_BIN) $(LAB_BIN) $(TOOL_BIN) $(BUILD)/pi0
	PI0_BIN=$(BUILD)/pi0 PI0_TOOLS=$(BUILD)/tests PI0_LOG_DIR=$(BUILD)/logs tests/run.sh $(TEST_BIN) tests/crosscheck.sh \
	  $(if $(filter 1,$(WITH_SERVER)),tests/server.sh)

test-gpu: $(GPU_TEST_BIN) $(LAB_BIN) $(BUILD)/pi0
	@test -n "$(GPU_TEST_BIN)" || { echo "test-gpu needs nvcc (CUDA toolkit) at build time"; exit 1; }
	PI0_BIN=$(BUILD)/pi0 PI0_LOG_DIR=$(BUILD)/logs tests/run.sh $(GPU_TEST_BIN)

test-asan:
	$(MAKE) BUILD=build-asan OPT=-O1 SANITIZE="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" test

# Installs what the build and the tests need: Debian packages (when missing) and PyPI packages the
# cross-checks against the reference libraries use. Uses sudo when not root.
APT_PACKAGES = build-essential pkg-config libopenblas-openmp-dev libjansson-dev libmsgpack-dev libwebsockets-dev \
               python3-pip
# openpi-client pins numpy<2 although the modules the tests use (msgpack_numpy, websocket_client_policy)
# work with numpy 2: it is installed without its dependencies, which are listed here instead.
PIP_PACKAGES = numpy sentencepiece pillow msgpack websockets typing_extensions
SUDO = $(shell [ "$$(id -u)" = 0 ] || echo sudo)
deps:
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $(APT_PACKAGES); }
	@python3 -c "import numpy, sentencepiece, PIL, msgpack, openpi_client.msgpack_numpy, openpi_client.websocket_client_policy" 2>/dev/null || \
	  { python3 -m pip install -q $(PIP_PACKAGES) && python3 -m pip install -q --no-deps openpi-client; } || \
	  { python3 -m pip install -q --break-system-packages $(PIP_PACKAGES) && \
	    python3 -m pip install -q --break-system-packages --no-deps openpi-client; }

clean:
	rm -rf build build-asan

-include $(LIB_OBJ:.o=.d) $(CLI_OBJ:.o=.d)
