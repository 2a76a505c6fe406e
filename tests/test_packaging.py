"""What pyproject.toml promises a plain `pip install jobserverd`: the
distribution's name, the `jobserver` command, and that every library the
code imports is a dependency, a plain one unless the importing module is
part of an extra (the HTTP side, the PostgreSQL backend), and that the
source distribution holds the documentation and the tests. The wheel is not
built here: .ci/run builds it and smoke-tests it in a fresh environment
(.ci/smoke_wheel.py)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PACKAGE = ROOT / "jobserver"
# The modules whose imports an extra provides, by the extra's name: the
# start of their paths inside the package.
EXTRA_PARTS = {"web": "web/", "postgres": "storage/postgres"}


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503)."""
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert found is not None, requirement
    return re.sub(r"[-_.]+", "-", found.group()).lower()


def _imported(path: Path) -> set[str]:
    """The top-level names of what a module imports from outside jobserver
    and the standard library, at its top or inside a function alike."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {name for name in found if name != "jobserver" and name not in sys.stdlib_module_names}


@functools.cache
def _providers() -> Mapping[str, list[str]]:
    """Which installed distributions provide each top-level module: a scan
    of every installed distribution's files, so made once."""
    return importlib.metadata.packages_distributions()


def _distributions(modules: set[str]) -> set[str]:
    providers = _providers()
    return {_name(providers.get(module, [module])[0]) for module in modules}


def _extra_of(path: Path) -> str | None:
    inside = path.relative_to(PACKAGE).as_posix()
    return next((extra for extra, start in EXTRA_PARTS.items() if inside.startswith(start)), None)


def test_the_distribution_is_jobserverd_with_the_jobserver_command():
    assert PROJECT["name"] == "jobserverd"
    # Its version is the package's, read where `jobserver --version` reads it.
    assert "version" not in PROJECT and PROJECT["dynamic"] == ["version"]
    dynamic = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert dynamic == {"version": {"attr": "jobserver.__version__"}}
    assert PROJECT["scripts"] == {"jobserver": "jobserver.cli:main"}
    assert PROJECT["license"] == "MIT"
    # A project URL only where the project has a real home: never its own
    # page on PyPI standing in for one (README.md says where the docs are).
    assert not any("pypi.org" in url for url in PROJECT.get("urls", {}).values())
    assert (ROOT / "LICENSE").is_file()


def test_the_version_says_whether_the_compiled_build_runs():
    # The optional mypyc build (setup.py) puts a C extension beside each
    # module it compiles; .ci/run runs this test on that build too.
    framing = importlib.util.find_spec("jobserver.wire.framing")
    assert framing is not None and framing.origin is not None
    compiled = not framing.origin.endswith(".py")
    # .ci/run's stage for that build says so, lest it test the pure one.
    assert compiled or os.environ.get("JOBSERVER_TEST_COMPILED") != "1"
    shown = subprocess.run(
        [sys.executable, "-m", "jobserver", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    suffix = " (compiled with mypyc)" if compiled else ""
    assert shown == f"jobserver {importlib.metadata.version('jobserverd')}{suffix}"


def test_the_clients_the_worker_and_cron_need_no_extra():
    plain = {_name(requirement) for requirement in PROJECT["dependencies"]}
    assert {"trio", "anyio", "cronsim", "python-dateutil"} <= plain
    assert "anyio[trio]>=4" in PROJECT["dependencies"]
    # Extras only for the heavy or native parts (and the tools of those
    # who work on jobserver itself).
    assert set(PROJECT["optional-dependencies"]) <= {"postgres", "web", "test", "docs"}


def test_every_library_imported_is_a_dependency_plain_unless_its_module_is_an_extras():
    extras = PROJECT["optional-dependencies"]
    plain = {_name(requirement) for requirement in PROJECT["dependencies"]}
    missing = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        extra = _extra_of(path)
        allowed = plain | {_name(requirement) for requirement in extras.get(extra, [])}
        needed = _distributions(_imported(path)) - allowed
        if needed:
            missing[str(path.relative_to(ROOT))] = sorted(needed)
    assert missing == {}


def test_each_extra_part_holds_modules_that_import_its_libraries():
    """An EXTRA_PARTS entry that matched no module, or modules that need
    nothing of the extra, would be a hole in the test above."""
    for extra, start in EXTRA_PARTS.items():
        modules = [path for path in PACKAGE.rglob("*.py") if _extra_of(path) == extra]
        assert modules, start
        wanted = {_name(requirement) for requirement in PROJECT["optional-dependencies"][extra]}
        imported = set().union(*(_distributions(_imported(path)) for path in modules))
        assert imported & wanted, extra


# What the sdist holds beside the repository's tracked files: the metadata
# setuptools writes. A tracked file it need not hold: git's own.
SDIST_METADATA = ("PKG-INFO", "setup.cfg", "jobserverd.egg-info/")
NOT_SHIPPED = {".gitignore"}


def _tracked() -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], capture_output=True, timeout=60, check=True, cwd=ROOT
    ).stdout.decode()
    # A file deleted in the working tree but not yet in git's index is gone.
    return {name for name in listed.split("\0") if name and (ROOT / name).exists()}


# Files of kinds the sdist never ships (an untracked .py or .md of those
# folders would: a release is built from a clean clone, as CI builds it).
UNTRACKED = (
    "tests/.env", "docs/id_rsa", ".ci/cache/blob.bin", "bench/results.json",
    "examples/secret.txt", "tests/jobs.db", "bench/peers/node_modules/x/index.js",
)


def test_the_sdist_holds_the_documentation_the_tests_and_nothing_untracked(tmp_path):
    """The sdist is the repository's tracked files (MANIFEST.in): docs/ and
    mkdocs.yml, protocol.md, SECURITY.md, ARCHITECTURE.md, LICENSE, the
    tests with their helpers. Built as CI builds it (--no-isolation), from
    a copy of those files, so that the build leaves nothing in the checkout
    and sees no file that git does not track."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an unpacked sdist is what this test checks)")
    tracked = _tracked()
    source = tmp_path / "source"
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name, follow_symlinks=False)
    # What a working checkout may hold beside them, never to be shipped.
    for untracked in UNTRACKED:
        (source / untracked).parent.mkdir(parents=True, exist_ok=True)
        (source / untracked).write_text("not tracked\n")
    subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp_path, source],
        capture_output=True, timeout=120, check=True,
    )
    (sdist,) = tmp_path.glob("jobserverd-*.tar.gz")
    with tarfile.open(sdist) as archive:
        shipped = {entry.name.partition("/")[2] for entry in archive if not entry.isdir()}
    extra = {name for name in shipped - tracked if not name.startswith(SDIST_METADATA)}
    assert extra == set()
    assert tracked - NOT_SHIPPED - shipped == set()
    for needed in ("docs/index.md", "docs/protocol.md", "mkdocs.yml", "protocol.md",
                   "SECURITY.md", "ARCHITECTURE.md", "LICENSE", "tests/conftest.py"):
        assert needed in shipped, needed
