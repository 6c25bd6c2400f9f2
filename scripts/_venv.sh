# Shared by scripts/test.sh and scripts/demo.sh (sourced, not run): create or reuse a virtualenv
# under .venv/ with pinned torch + Triton and this package installed in editable mode.
#
# A venv is reused when its torch and Triton versions match and the stamp it records (a hash of
# setup.py, pyproject.toml and the requested pins) is unchanged; otherwise it is (re)installed.

# torch 2.13.0 has a CPU wheel on these machines; an unpinned torch may pull a multi-GB CUDA build.
MT_TORCH_VERSION="${MT_TORCH_VERSION:-2.13.0}"

# Extras installed into every venv: tests, plus the optional plotting and progress features so that
# their code paths are tested too. demo.sh uses the same list, so both scripts share one venv.
MT_VENV_EXTRAS="${MT_VENV_EXTRAS:-test,plot,progress}"

mt_log() { printf '[megatron_tuning] %s\n' "$*" >&2; }

mt_python() {
  # The interpreter used to create venvs: $PYTHON, else python3; it must be >= 3.10.
  local py="${PYTHON:-python3}"
  if ! command -v "$py" >/dev/null 2>&1; then
    mt_log "error: '$py' not found; set PYTHON=/path/to/python3.10+"
    return 1
  fi
  if ! "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
    mt_log "error: $("$py" --version 2>&1) is too old; megatron_tuning needs Python >= 3.10 (set PYTHON=...)"
    return 1
  fi
  printf '%s\n' "$py"
}

mt_venv_name() {
  # 3.9.0 -> triton39, 3.10.1 -> triton310
  local major minor
  IFS=. read -r major minor _ <<<"$1"
  printf 'triton%s%s\n' "$major" "$minor"
}

mt_numpy_spec() {
  # Triton 3.3-3.6's interpreter breaks with numpy >= 2.4; 3.7+ works with it.
  local major minor
  IFS=. read -r major minor _ <<<"$1"
  if ((major == 3 && minor < 7)); then printf 'numpy<2.4\n'; else printf 'numpy\n'; fi
}

mt_stamp() {
  # What the venv was installed from; any change means "pip install again".
  local triton="$1" extras="$2" digest
  digest="$(cat "$MT_ROOT/setup.py" "$MT_ROOT/pyproject.toml" | { sha256sum 2>/dev/null || shasum -a 256; })"
  printf 'files=%s torch=%s triton=%s extras=%s root=%s\n' \
    "${digest:0:16}" "$MT_TORCH_VERSION" "$triton" "$extras" "$MT_ROOT"
}

mt_venv_matches() {
  # True when VENV has exactly torch $MT_TORCH_VERSION and Triton TRITON importable.
  local venv="$1" triton="$2"
  [[ -x "$venv/bin/python" ]] || return 1
  "$venv/bin/python" -c '
import sys
import torch, triton
ok = torch.__version__.split("+")[0] == sys.argv[1] and triton.__version__ == sys.argv[2]
sys.exit(0 if ok else 1)
' "$MT_TORCH_VERSION" "$triton" >/dev/null 2>&1
}

# mt_ensure_venv TRITON_VERSION EXTRAS -> prints the venv's python path on stdout.
mt_ensure_venv() {
  local triton="$1" extras="$2"
  local venv="$MT_ROOT/.venv/$(mt_venv_name "$triton")"
  local stamp_file="$venv/.megatron_tuning_stamp"
  local want_stamp
  want_stamp="$(mt_stamp "$triton" "$extras")"

  if mt_venv_matches "$venv" "$triton" && [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$want_stamp" ]]; then
    mt_log "reusing $venv (torch $MT_TORCH_VERSION, triton $triton)"
    printf '%s\n' "$venv/bin/python"
    return 0
  fi

  local py
  py="$(mt_python)" || return 1
  if [[ -e "$venv" ]] && ! "$venv/bin/python" -c pass >/dev/null 2>&1; then
    mt_log "$venv is broken (its python does not run); recreating it"
    rm -rf "$venv"
  fi
  if [[ ! -x "$venv/bin/python" ]]; then
    mt_log "creating $venv with $("$py" --version 2>&1)"
    "$py" -m venv "$venv" >&2 || return 1
  fi
  mt_log "installing torch==$MT_TORCH_VERSION triton==$triton $(mt_numpy_spec "$triton") and -e .[$extras] into $venv"
  # One resolver run for everything, so the torch/Triton pins hold for the package's own deps too.
  "$venv/bin/python" -m pip install --quiet --no-input --progress-bar off \
    "torch==$MT_TORCH_VERSION" "triton==$triton" "$(mt_numpy_spec "$triton")" \
    -e "$MT_ROOT[$extras]" >&2 || { mt_log "error: pip install into $venv failed"; return 1; }
  printf '%s\n' "$want_stamp" >"$stamp_file"
  printf '%s\n' "$venv/bin/python"
}
