"""omnifeed.tools."""
