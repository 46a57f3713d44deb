"""``python -m trainhealth``: the same as the ``trainhealth`` command."""

import sys

from trainhealth.commands import main

sys.exit(main())
