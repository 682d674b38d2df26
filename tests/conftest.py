"""Shared fixtures: program fingerprints that prove a program was left untouched."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fingerprint import fingerprint

__all__ = ["fingerprint"]
