"""Emit: Plan + fx graph -> stage source files, manifest.json, plan.txt (writes files, runs nothing)."""

from .package import FORMAT_VERSION, PackageInfo, emit
from .report import format_kept, format_plan

__all__ = ["FORMAT_VERSION", "PackageInfo", "emit", "format_kept", "format_plan"]
