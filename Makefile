# Two things a newcomer needs:  `make bench` (main job) and `make test` (tests).
# Both create .venv with Python 3.12 on a fresh machine and install the project.
VENV := .venv
STAMP := $(VENV)/.installed
# On a machine with an NVIDIA driver the CUDA build of jax comes along (extra `cuda`).
EXTRAS := test$(shell command -v nvidia-smi >/dev/null 2>&1 && echo ,cuda)

.PHONY: venv test bench clean

$(STAMP): pyproject.toml
	py=$$(sh tools/find_python312.sh) && "$$py" -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[$(EXTRAS)]'
	@touch $(STAMP)

venv: $(STAMP)

# `make test SLOW=1` also runs the tests marked slow (before a release).
MARKS := $(if $(SLOW),not gpu,not gpu and not slow)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 -q -m "$(MARKS)"

bench: $(STAMP)
	$(VENV)/bin/mmjax bench kernels

clean:
	rm -rf $(VENV) *.egg-info
