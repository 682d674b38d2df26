"""The incremental decomposition engine: rewrite only the nodes a table decomposes.

One concept a module, each importing only from those listed before it
(pyproject.toml's contract "the decomposition engine's modules"):

- ``disk``: the files of the on-disk template cache (stdlib only at import, so that
  ``epass cache`` starts without torch); ``encoding``: a template as JSON data and
  back (stdlib only at import too).
- ``state``: torch's process-global state: ``LOCK``, ``torch_state``,
  ``run_decompositions`` as epass calls it.
- ``table``: a table split the way ``run_decompositions`` splits it, and
  ``rewrites``, the one answer to "does this table rewrite op X".
- ``installed``: the distribution whose wheel installed a source file, checked
  against its RECORD (it imports nothing of torch).
- ``made``: who made a function: torch's build, or one installed library's files, and
  its name when all it reads is theirs or a constant.
- ``kernels``: the Python kernels registered through ``torch.library``, and which
  no cache key can name.
- ``identity``: the names of decomposition functions and tables in cache keys.
- ``safety``: what the incremental path can take (``unsafe_reason``, ``Fallback``).
- ``shapes``: the program's shape environment: the context fake values are computed
  in, the watch over it through a decomposition, symbols by position for disk keys.
- ``sizes``: size queries as the retrace makes, keeps and binds them: the node that
  first holds a size, the DCE, the runtime-assertion pass.
- ``keys``: arguments as the dispatcher passes them, template keys, fresh fakes.
- ``tracing``: tracing one decomposition into a template.
- ``propagation``: the values of copied nodes recomputed as the retrace's trace
  recomputes them (which ones, compared by metadata, settled ones skipped).
- ``batch``: one trace for many templates.
- ``views``: views of tensors written in place, regenerated where the retrace's
  functionalization regenerates them.
- ``templates``: finding a template (memory, disk, batch, trace), the caches' public
  ``cache_info`` / ``clear_cache``, and what a program still needs traced.
- ``signature``: the retrace's inputs, in its order and under its names.
- ``writeback``: writes through views written back through each view's inverse.
- ``splice``: ``decompose``, the engine itself.
- ``check``: check mode, ``first_difference`` from torch's program.

Every torch internal the engine leans on is reached through :mod:`epass._torch`,
which lists them all (``INTERNALS``); ``tests/decomp/test_internals.py`` pins what the
engine mirrors of them. This module imports nothing, torch least of all.
"""

from __future__ import annotations

__all__: list[str] = []
