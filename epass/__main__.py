"""``python -m epass``: the ``epass`` command."""

import sys

from epass.cli import main

if __name__ == "__main__":
    sys.exit(main())
