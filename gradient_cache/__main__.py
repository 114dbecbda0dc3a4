"""`python -m gradient_cache`: the same as the `gradient-cache` command."""

from .cli import main

if __name__ == "__main__":  # run as `python -m gradient_cache`, not on import
    raise SystemExit(main())
