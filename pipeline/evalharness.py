"""lm-evaluation-harness backend: `--model batchgen`, on batchgen's engine.

lm-eval hands a model whole lists of requests; this backend gives each list to one engine run,
so a few-shot header shared by every question of a subject (and each question's context shared
by its four choices) is prefilled once, and results come back in request order. Tokenization is
lm-eval's own (`TemplateLM`: the context's trailing spaces move into the continuation, the pair is
encoded whole and split, an empty context becomes the prefix token), and truncation and rolling
windows are those of its `hf` backend, so both score the same tokens.

lm-eval 0.4.13 finds models only in its built-in table, not through entry points: importing this
module registers `batchgen`; `lm_eval` itself finds it through a start-up hook that `make setup`
installs (pipeline/lm_eval_plugin.py), and the `batchgen-lm-eval` command (lm-eval's own command
line, run after that import) needs none. Both take every `lm_eval` option:

    lm_eval --model batchgen --model_args pretrained=DIR,dtype=float32 --tasks TASK --include_path TASKS_DIR

`peft=ADAPTER_DIR` runs every request through a PEFT LoRA adapter on the base model, as the hf
backend's `peft=` does (there it is merged into a copy; here it is applied beside the base weights).
"""
from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401  lm-eval's own table first: it fills it only while the registry is empty
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix, normalize_gen_kwargs

from batchgen_lm_eval_hook import make_room

from batchgen.jobs.checks import Checker
from batchgen.jobs.errors import JobValidationError, Location
from batchgen.jobs.params import PARAMS, normalize, split_fields
from batchgen.jobs.schema import GenerationDefaults
from batchgen.pipeline.engine.schedule import MAX_BATCH_TOKENS, MIN_SHARED_TOKENS
from batchgen.pipeline.engine.types import Request, SamplingParams

# generate_until's kwargs beside until, max_gen_toks, do_sample and temperature, as batchgen's job
# fields: those of transformers' generate that the hf backend passes on and batchgen has
# (min_new_tokens is min_tokens), and vLLM's penalties and seed. Any other is refused by name.
GEN_FIELDS = ("top_k", "top_p", "repetition_penalty", "min_tokens", "presence_penalty", "frequency_penalty", "seed")
_TAKES = f"batchgen takes until, max_gen_toks, do_sample, temperature, {', '.join(GEN_FIELDS)}"
_DEFAULTS = GenerationDefaults()
# where a request leaves them out, transformers' generate (so the hf backend) takes them from the
# model's generation_config, and where that has none, from these defaults of its own
HF_DEFAULTS = {"top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0}


make_room()  # an older lm-eval's table may hold the start-up hook's stand-in under that name


@register_model("batchgen")
class BatchgenLM(TemplateLM):
    def __init__(self, pretrained: str | None = None, dtype: str = "auto", device: str = "auto",
                 max_batch_tokens: int = MAX_BATCH_TOKENS, min_shared_tokens: int = MIN_SHARED_TOKENS,
                 max_length: int | None = None,
                 trust_remote_code: bool = False, add_bos_token: bool | None = None, batch_size: Any = None,
                 threads: int | None = None, peft: str | None = None, **unused: Any) -> None:
        super().__init__()
        from batchgen.pipeline.engine.engine import Engine
        from batchgen.pipeline.model.kernels import set_threads
        from batchgen.pipeline.model.load import load_model
        from batchgen.pipeline.run.preflight import context_window
        from batchgen.pipeline.text.tokenize import Tokenizer

        if unused:
            raise ValueError(f"batchgen model_args: unknown {sorted(unused)}")
        import torch

        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "auto"  # lm-eval passes cuda:0 by default; its hf backend then picks what there is too
        set_threads(threads)
        model, source = load_model(pretrained, device, str(dtype), bool(trust_remote_code))
        self.tok = Tokenizer.load(source, trust_remote_code=bool(trust_remote_code))
        self.engine = Engine.for_model(model, self.tok.eos_token_ids, min_shared_tokens=int(min_shared_tokens),
                                       max_batch_tokens=int(max_batch_tokens))
        self.adapter = 0  # every request's adapter index: 1 with `peft`, else the base model
        if peft:
            from batchgen.pipeline.model.adapter_files import inspect_adapter

            self.engine.model.set_adapters([inspect_adapter(peft, self.engine.model.config)])
            self.adapter = 1
        self.add_bos_token = None if add_bos_token is None else str(add_bos_token).lower() in ("1", "true", "yes")
        self._max_length = int(max_length) if max_length else (context_window(model.config) or 2048)
        config = _generation_config(source, model)
        self.gen_defaults = {name: default if getattr(config, name, None) is None else getattr(config, name)
                             for name, default in HF_DEFAULTS.items()}
        self.source = source

    # -- what TemplateLM asks for -----------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tok.hf.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tok.hf.bos_token_id
        return bos if bos is not None else self.tok.hf.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.source.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """As the hf backend: the tokenizer's own special tokens unless told, none before a BOS already there."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tok.hf.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        return list(self.tok.hf.encode(string, **special))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tok.hf.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """((context, continuation), context ids, continuation ids) each: (sum of the continuation's
        logprobs, whether greedy decoding would have produced it)."""
        pairs = [(ctx, cont) for _, ctx, cont in requests]
        return [(sum(lp), all(greedy)) for lp, greedy in self._score(pairs)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's whole logprob, in disjoint windows of the context length (as the hf backend)."""
        windows, owner = [], []
        for i, request in enumerate(requests):
            tokens = self.tok_encode(request.args[0])
            for pair in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append(pair)
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._score(windows)):
            totals[i] += sum(lp)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        reqs, stops = [], []
        for i, request in enumerate(requests):
            context, gen_kwargs = request.args
            task = getattr(request, "task_name", None)
            until, params = generation(gen_kwargs, f"task {task}" if task else "generate_until", self.gen_defaults)
            ids = self.tok_encode(context)[-(self.max_length - params.max_new_tokens) :]
            reqs.append(Request(i, ids or [self.prefix_token_id], params, stop=self.tok.stop_check(until),
                                adapter=self.adapter))
            stops.append(until)
        out = [""] * len(reqs)
        for c in self.engine.run(reqs):
            text = self.tok.decode(c.token_ids)
            for stop in stops[c.key]:
                if stop:
                    text = text.split(stop)[0]
            out[c.key] = text
        return out

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[list[float], list[bool]]]:
        """Per (context ids, continuation ids): the continuation tokens' logprobs and argmax flags,
        all pairs in one engine run. Left-truncated to the context length as the hf backend does."""
        reqs = []
        for i, (ctx, cont) in enumerate(pairs):
            full = (ctx + cont)[-(self.max_length + 1) :]
            reqs.append(Request(i, full, SamplingParams(max_new_tokens=0), score_from=len(full) - len(cont),
                                adapter=self.adapter))
        out: list[Any] = [None] * len(reqs)
        for c in self.engine.run(reqs):
            if c.error:
                raise RuntimeError(f"scoring request {c.key} failed: {c.error}")
            out[c.key] = (c.prompt_logprobs, c.prompt_greedy)
        return out


def _generation_config(source: str, model: Any) -> Any:
    """The model's generation_config.json as transformers reads it, else what a transformers model
    has (None for batchgen's own decoder, which reads only the EOS ids)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(source)
    except OSError:  # no generation_config.json
        return getattr(model, "generation_config", None)


def generation(gen_kwargs: dict[str, Any], where: str,
               defaults: dict[str, Any] = HF_DEFAULTS) -> tuple[list[str], SamplingParams]:
    """A generate_until request's stop strings and sampling parameters. lm-eval's own normalization
    first, as in its hf backend (the aliases of max_gen_toks; do_sample false is greedy whatever the
    temperature); each other kwarg is one of GEN_FIELDS, checked as a job's field is, or refused by
    name (ValueError): never dropped. ``defaults`` fill what the request leaves out (the model's
    generation_config, as the hf backend's generate does: a sampled request takes top_k 50)."""
    kwargs = dict(normalize_gen_kwargs(gen_kwargs))
    until = [s for s in kwargs.pop("until") if s]
    values = {name: getattr(_DEFAULTS, name) for name in PARAMS}
    values.update(defaults, max_new_tokens=kwargs.pop("max_gen_toks"), seed=0)
    temperature, sample = kwargs.pop("temperature", 0.0), kwargs.pop("do_sample")
    values["temperature"] = temperature if sample else 0.0
    check = Checker(Location(where))
    try:
        given, spelled = split_fields(check, kwargs, unknown=f"is not a generation argument batchgen knows; {_TAKES}")
        for name in given:
            if name not in GEN_FIELDS:
                raise check.fail(spelled[name], f"is not a generate_until argument of lm-eval's hf backend; {_TAKES}")
        values.update(given)
        v = normalize(check, values)
    except JobValidationError as e:
        raise ValueError(f"batchgen: {e}") from None
    return until, SamplingParams(
        max_new_tokens=v["max_new_tokens"], temperature=v["temperature"], top_p=v["top_p"], top_k=v["top_k"],
        seed=v["seed"], repetition_penalty=v["repetition_penalty"], presence_penalty=v["presence_penalty"],
        frequency_penalty=v["frequency_penalty"], min_tokens=v["min_tokens"])


def main() -> None:
    """`batchgen-lm-eval`: lm-eval's command line with the batchgen model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
