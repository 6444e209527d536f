"""Plain batched `model.generate` (left padding, no prefix sharing) over a job file, as one process:
the baseline every Hugging Face user has. Same job format and output line as the peers' runners.

usage: python -m bench.hf_run JOBS.jsonl OUT.jsonl [THREADS] [BATCH] [DTYPE] [DEVICE] [MODEL]
"""
from __future__ import annotations

import json
import sys
import time

t_start = time.perf_counter()

import torch  # noqa: E402
import transformers  # noqa: E402


def main() -> None:
    jobs_path, out_path = sys.argv[1:3]
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    batch = int(sys.argv[4]) if len(sys.argv) > 4 else 16
    dtype = sys.argv[5] if len(sys.argv) > 5 else "float32"
    device = sys.argv[6] if len(sys.argv) > 6 else "cpu"
    name = sys.argv[7] if len(sys.argv) > 7 and sys.argv[7] else None  # a model directory; None: the default
    torch.set_num_threads(threads)
    from transformers import AutoTokenizer, GenerationConfig

    from batchgen.pipeline.model.load import load_model

    model, source = load_model(name, device, dtype, pack_weights=False, own_decoder=False)  # plain Hugging Face layers
    tok = AutoTokenizer.from_pretrained(source)
    eos = model.generation_config.eos_token_id
    rows = [json.loads(line) for line in open(jobs_path)]
    t_loaded, ready_at = time.perf_counter(), time.monotonic()  # monotonic: the clock bench_engine reads
    texts, ntok = {}, 0
    with torch.inference_mode():
        for start in range(0, len(rows), batch):
            chunk = rows[start : start + batch]
            ids = [tok(r["prompt"]).input_ids for r in chunk]
            width = max(map(len, ids))
            pad = eos if isinstance(eos, int) else eos[0]
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=model.device)
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=model.device)
            config = GenerationConfig(max_new_tokens=chunk[0]["max_new_tokens"], do_sample=False, eos_token_id=eos,
                                      pad_token_id=pad)
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
            for r, seq in zip(chunk, out[:, width:].tolist()):
                cut = seq[: seq.index(pad)] if pad in seq else seq
                ntok += len(cut) + (pad in seq)
                texts[r["id"]] = tok.decode(cut, skip_special_tokens=True)
    t_done, done_at = time.perf_counter(), time.monotonic()
    with open(out_path, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r["id"], "completion": texts[r["id"]]}) + "\n")
    print(json.dumps({"system": "hf-batched", "import_s": round(t_loaded - t_start, 3),
                      "gen_s": round(t_done - t_loaded, 3), "completion_tokens": ntok, "ready_at": ready_at,
                      "done_at": done_at,
                      "version": f"transformers {transformers.__version__}, torch {torch.__version__}"}))


if __name__ == "__main__":
    main()
