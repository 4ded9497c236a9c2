#!/usr/bin/env bash
# Fill the git-ignored .whl/front/ with the wheels bench/run_h200.sh api installs on the GPU machine (no
# internet there; tests/gpu/install_front_wheels.py installs them): what the lane's rank 0 (the HTTP front)
# and glm53-bench import beyond the GPU image (torch, numpy, safetensors, tokenizers, pyyaml, jinja2, httpx,
# httpcore, anyio, h11, click, rich, matplotlib, prometheus-client, xxhash, typing-extensions, annotated-doc
# are there). Traced by running serve.sh and glm53-bench on the tiny checkpoint with every third-party import
# outside the image and these wheels refused: the front imports fastapi, starlette, pydantic, uvicorn (and
# fastapi 0.165 imports opentelemetry), llguidance on requests with a grammar; the bench imports openai,
# whose client is httpx2 (httpcore2, truststore) and which imports sniffio and jiter. No git, no
# huggingface_hub at serve time. The pyproject.toml pins where it has them (a CPU test checks); the others
# are the versions those pins require or the kit's tests run with. .whl/front/floor/ holds newer copies of
# image packages the wheels need at a floor (pydantic 2.14: typing-extensions >= 4.16; openai, httpx2:
# anyio >= 4.10; httpx2: idna >= 3.18; httpcore2: h11 >= 0.16), installed only where the image's is older.
# A folder of its own beside .whl/'s exllamav3 wheels (pydantic 2.10.6 there: pip refuses two versions of one
# package in one install).
# Run where PyPI is reachable:   bash tests/gpu/prepare_front_wheels.sh [DEST]   (default: .whl/front)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.whl/front}
py=${PYTHON:-python3}
front=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
       typing-inspection==0.4.5 opentelemetry-api==1.45.3 uvicorn==0.55.0 llguidance==1.9.1
       openai==3.63.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.17.0 httpcore2==2.17.0 truststore==0.10.5)
floor=(typing-extensions==4.16.0 anyio==4.16.0 idna==3.20 h11==0.16.0)
platforms=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch() {  # folder, pins...
    local to=$1; shift
    mkdir -p "$to"
    for pin in "$@"; do
        "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${platforms[@]}" -d "$to" "$pin"
    done
    # one version of each: pip refuses to install two
    for pin in "$@"; do
        name=$(echo "${pin%%==*}" | tr - _)
        n=$(find "$to" -maxdepth 1 -iname "${name}-[0-9]*.whl" | wc -l)
        [ "$n" = 1 ] || { echo "prepare_front_wheels: $n wheels of $name in $to (want 1):" >&2; ls "$to" >&2; exit 1; }
    done
}
fetch "$dest" "${front[@]}"
fetch "$dest/floor" "${floor[@]}"
total=0
for f in "$dest"/*.whl "$dest"/floor/*.whl; do
    size=$(stat -c %s "$f"); total=$((total + size))
    printf '%9d  %s\n' "$size" "${f#"$dest"/}"
done
printf '%9d  total (the device call carries 64 MiB in all)\n' "$total"
