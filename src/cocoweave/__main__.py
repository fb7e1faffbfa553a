"""`python -m cocoweave` is the command line."""

from .cli import main

main()
