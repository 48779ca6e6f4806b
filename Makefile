# Kvasir top-level Makefile: wraps CMake/CTest and installs what is missing.
#   make          build build/kvasir
#   make test     install deps (apt-get, npm oracle), build, run every test
#   make demo     a local swarm of three nodes (kvasir swarm up), a chat completion through its
#                 gateway, equal to the single-process answer; then kvasir swarm down
#   make asan     sanitizer build; every test again under ASan+UBSan
#   make fuzz     longer libFuzzer runs
#   make bench    kvasir vs llama.cpp speed (docs/BENCHMARKS.md)
#   make bench-hub  hub market view at 122B scale + load of 2,000 heartbeating nodes
#   make bench-122b  the Qwen3.5-122B-A10B shape over 3 loopback workers vs one process
#   make bench-verify  a verification check vs the expert it checks, 122B expert shape
#   make bench-ledger  ledger completions/s (docs/BENCHMARKS.md)
#   make bench-gateway  tokens/s of 1, 4, 16 clients through the gateway vs llama.cpp sequences
#   make arm      cross-build build-aarch64/kvasir (runs under `qemu-aarch64 -L /`)
#   make test-arm the unit tests of the aarch64 build under qemu, ARM nodes
#                 in a loopback swarm (tests/test_arm.sh) and ARM run, bench and
#                 gateway (tests/test_arm_run.sh), full versions
#   make bench-ring  the ring's aggregate tokens/s for S = 1, 2, 4, 8 vs one process, and with 20 ms links
#   make bench-wan   the WAN cost model (docs/WAN.md) against the test bed: 0-80 ms, 10 Mbit/s-unlimited
#   make bench-wan-sites  issue 31's targets: ring of sites vs per-layer dispatch, speculation over the ring (40 ms)
#   make bench-wan-122b   the Qwen3.5-122B-A10B shape (bench widths) on the same bed, against the cost model
#   make bench-wan-122b-real  the same with the real widths: the 76 GB sliced skeleton, --allow-sparse
#   make bench-arm  a 256 MiB emulated ARM node: slabs held, peak RSS
#   make bench-hedge  decode step p50/p99 over two replicas, healthy and with one stalling
#   make bench-autoscale  a gateway with --local-experts and two workers under 1 -> 16 -> 1 clients
#                 against a local-only gateway (CSV and PNG in bench/out, docs/BENCHMARKS.md)
#   make bench-pair-cost  CPU per remote expert pair (coordinator, nodes) and bench-autoscale's bound
#   make bench-lanes      two coordinators of 8 (two micro-batches) against one local-only of 16
#   make wan-test the WAN test bed (tests/test_wan_bed.sh, docs/NETDELAY.md) in its long
#                 version: two sites 40 ms apart, 0.5% loss, a host behind a NAT router, a
#                 kvasir hub and a NATed kvasir node (needs root), then the design's scenario
#                 in it (tests/test_wan_scenario.sh); make test runs the short ones
#   make attack   the attack set (tests labelled attack) in its long version
#                 (KV_ATTACK_FULL=1): each fails if one attack succeeds; make test
#                 runs the short version of each
BUILD      ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
JOBS       ?= $(shell nproc 2>/dev/null || echo 2)
FUZZ_SECONDS ?= 300
ARM_BUILD  ?= build-aarch64
ARM_TARGET ?=
# Kernel backends this CPU can run, from /proc/cpuinfo: a test that skips one
# of them fails (tests/kvtest.h kvt_skip_backend), so a machine with AVX-512
# cannot pass by leaving the AVX-512 kernels unchecked. Override to narrow.
KV_REQUIRE_BACKENDS ?= $(shell bash tools/cpu-backends.sh)
export KV_REQUIRE_BACKENDS

.PHONY: wan-test attack all build deps oracle test asan demo fuzz bench bench-hub bench-verify bench-ledger bench-122b bench-gateway bench-ring bench-wan bench-wan-sites bench-hedge bench-autoscale clean deps-arm arm test-arm bench-arm

all: build

deps:
	@bash tools/install-deps.sh

oracle: deps
	@bash tools/install-oracle.sh

build:
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release >/dev/null
	@cmake --build $(BUILD) -j$(JOBS) -- --no-print-directory

test: deps oracle deps-arm
	@$(MAKE) --no-print-directory build
	@$(MAKE) --no-print-directory arm ARM_TARGET="--target kvasir"
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DKV_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(FUZZ_BUILD) -j$(JOBS) --target fuzzers -- --no-print-directory
	@cd $(BUILD) && KV_FUZZ_BUILD=$(abspath $(FUZZ_BUILD)) KV_ARM_BIN=$(abspath $(ARM_BUILD))/kvasir \
	  KV_REQUIRE_ARM=1 ctest --output-on-failure -j$(JOBS)

attack: deps oracle
	@$(MAKE) --no-print-directory build
	@cd $(BUILD) && KV_ATTACK_FULL=1 ctest --output-on-failure -j$(JOBS) -L attack

# the WAN test bed of issue 30 in its long version (KV_WAN_FULL=1): root,
# network namespaces, nft, tcpdump (tools/install-deps.sh)
wan-test: deps
	@$(MAKE) --no-print-directory build
	@KV_BIN=$(abspath $(BUILD))/kvasir KV_SRC=$(CURDIR) KV_WAN_FULL=1 bash tests/test_wan_bed.sh
	@KV_BIN=$(abspath $(BUILD))/kvasir KV_SRC=$(CURDIR) KV_WAN_FULL=1 bash tests/test_wan_scenario.sh

# aarch64: Debian's cross compiler and arm64 libraries (cmake/aarch64.cmake);
# the unit tests run under qemu-user (CMAKE_CROSSCOMPILING_EMULATOR). No
# PostgreSQL stores there: libpq-dev:arm64 does not co-install with amd64's.
deps-arm:
	@bash tools/install-deps.sh --arm

arm: deps-arm
	@cmake -S . -B $(ARM_BUILD) -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64.cmake -DCMAKE_BUILD_TYPE=Release -DKV_PG=OFF >/dev/null
	@cmake --build $(ARM_BUILD) -j$(JOBS) $(ARM_TARGET) -- --no-print-directory

# test_worker is left out under emulation: its fairness case times three
# maximum-cost requests against a client read timeout that qemu's ~10x
# slowdown exceeds (every other case of it passes there).
test-arm: arm
	@$(MAKE) --no-print-directory build
	@cd $(ARM_BUILD) && KV_REQUIRE_BACKENDS=neon,neondot ctest --output-on-failure -j$(JOBS) -E '^test_(fuzz|worker)$$'
	@cd $(BUILD) && KV_ARM_BIN=$(abspath $(ARM_BUILD))/kvasir KV_REQUIRE_ARM=1 KV_ARM_FULL=1 \
	  ctest --output-on-failure -R '^test_(arm|arm_run|arm_budget|xcheck|mixed|opencl)$$'

# a 256 MiB ARM node (emulated) in a swarm of a 428 MB model: slabs held,
# peak resident memory, a byte-identical decode (docs/BENCHMARKS.md)
bench-arm: arm
	@$(MAKE) --no-print-directory build
	@KV_BIN=$(abspath $(BUILD))/kvasir KV_SRC=$(CURDIR) KV_ARM_BIN=$(abspath $(ARM_BUILD))/kvasir KV_REQUIRE_ARM=1 \
	  KV_ARM_BUDGET=256M KV_ARM_TOKENS=16 KV_ARM_MODEL="--layers 2 --embd 1024 --ff-exp 1024 --experts 64 --type q8_0" \
	  bash tests/test_arm_budget.sh

asan: deps oracle
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DKV_SANITIZE=ON >/dev/null
	@cmake --build $(ASAN_BUILD) -j$(JOBS) -- --no-print-directory
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DKV_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(FUZZ_BUILD) -j$(JOBS) --target fuzzers -- --no-print-directory
	@cd $(ASAN_BUILD) && KV_FUZZ_BUILD=$(abspath $(FUZZ_BUILD)) ctest --output-on-failure -j$(JOBS)

demo: deps
	@$(MAKE) --no-print-directory build
	@bash tools/demo.sh $(BUILD)/kvasir

fuzz: deps
	@cmake -S . -B $(FUZZ_BUILD) -DCMAKE_C_COMPILER=clang -DKV_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(FUZZ_BUILD) -j$(JOBS) --target fuzzers -- --no-print-directory
	@bash tools/fuzz.sh $(FUZZ_BUILD) $(FUZZ_SECONDS)

bench: deps oracle
	@$(MAKE) --no-print-directory build
	@bash bench/run.sh $(BUILD)/kvasir

bench-hub: deps
	@$(MAKE) --no-print-directory build
	@bash bench/hub.sh $(BUILD)

# the cost of a verification check against the expert it checks, at the
# 122B expert shape (docs/VERIFY.md "Cost", docs/BENCHMARKS.md)
bench-verify: deps
	@$(MAKE) --no-print-directory build
	@$(BUILD)/bench_verify 3072 1024 q4_K 64 9

bench-122b: deps
	@$(MAKE) --no-print-directory build
	@bash bench/skeleton122.sh $(BUILD)/kvasir

bench-gateway: deps oracle
	@$(MAKE) --no-print-directory build
	@bash bench/gateway.sh $(BUILD)/kvasir

bench-ring: deps
	@$(MAKE) --no-print-directory build
	@bash bench/ring.sh $(BUILD)

bench-wan: deps
	@$(MAKE) --no-print-directory build
	@bash bench/wan.sh $(BUILD)

bench-wan-sites: deps
	@$(MAKE) --no-print-directory build
	@bash bench/wan_sites.sh $(BUILD)

.PHONY: bench-wan-122b
bench-wan-122b: deps
	@$(MAKE) --no-print-directory build
	@WS_MODEL=122b bash bench/wan_sites.sh $(BUILD)

.PHONY: bench-wan-122b-real
bench-wan-122b-real: deps
	@$(MAKE) --no-print-directory build
	@WS_MODEL=122b-real bash bench/wan_sites.sh $(BUILD)

bench-hedge: deps
	@$(MAKE) --no-print-directory build
	@bash bench/hedge.sh $(BUILD)/kvasir

bench-autoscale: deps
	@$(MAKE) --no-print-directory build
	@bash bench/autoscale.sh $(BUILD)/kvasir

.PHONY: bench-pair-cost
bench-pair-cost: deps
	@$(MAKE) --no-print-directory build
	@bash bench/pair_cost.sh $(BUILD)/kvasir

.PHONY: bench-lanes
bench-lanes: deps
	@$(MAKE) --no-print-directory build
	@bash bench/lanes.sh $(BUILD)/kvasir

bench-ledger: deps
	@$(MAKE) --no-print-directory build
	@$(BUILD)/bench_ledger 1 500
	@$(BUILD)/bench_ledger 8 250

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD) $(ARM_BUILD)
