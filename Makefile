# The task runner developers type and CI calls (.ci/run -> make test).
SHELL := /bin/bash
CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo "nextest run" || echo "test")
# Scenario target: local (default), netns (root), docker (builds the images
# first), kind or k3d (a machine with kind or k3d, and Docker).
TARGET ?= local
# Which scenarios (files or directories); a subset never fails on the
# snapshots it does not reach.
SCENARIOS ?= scenarios
SCENARIO_FLAGS := --target $(TARGET) --report $(TARGET_DIR)/scenario-report/$(TARGET) \
	$(if $(filter true 1,$(CI)),--check) $(if $(ACCEPT),--accept) $(SCENARIO_ARGS)

IMAGE_TARGETS := docker bundle kind k3d

# The test and release builds select packages one of two ways, so that cargo
# resolves the same features each time and reuses what an earlier target
# compiled (`build`, `bench` and `test-gpu` are a developer's own builds)
# (components/kt-workspace-hack unifies the dependencies' features; these
# two unify the workspace crates' own):
# - DEV_BUILD: the debug binaries and every test target, as `make test`
#   uses them (dev-dependencies on: kt-tensor's test doubles, the agent's
#   Flight feature).
# - RELEASE_PKGS: the release binaries of scenarios, images and benches;
#   a bench adds `-p kt-bench --bin NAME` to the same selection.
DEV_BUILD := $(CARGO) build --workspace --bins --tests
RELEASE_PKGS := -p kt-metadata -p kt-store -p kt-agent -p kt-client -p kt-dataset -p kt-scenario
# $(call bench,NAME): build the bench NAME with the release binaries'
# selection and run it with BENCH_ARGS.
bench = $(CARGO) build --release $(RELEASE_PKGS) -p kt-bench --bin $(1) && $(TARGET_DIR)/release/$(1)

.PHONY: all build release python s3env promenv python-test bench-python chaos images images-gpu manifests manifests-check prometheus-check cluster-plans lint-workflows test test-gpu fmt fmt-check clippy unit validate scenario bench bench-rsync bench-gate bench-metadata bench-shards bench-cpu bench-broadcast bench-tensors bench-nccl bench-recovery bench-s3 probe-bounded fuzz clean

all: build

build:
	$(CARGO) build --workspace --all-targets

release:
	$(CARGO) build --release $(RELEASE_PKGS)

## test: the test command (formatting, lints, every unit and cross-component
## test, the runner's own tests, validation of every scenario file, the
## rendered manifests against kustomize/, the Kubernetes schemas and the
## bundle's policy, what kind/k3d would deploy for every scenario, and the
## workflows).
test: fmt-check clippy manifests-check prometheus-check lint-workflows unit python-test validate cluster-plans

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# The runner's self-tests start the real binaries: build them first.
# The S3 ingest tests need moto's server (testbed/s3/moto.sh makes its venv);
# the /metrics test needs promtool (testbed/prometheus/install.sh).
unit:
	bash testbed/s3/moto.sh
	bash testbed/prometheus/install.sh
	$(DEV_BUILD)
	$(CARGO) $(NEXTEST) --workspace

## test-gpu: on a machine with a GPU and NCCL: kt-tensor's CUDA tests, which
## elsewhere print `skipping: <reason>` and pass; here a test that cannot
## use the GPU fails, saying why (KT_REQUIRE_GPU=1). The gpu workflow runs it.
test-gpu:
	KT_REQUIRE_GPU=1 $(CARGO) test -p kt-tensor cuda:: -- --nocapture

validate:
	$(DEV_BUILD) -q
	$(TARGET_DIR)/debug/kt-scenario validate scenarios testbed/selftest testbed/bench

## scenario: the main job: every scenario under scenarios/ on $(TARGET)
## (local by default; TARGET=netns as root; TARGET=bundle runs the
## production install's pods on Docker, as root; SCENARIOS picks files). ACCEPT=1 records new or changed
## snapshots; CI=true rejects pending and unreferenced ones. The process
## targets run the python steps with the venv `make python` builds and
## the S3 server of topology `s3` from the one `make s3env` builds.
scenario: release $(if $(filter $(IMAGE_TARGETS),$(TARGET)),images,python s3env promenv)
	INSTA_WORKSPACE_ROOT=$(CURDIR) $(TARGET_DIR)/release/kt-scenario run $(SCENARIOS) $(SCENARIO_FLAGS)

# The process targets' S3 server (topology `s3`): moto's, from its venv.
s3env:
	bash testbed/s3/moto.sh

# The process targets' Prometheus (topology `prometheus`): Debian's.
promenv:
	bash testbed/prometheus/install.sh

## chaos: the chaos soak on $(TARGET) (local or netns) for CHAOS_DURATION
## (default 5m): a seeded workload while the store, the metadata server and
## agents are killed, frozen and restarted at random; CHAOS_ARGS adds flags
## (e.g. --seed N to repeat a run's choices).
CHAOS_DURATION ?= 5m
chaos: release
	$(TARGET_DIR)/release/kt-scenario chaos --target $(TARGET) --duration $(CHAOS_DURATION) $(CHAOS_ARGS)

## manifests: generate the injecting components' kustomizations and the
## sidecar injector's template (testbed/k8s/components.py) and render
## kustomize/ into manifests/ (commit the result).
manifests:
	python3 testbed/k8s/components.py
	python3 testbed/prometheus/sync.py
	bash testbed/k8s/render.sh

## prometheus-check: kt's alerts (testbed/prometheus/rules.yaml) pass
## `promtool check rules` and their unit tests (`promtool test rules`), and
## the monitoring component's PrometheusRule is generated from them
## (promtool: Debian's prometheus package; .ci/run installs it).
prometheus-check:
	bash testbed/prometheus/install.sh
	promtool check rules testbed/prometheus/rules.yaml
	cd testbed/prometheus && promtool test rules rules-test.yaml
	python3 testbed/prometheus/sync.py --check

## manifests-check: the generated files match their sources, every bundle
## validates against the schemas of the newest three Kubernetes minor
## versions and the testbeds' own, and passes testbed/k8s/policy.py; the
## release bundle pins every image by digest.
manifests-check:
	bash testbed/k8s/check.sh

## cluster-plans: every scenario planned for kind and k3d (--dry-run: the
## runner's kustomizations rendered, nothing deployed), each deployment
## validated against the schemas and testbed/k8s/policy.py.
cluster-plans:
	$(DEV_BUILD) -q
	bash testbed/k8s/check-plans.sh $(TARGET_DIR)/debug/kt-scenario

## lint-workflows: actionlint on .github/workflows, testbed/k8s/workflows.py,
## and a rehearsal of every job (testbed/ci/rehearse.py: run: steps against
## stand-ins, what they hand the scenario runner checked by the real one,
## built here first).
lint-workflows:
	$(DEV_BUILD) -q
	KT_REHEARSE_BIN_DIR=$(TARGET_DIR)/debug bash testbed/k8s/lint-workflows.sh

## python: the Python package (import kt): the abi3 wheel into
## $(TARGET_DIR)/wheels, installed into the venv $(TARGET_DIR)/python with the
## pinned build and test tools (components/kt-python/build.sh).
python:
	bash components/kt-python/build.sh >/dev/null

## python-test: mypy --strict over the package and the reference's examples
## (with the test module and harness that run them), then the package's
## pytest suite against real servers on loopback (the debug binaries `unit`
## builds).
python-test: python
	cd components/kt-python && MYPYPATH=python $(abspath $(TARGET_DIR))/python/bin/python -m mypy \
		--strict --cache-dir $(abspath $(TARGET_DIR))/mypy-cache \
		python/kt tests/examples.py tests/test_reference.py tests/loopback.py tests/kubeapi.py
	$(DEV_BUILD) -q
	KT_BIN_DIR=$(TARGET_DIR)/debug $(TARGET_DIR)/python/bin/python -m pytest -q -rs components/kt-python/tests

## bench-python: the same 1 GiB state dict (500 tensors) and 10,000-file
## tree moved from Python and from the Rust CLI in one run on a loopback
## testbed (release binaries); Python/Rust ratios and the import time on
## the last line (BENCH_ARGS=--quick for a smoke run).
bench-python: release python
	KT_BIN_DIR=$(abspath $(TARGET_DIR))/release $(TARGET_DIR)/python/bin/python \
		components/kt-python/bench/bench.py $(BENCH_ARGS)

## images: the five images (metadata, store, agent, client, dataset controller), built offline
## from a base assembled from this machine (testbed/images/build.sh), tagged
## with the git revision and the workspace version.
images: release
	testbed/images/build.sh $(TARGET_DIR)/release

## images-gpu: the same plus kt-agent-gpu, the agent with NCCL's runtime
## (libnccl.so.2 from the nvidia-nccl-cu12 wheel on PyPI; KT_NCCL_WHEEL pins it).
images-gpu: release
	KT_IMAGE_GPU=1 testbed/images/build.sh $(TARGET_DIR)/release

## probe-bounded: the servers' bounds measured on loopback (release
## binaries): /healthz latency under 600 unfinished put bodies, and the
## store's RSS under 4 concurrent large put plans (PROBE_ARGS=--slow N --size MiB).
probe-bounded: release
	python3 testbed/probes/bounded.py $(TARGET_DIR)/release $(PROBE_ARGS)

## bench: criterion benches of the sync engine (scan, hash, diff, chunk roots).
bench:
	$(CARGO) bench -p kt-bench

## bench-rsync: kt against a real rsync daemon on the same data, in one run
## (BENCH_ARGS=--tls: kt serves HTTPS, for the cost of transport security).
bench-rsync:
	@command -v rsync >/dev/null 2>&1 || { echo "rsync missing: apt-get install -y rsync"; exit 1; }
	$(call bench,kt-bench-rsync) $(BENCH_ARGS)

## bench-gate: the rsync comparison 3 times over (fresh data and servers
## each), each case's median kt/rsync ratio held against the committed
## testbed/bench/baseline.json: fails when one is worse than its baseline by
## more than the margin; each case's CPU ratio (NAME.cpu) is held too.
## GATE_ARGS=--profile quick: 2,000 files and 128 MiB (CI); --judge cpu: the
## CPU ratios only (a machine busy with other work moves the time ratios);
## --accept: record the run as the profile's new baseline.
bench-gate:
	@command -v rsync >/dev/null 2>&1 || { echo "rsync missing: apt-get install -y rsync"; exit 1; }
	$(call bench,kt-bench-gate) $(GATE_ARGS)

## bench-shards: a streamed share (kt_client::stream, what kt.Dataset reads)
## against a plain prefix get of the same 1 GiB in 64 shards: time to the
## first file, throughput, and the most local bytes held against the budget.
bench-shards:
	$(call bench,kt-bench-shards) $(BENCH_ARGS)

## bench-metadata: 200 concurrent clients doing lookups (lease + release, or
## --op stat) against an in-process metadata server; lookups/s and p99.
bench-metadata:
	$(call bench,kt-bench-metadata) $(BENCH_ARGS)

## bench-tensors: a 1 GiB state dict of 500 tensors between two node agents on
## the host backend, packed and unpacked, against a plain TCP copy of the same
## bytes, in one run (ratios on the last line; --quick for a smoke test).
bench-tensors:
	$(call bench,kt-bench-tensors) $(BENCH_ARGS)

## fuzz: every decoder that reads bytes from the network or a socket
## (manifest codec, documents, the agent's control frames, quorum, session,
## tensor and broadcast bodies, batch frame streams) fed mutated and random
## inputs for KT_FUZZ_SECONDS (default 30) s each: no panic, no hang, at most
## 64 MiB allocated per case; prints the cases run and the seed (KT_FUZZ_SEED
## repeats a run).
KT_FUZZ_SECONDS ?= 30
fuzz:
	$(DEV_BUILD)
	KT_FUZZ_SECONDS=$(KT_FUZZ_SECONDS) $(CARGO) test --workspace --test fuzz -- --ignored --nocapture

## bench-s3: an S3 ingest of 1 GiB in 1,000 objects (moto's server) into the
## store against a plain download of the same objects to local disk: the
## ratio (target 1.3x) and the ingesting process's peak RSS (target 256 MiB).
## BENCH_ARGS='--size 64MiB --objects 100 --runs 1' for a quick run.
bench-s3:
	bash testbed/s3/moto.sh
	$(call bench,kt-bench-s3) $(BENCH_ARGS)

## bench-recovery: a 1 GiB get and put with the store SIGKILLed and started
## again halfway, against the same undisturbed (real kt-metadata and kt-store
## processes on loopback): the extra time against the store's time away, and
## the bytes moved twice (medians and targets on the last two lines).
bench-recovery: release
	$(call bench,kt-bench-recovery) $(BENCH_ARGS)

## bench-nccl: on a CUDA GPU with NCCL, a 4 GiB state dict of 500 tensors
## between two ranks through the transfer engine, packed and unpacked, against
## a bare NCCL broadcast of the same bytes (ratios on the last line).
bench-nccl:
	$(call bench,kt-bench-nccl) $(BENCH_ARGS)

## bench-cpu: CPU seconds per GiB (and ms per MB) of a put (client and
## store), the store's send, a relaying broadcast member and a pure getter:
## 256 MiB down a chain of 4 members, each its own process on loopback (no
## root), 3 runs; target: a relay at 3 ms/MB or less (last line).
bench-cpu:
	$(call bench,kt-bench-cpu) $(BENCH_ARGS)

## bench-broadcast: on the netns target (root), 256 MiB to 12 pods over
## 300 Mbit/s links and 512 MiB to 32 pods over 250 Mbit/s (single get, star,
## default-shape broadcast, one with its rank 1 killed midway), then 512 MiB
## to 32 pods over 1 Gbit/s.
bench-broadcast: release
	$(call bench,kt-bench-broadcast) --bin-dir $(TARGET_DIR)/release \
		--report $(TARGET_DIR)/bench-broadcast $(BENCH_ARGS)

clean:
	$(CARGO) clean
