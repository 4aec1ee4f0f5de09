"""`python -m harness.train ...`: drafter training, beside the benchmark app (see train/__main__.py)."""

from train.__main__ import main

if __name__ == "__main__":
    main()
