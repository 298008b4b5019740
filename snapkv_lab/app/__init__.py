"""The application: the `snapkv-lab` command line and the docs' generated tables.

    cli.py          the entry point: parses the command table, runs a command
    commands.py     the subcommands (figures, needle, eval, convert): name, help, options, run function
    figure_sets.py  `snapkv-lab figures`: every registered figure set, recomputed and drawn
    docs_tables.py  the docs' tables that come from data/, written between markers in their pages
"""
