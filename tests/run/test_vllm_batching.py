"""The batch limits batchgen gives a `vllm serve` it starts: vLLM 0.32's offline (`LLM`) defaults
for the device, never over the user's own flags; and the requests kept in flight."""
from __future__ import annotations

import os
import stat

import pytest

from batchgen.pipeline.serve.batching import GIB, Device, batch_args, detect, in_flight, offline_limits
from batchgen.pipeline.serve.vllm_server import VllmServer


@pytest.mark.parametrize("device, world, limits", [
    (Device("cpu"), 1, (4096, 256)),
    (Device("cpu"), 2, (8192, 512)),
    (Device("cuda", "NVIDIA H100 80GB HBM3", 81559 << 20), 1, (16384, 1024)),
    (Device("cuda", "NVIDIA H200", 143771 << 20), 1, (16384, 1024)),
    (Device("cuda", "NVIDIA A100-SXM4-80GB", 81920 << 20), 1, (8192, 256)),  # vLLM keeps A100s small (#17885)
    (Device("cuda", "NVIDIA B200", 183359 << 20), 1, (16384, 1024)),
    (Device("cuda", "NVIDIA L4", 23034 << 20), 1, (8192, 256)),
    (Device("unknown"), 1, None),
])
def test_offline_limits_follow_vllms_table(device, world, limits):
    assert offline_limits(device, world) == limits


def test_the_users_flags_win_in_either_spelling():
    cpu = Device("cpu")
    assert batch_args([], cpu) == ["--max-num-batched-tokens", "4096", "--max-num-seqs", "256"]
    assert batch_args(["--max-num-seqs", "8"], cpu) == ["--max-num-batched-tokens", "4096"]
    assert batch_args(["--max-num-batched-tokens=512"], cpu) == ["--max-num-seqs", "256"]
    assert batch_args(["-tp", "2"], cpu) == ["--max-num-batched-tokens", "8192", "--max-num-seqs", "512"]
    assert batch_args([], Device("unknown")) == []


def test_in_flight_is_twice_the_servers_sequences():
    assert in_flight(["serve", "m", "--max-num-seqs", "64"]) == 128
    assert in_flight(["serve", "m", "--max-num-seqs=1024"]) == 2048
    assert in_flight(["serve", "m"]) == 512


def _fake_smi(tmp_path, line: str):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{line}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}


def test_detect_reads_the_first_visible_gpu_from_nvidia_smi(tmp_path, monkeypatch):
    env = _fake_smi(tmp_path, "NVIDIA H100 80GB HBM3, 81559")
    monkeypatch.setenv("PATH", env["PATH"])
    assert detect({"CUDA_VISIBLE_DEVICES": "3,1"}) == Device("cuda", "NVIDIA H100 80GB HBM3", 81559 << 20)
    assert detect({}).memory >= 70 * GIB


def test_an_answer_detect_cannot_read_leaves_vllms_choice(tmp_path, monkeypatch):
    env = _fake_smi(tmp_path, "No devices were found")
    monkeypatch.setenv("PATH", env["PATH"])
    assert detect({}) == Device("unknown")


def test_a_started_servers_command_carries_the_limits_before_the_users_args(tmp_path):
    server = VllmServer("/bin/true", "model", "m", str(tmp_path / "log"), ["--max-num-seqs", "32"])
    command = server.command
    assert command.count("--max-num-seqs") == 1 and command[command.index("--max-num-seqs") + 1] == "32"
    if detect() == Device("cpu"):  # this machine: vLLM's CPU backend
        assert command[command.index("--max-num-batched-tokens") + 1] == "4096"
