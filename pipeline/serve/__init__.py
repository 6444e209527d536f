"""Serving engines behind batchgen's runner: an OpenAI-compatible completions server (vLLM's, or any
that returns token ids) takes the engine's place. batchgen keeps reading, checks, tokenization,
prefix-sorted windows, committed parts and every output; the server computes.

- `mapping`: a request (token ids and a job's parameters) as a `/v1/completions` body, and the
  server's answer as the engine's `Completion`s;
- `client`: the requests sent in prefix order, a bounded number in flight per server, retried on
  connection errors, 429, 5xx and timeouts;
- `vllm_server`: `vllm serve` started by batchgen, watched so that it never outlives it.

Below the runner (pipeline/run/executors.py), above text/ and engine/'s plain types.
"""
