"""A library installed the way a wheel installs one, for the tests of names made from
installed files: a package and its ``.dist-info`` with ``METADATA`` and ``RECORD``
(each file's sha256), in a site directory of its own."""

from __future__ import annotations

import base64
import hashlib
import json
import textwrap
from pathlib import Path

NAME = "epass_fakelib"

# Decompositions of aten.silu the way a library writes them: a plain function reading
# a constant and a module of its own, one reading a list, and a factory whose closure
# holds what its caller gives.
SOURCE = textwrap.dedent(
    """
    import torch

    from epass_fakelib import settings

    aten = torch.ops.aten
    SCALE = 2.0
    STATE = [2.0]


    def silu(x):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), SCALE)


    def configured(x):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), settings.FACTOR)


    def from_list(x):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), STATE[0])


    def scaled(k):
        def silu(x):
            return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), k[0])

        return silu


    class Options:
        scale = 2.0


    OPTIONS = Options()


    def through_an_instance(x):
        return aten.mul.Tensor(aten.mul.Tensor(x, aten.sigmoid.default(x)), OPTIONS.scale)


    def helper(x):
        return aten.mul.Tensor(x, aten.sigmoid.default(x))


    helper.factor = 2.0


    def through_a_function(x):
        return aten.mul.Tensor(helper(x), helper.factor)


    def by_name(x):
        return aten.mul.Tensor(helper(x), getattr(Options, "scale"))
    """
)
SETTINGS = "FACTOR = 2.0\n"


def _hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install(site: Path, *, editable: bool = False) -> Path:
    """Install the library into ``site``; returns its package folder."""
    package = site / NAME
    package.mkdir(parents=True)
    files = {
        f"{NAME}/__init__.py": SOURCE.encode(),
        f"{NAME}/settings.py": SETTINGS.encode(),
    }
    info = site / f"{NAME}-1.0.dist-info"
    info.mkdir()
    files[f"{info.name}/METADATA"] = f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 1.0\n".encode()
    if editable:
        direct = {"url": f"file://{site}", "dir_info": {"editable": True}}
        files[f"{info.name}/direct_url.json"] = json.dumps(direct).encode()
    rows = []
    for relative, data in files.items():
        (site / relative).write_bytes(data)
        rows.append(f"{relative},sha256={_hash(data)},{len(data)}")
    rows.append(f"{info.name}/RECORD,,")
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return package
