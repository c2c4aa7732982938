# Tandem: make setup | protos | kernels | run | run-head | test | test-unit | test-service | test-system | test-deploy | test-slow
#         | soak | bench | bench-load | bench-router | bench-passcost | bench-topology | bench-trees | bench-precision | bench-kernels | bench-decoder | bench-variants | train-head | image | deploy-check
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTOS := $(shell find protos -name '*.proto')
GEN_STAMP := tandem/v1/.stamp

.PHONY: run-head train-head setup protos kernels run test test-unit test-service test-system test-deploy test-slow soak bench bench-load bench-router bench-passcost bench-topology bench-trees bench-precision bench-kernels bench-decoder bench-variants bench-agreement image deploy-check image-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	# xgrammar without its dependencies: they are in pyproject.toml, except triton (~1 GB), which
	# only its GPU kernels import; Tandem applies the masks itself.
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	touch $@

setup: $(VENV)/.installed protos kernels

# Tandem's CPU kernel for Linear layers (tandem/engine/rowgemm.py; needs g++); rebuilt only when
# its source, flags or torch change. Without it the layers run on oneDNN's kernels, slower.
kernels: $(VENV)/.installed
	$(PY) -m tandem.engine.rowgemm

$(GEN_STAMP): $(PROTOS) protos/generate.sh $(VENV)/.installed
	protos/generate.sh $(PY)
	touch $@

protos: $(GEN_STAMP)

run: setup
	$(PY) -m tandem.launch

# The same with SmolLM2-135M-Instruct and the head shipped for it (draft method "head"; n-gram drafting
# from a model-free draft worker): about 1 GB of memory, no draft model.
run-head: setup
	$(PY) -m tandem.launch --target smollm2-135m-instruct --draft none --head shipped

# Every tier (what CI runs). The tiers are pytest markers (pyproject.toml; tests/conftest.py refuses a
# test without exactly one): unit (in this process, no server), service (the stack in this process
# over real gRPC), system (real processes, a private Redis, kill -9 and SIGTERM), deploy (Helm and
# kustomize rendered and validated; needs kubectl). PYTEST_ARGS adds options, e.g. PYTEST_ARGS=-x.
PYTEST_ARGS ?=
test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-unit test-service test-system test-deploy: test-%: setup
	$(PY) -m pytest -q -m $* $(PYTEST_ARGS) tests

# The long runs `make test` leaves out: the hostile-request fuzz (tests/test_fuzz.py) with
# FUZZ_EXAMPLES examples per strategy instead of 150, the tests marked `slow` (the Qwen pair at every
# precision, tests/test_precision_qwen.py, and variants of tests make test keeps), then the full
# soak (SOAK_SECONDS, below).
FUZZ_EXAMPLES ?= 3000
test-slow: setup
	TANDEM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q --timeout 3600 $(PYTEST_ARGS) tests/test_fuzz.py
	TANDEM_SLOW_TESTS=1 $(PY) -m pytest -q --timeout 3600 -m slow $(PYTEST_ARGS) tests
	$(PY) -m tests.soak --seconds $(SOAK_SECONDS)

# Five minutes of concurrent clients, cancellations, deadlines and worker restarts (tests/soak.py).
SOAK_SECONDS ?= 300
soak: setup
	$(PY) -m tests.soak --seconds $(SOAK_SECONDS)

bench: setup
	$(PY) -m bench.e2e
	$(PY) -m bench.precision $(PRECISION_ARGS)

# Train the block-drafter head for SmolLM2-135M-Instruct as shipped (tandem/head/trained/, docs/head.md),
# in two runs: from random weights on the target's greedy answers, then from that head on its greedy
# and sampled answers and second turns, ending with the greedy calibration. About two hours on 2 CPU cores; HEAD_OUT
# keeps each run's data, log and state (rerun to resume).
HEAD_OUT ?= runs/head-smollm2
HEAD_COMMON ?= --target smollm2-135m-instruct --batch 8 --anchors 48 --eval-every 100 --eval-sequences 24 \
	--max-new-tokens 160
HEAD_ARGS ?= --steps 1000
HEAD_MORE_ARGS ?= --steps 550 --lr 5e-4 --sampled-temperature 0.7 --followups 300 --calibration-sequences 48 \
	--eval-every 50
train-head: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m tandem.head.train --out $(HEAD_OUT) --resume $(HEAD_COMMON) $(HEAD_ARGS) \
		--calibration-sequences 0
	OMP_WAIT_POLICY=PASSIVE $(PY) -m tandem.head.train --out $(HEAD_OUT)-more --resume \
		--init $(HEAD_OUT)/head.safetensors $(HEAD_COMMON) $(HEAD_MORE_ARGS)

# Concurrent streams, speculation on vs off (bench/load.py); LOAD_ARGS=--quick for a smoke run.
LOAD_ARGS ?=
bench-load: setup
	$(PY) -m bench.load $(LOAD_ARGS)

# The native face against the SMG router's OpenAI API in front of it, 1 and 4 streams (bench/router.py).
bench-router: setup
	$(PY) -m bench.e2e --only router --out bench/results/router.json

# A batched verify pass's time by sessions and positions (bench/passcost.py), the controller's cost curve.
bench-passcost: setup
	$(PY) -m bench.passcost --shared 120

# The pools' layouts side by side, each process pinned to its CPUs (bench/topology.py): plain, draft
# co-located with verify, split, split with drafting ahead, split through an emulated link;
# TOPOLOGY_ARGS=--quick for a smoke run.
TOPOLOGY_ARGS ?=
bench-topology: setup
	$(PY) -m bench.topology $(TOPOLOGY_ARGS)

# Chains against trees of candidates, Qwen pair and n-gram, 1, 4 and 16 streams, and transformers'
# assisted generation (bench/trees.py); TREES_ARGS=--quick for a smoke run.
TREES_ARGS ?=
bench-trees: setup
	$(PY) -m bench.trees $(TREES_ARGS)

# Draft worker settings side by side on one verify worker, prompts interleaved (bench/variants.py);
# VARIANTS_ARGS names them, e.g. --variant whole= --variant "vocab=--draft-vocab 32768".
VARIANTS_ARGS ?= --variant whole= --variant "vocab=--draft-vocab 32768"
bench-variants: setup
	$(PY) -m bench.variants $(VARIANTS_ARGS)

# The target's forward pass on Tandem's own CPU kernel against oneDNN's, by precision (bench/kernels.py).
bench-kernels: setup
	$(PY) -m bench.kernels

# Forward passes through transformers' modules against the lean decoder (bench/decoder.py).
bench-decoder: setup
	$(PY) -m bench.decoder

# How often a draft at each precision agrees with the target's greedy tokens, and its step (bench/agreement.py).
bench-agreement: setup
	$(PY) -m bench.agreement

# The peers section of `make bench`: the target at float32, bfloat16 and int8, plain and speculative,
# beside llama.cpp built from its PyPI sources (bench/precision.py); PRECISION_ARGS=--quick for a smoke run.
PRECISION_ARGS ?=
bench-precision: setup
	$(PY) -m bench.precision $(PRECISION_ARGS)

# One image, three entry points; VARIANT=gpu (CUDA base) or cpu (slim). Needs a Docker engine.
IMAGE ?= tandem
VARIANT ?= gpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image:
	docker build -f deploy/Dockerfile --build-arg VARIANT=$(VARIANT) -t $(IMAGE):$(VERSION)-$(VARIANT) .

# Build the cpu image for real and run the chart's pods (cpu-dev values) as Docker containers:
# health, greedy output, migration on docker stop, non-root, read-only root. Root + Docker; not in `make test`.
image-check:
	deploy/image-check.sh

# Render, lint and schema-validate the Helm chart and kustomize overlays (no cluster needed).
deploy-check: test-deploy

clean:
	rm -rf tandem/v1 fmaas vllm_engine .pytest_cache
