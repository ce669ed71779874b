"""Exit statuses of the `omnifeed` commands beyond 0 (success), 1 (a handled error) and 2 (usage)."""

INDEX_DAMAGED_EXIT = 3
"""`omnifeed index`: indexed, with damaged samples left out (each named on stderr, counted in the manifest)."""
