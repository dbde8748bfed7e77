"""Triton kernels of the serving path: every `triton` import lives here."""
