"""epass's boundary with torch's private API: every torch internal epass touches is
reached in this package and nowhere else, called as the running release wants.

One room a concern, so that a release that changes an internal changes one module
(``tests/test_torch_internals.py`` fails on a private torch name or a branch on the
release outside this package, and calls each internal as epass calls it):

- ``internals``: the list of them all (``INTERNALS``, also here), the running release
  (``RELEASE``, ``EXACT_RELEASE``), and how an internal the release lacks is named;
- ``operators``: what a node's target is, its schema and kernels; torch's decomposition
  tables and their split; the kernels registered with torch;
- ``tracing``: a decomposition traced as export's retrace traces it;
- ``fakes``: fake values and the shape environment;
- ``programs``: an ExportedProgram's private fields and how the retrace rebuilds one;
  graph names, module buffers, tensor versions, pytree;
- ``archives``: a .pt2 archive read once it is screened, and the schema the screen walks;
- ``quiet``: the warnings torch raises from its own code, silenced.

Importing a module loads only what ``import torch`` has loaded (the operator classes
and pytree); every other internal is imported by the function that calls it, so that
one a release lacks fails where the incremental path steps aside for the retrace and
names it (``internals.unexpected``), never at import.
"""

from __future__ import annotations

from epass._torch.internals import INTERNALS

__all__ = ["INTERNALS"]
