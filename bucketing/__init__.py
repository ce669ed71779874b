"""omnifeed.bucketing."""
