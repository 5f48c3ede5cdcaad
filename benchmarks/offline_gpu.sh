#!/usr/bin/env bash
# benchmarks/offline_gpu.sh: the GPU runs of benchmarks/ on a machine with a GPU, PyTorch and no network access (the
# figures in benchmarks/README.md came from one: Python 3.12, torch 2.11 with CUDA 13, no Transformer Engine).
# What verl 0.6.1, megatron-core, Ray and the reward server need beyond such a machine's PyTorch image travels as
# wheels (~61 MB) in .whl/, git-ignored, beside the working tree:
#
#   bash benchmarks/offline_gpu.sh wheels                        # here, with PyPI: download and build .whl/
#   bash benchmarks/offline_gpu.sh run python -m benchmarks.X    # there: install .whl/ into /tmp/site, then run
#
# `wheels` needs a Python 3.12 (PYTHON312) to build the two wheels PyPI has only as source archives (megatron-core
# 0.13.0: no cp312 wheel; antlr4-python3-runtime 4.9.3), and repacks Ray 2.60.0 without what no run here imports
# (its Java jars, the dashboard's web client, rllib/data/serve/tune/train/llm) with its binaries stripped: 79 -> 35 MB.
# transformers 4.56.1 is the SGLang image's (the GPU machine's 5.x is too new for verl 0.6.1).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
wheels_dir="$repo/.whl"
SITE="${SITE:-/tmp/site}"                                # where `run` installs the wheels
PYTHON312="${PYTHON312:-python3.12}"                    # builds the two source-only wheels (`wheels`)

PINS=(
  verl==0.6.1 tensordict==0.10.0 orjson pyvers==0.1.0 codetiming==1.4.0 omegaconf==2.3.0 hydra-core==1.3.8
  jsonschema==4.26.0 jsonschema-specifications referencing rpds-py torchdata==0.11.0 datasets==4.0.0 dill==0.3.8
  multiprocess==0.70.16 peft==0.21.2 importlib-metadata lazy-importer pylatexenc fsspec==2025.3.0 opentelemetry-api
  openai==1.99.1 distro jiter sniffio
  fastapi==0.116.1 starlette==0.47.3 uvicorn==0.35.0 pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0
  typing-inspection==0.4.1
  transformers==4.56.1 tokenizers==0.22.1 huggingface-hub==0.36.2
)
SOURCE_ONLY=(megatron-core==0.13.0 antlr4-python3-runtime==4.9.3)
RAY_DROPPED=(jars dashboard/client/build rllib data serve tune train llm)

wheels() {
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  rm -rf "$wheels_dir" && mkdir -p "$wheels_dir"
  local -a platform=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$wheels_dir" "${PINS[@]}"
  "$PYTHON312" -m pip wheel -q --no-deps -w "$wheels_dir" "${SOURCE_ONLY[@]}"
  python3 -m pip download -q --no-deps "${platform[@]}" -d "$tmp" ray==2.60.0
  python3 -m venv "$tmp/venv" && "$tmp/venv/bin/pip" install -q wheel
  "$tmp/venv/bin/wheel" unpack -d "$tmp" "$tmp"/ray-2.60.0-*.whl >/dev/null
  local ray="$tmp/ray-2.60.0/ray" part
  for part in "${RAY_DROPPED[@]}"; do rm -rf "${ray:?}/$part"; done
  strip --strip-unneeded "$ray/_raylet.so" "$ray/core/src/ray/gcs/gcs_server" "$ray/core/src/ray/raylet/raylet"
  "$tmp/venv/bin/wheel" pack -d "$wheels_dir" "$tmp/ray-2.60.0" >/dev/null
  echo "offline_gpu.sh: $(find "$wheels_dir" -type f -name '*.whl' | wc -l) wheels, $(du -sh "$wheels_dir" | cut -f1) in $wheels_dir"
}

run() {
  compgen -G "$wheels_dir/*.whl" >/dev/null || { echo "offline_gpu.sh: no wheels in $wheels_dir: run 'wheels' first" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheels_dir"/*.whl
  export PYTHONPATH="$SITE:$repo${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
  cd "$repo"
  "$@"
}

case "${1:-}" in
  wheels) wheels ;;
  run) shift; run "$@" ;;
  *) sed -n '2,12p' "${BASH_SOURCE[0]}" >&2; exit 2 ;;
esac
