"""``python -m srupp``: the CLI, as ``torchrun -m srupp train RECIPE`` starts it."""

from .cli import main

raise SystemExit(main())
