"""The detokenizer process: token ids in, text deltas out, stop strings held back and trimmed."""
