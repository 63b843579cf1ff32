#!/usr/bin/env bash
# Run mmjax CLI commands on a lent GPU machine (the device tool's `run`): installs the wheels carried in
# .whl/ (PyAV is not in the GPU image) into /tmp/site, then runs each argument as one `mmjax ...` command
# line, e.g.  tools/device_run.sh "bench prefill --tokens 1048576 --configs ashape --out \$OUT"
# A failing command does not stop the next; the exit status is the number of failures.
set -u
source "$(dirname "$0")/carried_wheels.sh" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
fails=0
for cmd in "$@"; do
  echo "=== mmjax $cmd ($(date -u +%H:%M:%S))" >&2
  eval "python3 -m mmjax.drivers.cli $cmd" || fails=$((fails + 1))
done
exit $fails
