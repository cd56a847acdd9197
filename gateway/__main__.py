"""``python -m gateway`` runs the ``onehop`` command line."""

from gateway.cli import main

raise SystemExit(main())
