"""Emit: Plan + graph -> stage source files and manifest.json."""
