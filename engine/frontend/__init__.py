"""The caller's process: the Engine, the tokenizer manager, input checking, and the caller's
halves of encode() and score(). Nothing here imports torch kernels or touches a device."""
