"""setup.cfg ships every file the packages read: each folder inside a package is a package
of the configuration (setuptools otherwise warns "Package 'partitioner.profiles' is absent
from the packages configuration" and will stop shipping such folders), and the built-in
hardware profiles are package data of theirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from setuptools.config.setupcfg import read_configuration

from .conftest import ROOT

TOP = ("partitioner", "codegen", "runtime", "driver")


@pytest.fixture(scope="module")
def options() -> dict:
    here = os.getcwd()
    os.chdir(ROOT)  # find: and find_namespace: search the current directory
    try:
        return read_configuration(str(ROOT / "setup.cfg"))["options"]
    finally:
        os.chdir(here)


def _folders(top: str) -> set[str]:
    """Every folder under `top` that holds a file, as a dotted name (caches aside)."""
    found = set()
    for folder, dirs, files in os.walk(ROOT / top):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if files:
            found.add(".".join(Path(folder).relative_to(ROOT).parts))
    return found


@pytest.mark.parametrize("top", TOP)
def test_every_folder_of_a_package_is_configured(options: dict, top: str) -> None:
    missing = _folders(top) - set(options["packages"])
    assert not missing, f"absent from setup.cfg's packages: {sorted(missing)}"
    assert not any("__pycache__" in p for p in options["packages"]), options["packages"]


def test_the_hardware_profiles_are_package_data(options: dict) -> None:
    shipped = options["package_data"].get("partitioner.profiles", [])
    profiles = sorted(p.name for p in (ROOT / "partitioner" / "profiles").glob("*.json"))
    assert profiles and "*.json" in shipped, (profiles, options["package_data"])
