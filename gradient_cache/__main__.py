"""`python -m gradient_cache`: the same as the `gradient-cache` command."""

from .cli import main

raise SystemExit(main())
