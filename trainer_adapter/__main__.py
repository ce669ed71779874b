"""``python -m omnifeed.trainer_adapter``: the toy trainer rank (a template for real ones; see its ``--help``)."""

from ._toy_trainer import main

if __name__ == "__main__":
    raise SystemExit(main())
