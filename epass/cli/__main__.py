"""``python -m epass.cli``: :func:`epass.cli.main`, its code as the exit status."""

import sys

from epass.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
