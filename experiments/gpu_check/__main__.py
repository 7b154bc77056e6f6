"""`python -m experiments.gpu_check`: see the package's docstring."""

import sys

from .cli import main

sys.exit(main())
