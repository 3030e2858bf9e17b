"""srupp.ops.marks: the compile mark set without importing torch._dynamo."""

import subprocess
import sys

import torch

from srupp.ops.marks import CONSTANT_MARK, constant_when_compiled


def test_the_mark_is_the_one_torch_s_decorator_sets():
    def ours():
        return 1

    def theirs():
        return 1

    constant_when_compiled(ours)
    torch.compiler.assume_constant_result(theirs)
    assert getattr(theirs, CONSTANT_MARK) is True
    assert vars(ours) == vars(theirs) == {CONSTANT_MARK: True}


def test_a_marked_function_is_constant_under_compile():
    calls = []

    @constant_when_compiled
    def flag() -> bool:
        calls.append(1)
        return True

    def f(x):
        return x + 1 if flag() else x - 1

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    assert compiled(torch.zeros(2)).tolist() == [1.0, 1.0]
    n = len(calls)
    compiled(torch.zeros(2))
    assert len(calls) == n  # baked into the graph: not called again


def test_importing_srupp_leaves_torch_dynamo_unimported():
    code = "import sys, srupp, srupp.train, srupp.cli; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
