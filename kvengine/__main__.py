"""``python -m kvengine``: the ``kvengine`` command."""

import sys

from kvengine.cli import main

sys.exit(main())
