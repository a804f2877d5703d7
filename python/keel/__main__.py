"""``python -m keel``: the versions and devices Keel runs on, and a self-check of
every op against torch (``keel._info``)."""
import sys

from ._info import main

sys.exit(main())
