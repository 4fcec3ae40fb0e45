#!/usr/bin/env bash
# The wheels a GPU machine needs beyond its image, for scripts/gpu_session.sh to install there
# (it has no network): .whl holds the engine's (pyzmq, xgrammar and its apache-tvm-ffi), .pfw
# the flows' (Prefect and its closure, prefect-dask). Run here, in the repo root, before the
# first GPU call of a fresh checkout; carry .whl and .pfw in that call.
#
#   bash scripts/gpu_wheels.sh
#
# The machine runs CPython 3.12 on x86-64. Its image already holds torch, triton, transformers,
# numpy, pyarrow, httpx, anyio, jinja2 and many more (the device's KINDS.md lists them): those
# are left out, so the whole call stays under its 64 MiB limit (with a Triton cache tarball).
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl .pfw .tc .triton-cache .fi; do  # (kept out of git: never committed)
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
ALL=$(mktemp -d)
trap 'rm -rf "$ALL"' EXIT
PLATFORMS=""
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS="$PLATFORMS --platform ${p}_x86_64"
done
# the same pins as pyproject.toml (Prefect 3.8's server and scheduler need them)
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 \
  --implementation cp $PLATFORMS --platform any -d "$ALL" \
  'prefect==3.8.8' 'prefect-dask>=0.3.7,<0.4' 'fastapi>=0.139,<0.151' 'sqlalchemy>=2.0,<2.1' \
  'pydantic>=2.7,<3' 'pyzmq>=25' 'xgrammar>=0.2.8,<0.3' 2>&1 | grep -v "^WARNING" || true
python3 - "$ALL" <<'PY'
import re, shutil, sys
from pathlib import Path

# the image's packages, as the device's KINDS.md lists them (read on 2026-11-17)
IMAGE = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow
pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark
pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split())
ENGINE = {"pyzmq", "xgrammar", "apache-tvm-ffi"}
src = Path(sys.argv[1])
for d in (".whl", ".pfw"):
    shutil.rmtree(d, ignore_errors=True)
    Path(d).mkdir()
sizes = {".whl": 0, ".pfw": 0}
for wheel in sorted(src.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0].lower())
    if name in IMAGE or name.startswith("nvidia-"):
        continue
    folder = ".whl" if name in ENGINE else ".pfw"
    shutil.copy(wheel, folder)
    sizes[folder] += wheel.stat().st_size
print(", ".join(f"{d}: {n / 2**20:.1f} MiB" for d, n in sizes.items()))
PY
