"""omnifeed.cache."""
