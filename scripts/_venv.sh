# Sourced by the scripts in this folder: creates .venv on first use and (re)installs pearl
# with the given extras whenever pyproject.toml changes. Needs Python >= 3.11.
set -euo pipefail
extras="${PEARL_EXTRAS:-dev,slurm,analysis,engine,megatron}"
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "pearl needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2; exit 2; }
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=".venv/.pearl-installed-$(sha256sum pyproject.toml | cut -c1-16)-${extras//,/-}"
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[${extras}]"
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
