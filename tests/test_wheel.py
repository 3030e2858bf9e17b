"""srupp from a wheel installed outside the checkout.

The wheel is built offline from a copy of the files a build reads
(``pip wheel --no-build-isolation``, with this venv's setuptools), installed
with ``pip install --no-deps --target`` into a temporary folder, and run from
another temporary folder with only that folder on ``PYTHONPATH`` first: the
recipes, compare's tuned-settings table and the C++ kernel source must come from
package data, not from the checkout.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# what the build reads: pyproject.toml's readme and license-files, the package,
# and recipes/ (src/srupp/recipes links to it)
BUILD_INPUTS = ["pyproject.toml", "README.md", "LICENSE", "src", "recipes"]
SETUPTOOLS_NEEDED = (77,)  # pyproject.toml's [build-system] requires

CHECK = r"""
import json, sys
from pathlib import Path

site = Path(sys.argv[1]).resolve()
checkout = [Path(p).resolve() for p in sys.argv[2:]]  # the checkout's package and recipes
import srupp
assert Path(srupp.__file__).resolve().is_relative_to(site), srupp.__file__
from srupp.train import compare

recipes = {}
for data, name in [("shakespeare", "shakespeare-cpu.toml"), ("brown", "brown-cpu.toml")]:
    path = compare.default_recipe(data)
    assert path.name == name and path.resolve().is_relative_to(site), path
    recipes[data] = compare.build_config(path).data.corpus
tuned = compare.load_tuned()
leaked = sorted(m for m, mod in list(sys.modules.items())
                if getattr(mod, "__file__", None)
                and any(Path(mod.__file__).resolve().is_relative_to(c) for c in checkout))
print(json.dumps({"recipes": recipes, "tuned": tuned, "leaked": leaked,
                  "enwik8_base": str(compare.packaged_recipe("enwik8-base.toml"))}))
"""


def _setuptools_version():
    try:
        from importlib.metadata import version

        return tuple(int(p) for p in version("setuptools").split(".")[:2])
    except Exception:  # not installed, or an odd version string
        return None


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, site): the built wheel and the folder it is installed into."""
    have = _setuptools_version()
    if have is None or have < SETUPTOOLS_NEEDED:
        pytest.skip(f"cannot build the wheel offline: setuptools>={SETUPTOOLS_NEEDED[0]} is "
                    f"needed in this environment, found {have} (pip install 'srupp[test]')")
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    tree.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "build")
    for name in BUILD_INPUTS:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, symlinks=True, ignore=skip)
        else:
            shutil.copy2(src, tree / name)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(tree)], check=True, env=env, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("srupp-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "-q", "--no-deps", "--no-index", "--target", str(site),
                    str(wheel)], check=True, env=env, cwd=tmp)
    return wheel, site


def _outside(site: Path, tmp_path: Path):
    """Environment and working directory with no checkout in sight."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    env["PYTHONNOUSERSITE"] = "1"
    return env, cwd


def test_the_wheel_carries_the_package_data(installed):
    wheel, site = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for recipe in (ROOT / "recipes").glob("*.toml"):
        assert f"srupp/recipes/{recipe.name}" in names
        # a file, not a link back into a checkout
        assert (site / "srupp" / "recipes" / recipe.name).read_bytes() == recipe.read_bytes()
    # every source of the C++ kernels, which the first use compiles
    csrc = ROOT / "src" / "srupp" / "ops" / "csrc"
    sources = {p.name for p in csrc.iterdir() if p.suffix in (".cpp", ".h")}
    assert len(sources) > 1 and {f"srupp/ops/csrc/{n}" for n in sources} <= names


def test_compare_and_params_work_from_the_installed_wheel(installed, tmp_path):
    _, site = installed
    env, cwd = _outside(site, tmp_path)
    done = subprocess.run([sys.executable, "-c", CHECK, str(site), str(ROOT / "src"),
                           str(ROOT / "recipes")], env=env,
                          cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["recipes"] == {"shakespeare": "shakespeare", "brown": "brown"}
    assert got["tuned"]["shakespeare"]["srupp"] == {"train.lr": 1e-2}
    assert got["leaked"] == []  # nothing was imported from the checkout
    # the installed console script: `srupp params` on a recipe shipped in the wheel
    recipe = Path(got["enwik8_base"])
    assert recipe.resolve().is_relative_to(site.resolve())
    done = subprocess.run([str(site / "bin" / "srupp"), "params", str(recipe)], env=env, cwd=cwd,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert abs(json.loads(done.stdout)["params"] / 108e6 - 1) < 0.03


def test_extras_match_what_the_code_asks_for():
    import re

    from srupp._extras import EXTRA_OF

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()  # noqa: E731
    assert sorted(name(r) for r in project["dependencies"]) == [
        "numpy", "safetensors", "tomli", "torch", "tqdm"]
    extras = project["optional-dependencies"]
    for module, extra in EXTRA_OF.items():
        assert module in {name(r) for r in extras[extra]}, (module, extra)
    groups = set(extras) - {"all", "test"}
    assert set(EXTRA_OF.values()) == groups
    (everything,) = extras["all"]
    assert set(re.fullmatch(r"srupp\[(.*)\]", everything).group(1).split(",")) == groups
