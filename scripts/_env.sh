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
  echo "Installing flax-escale${extras:+[$extras]} into $venv (minutes the first time)..." >&2
  # pip and the build backend talk on success too (setuptools' editable-install warning): their
  # output is kept in a log that is shown only when the install fails.
  log="$(mktemp)"
  if ! { "$python" -m pip install --quiet --disable-pip-version-check --upgrade pip &&
    "$python" -m pip install --quiet --disable-pip-version-check -e "$root${extras:+[$extras]}"; } \
    > "$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    echo "Installing flax-escale${extras:+[$extras]} into $venv failed (pip's output above)." >&2
    exit 1
  fi
  rm -f "$log"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
cd "$root"
