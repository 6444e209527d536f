"""Real English text for benchmark prompts, with no download: sentences from the docstrings of
Python's standard library (the same on every machine with the same Python), and job files built
from them in the shapes real jobs have:

- fewshot: MMLU-style 5-shot multiple choice. Per subject, a header of five answered questions
  (about 400 tokens) shared by every question of the subject; each question 30-400 tokens,
  log-uniform (most are short, some are long), with four options. Up to 16 subjects (the 1,000-job
  file: 16 x 64).
- system_prompt: a ~500-token system prompt per group, each followed by user requests of 20-120
  tokens.
- samples: decode-heavy, 16 samples ("n") of each of 8 questions under a ~1,600-token 8-shot
  header, 128 new tokens.
- long_document: 32 questions about each of 2 documents of ~3,000 tokens, 64 new tokens.

Job rows: {"id", "group", "prompt", "max_new_tokens"}; jobs of a group are contiguous (the CTranslate2
runner passes a group's common prefix as its static prompt).
"""
from __future__ import annotations

import importlib
import math
import random
import re
import warnings
from functools import lru_cache

MODULES = ("collections", "json", "argparse", "logging", "email", "http.client", "asyncio", "unittest", "difflib",
           "textwrap", "csv", "pathlib", "subprocess", "threading", "decimal", "fractions", "statistics", "random",
           "datetime", "calendar", "heapq", "bisect", "itertools", "functools", "string", "shutil", "tarfile",
           "zipfile", "sqlite3", "urllib.request", "inspect", "dataclasses", "enum", "contextlib", "socket", "ssl",
           "smtplib", "imaplib", "pickle", "copy", "locale", "gettext", "optparse", "configparser", "tempfile",
           "io", "codecs", "struct", "queue", "sched", "weakref", "numbers", "math", "hashlib", "secrets",
           "mailbox", "mimetypes", "doctest", "pdb", "timeit", "trace", "sys", "os", "time", "select", "signal",
           "ast", "tokenize", "importlib", "traceback", "warnings", "builtins")
SUBJECTS = ("file systems", "networking", "concurrency", "text processing", "numeric computing", "data formats",
            "testing", "interpreter internals", "security", "databases", "web protocols", "packaging", "debugging",
            "serialization", "dates and times", "email handling")  # a subject's name is in its jobs' ids: 16 distinct
CHARS_PER_TOKEN = 4.2  # SmolLM2's tokenizer on this text


@lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    texts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in MODULES:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            for obj in vars(mod).values():
                doc = getattr(obj, "__doc__", None)
                if isinstance(doc, str) and len(doc) > 200 and getattr(obj, "__module__", name) == name:
                    texts.append(doc)
    flat = re.sub(r"\s+", " ", " ".join(texts))
    seen, out = set(), []
    for s in re.split(r"(?<=[.!?])\s+", flat):
        s = s.strip()
        if 40 < len(s) < 300 and s[0].isupper() and not any(c in s for c in ">{}[]=_\\`") and s not in seen:
            seen.add(s)
            out.append(s)
    return tuple(out)


class _Text:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.pool = sentences()

    def sentence(self) -> str:
        return self.rng.choice(self.pool)

    def about(self, tokens: int) -> str:
        """Sentences adding up to about `tokens` tokens."""
        out, chars = [], 0
        while chars < tokens * CHARS_PER_TOKEN:
            s = self.sentence()
            out.append(s)
            chars += len(s) + 1
        return " ".join(out)

    def log_uniform(self, lo: int, hi: int) -> int:
        return int(lo * math.exp(self.rng.random() * math.log(hi / lo)))


def _mcq(text: _Text, tokens: int, answer: str | None) -> str:
    """A question of about `tokens` tokens: a stem and four short options (~35 tokens)."""
    options = "\n".join(f"{letter}. {' '.join(text.sentence().split()[:5])}" for letter in "ABCD")
    stem = text.about(max(8, tokens - 35))
    return f"{stem}\n{options}\nAnswer:" + (f" {answer}\n\n" if answer else "")


def fewshot(subjects: int = 4, questions: int = 16, max_new_tokens: int = 16, seed: int = 0) -> list[dict]:
    text = _Text(seed)
    rows = []
    for s in range(subjects):
        subject = SUBJECTS[s % len(SUBJECTS)]
        header = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
        header += "".join(_mcq(text, 75, text.rng.choice("ABCD")) for _ in range(5))
        for q in range(questions):
            rows.append({"id": f"{subject.replace(' ', '-')}-{q}", "group": subject,
                         "prompt": header + _mcq(text, text.log_uniform(30, 400), None),
                         "max_new_tokens": max_new_tokens})
    return rows


def system_prompt(groups: int = 8, jobs: int = 8, max_new_tokens: int = 16, seed: int = 0) -> list[dict]:
    text = _Text(seed + 1)
    rows = []
    for g in range(groups):
        system = (f"You are the documentation assistant for team {g}. Answer briefly and precisely. "
                  + text.about(480) + "\n\n")
        for j in range(jobs):
            rows.append({"id": f"g{g}-{j}", "group": f"g{g}",
                         "prompt": system + "User: " + text.about(text.log_uniform(20, 120)) + "\nAssistant:",
                         "max_new_tokens": max_new_tokens})
    return rows


def samples(prompts: int = 8, n: int = 16, max_new_tokens: int = 128, seed: int = 0) -> list[dict]:
    """Decode-heavy: `n` samples of each of `prompts` questions under one 8-shot worked-answer
    header of about 1,600 tokens (every row decodes over the shared header)."""
    text = _Text(seed + 2)
    header = "".join(f"Question: {text.about(60)}\nAnswer: Let us think step by step. {text.about(125)}\n\n"
                     for _ in range(8))
    return [{"id": f"q{i}", "group": "header", "prompt": header + f"Question: {text.about(text.log_uniform(20, 80))}"
             "\nAnswer: Let us think step by step.", "n": n, "max_new_tokens": max_new_tokens} for i in range(prompts)]


def long_document(documents: int = 2, questions: int = 32, max_new_tokens: int = 64, seed: int = 0) -> list[dict]:
    """Long shared context: `questions` short questions about each document of about 3,000 tokens."""
    text = _Text(seed + 3)
    rows = []
    for d in range(documents):
        document = f"Document {d}:\n{text.about(3350)}\n\n"
        rows += [{"id": f"d{d}-{q}", "group": f"d{d}", "max_new_tokens": max_new_tokens,
                  "prompt": document + f"Question: {text.about(text.log_uniform(10, 40))}\nAnswer:"}
                 for q in range(questions)]
    return rows


WORKLOADS = {"fewshot": fewshot, "system_prompt": system_prompt, "samples": samples, "long_document": long_document}
