"""The application: the `snapkv-lab` command line and the docs' generated tables.

    cli.py          the entry point: parses the command table, runs a command
    commands.py     the subcommands (figures, needle, eval, convert): name, help, options, run function
    figure_sets.py  `snapkv-lab figures`: every registered figure set, recomputed and drawn
    catalog.py      the names the options take (benchmarks and tasks, pressure suites), checked before torch loads
    docs_tables.py  the docs' tables that come from data/, written between markers in their pages
"""
