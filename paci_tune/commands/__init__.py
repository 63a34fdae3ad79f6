"""Click commands that live outside ``cli.py``; ``cli.py`` registers them on the main group."""
