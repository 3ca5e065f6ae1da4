"""Models tokentrail builds for itself: the tiny model for single-machine runs and tests."""
