import os

# Must run before anything imports triton: triton reads TRITON_INTERPRET at
# first import; set later, it reports "0 active drivers" on CPU-only machines.
os.environ.setdefault("TRITON_INTERPRET", "1")
