"""Answers: greedy decoding, answers from stored K/V, reuse of a stored calibration, chat, the rows' export."""
