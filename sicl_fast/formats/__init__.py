"""Data in and out: requests, input files and paths, result records, the tokenized Prompt and its spans."""
