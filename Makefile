# Two entry points: `make demo` and `make test` (`make check` is test's fast tier). They build
# .venv/ from pinned requirements.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# lm-eval in a venv of its own (its ~40 dependencies stay out of the project's): the test
# that drives `warmboot serve` with lm-eval's local-completions model runs it.
LMEVAL       := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL)/.installed
# LangChain, LiteLLM and schemathesis likewise, for the client tests.
CLIENTS       := .venv-clients
CLIENTS_STAMP := $(CLIENTS)/.installed
# compressed-tensors and AutoAWQ's torch-only code (pure Python) beside the project venv, for
# the checks of the quantized test checkpoints against the formats' own libraries.
QUANT       := .venv-quant
QUANT_STAMP := $(QUANT)/.installed
# peft and accelerate (pure Python) likewise, for the LoRA adapter tests (adapters peft writes).
LORA       := .venv-lora
LORA_STAMP := $(LORA)/.installed

.PHONY: demo test lint bench clean runsc promtool gpu-wheels native
.PHONY: check

$(STAMP): requirements.txt pyproject.toml
	@free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); [ "$$free" -ge 3 ] \
		|| { echo "error: the venv needs about 2.5 GiB of disk (3 GiB free to build it); $$free GiB free here" >&2; exit 1; }
	test -x $(PY) || python3 -m venv $(VENV)
	# requirements.txt is the complete pinned set: --no-deps stops pip from adding unpinned
	# extras (xgrammar would pull triton, and an unpinned torch would be a CUDA build).
	$(PY) -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps -r requirements.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps -e .
	touch $(STAMP)

$(QUANT_STAMP): tests/quant/requirements.txt $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps \
		--target $(QUANT)/site -r tests/quant/requirements.txt
	touch $(QUANT_STAMP)

$(LORA_STAMP): tests/lora/requirements.txt $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps \
		--target $(LORA)/site -r tests/lora/requirements.txt
	touch $(LORA_STAMP)

$(LMEVAL_STAMP): tests/lm_eval/requirements.txt
	test -x $(LMEVAL)/bin/python || python3 -m venv $(LMEVAL)
	$(LMEVAL)/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps \
		-r tests/lm_eval/requirements.txt
	touch $(LMEVAL_STAMP)

$(CLIENTS_STAMP): tests/clients/requirements.txt
	test -x $(CLIENTS)/bin/python || python3 -m venv $(CLIENTS)
	$(CLIENTS)/bin/python -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps \
		-r tests/clients/requirements.txt
	touch $(CLIENTS_STAMP)

# gVisor for process snapshots: installed when missing and we are root with apt; otherwise the
# tests that need it skip and say why.
runsc:
	@command -v runsc >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& { apt-get update -qq && apt-get install -y -qq runsc >/dev/null; } \
		|| echo "runsc not installed: gVisor tests will skip"; }

# promtool (Prometheus's linter) for the /metrics lint test: the one binary taken out of Debian's
# prometheus package (19 MB download; installing the package would bring web assets, a system
# user and a Prometheus service). Installed when missing and we are root with apt; otherwise
# that test skips.
promtool:
	@command -v promtool >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
		&& d=$$(mktemp -d) && apt-get update -qq && (cd $$d && apt-get download -qq prometheus 2>/dev/null) \
		&& dpkg-deb --fsys-tarfile $$d/prometheus_*.deb | tar -x -C $$d ./usr/bin/promtool \
		&& install -m 755 $$d/usr/bin/promtool /usr/local/bin/promtool; rm -rf "$$d"; \
		command -v promtool >/dev/null 2>&1 || echo "promtool not installed: the /metrics lint test will skip"; }

# The native CPU kernels (warmboot/kernels/native), built with the system's g++ once per key
# (sources, compiler, torch, CPU flags) into $WARMBOOT_CACHE/native; without this target the
# first engine that wants them builds them (about 20 s).
native: $(STAMP)
	$(PY) -c "from warmboot.kernels import native as n; print('native kernels:', n.library() or n.unavailable_reason(), n.isa() or '')"

demo: $(STAMP) runsc native
	$(PY) -m warmboot.cli demo

test: $(STAMP) runsc promtool native $(LMEVAL_STAMP) $(CLIENTS_STAMP) $(QUANT_STAMP) $(LORA_STAMP)
	$(PY) -m ruff format --check warmboot tests bench
	$(PY) -m ruff check warmboot tests bench
	$(PY) -m pytest -q -ra

# The fast tier for the edit-test loop (under 2 minutes on 2 cores): the suite less the tests
# marked slow (interpreter kernels, gVisor, GPU-script smoke runs). `make test` runs everything.
check: $(STAMP) native
	$(PY) -m ruff format --check warmboot tests bench
	$(PY) -m ruff check warmboot tests bench
	$(PY) -m pytest -q -ra -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff format --check warmboot tests bench
	$(PY) -m ruff check warmboot tests bench

bench: $(STAMP)
	$(PY) bench/decode.py

clean:
	rm -rf $(VENV)

# Wheels the GPU image lacks (its Python is 3.12), for bench/gpu_run.sh: the device tool's
# `run` with carry [".whl"]. Versions come from requirements.txt.
GPU_WHEELS := xgrammar apache-tvm-ffi pydantic pydantic_core annotated-types typing-inspection
gpu-wheels: $(STAMP)
	mkdir -p .whl
	$(PY) -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
	  --python-version 3.12 --implementation cp -d .whl \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  $$(for w in $(GPU_WHEELS); do grep -i "^$$w==" requirements.txt; done)
