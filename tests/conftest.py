"""Shared fixtures: program fingerprints that prove a program was left untouched, and
the hypothesis profiles (``ci``: the same examples on every machine; ``fuzz``: new
random examples, run by ``benchmarks/fuzz.sh``)."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vision_models
from fingerprint import fingerprint

__all__ = ["fingerprint"]

# A torchvision wheel built for CUDA cannot load its C++ ops beside a CPU torch, and then
# `import torchvision` fails, and with it every import of transformers or timm: the
# schemas its fake kernels need are defined first (tests/vision_models.py).
vision_models.make_torchvision_importable()

# Under pytest-xdist each worker is a process of its own: one torch thread each, so
# that the workers share the cores instead of fighting over them.
if "PYTEST_XDIST_WORKER" in os.environ:
    import torch

    torch.set_num_threads(1)

# A run started in the background of a non-interactive shell (`pytest ... &`) has
# SIGINT ignored, and so would every command line the tests start: the tests that
# interrupt one would see it run on. They get the default back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tests never touch the user's template cache: this session's cache lives in a
# directory of its own, set here (at import) so that subprocesses inherit it. Tests
# that need a cold or a filled cache set EPASS_CACHE_DIR to their own tmp_path.
_CACHE_DIR = tempfile.mkdtemp(prefix="epass-test-cache-")
os.environ["EPASS_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)

# CI runs a fixed set of examples, and keeps no example database between runs: a
# submission passes or fails on its own code, never on a random draw or on what an
# earlier run on the same machine found. New examples are explored by
# benchmarks/fuzz.sh; what it finds becomes an explicit @example.
# (hypothesis has a "ci" profile of its own; this one does not depend on its version.)
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("fuzz", derandomize=False, database=None, print_blob=True)
if "CI" in os.environ and settings.get_current_profile_name() == "default":
    settings.load_profile("ci")  # unless --hypothesis-profile chose another
