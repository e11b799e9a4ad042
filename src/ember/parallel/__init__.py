"""Parallel layouts applied to the plain model from the outside."""
