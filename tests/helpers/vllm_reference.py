"""vLLM's own offline generation, the reference the served runs are checked against. Runs in vLLM's
venv (`make vllm-env`), never batchgen's: `bench/vllm_cpu_serve.sh python tests/helpers/vllm_reference.py
SPEC.json OUT.json`. It imports nothing of batchgen.

SPEC: {"model": DIR, "prompts": [[ids]], "max_tokens": N, "dtype": "float32", "args": {LLM kwargs},
       "loras": [adapter DIR or null per prompt] (optional; the LLM's args then enable LoRA)}.
OUT: {"token_ids": [[ids] per prompt], "cached_tokens": [per prompt], "version": vLLM's}.
LLM.generate greedy (temperature 0) on the same token ids, prefix caching on, as the server runs;
each prompt with its LoRARequest (one per directory), as a served request naming its module.
"""
import json
import os
import sys


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), enable_prefix_caching=True, seed=0,
              **spec.get("args", {}))
    sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    loras = spec.get("loras")
    if loras is not None:
        from vllm.lora.request import LoRARequest

        ids = {d: i for i, d in enumerate(dict.fromkeys(d for d in loras if d), 1)}
        loras = [LoRARequest(f"lora-{ids[d]}", ids[d], d) if d else None for d in loras]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], sp, use_tqdm=False,
                        lora_request=loras)
    json.dump({"token_ids": [list(o.outputs[0].token_ids) for o in outs],
               "cached_tokens": [o.num_cached_tokens or 0 for o in outs], "version": vllm.__version__},
              open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts its engine processes with spawn: they import this file
    main()
