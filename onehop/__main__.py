"""``python -m onehop`` runs the ``onehop`` command line."""

from onehop.cli import main

raise SystemExit(main())
