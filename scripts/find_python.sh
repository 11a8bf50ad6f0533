#!/usr/bin/env bash
# Prints the path of a Python >= 3.12: first on PATH, then under pyenv.
# Each candidate is run, because a pyenv shim exists for versions that are not active.
set -u

ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

for name in python3.12 python3.13 python3.14 python3; do
  if command -v "$name" >/dev/null 2>&1 && ok "$name"; then
    "$name" -c 'import sys; print(sys.executable)'
    exit 0
  fi
done

roots=()
command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
roots+=("${PYENV_ROOT:-$HOME/.pyenv}")
for root in "${roots[@]}"; do
  for py in "$root"/versions/3.1[2-9]*/bin/python; do
    if [ -x "$py" ] && ok "$py"; then
      echo "$py"
      exit 0
    fi
  done
done

echo "error: need Python >= 3.12 and found none on PATH or under pyenv;" \
     "install it with 'pyenv install 3.12' (https://github.com/pyenv/pyenv)" \
     "or your package manager, then rerun make" >&2
exit 1
