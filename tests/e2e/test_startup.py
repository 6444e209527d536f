"""What a run imports before its first forward: a greedy or sampled run of a model batchgen's own
decoder and tokenizer stand-in serve imports neither transformers nor pandas, and gives the same
output as a run through transformers' tokenizer."""
import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from batchgen.pipeline.engine.sampling import warp

pytestmark = pytest.mark.slow

NOT_IMPORTED = ("transformers", "pandas", "huggingface_hub", "datasets", "ray", "peft", "llguidance", "jsonschema",
                "lm_eval", "sympy", "scipy")
# torch's parts that `import torch` leaves out, which only compiling or building extensions imports
TORCH_NOT_IMPORTED = ("torch._dynamo", "torch._inductor", "torch.utils.cpp_extension", "torch.onnx")


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.8, 0, 1.0), (1.3, 5, 1.0), (0.7, 0, 0.9), (1.0, 3, 0.5),
                                                     (0.5, 300, 0.95), (2.0, 1, 0.0)])
def test_warp_is_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 257, generator=g) * 3
    logits[0, 10:20] = logits[0, 5]  # ties at the cut-offs
    logits[0, 30] = float("-inf")
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    assert torch.equal(warp(logits, temperature, top_k, top_p), procs(None, logits))


def test_a_cli_run_imports_neither_transformers_nor_pandas(tmp_path, model_dir):
    """The first run of a model directory loads its tokenizer through transformers and records it
    (pipeline/text/fast_tokenizer.py); the next imports neither (nor any other package a run of
    the decoder does not need, nor more of torch than `import torch`), and writes the same output."""
    import transformers

    src = tmp_path / "jobs.jsonl"
    rows = [{"id": "p", "prompt": "the shared words of every job here, then one"},
            {"id": "c", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
            {"id": "s", "prompt": "the shared words of every job here, then two", "temperature": 0.8, "n": 2,
             "top_p": 0.9, "top_k": 20, "seed": 3}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**__import__("os").environ, "BATCHGEN_CACHE_DIR": str(tmp_path / "cache")}
    outputs = []
    for run in range(2):
        out = tmp_path / f"out{run}.parquet"
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "batchgen", "process", str(src), "-o", str(out),
                               "--model", str(model_dir), "--max-new-tokens", "5", "--device", "cpu"],
                              capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        modules = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
        # packages whose submodules were imported (a package refused at its name alone shows there too)
        imported = {name.split(".")[0] for name in modules if "." in name}
        assert ("transformers" in imported) if run == 0 else not imported & set(NOT_IMPORTED), \
            sorted(imported & set(NOT_IMPORTED))
        assert run == 0 or "torch" in modules and not modules & set(TORCH_NOT_IMPORTED), \
            sorted(modules & set(TORCH_NOT_IMPORTED))
        summary = json.loads(out.with_name(out.name + ".summary.json").read_text())
        assert summary["versions"]["transformers"] == transformers.__version__
        outputs.append(pq.read_table(out).to_pylist())
    assert outputs[0] == outputs[1]


def test_pyarrow_looks_for_pandas_again_once_it_is_imported():
    """The `batchgen` process keeps pyarrow from importing pandas on its first list conversion; once
    anything imports pandas, pyarrow treats pandas objects as pandas objects again."""
    code = """if True:
        import sys
        from batchgen.pipeline.cli import _arrow_without_pandas
        _arrow_without_pandas(["process", "jobs.jsonl"])
        import pyarrow as pa
        table = pa.Table.from_pylist([{"a": 1, "b": "x"}])
        assert "pandas" not in sys.modules
        import pandas as pd
        assert pa.array(pd.Series([1.0, float("nan")])).null_count == 1  # NaN is null, as pandas' missing value
        assert table.to_pandas()["b"].tolist() == ["x"]
        print("ok")"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
