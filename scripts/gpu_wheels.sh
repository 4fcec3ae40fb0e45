#!/usr/bin/env bash
# The wheels a GPU machine needs beyond its image, for scripts/gpu_session.sh to install there
# (it has no network): .whl holds the engine's (pyzmq, xgrammar and what they need: apache-tvm-ffi,
# pydantic), .pfw the flows' (Prefect and its closure, prefect-dask with dask and distributed).
# Run here, in the repo root, before the first GPU call of a fresh checkout; carry .whl (every
# call) and .pfw (a call whose steps run a flow) in that call.
#
#   bash scripts/gpu_wheels.sh           download both folders afresh, then check them
#   bash scripts/gpu_wheels.sh --check   only check the wheels already there
#
# The machine runs CPython 3.12 on x86-64. Its image already holds torch, triton, transformers,
# numpy, pyarrow, httpx, anyio, jinja2 and many more (the device's KINDS.md lists them): those
# are left out, so the whole call stays under its 64 MiB limit: the tracked tree ~9.5 MB, a .tc
# Triton cache tarball ~10 MB, so .whl + .pfw <= 44 MB (43.2 MB on 2026-11-28). If a release
# grows past that, the biggest are prefect, cryptography, asyncpg and sqlalchemy; asyncpg looks
# unused (the flows' server is SQLite) but Prefect's server imports it at start: keep it.
# Left out on purpose: `datasets` (a core dependency, but flows import it only for Hugging Face
# sources and exports, and no GPU step runs those tests) and the `test` extra's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl .pfw .tc .triton-cache .fi; do  # (kept out of git: never committed)
  grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
ALL=""
if [ "${1:-}" != --check ]; then
  ALL=$(mktemp -d)
  trap 'rm -rf "$ALL"' EXIT
  # pip matches manylinux_2_N exactly: name each that wheels use up to the image's glibc (its
  # Python 3.12.3 is Ubuntu 24.04's, glibc 2.39; cryptography's wheel is manylinux_2_34).
  # (py3-none-any wheels match any --platform: no `--platform any` needed.)
  PIP="python3 -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version 3.12 --implementation cp"
  for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    PIP="$PIP --platform ${p}_x86_64"
  done
  # One resolution for everything with its needs, so each package comes in one version: the same
  # pins as pyproject.toml (Prefect 3.8's server and scheduler need them). pydantic is here too:
  # xgrammar needs it, and it must be the version Prefect accepts.
  get() {  # (a failed download stops here, before the folders are emptied)
    $PIP -d "$ALL" "$@" >"$ALL/pip.log" 2>&1 || { grep -v "^WARNING" "$ALL/pip.log" | tail -5; exit 1; }
  }
  get 'prefect==3.8.8' 'prefect-dask>=0.3.7,<0.4' 'fastapi>=0.139,<0.151' 'sqlalchemy>=2.0,<2.1' \
    'pydantic>=2.7,<3'
  # xgrammar without its needs: with them pip would fetch torch, triton and CUDA's libraries
  # (gigabytes, all on the image); the check below names any need that is neither here nor there.
  get --no-deps 'pyzmq>=25' 'xgrammar>=0.2.8,<0.3' 'apache-tvm-ffi>=0.1.11'
fi
python3 - "$ALL" <<'PY'
import re, shutil, sys
from email.parser import Parser
from pathlib import Path
from zipfile import ZipFile

try:
    from packaging.requirements import Requirement
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import parse_wheel_filename
    from pip._vendor.packaging.version import Version

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
# versions a session's `pip list` there showed (KINDS.md), to check pins against where known
IMAGE_VERSIONS = {"numpy": "2.5.2", "torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0",
                  "huggingface-hub": "1.33.0", "safetensors": "0.8.0", "tokenizers": "0.23.2"}
# carried although the image has them, as its versions there are not on record: pydantic 2.14
# needs typing-extensions>=4.16 (the newest), and Prefect caps python-dateutil <3 where 4.0 is out.
# Both are small and pure Python, and keep older callers working (pandas takes dateutil>=2.8.2).
REFRESH = {"typing-extensions", "python-dateutil"}
ENGINE_ROOTS = {"pyzmq", "xgrammar"}
ROOTS = ENGINE_ROOTS | {"prefect", "prefect-dask", "fastapi", "sqlalchemy", "pydantic"}
PINS = {"prefect": "==3.8.8", "fastapi": "<0.151", "sqlalchemy": "<2.1"}
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def wheels(folder):
    """{name: (path, version, [applicable requirements])} of a folder's wheels; a name seen twice
    is an error (the install there takes one version of each)."""
    out, errors = {}, []
    for path in sorted(Path(folder).glob("*.whl")):
        with ZipFile(path) as z:
            meta = Parser().parsestr(z.read(next(n for n in z.namelist()
                                                 if n.endswith(".dist-info/METADATA"))).decode())
        name = norm(meta["Name"])
        reqs = [Requirement(r) for r in meta.get_all("Requires-Dist") or []]
        reqs = [r for r in reqs if r.marker is None or r.marker.evaluate(ENV)]  # (drops extras)
        if name in out:
            errors.append(f"two versions of {name}: {out[name][0].name}, {path.name}")
        out[name] = (path, meta["Version"], reqs)
    return out, errors


def fits(path):
    """Whether a wheel's tags install on CPython 3.12, x86-64, glibc 2.39 (Ubuntu 24.04)."""
    for tag in parse_wheel_filename(path.name)[3]:
        m = re.fullmatch(r"manylinux_2_(\d+)_x86_64", tag.platform)
        plat = tag.platform in ("any", "linux_x86_64", "manylinux1_x86_64", "manylinux2010_x86_64",
                                "manylinux2014_x86_64") or (m and int(m[1]) <= 39)
        m = re.fullmatch(r"(cp|py)3(\d*)", tag.interpreter)
        py = m and (not m[2] or int(m[2]) <= 12) and (tag.abi == "none" or m[1] == "cp" and (
            tag.abi == "abi3" or tag.abi == "cp312" == tag.interpreter))
        if plat and py:
            return True
    return False


def carried(name):
    return name in REFRESH or not (name in IMAGE or name.startswith("nvidia-"))


if sys.argv[1]:  # sort the download: the engine's closure into .whl, the rest into .pfw
    got, errors = wheels(sys.argv[1])
    assert not errors, errors
    engine, todo = set(), list(ENGINE_ROOTS)
    while todo:
        name = todo.pop()
        if name in got and carried(name) and name not in engine:
            engine.add(name)
            todo += [norm(r.name) for r in got[name][2]]
    for d in (".whl", ".pfw"):
        shutil.rmtree(d, ignore_errors=True)
        Path(d).mkdir()
    for name, (path, _, _) in got.items():
        if carried(name):
            shutil.copy(path, ".whl" if name in engine else ".pfw")

# the check: one version of each, every need met here or on the image, .whl alone enough for
# the engine, and nothing the image has carried again
whl, errors = wheels(".whl")
pfw, more = wheels(".pfw")
errors += more + [f"{n} in both .whl and .pfw" for n in whl.keys() & pfw.keys()]
have = {**pfw, **whl}
unknown = []
for folder, group, alone in ((".whl", whl, whl), (".pfw", pfw, have)):
    for name, (path, version, reqs) in group.items():
        if not carried(name):
            errors.append(f"{folder}/{path.name}: the image has {name}")
        if not fits(path):
            errors.append(f"{folder}/{path.name}: not for cp312 manylinux x86_64")
        for r in reqs:
            dep = norm(r.name)
            if dep in alone:
                if not r.specifier.contains(alone[dep][1], prereleases=True):
                    errors.append(f"{name} needs {r}, {folder} has {dep} {alone[dep][1]}")
            elif dep in IMAGE_VERSIONS:
                if not r.specifier.contains(IMAGE_VERSIONS[dep], prereleases=True):
                    errors.append(f"{name} needs {r}, the image has {dep} {IMAGE_VERSIONS[dep]}")
            elif dep in IMAGE:
                unknown += [(dep, s) for s in r.specifier]
            else:
                where = ".whl" if alone is whl else ".whl/.pfw"
                errors.append(f"{name} needs {r}: in neither {where} nor the image")
for name in ROOTS:
    if name not in have:
        errors.append(f"{name} missing")
    elif name in PINS and not Requirement(name + PINS[name]).specifier.contains(have[name][1]):
        errors.append(f"{name} {have[name][1]}: pyproject.toml pins {PINS[name]}")
for d, group in ((".whl", whl), (".pfw", pfw)):
    size = sum(p.stat().st_size for p, _, _ in group.values())
    print(f"{d}: {len(group)} wheels, {size / 2**20:.1f} MiB: "
          + " ".join(f"{n}=={v}" for n, (_, v, _) in sorted(group.items())))
# (the image's versions of these are not on record: `pip show` there, if a need fails to import)
bounds = {}
for dep, s in unknown:  # the highest floor and the lowest cap of each
    key = (dep, s.operator[0] if s.operator in ("<", "<=", ">", ">=") else s.operator + s.version)
    if key not in bounds or (Version(s.version) > Version(bounds[key].version)) == (key[1] == ">"):
        bounds[key] = s
print("needs on the image, versions unchecked:", ", ".join(
    f"{dep}{','.join(str(s) for (d, _), s in sorted(bounds.items()) if d == dep)}"
    for dep in sorted({d for d, _ in bounds})))
if errors:
    sys.exit("gpu_wheels.sh: check FAILED:\n  " + "\n  ".join(errors))
print("check: one version of each; every need met by .whl/.pfw or the image")
PY
du -cb .whl/*.whl .pfw/*.whl | awk 'END { printf "in all: %.1f MB (keep it under 44 MB: the tree is ~9.5, a .tc ~10)\n", $1 / 1e6 }'
