"""Compatibility matrices: one data file per target."""
