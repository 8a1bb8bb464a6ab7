# The task runner developers type and CI calls (.ci/run -> make test).
SHELL := /bin/bash
CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
NEXTEST := $(shell command -v cargo-nextest >/dev/null 2>&1 && echo "nextest run" || echo "test")

.PHONY: all build release test fmt fmt-check clippy unit scenario bench bench-rsync clean

all: build

build:
	$(CARGO) build --workspace --all-targets

release:
	$(CARGO) build --release -p kt-metadata -p kt-store -p kt-client

## test: the test command (formatting, lints, every unit and cross-component test).
test: fmt-check clippy unit

fmt:
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit:
	$(CARGO) $(NEXTEST) --workspace

## scenario: the main job on the local target: real binaries on loopback, whole flows.
scenario: release
	bash testbed/local-smoke.sh $(TARGET_DIR)/release

## bench: criterion benches of the sync engine (scan, hash, diff, chunk roots).
bench:
	$(CARGO) bench -p kt-bench

## bench-rsync: kt against a real rsync daemon on the same data, in one run.
bench-rsync:
	@command -v rsync >/dev/null 2>&1 || { echo "rsync missing: apt-get install -y rsync"; exit 1; }
	$(CARGO) run --release -p kt-bench --bin kt-bench-rsync -- $(BENCH_ARGS)

clean:
	$(CARGO) clean
