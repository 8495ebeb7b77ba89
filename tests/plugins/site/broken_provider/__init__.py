"""A provider plugin whose import fails, for tests of isolation."""

raise ImportError("libbrokenaccel.so: cannot open shared object file")
