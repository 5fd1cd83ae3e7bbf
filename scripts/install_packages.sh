# Sourced by scripts/setup.sh and scripts/wheel_check.sh: `install_packages HOME TARGET ARGS...` installs ARGS into
# the environment of the Python TARGET with uv, kept in the environment of the Python HOME (the project venv: pip
# install uv, one 20 MB wheel, once), else with TARGET's pip.
#
# Why: on CI's two cores pip took about 80 s to set up the project venv (torch's CPU wheel and the extras); uv, which
# unpacks and links in parallel, took 19 s from an empty cache. uv does not read pip's configuration, so this
# machine's (pip config list: local wheel folders, extra indexes, constraints) is passed to it, with pip's choice
# among indexes (the best version from any of them, not the first index that has the package). The packages come out
# the versions pip picks. If uv cannot be installed or fails, pip installs, as before.
_pip_config_for_uv() {  # PYTHON: pip's configured sources as uv arguments, one per line
    local line key value item
    "$1" -m pip config list 2>/dev/null | while IFS= read -r line; do
        key=${line%%=*}; value=${line#*=}; value=${value#\'}; value=${value%\'}
        case "${key##*.}" in
            find-links|extra-index-url|constraint)
                for item in $value; do printf -- '--%s\n%s\n' "${key##*.}" "$item"; done ;;
            index-url) printf -- '--index-url\n%s\n' "$value" ;;
        esac
    done | awk 'NR % 2 { flag = $0; next } !seen[flag SUBSEP $0]++ { print flag; print }'  # each pair once
}

install_packages() {  # HOME TARGET ARGS...: pip install ARGS into TARGET's environment
    local home=$1 py=$2 uv
    shift 2
    uv="$(dirname "$home")/uv"
    if [ -x "$uv" ] || "$home" -m pip install --quiet --disable-pip-version-check --no-compile uv >/dev/null 2>&1; then
        local config=()
        mapfile -t config < <(_pip_config_for_uv "$py")
        if "$uv" pip install --quiet --python "$py" --index-strategy unsafe-best-match "${config[@]}" "$@"; then
            return 0
        fi
        echo "install_packages: uv failed; installing with pip" >&2
    fi
    "$py" -m pip install --quiet --disable-pip-version-check --no-compile "$@"
}

compile_bytecode() {  # PYTHON [DIR...]: byte-compile DIRs (default: PYTHON's site-packages) where Python will not
    # Where PYTHONDONTWRITEBYTECODE is set (it is where this project's tests run), Python writes no .pyc files, and
    # each process compiled torch and Transformers from source again: 19 s to import hf_kvplus against 9 s from byte
    # code, in every process a test run starts (its workers, the notebooks' kernels, the scripts it runs). In
    # parallel, about 50 s on two cores for the project venv; a file that does not compile (one of torch's tests in
    # newer syntax) is left to its source. pip compiles what it installs unless told not to; uv does not.
    local py=$1
    shift
    [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || return 0
    [ $# -gt 0 ] || set -- "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    "$py" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true
}
