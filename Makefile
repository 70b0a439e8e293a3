# The project's contract (see README):
#   make demo   set up from a fresh machine, then the product's story (scripts/demo.sh)
#   make test   set up, lint, host suites, the container image and its tests, then the
#               soft-RoCE VM suite (fails if it skipped) and the arm64 suite under qemu-user
#   make bench  benchmarks, then the report: bench/REPORT.md, bench/results/report.json
#   make lint   ruff, ruff format --check, mypy --strict, stale generated-code check, deploy files,
#               every MUST of docs/data-plane.md has a conformance row
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

VENV   := .venv
PY     := $(VENV)/bin/python
# The VM harness is stdlib-only and runs on the system Python.
TESTVM := /usr/bin/python3 deploy/testvm/testvm.py
LINT_PATHS := dpu_agent host_client dpu_wire scripts tests deploy bench setup.py
VM_JUNIT := .testvm/out/junit-vm.xml
# The core RDMA subset the arm64 guest runs (BlueField's ISA): raw RC QPs with 1 MiB
# WRITE/READ, the verbs transport, 1000 mixed jobs through a real agent, volume I/O,
# the agent SIGKILLed mid-jobs and with acknowledged writes in flight, the native core
# on both ends and the agent's fast path (compiled for arm64 in the root).
A64_JUNIT := .testvm/out/junit-aarch64-rdma.xml
CONTAINER_JUNIT := .testvm/out/junit-container.xml
A64_RDMA_TESTS := tests/vm/test_rdma_rxe.py tests/vm/test_verbs_transport.py \
    tests/vm/test_dataplane_verbs.py::test_1000_mixed_jobs_over_rxe \
    tests/vm/test_dataplane_verbs.py::test_volume_round_trips_over_rxe \
    tests/vm/test_dataplane_verbs.py::test_agent_killed_mid_jobs_fails_them_and_a_new_session_works \
    tests/vm/test_dataplane_verbs.py::test_acknowledged_writes_survive_sigkill_over_rxe \
    tests/vm/test_native_verbs.py

.PHONY: help venv proto check-proto docs check-docs lint lint-deploy test test-host test-vm test-aarch64 test-aarch64-rdma image test-container container-bases lab vm-fetch demo demo-rdma bench clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14

venv:  ## install Debian packages, the virtualenv and the project (idempotent)
	@scripts/bootstrap.sh

proto: venv  ## regenerate dpu_wire/v1 from proto/
	$(PY) scripts/gen_proto.py

check-proto: venv  ## fail if dpu_wire/v1 is stale
	$(PY) scripts/gen_proto.py --check

docs: venv  ## regenerate docs/api.md from the protos and their comments
	$(PY) scripts/gen_api_docs.py

check-docs: venv  ## fail if docs/api.md is stale
	$(PY) scripts/gen_api_docs.py --check

lint: venv check-proto check-docs lint-deploy  ## ruff + mypy --strict on our code (not generated stubs), lint-deploy, spec rules
	$(PY) scripts/check_spec_rules.py
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy $(LINT_PATHS)

lint-deploy: venv  ## deployment files: shellcheck, systemd-analyze, hadolint, kubernetes-validate, ...
	$(PY) deploy/lint_deploy.py

test-host: venv  ## unit, integration, fault, load, fuzz, crash-torture and tcp conformance suites here (tests/vm: one line, they run in test-vm)
	$(PY) -m pytest tests/unit tests/integration tests/faults tests/fuzz tests/torture tests/conformance tests/vm

# NICE: a prefix for the recipes `make test` runs beside another suite (nice -n 19).
NICE :=

test-aarch64: venv  ## unit + tcp integration suites on arm64 under qemu-user (root; ~12 min, its virtualenv 2 of them)
	$(NICE) deploy/aarch64/run-tests.sh

test-aarch64-rdma: venv  ## the core RDMA subset in an arm64 guest (cortex-a72, rxe0/rxe1) under TCG (root; ~5 min)
	@mkdir -p $(dir $(A64_JUNIT)) && rm -f $(A64_JUNIT)
	$(TESTVM) run --arch arm64 --timeout 2400 -- python -m pytest $(A64_RDMA_TESTS) \
	    -p no:cacheprovider -p no:hypothesispytest -v --durations=10 --junitxml=/src/$(A64_JUNIT)
	/usr/bin/python3 deploy/testvm/check_junit.py $(A64_JUNIT) --min-tests 60

image: venv  ## build the agent's image with podman, no network in the build (deploy/container/build.sh; root)
	deploy/container/build.sh

lab: venv  ## the soft-RoCE container lab on a host with rdma_rxe: make lab NETDEV=eth0 (deploy/container/lab.sh)
	deploy/container/lab.sh up $(NETDEV)

test-container: venv  ## build the amd64 and arm64 images, run the agent in them, test from outside (root)
	@mkdir -p $(dir $(CONTAINER_JUNIT)) && rm -f $(CONTAINER_JUNIT)
	IMAGE=$$(deploy/container/build.sh | tail -n 1) && \
	    ARM64=$$(deploy/container/build.sh --arch arm64 | tail -n 1) && \
	    DPU_CONTAINER_IMAGE=$$IMAGE DPU_CONTAINER_IMAGE_ARM64=$$ARM64 \
	    $(PY) -m pytest tests/container -v --junitxml=$(CONTAINER_JUNIT)
	/usr/bin/python3 deploy/testvm/check_junit.py $(CONTAINER_JUNIT) --min-tests 6

vm-fetch: venv  ## download and cache the test VM's kernel and initramfs
	$(TESTVM) fetch

test-vm: venv  ## the RDMA suite inside the soft-RoCE test VM (with the agent's image); fails if it skipped or ran nothing
	@mkdir -p $(dir $(VM_JUNIT)) && rm -f $(VM_JUNIT)
	IMAGE=$$(deploy/container/build.sh | tail -n 1) && \
	    STORE=$$(podman --runtime runc --cgroup-manager cgroupfs info --format '{{.Store.GraphRoot}}') && \
	    $(TESTVM) run --timeout 2700 --mem 3072 --env DPU_CONTAINER_IMAGE=$$IMAGE \
	    --env DPU_CONTAINER_STORE=$$STORE -- \
	    $(PY) -m pytest tests/vm -p no:cacheprovider -p no:hypothesispytest -v --durations=20 \
	    --junitxml=$(VM_JUNIT)
	/usr/bin/python3 deploy/testvm/check_junit.py $(VM_JUNIT) --min-tests 1

container-bases: venv  ## what the images are built from (amd64 and arm64 bases, wheelhouses; cached; root)
	$(NICE) deploy/container/build.sh --bases
	$(NICE) deploy/container/build.sh --bases --arch arm64

# The host suites and the VM suite each leave about one of two cores idle (measured with
# vmstat: 57 % and 52 % idle). Beside the first, the images' bases (emulated mmdebstrap
# for arm64: minutes on a fresh machine); beside the second, the arm64 suite under
# qemu-user; both at the lowest CPU priority, so that they take only what is idle.
test: lint  ## everything: set-up, lint, host suites, the container, VM suite, arm64 suite
	$(MAKE) --no-print-directory -j2 --output-sync=target NICE="nice -n 19" test-host container-bases
	$(MAKE) --no-print-directory test-container
	$(MAKE) --no-print-directory -j2 --output-sync=target NICE="nice -n 19" test-vm test-aarch64

demo: venv  ## the story: mTLS agent + mosquitto, a volume round trip, compute, events, metrics, tenants
	@scripts/demo.sh

demo-rdma: venv  ## the same story inside the soft-RoCE test VM, the session over rxe0 (verbs)
	$(TESTVM) run --env DPU_DEMO_DIR=/tmp/demo --env DPU_DEMO_TRANSPORT=verbs -- scripts/demo.sh

bench: venv  ## run the benchmarks, then the report (bench/REPORT.md, bench/results/)
	$(PY) -m bench.run

clean:  ## remove the virtualenv and test output (keeps the VM kernel cache)
	rm -rf $(VENV) .testvm .pytest_cache .mypy_cache .ruff_cache .demo
