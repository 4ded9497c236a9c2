"""Install the carried front wheels (tests/gpu/prepare_front_wheels.sh fills .whl/front/) on a machine
without a package index, then check what they require: the carried wheels must meet each other's
requirements, and for each one on a distribution they do not carry the machine's version must meet it, or
that name's floor wheel (.whl/front/floor/) is installed too. Floor wheels go in only where needed, so the
image's own copy of a package (typing-extensions, anyio, ...) is shadowed only when it is too old or absent.

    python3 tests/gpu/install_front_wheels.py [--wheels .whl/front] [--target /tmp/site]
    export PYTHONPATH=/tmp/site

Prints one line per distribution (version, and whether it is carried, a floor wheel or the machine's own).
Exit codes: 0 every requirement met; 1 pip failed or a requirement is unmet with no floor wheel for it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # a Python without packaging: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename


def wheel_name(path: Path) -> str:
    return canonicalize_name(parse_wheel_filename(path.name)[0])


def requirements(path: Path) -> list[Requirement]:
    """The wheel's Requires-Dist that apply here without extras."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def pip_install(wheels: list[Path], target: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"install_front_wheels: pip failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--wheels", type=Path, default=Path(".whl/front"))
    p.add_argument("--target", type=Path, default=Path("/tmp/site"))
    a = p.parse_args()
    carried = sorted(a.wheels.glob("*.whl"))
    if not carried:
        print(f"install_front_wheels: no wheels in {a.wheels}: run tests/gpu/prepare_front_wheels.sh where PyPI "
              f"is reachable and carry .whl", file=sys.stderr)
        return 1
    floors = {wheel_name(w): w for w in sorted((a.wheels / "floor").glob("*.whl"))}
    pip_install(carried, a.target)
    sys.path.insert(0, str(a.target))  # what PYTHONPATH=target gives the processes that use them
    names = {wheel_name(w) for w in carried}
    needs: dict[str, list[Requirement]] = {}
    for w in carried:  # the carried wheels' requirements on each other too: the pins must agree
        for r in requirements(w):
            needs.setdefault(canonicalize_name(r.name), []).append(r)
    add, unmet = [], []
    for name, reqs in sorted(needs.items()):
        have = installed(name)
        if have is not None and all(r.specifier.contains(have, prereleases=True) for r in reqs):
            continue
        if name in floors and name not in names:
            add.append(floors[name])
        else:
            unmet.append(f"{name} {have or 'absent'}: wanted {', '.join(str(r) for r in reqs)}")
    if add:
        pip_install(add, a.target)
    for name in sorted(names | set(needs)):
        origin = "carried" if name in names else "floor wheel" if floors.get(name) in add else "this machine's"
        print(f"  {name:<20} {installed(name) or 'absent':<12} {origin}")
    for line in unmet:
        print(f"install_front_wheels: unmet: {line}", file=sys.stderr)
    return 1 if unmet else 0


if __name__ == "__main__":
    sys.exit(main())
