"""omnifeed.trainer_adapter."""
