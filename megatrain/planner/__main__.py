import sys

from ..commands.plan import main

sys.exit(main())
