"""``python -m epass``: the ``epass`` command."""

import sys

try:
    from epass.cli import console
except KeyboardInterrupt:  # Ctrl-C while the command itself is imported
    print("epass: interrupted", file=sys.stderr)
    sys.exit(130)  # epass.cli.EXIT_INTERRUPTED, which did not finish importing

if __name__ == "__main__":
    console()
