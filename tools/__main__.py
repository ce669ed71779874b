"""``python -m omnifeed.tools``: the `omnifeed` command line."""

from ._cli import main

raise SystemExit(main())
