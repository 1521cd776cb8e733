# Sourced by scripts/run-default, scripts/test and .ci/run: creates .venv and installs the project on first use.
# SHUFFLEDP_EXTRAS: the extras to install, comma-separated; "" = none (scripts/run-default: what the default run
# needs); unset = "dev,jax" (scripts/test, .ci/run: the test suite's). .venv/.extras lists the extras installed (a
# .venv made before it existed has "dev,jax"): a .venv made by scripts/run-default gets the tests' when scripts/test
# first runs; one with more is kept. .venv/.installed: when it was installed.
# SHUFFLEDP_VENV_DRY_RUN=1: only print what would be installed (tests/test_venv_setup.py).
# native/ (shuffledp_prio, the Prio3 binding of issue 45; not on PyPI) is a Rust build (maturin), ~1-2 min the first
# time, rebuilt when its sources are newer than .venv/.native-installed. It is built BEFORE the project's install,
# so that the extra `prio3` resolves to it (pip never looks for it on an index):
# - extra prio3 wanted (SHUFFLEDP_EXTRAS=prio3): required; without cargo one line refuses it and nothing is installed
#   (the extra installed already with the binding: one line, and the installed binding is kept);
# - extra dev (the tests' set-up, without prio3): built where cargo exists; without cargo one line says so and the
#   set-up goes on (tests/test_prio3_native.py skips);
# - otherwise (scripts/run-default: no extras): not built, so the default run's set-up needs no Rust.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
_venv_want="${SHUFFLEDP_EXTRAS-dev,jax}"
_venv_have=""
if [ -f .venv/.extras ]; then
  _venv_have="$(tr -d ' \n' < .venv/.extras)"
elif [ -f .venv/.installed ]; then
  _venv_have="dev,jax"  # installed before .venv/.extras existed, always with these
fi
_venv_extras="$_venv_have"  # the union: a reinstall keeps the extras there already
_venv_missing=""
for _venv_e in ${_venv_want//,/ }; do
  if [[ ",$_venv_have," != *",$_venv_e,"* ]]; then
    _venv_missing="$_venv_missing $_venv_e"
    _venv_extras="${_venv_extras:+$_venv_extras,}$_venv_e"
  fi
done
# native/: "required" (the prio3 extra), "optional" (the dev extra: where cargo exists) or "" (not built)
_venv_native=""
if [ -d native ]; then
  if [[ ",$_venv_extras," == *",prio3,"* ]]; then
    _venv_native=required
  elif [[ ",$_venv_extras," == *",dev,"* ]]; then
    _venv_native=optional
  fi
fi
_venv_native_stale=""
if [ -n "$_venv_native" ] && { [ ! -f .venv/.native-installed ] \
  || [ -n "$(find native/src native/python native/Cargo.toml native/Cargo.lock native/pyproject.toml \
    -newer .venv/.native-installed 2>/dev/null | head -n 1)" ]; }; then
  _venv_native_stale=1
fi
if [ -n "$_venv_native_stale" ] && ! command -v cargo > /dev/null 2>&1; then
  if [ "$_venv_native" = required ] && [ ! -f .venv/.native-installed ]; then
    echo "the prio3 extra needs a Rust toolchain to build native/ (shuffledp_prio) and no cargo was found: install rustup (https://rustup.rs) and run this again; nothing was installed" >&2
    exit 1
  fi
  echo "Prio3 transport unavailable: no Rust toolchain (cargo) found; install rustup (https://rustup.rs) and run this again to build native/ (shuffledp_prio)" >&2
  _venv_native_stale=""
fi
# (re)install when extras are missing, or the packaging or the C extension changed: an editable install does not
# rebuild it by itself
_venv_project=""
if [ ! -x .venv/bin/shuffledp ] || [ ! -f .venv/.installed ] || [ -n "$_venv_missing" ] \
  || [ pyproject.toml -nt .venv/.installed ] || [ setup.py -nt .venv/.installed ] \
  || [ shuffledp/mechanisms/_ldp_kernels.c -nt .venv/.installed ]; then
  _venv_project=1
fi
if [ -n "$_venv_project" ] && [ -z "${SHUFFLEDP_VENV_DRY_RUN:-}" ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
if [ -n "$_venv_native_stale" ]; then
  if [ -n "${SHUFFLEDP_VENV_DRY_RUN:-}" ]; then
    echo "would install: pip install ./native"
  else
    echo "building native/ (shuffledp_prio, the Prio3 binding: Rust, ~1-2 min the first time)..." >&2
    if .venv/bin/python -m pip install -q ./native; then
      touch .venv/.native-installed
    elif [ "$_venv_native" = required ] && [ ! -f .venv/.native-installed ]; then
      echo "the prio3 extra is unavailable: building native/ (shuffledp_prio) failed (the error is above); the set-up stopped before installing the project" >&2
      exit 1
    else
      echo "Prio3 transport unavailable: building native/ failed (the error is above); the rest of .venv is ready" >&2
    fi
  fi
fi
if [ -n "$_venv_project" ]; then
  _venv_spec=".${_venv_extras:+[$_venv_extras]}"
  if [ -z "$_venv_extras" ]; then
    echo "setting up .venv: the project without extras (what the default run needs; ~460 MB, ~70 s once)..." >&2
  elif [[ ",$_venv_extras," == *",dev,"* ]]; then
    echo "setting up .venv: the project with extras $_venv_extras (dev, jax: the tests', ~1.2 GB, ~2.5 min once)..." >&2
  else
    echo "setting up .venv: the project with extras $_venv_extras..." >&2
  fi
  if [ -n "${SHUFFLEDP_VENV_DRY_RUN:-}" ]; then
    echo "would install: pip install -e '$_venv_spec'"
  else
    .venv/bin/python -m pip install -q -e "$_venv_spec"
    echo "$_venv_extras" > .venv/.extras
    touch .venv/.installed
  fi
fi
