"""`python -m fleetline.cli`: the same command as `fleetline`."""

import sys

from fleetline.cli import main

sys.exit(main())
