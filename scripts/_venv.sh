# Sourced by scripts/test and scripts/run-default: creates .venv and installs the project on first use.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# (re)install when the packaging or the C extension changed: an editable install does not rebuild it by itself
if [ ! -x .venv/bin/shuffledp ] || [ pyproject.toml -nt .venv/.installed ] || [ setup.py -nt .venv/.installed ] \
  || [ shuffledp/mechanisms/_ldp_kernels.c -nt .venv/.installed ]; then
  echo "setting up .venv (first run only)..." >&2
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev,jax]'  # jax: the Flax adapter's tests (~500 MB, ~2.5 min once)
  touch .venv/.installed
fi
