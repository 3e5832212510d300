"""``python -m h5serve.daemon`` is ``h5serve start --foreground``."""

import sys

from h5serve.cli import main

if __name__ == "__main__":
    sys.exit(main(["start", "--foreground", *sys.argv[1:]]))
