"""Passes: graph rewrites, each returning a PassResult."""
