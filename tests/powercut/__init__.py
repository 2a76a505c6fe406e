"""A power cut for tests: powercut.so, built here from powercut.c, keeps
the durable image of a directory's files (their content at their last
fsync or fdatasync) while a program runs under LD_PRELOAD; after kill -9,
that image is what a disk would hold once the power came back. powercut.c's
header comment gives the model."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("powercut.c")
# What the shim stops a process with when it cannot keep the image.
SHIM_FAILED = 86
# The shim's copies in the shadow directory: one being made (not durable:
# its sync never returned), one complete but not yet under its own name.
PARTIAL_PREFIX = ".powercut-partial-"
DONE_PREFIX = ".powercut-done-"
# Shared memory (SQLite's WAL index) does not outlive the machine.
VOLATILE_SUFFIXES = ("-shm",)


class BuildFailed(Exception):
    """gcc is missing or refused the shim."""


def build(into: Path) -> Path:
    """Compile powercut.c into `into`/powercut.so; the path to it."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise BuildFailed(
            "gcc not found: the power-cut tests compile tests/powercut/powercut.c "
            "into an LD_PRELOAD library at run time (Debian: apt-get install gcc)"
        )
    shim = into / "powercut.so"
    command = [gcc, "-shared", "-fPIC", "-O2", "-o", str(shim), str(SOURCE)]
    built = subprocess.run([*command, "-ldl"], capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        raise BuildFailed(f"{' '.join(command)} failed:\n{built.stderr}")
    return shim


class Disk:
    """`directory`, whose files a program run with `wrapper()` writes through
    a cache that a power cut empties; `shadow` holds their durable image."""

    def __init__(self, shim: Path, directory: Path, shadow: Path) -> None:
        self.shim = shim
        self.directory = directory
        self.shadow = shadow
        # What is there before the program starts is on the disk already.
        shutil.copytree(directory, shadow)

    def wrapper(self, fail_syncs: Path | None = None) -> list[str]:
        """A command prefix that runs a program on this disk; while a file
        exists at `fail_syncs`, its syncs fail with EIO."""
        failing = [f"POWERCUT_FAIL_SYNCS={fail_syncs}"] if fail_syncs is not None else []
        return [
            "env",
            f"LD_PRELOAD={self.shim}",
            f"POWERCUT_DIR={self.directory}",
            f"POWERCUT_SHADOW={self.shadow}",
            *failing,
        ]

    def image(self, into: Path) -> Path:
        """The directory as the disk holds it after a power cut (the program
        must be dead: kill -9), copied to `into`."""
        images: dict[str, Path] = {}
        for path in self.shadow.iterdir():
            if path.name.startswith(DONE_PREFIX):
                images[path.name.removeprefix(DONE_PREFIX)] = path
            elif not path.name.startswith(PARTIAL_PREFIX):
                images.setdefault(path.name, path)
        into.mkdir()
        for name, path in images.items():
            if not name.endswith(VOLATILE_SUFFIXES):
                shutil.copyfile(path, into / name)
        return into
