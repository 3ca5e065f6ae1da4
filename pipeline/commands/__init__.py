"""CLI verbs: one module each, exposing ``add_parser(subparsers)``; the parser's
``run`` default takes the parsed arguments and returns the exit code."""
