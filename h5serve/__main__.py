"""``python -m h5serve`` is the ``h5serve`` command."""

import sys

from h5serve.cli import main

sys.exit(main())
