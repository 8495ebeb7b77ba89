"""Serving dynamic callers from fixed-shape executables: shapes, boundary casts, executable tables
(and, from the static-shape runtime work, buckets, device steps and the on-disk cache)."""
