"""Speculative decoding: draft proposers and the lossless verification of their drafts."""
