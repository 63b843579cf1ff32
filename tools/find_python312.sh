#!/usr/bin/env sh
# Print the path of a working Python 3.12 interpreter, or fail with a message.
# pyenv shims can exist on PATH for versions that are not selected, so each candidate is run.
for p in "$PYTHON312" $HOME/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 \
         /usr/local/bin/python3.12 /usr/bin/python3.12 "$(command -v python3.12 2>/dev/null)" \
         "$(command -v python3 2>/dev/null)"; do
  [ -n "$p" ] && [ -x "$p" ] || continue
  if "$p" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' >/dev/null 2>&1; then
    echo "$p"
    exit 0
  fi
done
echo "error: no working Python 3.12 found (jax==0.11.2 needs it); install one, e.g. 'pyenv install 3.12', or set PYTHON312=/path/to/python3.12" >&2
exit 1
