"""The `vlmcap` command line: one module per command, each importing its layer inside the command, so a
camera node running `vlmcap pipeline` never loads the engine."""
