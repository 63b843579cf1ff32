# Two things a newcomer needs:  `make bench` (main job) and `make test` (tests).
# Both create .venv with Python 3.12 on a fresh machine and install the project.
PYTHON312 ?= $(shell command -v python3.12 2>/dev/null || ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -n 1)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: venv test bench clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found; install it (e.g. pyenv install 3.12) or pass PYTHON312=/path/to/python3.12" >&2; exit 1; }
	$(PYTHON312) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q

bench: $(STAMP)
	$(VENV)/bin/mmjax bench kernels

clean:
	rm -rf $(VENV) *.egg-info
