"""srupp.tune_cpu_allocator: large buffers come from a heap glibc keeps for reuse.

The effect on a training step (page faults and system time) is measured with
getrusage in docs/performance.md ("The CPU allocator"); it depends on the
kernel's memory management, so the test checks the mechanism, which is
deterministic: where glibc serves a block.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest


# Whether a fresh 1 MiB malloc is served by mmap (glibc's default: its initial
# threshold is 128 KiB) or from the heap (after tuning: threshold 32 MiB). Read
# from mallinfo2's hblkhd (bytes in mmapped blocks) in a child that imports
# nothing else, so no earlier allocation has moved glibc's adaptive threshold.
_CHILD = r"""
import ctypes, ctypes.util, importlib.util, json, sys

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "tuned":
    # the module alone (importing the package would import torch and allocate)
    spec = importlib.util.spec_from_file_location("allocator", sys.argv[2])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.tune_cpu_allocator()
before = libc.mallinfo2().hblkhd
p = libc.malloc(2**20)
after = libc.mallinfo2().hblkhd
libc.free(p)
print(json.dumps(after - before))
"""


def _glibc(mallinfo2: bool = False) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    return hasattr(libc, "gnu_get_libc_version") and (not mallinfo2 or hasattr(libc, "mallinfo2"))


def _mmapped_bytes(mode: str) -> int:
    from srupp import allocator

    out = subprocess.run([sys.executable, "-c", _CHILD, mode, allocator.__file__],
                         capture_output=True, text=True, check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc(mallinfo2=True), reason="mallopt tuning applies to Linux glibc (2.33+ for "
                                         "mallinfo2, which this test reads)")
def test_tuning_serves_large_blocks_from_the_reusable_heap():
    # default: a 1 MiB block is its own mmap, unmapped (and later re-faulted) on free
    assert _mmapped_bytes("plain") >= 2**20
    # tuned: it comes from the heap, which is kept for reuse
    assert _mmapped_bytes("tuned") == 0


def test_idempotent_and_reports_what_it_did():
    # in a child: the setting is process-wide and would outlive this test here
    code = ("import json, srupp; a = srupp.tune_cpu_allocator(); "
            "print(json.dumps([a, srupp.tune_cpu_allocator()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == second == _glibc()


def test_env_opt_out(monkeypatch):
    from srupp import allocator

    monkeypatch.setattr(allocator, "_applied", False)
    monkeypatch.setenv("SRUPP_TUNE_ALLOCATOR", "0")
    assert allocator.tune_from_env() is False
    assert allocator._applied is False


def test_cli_applies_the_setting(monkeypatch, capsys):
    from srupp import allocator
    from srupp.cli import main

    calls = []
    monkeypatch.setattr(allocator, "tune_from_env", lambda: calls.append(1) or True)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "shakespeare-cpu.toml"
    assert main(["params", str(recipe)]) == 0
    assert calls == [1]
