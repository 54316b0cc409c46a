#!/usr/bin/env bash
# pip_install.sh PYTHON: `pip wheel` of the source tree (scikit-build-core,
# pyproject.toml; no build isolation, so the venv's nanobind and
# scikit-build-core are used and no network is needed), installed into a
# scratch folder, then imported from there: shmps.Server starts the
# shmps-server inside the wheel and a worker pushes and pulls through it.
# The wheel is built without CUDA to keep this short (the CMake build
# covers CUDA); its build folder build/wheel/ is kept between runs.
set -euo pipefail
python=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")  # absolute, the venv kept (no symlink resolved)
source_dir=$(cd "$(dirname "$0")/../.." && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$python" -m pip wheel --no-build-isolation --no-deps --disable-pip-version-check -q -w "$scratch/wheel" \
  --config-settings=cmake.define.SHMPS_CUDA=OFF "$source_dir" > "$scratch/wheel.log" 2>&1 || { tail -40 "$scratch/wheel.log"; fail "pip wheel"; }
wheel=$(ls "$scratch"/wheel/shmps-*.whl) || fail "no wheel written"
echo "ok: $(basename "$wheel")"
"$python" -m pip install --no-deps --disable-pip-version-check -q --target "$scratch/site" "$wheel" ||
  fail "pip install $wheel"
for f in shmps/__init__.py shmps/torch.py shmps/bin/shmps-server; do
  [ -e "$scratch/site/$f" ] || fail "the installed package lacks $f"
done
ls "$scratch"/site/shmps/_shmps*.so > /dev/null || fail "the installed package lacks the extension"

cd "$scratch"  # nothing of the source tree on sys.path
env -u SHMPS_SERVER_BIN PYTHONPATH="$scratch/site" "$python" - "$scratch/site" <<'PY'
import os, sys
import numpy as np
import shmps
site = sys.argv[1]
assert shmps.__file__.startswith(site), shmps.__file__
assert shmps.server_binary() == os.path.join(site, "shmps", "bin", "shmps-server"), shmps.server_binary()
with shmps.Server(tensors=[("w", (4,))], optimizer="sgd", lr=1, init="uniform", backend="host") as server:
    with shmps.connect(server.name) as w:
        buf = w.register_buffer(16)
        v = w.pull(buf)
        w0 = np.asarray(buf).view(np.float32).copy()
        np.asarray(buf).view(np.float32)[:] = [1, 2, 3, 4]
        assert w.push(buf, v) == 1
        w.pull(buf)
        assert np.array_equal(np.asarray(buf).view(np.float32), w0 - np.float32([1, 2, 3, 4]))
print("ok: the installed package's server and worker: w = w0 - g")
PY
