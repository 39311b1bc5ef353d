"""``python -m pipeline.cli``: the ``satp`` command."""
import sys

from pipeline.cli import main

sys.exit(main())
