#!/usr/bin/env bash
# Fill the git-ignored .whl/ with the wheels exllamav3_ref.py installs on the GPU machine (no internet there):
# exllamav3 1.6.5 and what its import graph needs beyond the GPU image (torch, numpy, safetensors,
# tokenizers, pyyaml, pillow, rich, ninja, typing-extensions are there). Traced by importing exllamav3.ext
# and exllamav3.modules.quant.exl3 with every other third-party import refused: only pydantic is imported
# (exllamav3/util/memory.py); llguidance is optional (try/except), marisa_trie is imported inside a loader
# function. pydantic 2.10.6 needs pydantic-core 2.27.2 (compiled: cp312 manylinux) and annotated-types, and
# typing-extensions >= 4.12.2 from the image. Keep the pins equal to WHEELS in exllamav3_ref.py (a CPU test
# checks). Run where PyPI is reachable:   bash tests/gpu/prepare_wheels.sh [DEST]   (default: .whl)
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.whl}
py=${PYTHON:-python3}
mkdir -p "$dest"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
for pin in exllamav3==1.6.5 pydantic==2.10.6 pydantic-core==2.27.2 annotated-types==0.7.0; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dest" "$pin"
done
# One version of each: pip refuses to install two, and exllamav3_ref picks the pinned file by name
for name in exllamav3 pydantic pydantic_core annotated_types; do
    n=$(find "$dest" -maxdepth 1 -name "${name}-[0-9]*.whl" | wc -l)
    [ "$n" = 1 ] || { echo "prepare_wheels: $n wheels of $name in $dest (want 1):" >&2; ls "$dest" >&2; exit 1; }
done
total=0
for f in "$dest"/exllamav3-*.whl "$dest"/pydantic-*.whl "$dest"/pydantic_core-*.whl "$dest"/annotated_types-*.whl; do
    size=$(stat -c %s "$f"); total=$((total + size))
    printf '%9d  %s\n' "$size" "$(basename "$f")"
done
printf '%9d  total (carry limit 64 MiB)\n' "$total"
