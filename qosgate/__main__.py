"""`python -m qosgate`: the `qosgate` command."""

import sys

from qosgate.cli import main

sys.exit(main())
