"""Job sets with known prefix structure, shared by the engine tests."""
from __future__ import annotations

import random

from batchgen.pipeline.text.tokenize import Tokenizer
from batchgen.pipeline.engine.types import Request, SamplingParams
from tests.helpers.tiny_tokenizer import make_tokenizer

SYSTEM = "You are a careful assistant. Answer in one short sentence and never invent facts. "
SHOTS = [
    "Q: 2+2? A: 4. Q: 3+5? A: 8. Q: 7+1? A: 8. Q: 6+3? A: 9. Q: 1+1? A: 2. ",
    "Q: capital of France? A: Paris. Q: of Peru? A: Lima. Q: of Japan? A: Tokyo. ",
]
DOCS = ["Doc: the river is long and cold. ", "Doc: a quiet town by the sea. "]


def tokenizer() -> Tokenizer:
    return Tokenizer(make_tokenizer())


def edge_case_requests(tok: Tokenizer, max_new_tokens: int = 10) -> list[Request]:
    """The seed case, single tokens, three nested levels, uneven suffixes, chat jobs, n samples."""
    rng = random.Random(0)
    texts = [
        "I have a dream",
        "I have a dream",  # the same prompt twice: its whole prompt is shared
        "I have a dream ",  # plus a trailing space
        "I have a dream that one day this nation will rise up",
    ]
    for shot in SHOTS:
        for doc in DOCS:
            texts += [SYSTEM + shot + doc + q for q in ("Q: why?", "Q: where is it and how far is it from here?")]
        texts.append(SYSTEM + shot + "Q: 9+9?")
    texts.append(SYSTEM)  # a prompt that is exactly a shared prefix of others
    reqs = [Request(i, tok.encode_prompt(t), SamplingParams(max_new_tokens=max_new_tokens))
            for i, t in enumerate(texts)]
    reqs[5].params = SamplingParams(max_new_tokens=3)  # per-job lengths differ inside a group
    chat = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": u}]
        for u in ("Say hi.", "Name a colour.", "Count to three, slowly, and then stop counting.")
    ]
    for m in chat:
        reqs.append(Request(len(reqs), tok.encode_messages(m), SamplingParams(max_new_tokens=max_new_tokens)))
    # raw single-token prompts and a very long suffix under a short shared head
    reqs.append(Request(len(reqs), [7], SamplingParams(max_new_tokens=max_new_tokens)))
    reqs.append(Request(len(reqs), [7], SamplingParams(max_new_tokens=max_new_tokens)))
    reqs.append(Request(len(reqs), [9], SamplingParams(max_new_tokens=max_new_tokens)))
    head = tok.encode_prompt(SYSTEM)
    reqs.append(Request(len(reqs), head + [rng.randrange(10, 100) for _ in range(70)],
                        SamplingParams(max_new_tokens=max_new_tokens)))
    # n samples of one prompt, greedy: each equals the single greedy answer
    reqs.append(Request(len(reqs), tok.encode_prompt("Once upon a time"), SamplingParams(max_new_tokens=max_new_tokens, n=3)))
    return reqs
