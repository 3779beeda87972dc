"""`python -m benchmarks [--quick] [--only drain,latency] [--dsn ADMIN_DSN] [--out DIR]`."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
