"""A trainer run under torchrun, for test_distributed.py (not a test itself).

    python -m torch.distributed.run ... torchrun_worker.py OUT REPORT KEY=VALUE ...

Trains ``OUT`` through the library's own path (distributed.setup, Trainer),
then rank 0 writes ``REPORT`` (JSON): the summary, and whether every rank
ended with bitwise the same parameters. Each rank first writes its pid to
``REPORT.pid<rank>``, so that a test can kill one of them.

``SRUPP_TEST_SYNC_EVERY_MICROBATCH=1`` turns DDP's ``no_sync`` into a no-op:
gradients are then all-reduced after every micro-batch, the slow way that
gradient accumulation must equal.
"""

import contextlib
import json
import os
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from srupp.train import Trainer, build_config, distributed


def main() -> None:
    out, report, overrides = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    distributed.die_with_launcher()
    if os.environ.get("SRUPP_TEST_SYNC_EVERY_MICROBATCH") == "1":
        DistributedDataParallel.no_sync = lambda self: contextlib.nullcontext()
    cfg = build_config(None, overrides)
    dist = distributed.setup(cfg.train.device, cfg.train.dist_backend, cfg.train.dist_timeout)
    Path(f"{report}.pid{dist.rank}").write_text(str(os.getpid()))
    trainer = Trainer(cfg, out, progress=False, dist=dist,
                      resume=os.environ.get("SRUPP_TEST_RESUME") == "1")
    summary = trainer.train()
    # FSDP holds DTensor shards: compare the whole tensors (a collective, on every rank)
    flat = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten()
                      for p in trainer.model.parameters()])
    every = dist.gather_objects(flat)
    if dist.is_main:
        report.write_text(json.dumps({
            "summary": summary, "world_size": dist.world_size,
            "ranks_bitwise_equal": all(torch.equal(every[0], x) for x in every)}))
    distributed.teardown(dist)


if __name__ == "__main__":
    main()
