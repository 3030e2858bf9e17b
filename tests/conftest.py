import os

# Must run before anything imports triton: triton reads TRITON_INTERPRET at
# first import; set later, it reports "0 active drivers" on CPU-only machines.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The srupp CLI tunes glibc's malloc for its process (srupp.allocator); tests call
# the CLI in this process and in children, and shouldn't change the runner's malloc
# or depend on it. tests/test_allocator.py tests the setting in child processes.
os.environ.setdefault("SRUPP_TUNE_ALLOCATOR", "0")

import pytest  # noqa: E402


@pytest.fixture
def corpus(tmp_path):
    """A small text file: the tiny corpus of lm_helpers, repeated."""
    from lm_helpers import TEXT

    p = tmp_path / "corpus.txt"
    p.write_text(TEXT * 40)
    return p
