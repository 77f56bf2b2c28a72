"""What is kept on disk: the run history, event serialization, data and cache folders."""
