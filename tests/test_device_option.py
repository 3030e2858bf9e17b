"""``pytest --device cuda``: what it collects, on a machine with or without CUDA.

The GPU check (benchmarks/gpu_check.py) runs the suite with ``--device cuda``
in a short GPU window; these tests make sure that selection is what it should
be before a GPU ever sees it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# every area whose agreement tests mean something on a GPU must have some there
AREAS = ("tests/ops/", "tests/nn/", "tests/models/test_state.py",
         "tests/models/test_decoding.py", "tests/models/test_lm.py",
         "tests/models/test_seq2seq.py", "tests/models/test_classifier.py",
         "tests/test_hf.py", "tests/test_onnx.py", "tests/train/")


def collect(*args: str, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_device_cuda_collects_the_agreement_tests_without_cuda():
    proc = collect("--device", "cuda", "tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    per_file = Counter(i.split("::")[0] for i in ids)
    print(f"pytest --device cuda would collect {len(ids)} tests:")
    for f, n in sorted(per_file.items()):
        print(f"  {n:4d}  {f}")
    missing = [a for a in AREAS if not any(f.startswith(a) for f in per_file)]
    assert not missing, f"no test runs on the device in {missing}"
    # CPU-only tests stay behind: the C++ kernel's own tests, the reference package's
    assert "tests/ops/test_cpu_kernel.py" not in per_file
    assert not any(f.startswith("tests/data/") for f in per_file)
    summary = proc.stdout.strip().splitlines()[-1]
    m = re.search(r"(\d+)/(\d+) tests? collected \((\d+) deselected\)", summary)
    assert m and int(m.group(1)) == len(ids), summary


def test_device_cuda_refuses_the_triton_interpreter():
    proc = collect("--device", "cuda", "tests/test_device_option.py",
                   env_extra={"TRITON_INTERPRET": "1"})
    assert proc.returncode != 0
    assert "unset TRITON_INTERPRET" in proc.stdout + proc.stderr
