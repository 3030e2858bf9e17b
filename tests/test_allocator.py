"""srupp.tune_cpu_allocator: freed large buffers are reused, not faulted in again."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys

import pytest

import srupp

# Allocates and frees three 20 MB tensors per round: with glibc's defaults the
# freed top of the heap exceeds the (adaptive) trim threshold and is handed back,
# so every round faults it in again.
_CHILD = r"""
import json, resource, sys, torch
if sys.argv[1] == "tuned":
    import srupp
    assert srupp.tune_cpu_allocator()
def round_():
    ts = [torch.empty(5 * 2**20).fill_(1.0) for _ in range(3)]   # 3 x 20 MiB
    del ts
big = torch.empty(6 * 2**20).fill_(1.0); del big               # raise the adaptive threshold
for _ in range(2):
    round_()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    round_()
print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / 10))
"""


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return hasattr(libc, "gnu_get_libc_version")


def _faults(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc(), reason="mallopt tuning applies to Linux glibc only")
def test_tuning_removes_page_faults_of_reallocated_buffers():
    plain, tuned = _faults("plain"), _faults("tuned")
    # 3 x 20 MiB is 15,360 pages of 4 KiB; several thousand of them fault again each round
    print(f"minor faults per round: default {plain}, tuned {tuned}")
    assert plain > 1000, f"expected glibc to hand memory back by default, got {plain} faults"
    assert tuned < plain / 10, (plain, tuned)


def test_idempotent_and_reports_what_it_did():
    first = srupp.tune_cpu_allocator()
    assert srupp.tune_cpu_allocator() is first
    assert first is _glibc()


def test_env_opt_out(monkeypatch):
    from srupp import allocator

    monkeypatch.setattr(allocator, "_applied", False)
    monkeypatch.setenv("SRUPP_TUNE_ALLOCATOR", "0")
    assert allocator.tune_from_env() is False
    assert allocator._applied is False
