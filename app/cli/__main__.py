"""``python -m app.cli``: the `kvwarden` command line."""

from __future__ import annotations

import sys

from app.cli import main

sys.exit(main())
