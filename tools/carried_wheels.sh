# Sourced by the device scripts in tools/ (device_run.sh, issue16_targets.sh) on a lent GPU machine: installs the
# wheels carried in .whl/ (PyAV is not in the GPU image) into /tmp/site and puts it and the checkout on PYTHONPATH.
# Returns 1 if the install fails.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || return 1
  export PYTHONPATH=/tmp/site:${PWD}
else
  export PYTHONPATH=${PWD}
fi
