# Sourced by the quick-start scripts: makes sure .venv exists and holds the project installed
# with the given extras, reinstalling only when pyproject.toml changed since the last install.
# Usage: source scripts/_env.sh EXTRAS   (EXTRAS: "" for the library alone, "test" for tests)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FLAX_ESCALE_VENV:-$root/.venv}"
extras="${1:-}"
if [ ! -x "$venv/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
python="$venv/bin/python"
stamp="$venv/.flax-escale-installed${extras:+-$extras}"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  "$python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$python" -m pip install --quiet --disable-pip-version-check -e "$root${extras:+[$extras]}"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
